"""Draft tree shapes: which draft tokens to propose, depth by depth, from the drafter's candidates.

What this module owns: the shape of one request's draft for one speculation round, built step by
step while the drafter runs. The runtime asks `TreeBuilder.frontier()` which nodes need the
drafter's next-token candidates (-1 is the committed prefix), runs the drafter once over all of
them, hands each node's ranked candidates back with `expand`, and repeats until `done`; then
`tree()` gives the tokens and parent links to verify in one target pass. Nodes are numbered in
the order they were made, depth by depth, so parents always come before their children.

Shapes (`TreeShape`):
- chain(K): the top candidate at each depth, K deep. A chain is a tree with one branch. With
  `min_confidence`, it stops early at a node whose own draft probability is below it (as
  transformers' assistant confidence threshold): an unsure drafter stops drafting.
- top-k per depth (`branching`=(k1, …, kD)): every node at depth d−1 gets its k_d best candidates.
- static width × depth (`width`, `depth`): beam-like; at each depth the `width` new nodes with the
  highest path confidence (product of draft probabilities from the root) are kept, and all of
  them are expanded next: always width × depth nodes.
- dynamic by confidence (EAGLE-2, Li et al. 2024): each expanded node proposes its `top_k` best
  candidates; only the `top_k` nodes of highest path confidence at a depth are expanded further
  (and none whose confidence is below `min_confidence`); at the end the `budget` nodes of highest
  path confidence are kept. A node's confidence never exceeds its parent's, so what is kept is a
  tree (ties are broken towards shallower, then earlier nodes). Shape follows the drafter's
  confidence: a sure drafter grows a deep chain, an unsure one a bushy, shallow tree.

Pure policy: token ids and floats only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHAIN, TOPK, BEAM, DYNAMIC = "chain", "topk", "beam", "dynamic"
SHAPE_KINDS = (CHAIN, TOPK, BEAM, DYNAMIC)


@dataclass(frozen=True)
class TreeShape:
    """How a draft tree grows. Use the constructors: `chain`, `topk`, `beam`, `dynamic`."""

    kind: str
    depth: int
    branching: tuple[int, ...] = ()  # topk: children per node at each depth
    width: int = 1  # beam: nodes kept per depth
    top_k: int = 1  # dynamic: candidates per expanded node, nodes expanded per depth
    budget: int = 0  # dynamic: nodes kept in the end
    min_confidence: float = 0.0  # dynamic: path confidence, chain: own probability to go on

    def __post_init__(self) -> None:
        if self.kind not in SHAPE_KINDS:
            raise ValueError(f"unknown tree shape {self.kind!r} (choose from {', '.join(SHAPE_KINDS)})")
        if self.depth < 1:
            raise ValueError(f"a draft needs depth >= 1, got {self.depth}")
        if self.kind == TOPK and (len(self.branching) != self.depth or min(self.branching) < 1):
            raise ValueError(
                f"topk branching {self.branching} must give >= 1 child at each of {self.depth} depths"
            )
        if self.width < 1 or self.top_k < 1:
            raise ValueError("width and top_k must be >= 1")
        if self.kind == DYNAMIC and self.budget < 1:
            raise ValueError(f"a dynamic tree needs a budget >= 1, got {self.budget}")

    @staticmethod
    def chain(k: int, min_confidence: float = 0.0) -> TreeShape:
        return TreeShape(CHAIN, k, min_confidence=min_confidence)

    @staticmethod
    def topk(*branching: int) -> TreeShape:
        return TreeShape(TOPK, len(branching), branching=tuple(branching))

    @staticmethod
    def beam(width: int, depth: int) -> TreeShape:
        return TreeShape(BEAM, depth, width=width)

    @staticmethod
    def dynamic(depth: int, top_k: int, budget: int, min_confidence: float = 0.0) -> TreeShape:
        return TreeShape(DYNAMIC, depth, top_k=top_k, budget=budget, min_confidence=min_confidence)

    @property
    def is_chain(self) -> bool:
        return (
            self.kind == CHAIN
            or (self.kind == TOPK and max(self.branching) == 1)
            or (self.kind == BEAM and self.width == 1)
        )

    @property
    def max_nodes(self) -> int:
        """The most draft nodes this shape can propose."""
        if self.kind == CHAIN:
            return self.depth
        if self.kind == BEAM:
            return self.width * self.depth
        if self.kind == DYNAMIC:
            return min(self.budget, self.top_k + (self.depth - 1) * self.top_k**2)
        total, level = 0, 1
        for k in self.branching:
            level *= k
            total += level
        return total

    @property
    def candidates_per_node(self) -> int:
        """How many ranked candidates the drafter should offer per expanded node."""
        if self.kind == CHAIN:
            return 1
        if self.kind == TOPK:
            return max(self.branching)
        if self.kind == BEAM:
            return self.width
        return self.top_k

    def limited(self, max_nodes: int) -> TreeShape:
        """The same kind of shape cut down to at most `max_nodes` nodes (e.g. near max_tokens)."""
        max_nodes = max(1, max_nodes)
        if self.max_nodes <= max_nodes:
            return self
        if self.kind == CHAIN:
            return TreeShape.chain(max_nodes, self.min_confidence)
        if self.kind == DYNAMIC:
            return TreeShape.dynamic(self.depth, self.top_k, max_nodes, self.min_confidence)
        if self.kind == BEAM and self.width <= max_nodes:
            return TreeShape.beam(self.width, max_nodes // self.width)
        if self.kind == TOPK:  # drop the deepest levels while the tree is too big
            branching = list(self.branching)
            while len(branching) > 1 and TreeShape.topk(*branching).max_nodes > max_nodes:
                branching.pop()
            if TreeShape.topk(*branching).max_nodes <= max_nodes:
                return TreeShape.topk(*branching)
        return TreeShape.chain(max_nodes)


@dataclass(frozen=True)
class DraftTree:
    """A finished draft: node i carries token_ids[i] under parents[i] (-1: the committed prefix).

    probs[i]: the drafter's probability of the node's token given its parent; confidence[i]: the
    product along its path; ranks[i]: its rank among its parent's candidates (0 = the best).
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    confidence: tuple[float, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @staticmethod
    def chain(tokens: Sequence[int], probs: Sequence[float] | None = None) -> DraftTree:
        probs = tuple(probs) if probs is not None else (1.0,) * len(tokens)
        confidence, running = [], 1.0
        for p in probs:
            running *= p
            confidence.append(running)
        n = len(tokens)
        return DraftTree(
            tuple(tokens), tuple(range(-1, n - 1)), probs, tuple(confidence), (0,) * n, tuple(range(1, n + 1))
        )

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree((), (), (), (), (), ())

    def path_to(self, node: int) -> list[int]:
        """Node indexes from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@dataclass
class _Node:
    token: int
    parent: int
    prob: float
    confidence: float
    rank: int
    depth: int


class TreeBuilder:
    """Grows one `DraftTree` of a `TreeShape`, depth by depth (see the module docstring)."""

    def __init__(self, shape: TreeShape) -> None:
        self.shape = shape
        self._nodes: list[_Node] = []
        self._frontier: list[int] = [-1]
        self._depth = 0  # depth of the deepest nodes made so far
        self._pending: dict[int, list[tuple[int, float]]] = {}
        self.kept: list[int] | None = None  # after `tree()`: the nodes kept, when some were pruned

    @property
    def done(self) -> bool:
        return not self._frontier

    @property
    def num_nodes(self) -> int:
        """Nodes made so far (the next node made gets this index)."""
        return len(self._nodes)

    def parent(self, node: int) -> int:
        return self._nodes[node].parent

    def token(self, node: int) -> int:
        return self._nodes[node].token

    def frontier(self) -> list[int]:
        """Nodes (-1: the committed prefix) whose next-token candidates the drafter must give now."""
        return list(self._frontier)

    def expand(self, node: int, candidates: Sequence[tuple[int, float]]) -> None:
        """The drafter's candidates after `node`: (token, probability), best first."""
        if node not in self._frontier:
            raise ValueError(f"node {node} is not on the frontier {self._frontier}")
        if node in self._pending:
            raise ValueError(f"node {node} was already expanded")
        self._pending[node] = list(candidates)
        if len(self._pending) == len(self._frontier):
            self._grow()

    def tree(self) -> DraftTree:
        """The finished draft (call once `done`)."""
        if not self.done:
            raise ValueError("the tree is still growing: expand the frontier first")
        nodes = self._nodes
        if self.shape.kind == DYNAMIC and len(nodes) > self.shape.budget:
            order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].confidence, nodes[i].depth, i))
            keep = sorted(order[: self.shape.budget])
            self.kept = keep
            kept = set(keep)
            if any(nodes[i].parent >= 0 and nodes[i].parent not in kept for i in keep):
                raise AssertionError("a kept node lost its parent")  # confidence is monotone
            renumber = {old: new for new, old in enumerate(keep)}
            renumber[-1] = -1
            nodes = [
                _Node(n.token, renumber[n.parent], n.prob, n.confidence, n.rank, n.depth)
                for n in (nodes[i] for i in keep)
            ]
        return DraftTree(
            tuple(n.token for n in nodes),
            tuple(n.parent for n in nodes),
            tuple(n.prob for n in nodes),
            tuple(n.confidence for n in nodes),
            tuple(n.rank for n in nodes),
            tuple(n.depth for n in nodes),
        )

    # ------------------------------------------------------------------ internals

    def _confidence(self, node: int) -> float:
        return 1.0 if node < 0 else self._nodes[node].confidence

    def _grow(self) -> None:
        shape, depth = self.shape, self._depth + 1
        proposals: list[tuple[int, int, float, int]] = []  # parent, token, prob, rank
        for parent in self._frontier:
            limit = shape.candidates_per_node
            if shape.kind == TOPK:
                limit = shape.branching[depth - 1]
            for rank, (token, prob) in enumerate(self._pending[parent][:limit]):
                proposals.append((parent, token, prob, rank))
        if shape.kind == BEAM:
            # keep the `width` best by path confidence, then in (parent, rank) order
            scored = sorted(
                range(len(proposals)),
                key=lambda i: (-self._confidence(proposals[i][0]) * proposals[i][2], i),
            )
            proposals = [proposals[i] for i in sorted(scored[: shape.width])]
        made = []
        for parent, token, prob, rank in proposals:
            confidence = self._confidence(parent) * prob
            self._nodes.append(_Node(token, parent, prob, confidence, rank, depth))
            made.append(len(self._nodes) - 1)
        self._pending.clear()
        self._depth = depth
        if depth >= shape.depth or not made:
            self._frontier = []
        elif (
            shape.kind == CHAIN and shape.min_confidence and self._nodes[made[0]].prob < shape.min_confidence
        ):
            self._frontier = []  # an unsure drafter stops here
        elif shape.kind == DYNAMIC:
            ranked = sorted(made, key=lambda i: (-self._nodes[i].confidence, i))
            chosen = [i for i in ranked[: shape.top_k] if self._nodes[i].confidence >= shape.min_confidence]
            self._frontier = sorted(chosen)
        else:
            self._frontier = made


def chain_parents(length: int) -> tuple[int, ...]:
    """Parent links of a chain of `length` draft tokens."""
    return tuple(range(-1, length - 1))


__all__ = [
    "BEAM",
    "CHAIN",
    "DYNAMIC",
    "SHAPE_KINDS",
    "TOPK",
    "DraftTree",
    "TreeBuilder",
    "TreeShape",
    "chain_parents",
]
