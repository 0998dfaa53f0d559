"""The speculation controller: per request and round, which drafter, which shape, or none.

What this module owns: `SpeculationConfig` (how a model speculates, as a user sets it), the live
statistics of each (target, drafter) pair and of each request, the cost model, and the decision.
The runtime measures and reports; this module decides. Pure policy: floats and names, no clocks
(the runtime hands in measured seconds).

Statistics (exponentially decayed, so they follow the text being written):
- acceptance, per pair and per request: at every verified node that the drafter expanded (the
  committed prefix, then each accepted node), the rank the target's own next token had among the
  drafter's candidates there (0 = its best guess; "miss" when it was not among them), by depth.
  With top-k children at a depth the chance to accept there is the sum of the first k rank
  rates. For a deterministic draft (greedy, top-k, n-gram) that is exact; for sampled drafts it
  is the rate of the token the target produced. A round with nothing to draft (no n-gram match)
  is a plain decode step and records nothing: n-gram rates are rates given a match.
- tokens per verify, per drafter and shape: the realised mean, used once a shape has been tried
  enough, in place of the model above.
- costs (`policy.speculation.cost`, kept across reloads of the target): seconds per drafter forward
  (one depth for a batch) per drafter, and the target's forward seconds by the tokens it
  computes, t(n), a table measured per n (`CostTable`: not a line, since a forward's cost can
  jump where a native kernel hands a batch to torch), fed by plain decode steps (n = batch) and
  verify passes (n = every draft node plus the last token of each request). So K and the tree
  size stop short of a jump in t(n) unless the tokens past it pay for it.
- shadow rounds: a drafter that costs nothing to ask (n-gram) is asked even while a request
  decodes plainly, and its guess is scored against the token that came (`record_shadow`), so a
  request whose text turns copy-heavy switches speculation on without waiting for a probe.

The decision for a request in a batch of B: for every available drafter and every candidate
shape, expected tokens E (1 + the expected accepted length) over expected cost relative to plain
decode, (depth·c_draft + t(B·(nodes + 1)) + the drafter's catch-up prefill spread over the rounds
left) / t(B). The best wins if its speedup beats
`min_speedup`; otherwise the request decodes plainly this round ("off"), and tries again every
`probe_every` rounds (its statistics may have changed: a copy-heavy passage starts).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from polylane.policy.speculation.cost import Ema, SpecMeasurements
from polylane.policy.speculation.tree import CHAIN, DYNAMIC, SHAPE_KINDS, TOPK, TreeShape

NGRAM = "ngram"
TWIN_PREFIX = "twin"  # "twin" (int4) or "twin:int8": the target's quantised twin
AUTO = "auto"
MODES = ("auto", "chain", "tree")
MAX_DEPTH = 12  # depths tracked by the acceptance statistics
MAX_RANK = 4  # ranks tracked (candidates a drafter offers per node)
PREFILL_SPEEDUP = 8  # prior: a prefilled token costs this much less than a decode step
REMEASURE_EVERY = 64  # speculative steps between two plain ones (the baseline is re-measured)
MAX_PROBE_INTERVAL = 1024  # rounds between probes of a request that decodes plainly, at most


@dataclass(frozen=True)
class SpeculationConfig:
    """How a target model speculates.

    drafters: where drafts come from, in order of preference before anything is measured:
        a served model's name (its tokenizer must be identical to the target's and it must stream
        fewer bytes per token), "twin" / "twin:int4" / "twin:int8" (the target's own weights
        quantised, loaded under the residency budget), "ngram" (prompt lookup), or "auto" (every
        resident model that qualifies, and n-gram).
    mode: "auto" (the controller picks chain or tree), "chain" or "tree".
    shape: a fixed shape for every round (no adaptive K or tree size); None lets the controller
        choose. A fixed shape with adaptive=False speculates every round, even when it loses.
    max_draft_tokens: the longest chain, and the deepest tree.
    max_tree_nodes: the most draft nodes a tree may have.
    adaptive: let the controller switch speculation off when it loses to plain decode.
    min_speedup: the expected speedup below which a request decodes plainly (a margin over 1:
        the estimate is noisy, and a marginal draft that loses costs more than one that wins gains).
    probe_every: rounds between retries for a request that decodes plainly.
    ngram_min / ngram_max: the n-gram sizes prompt lookup matches.
    draft_confidence: a model drafter's chain stops at a token it gives less than this probability
        (transformers' assistant confidence threshold; 0: never stop early).
    """

    drafters: tuple[str, ...] = (AUTO,)
    mode: str = "auto"
    shape: TreeShape | None = None
    max_draft_tokens: int = 8
    max_tree_nodes: int = 24
    adaptive: bool = True
    min_speedup: float = 1.1
    probe_every: int = 16
    ngram_min: int = 1
    ngram_max: int = 3
    draft_confidence: float = 0.4

    def __post_init__(self) -> None:
        if isinstance(self.drafters, str):
            object.__setattr__(self, "drafters", (self.drafters,))
        if not self.drafters:
            raise ValueError("speculation needs at least one drafter (or 'auto')")
        if self.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.max_draft_tokens <= MAX_DEPTH:
            raise ValueError(f"max_draft_tokens must be in [1, {MAX_DEPTH}], got {self.max_draft_tokens}")
        if self.max_tree_nodes < 1:
            raise ValueError(f"max_tree_nodes must be >= 1, got {self.max_tree_nodes}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        for name in self.drafters:
            if name.startswith(TWIN_PREFIX) and name not in ("twin", "twin:int4", "twin:int8"):
                raise ValueError(f"unknown twin {name!r}: use twin, twin:int4 or twin:int8")

    @staticmethod
    def parse(value: object) -> SpeculationConfig | None:
        """From a config file or API value: False/None → None, True → defaults, a dict → fields,
        a string or list → drafters."""
        if value is None or value is False:
            return None
        if value is True:
            return SpeculationConfig()
        if isinstance(value, str):
            return SpeculationConfig(drafters=(value,))
        if isinstance(value, list | tuple):
            return SpeculationConfig(drafters=tuple(str(v) for v in value))
        if isinstance(value, dict):
            fields = dict(value)
            unknown = set(fields) - {
                "drafters", "mode", "shape", "max_draft_tokens", "max_tree_nodes", "adaptive",
                "min_speedup", "probe_every", "ngram_min", "ngram_max", "draft_confidence",
            }  # fmt: skip
            if unknown:
                raise ValueError(f"unknown speculation settings {sorted(unknown)}")
            if "drafters" in fields:
                drafters = fields["drafters"]
                fields["drafters"] = (drafters,) if isinstance(drafters, str) else tuple(drafters)
            if "shape" in fields:
                fields["shape"] = parse_shape(fields["shape"])
            return SpeculationConfig(**fields)
        raise ValueError(f"cannot read speculation setting {value!r}")


def parse_shape(text: object) -> TreeShape:
    """A shape from text: chain:4, topk:3,2,1, beam:2x4 (width × depth), dynamic:6,3,16 (depth,
    top_k, budget)."""
    if isinstance(text, TreeShape):
        return text
    kind, _, args = str(text).partition(":")
    try:
        if kind == "chain":
            return TreeShape.chain(int(args))
        if kind == "topk":
            return TreeShape.topk(*(int(a) for a in args.split(",")))
        if kind == "beam":
            width, depth = args.split("x")
            return TreeShape.beam(int(width), int(depth))
        if kind == "dynamic":
            depth, top_k, budget = (int(a) for a in args.split(","))
            return TreeShape.dynamic(depth, top_k, budget)
    except ValueError as error:
        raise ValueError(f"cannot read tree shape {text!r}: {error}") from None
    raise ValueError(f"unknown tree shape {text!r} (kinds: {', '.join(SHAPE_KINDS)})")


# ---------------------------------------------------------------------- statistics


@dataclass
class AcceptanceStats:
    """Rank rates by depth: decayed counts of nodes reached at depth d and of the target's token
    being candidate r there (d = 1 … MAX_DEPTH, r < MAX_RANK).

    Decay is lazy: counts are stored multiplied by a growing scale, so a record is O(1).
    """

    decay: float = 0.99
    reached_scaled: list[float] = field(default_factory=lambda: [0.0] * (MAX_DEPTH + 1))
    hits_scaled: list[list[float]] = field(
        default_factory=lambda: [[0.0] * MAX_RANK for _ in range(MAX_DEPTH + 1)]
    )
    scale: float = 1.0
    events: int = 0

    def record(self, depth: int, rank: int | None) -> None:
        """At a node of depth `depth - 1`, the target's token was candidate `rank` (None: a miss)."""
        depth = min(max(depth, 1), MAX_DEPTH)
        self.events += 1
        self.scale /= self.decay
        if self.scale > 1e100:  # renormalise long before floats overflow
            self.reached_scaled = [v / self.scale for v in self.reached_scaled]
            self.hits_scaled = [[v / self.scale for v in row] for row in self.hits_scaled]
            self.scale = 1.0
        self.reached_scaled[depth] += self.scale
        if rank is not None and 0 <= rank < MAX_RANK:
            self.hits_scaled[depth][rank] += self.scale

    def reached(self, depth: int) -> float:
        return self.reached_scaled[depth] / self.scale

    def hits(self, depth: int) -> list[float]:
        return [v / self.scale for v in self.hits_scaled[depth]]

    def table(
        self,
        prior: Sequence[float],
        extra: AcceptanceStats | None = None,
        extra_weight: float = 0.0,
        own_cap: float = float("inf"),
        prior_weight: float = 2.0,
    ) -> list[list[float]]:
        """table[d][k]: chance that the target's token is among the drafter's k best candidates
        at depth d (k = 0 … MAX_RANK). Each depth's own counts are smoothed towards all depths
        pooled, and those towards `prior`. With `extra` (a request's own counts), those are added
        with weight `extra_weight` and this object's counts are capped at `own_cap` events in all
        (so a request's own history soon outweighs its pair's)."""
        total = sum(self.reached_scaled[1:]) / self.scale
        own = min(1.0, own_cap / total) / self.scale if total > 0 else 0.0
        extra_scale = extra_weight / extra.scale if extra is not None else 0.0
        reached = [0.0] * (MAX_DEPTH + 1)
        hits = [[0.0] * MAX_RANK for _ in range(MAX_DEPTH + 1)]
        for d in range(1, MAX_DEPTH + 1):
            reached[d] = self.reached_scaled[d] * own
            hits[d] = [v * own for v in self.hits_scaled[d]]
            if extra is not None:
                reached[d] += extra.reached_scaled[d] * extra_scale
                hits[d] = [h + v * extra_scale for h, v in zip(hits[d], extra.hits_scaled[d], strict=True)]
        pooled_reached = sum(reached[1:])
        pooled = [
            (sum(hits[d][r] for d in range(1, MAX_DEPTH + 1)) + prior_weight * prior[r])
            / (pooled_reached + prior_weight)
            for r in range(MAX_RANK)
        ]
        table = [[0.0] * (MAX_RANK + 1)]
        for d in range(1, MAX_DEPTH + 1):
            row, running = [0.0], 0.0
            for r in range(MAX_RANK):
                running += (hits[d][r] + prior_weight * pooled[r]) / (reached[d] + prior_weight)
                row.append(min(1.0, running))
            table.append(row)
        return table


@dataclass
class PairStats:
    """What one (target, drafter) pair has done: the numbers behind /metrics."""

    rounds: int = 0
    draft_tokens: int = 0  # draft nodes proposed
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # accepted + recovered/bonus
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    chain_rounds: int = 0
    tree_rounds: int = 0
    decisions_on: int = 0
    decisions_off: int = 0
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    @property
    def draft_cost_share(self) -> float:
        total = self.draft_seconds + self.verify_seconds
        return self.draft_seconds / total if total else 0.0


@dataclass(frozen=True)
class SpecDecision:
    """Speculate this round with `drafter` and `shape`; `expected_speedup` is the model's guess."""

    drafter: str
    shape: TreeShape
    expected_tokens: float
    expected_speedup: float


@dataclass
class _RequestState:
    acceptance: AcceptanceStats = field(default_factory=lambda: AcceptanceStats(decay=0.9))
    off_rounds: int = 0
    probe_interval: int = 0  # rounds between probes while off (0: not off yet); doubles per probe
    rounds: int = 0


@dataclass(frozen=True)
class DrafterInfo:
    """A drafter the runtime can use for this target: its kind and a cost prior (seconds per
    drafter forward relative to one target decode step, e.g. its bytes over the target's)."""

    name: str
    kind: str  # "model" | "twin" | "ngram"
    relative_cost: float


# Rank rates assumed before anything is measured (optimistic enough that a drafter gets tried).
_PRIORS = {"model": (0.6, 0.1, 0.05, 0.03), "twin": (0.8, 0.08, 0.03, 0.02), NGRAM: (0.35, 0.05, 0.02, 0.01)}


class SpecController:
    """Decisions and statistics for one target model (see the module docstring)."""

    def __init__(
        self,
        target: str,
        config: SpeculationConfig,
        pairs: dict[str, PairStats] | None = None,
        costs: SpecMeasurements | None = None,
    ) -> None:
        """`pairs` and `costs`: statistics and measurements to continue (a target whose lease is
        let go and taken again keeps what it learnt)."""
        self.target = target
        self.config = config
        self.drafters: dict[str, DrafterInfo] = {}
        self.pairs: dict[str, PairStats] = pairs if pairs is not None else {}
        self.costs = costs if costs is not None else SpecMeasurements()
        self._requests: dict[int, _RequestState] = {}
        self._shape_cache: dict[str, list[tuple[TreeShape, int, int]]] = {}
        self._steps_since_plain: dict[int, int] = {}  # batch size → steps since a plain one

    # ------------------------------------------------------------------ setup

    def add_drafter(self, info: DrafterInfo) -> None:
        self.drafters[info.name] = info
        self.pairs.setdefault(info.name, PairStats())
        self.costs.add_drafter(info.name)

    def forget(self, request: int) -> None:
        self._requests.pop(request, None)

    # ------------------------------------------------------------------ the decision

    def candidate_shapes(self, kind: str) -> list[TreeShape]:
        """Shapes the controller weighs (a fixed configured shape is the only one)."""
        config = self.config
        if config.shape is not None:
            return [config.shape]
        k_max, n_max = config.max_draft_tokens, config.max_tree_nodes
        shapes: list[TreeShape] = []
        if config.mode in ("auto", "chain"):
            stop = config.draft_confidence if kind != NGRAM else 0.0
            shapes += [TreeShape.chain(k, stop) for k in range(1, k_max + 1)]
        if config.mode in ("auto", "tree"):
            for depth in range(2, k_max + 1):
                for head in ((2,), (3,), (2, 2), (4,), (3, 2), (4, 2)):
                    if len(head) > depth:
                        continue
                    shape = TreeShape.topk(*head, *([1] * (depth - len(head))))
                    if shape.max_nodes <= n_max:
                        shapes.append(shape)
            if kind == NGRAM:  # n-gram trees are tries of matches, sized by nodes
                shapes += [TreeShape.topk(b, *([1] * (d - 1))) for b in (2, 3) for d in (4, k_max)]
            else:
                for budget in (8, 16, n_max):
                    if budget <= n_max:
                        shapes.append(TreeShape.dynamic(min(k_max, 6), 4, budget))
        unique = list(dict.fromkeys(s for s in shapes if s.max_nodes <= max(n_max, k_max)))
        return unique or [TreeShape.chain(1)]

    def expected_tokens(self, drafter: str, shape: TreeShape, request: int | None = None) -> float:
        """Expected tokens per round: 1 + the expected accepted length (from the rank rates). A
        dynamic tree, whose shape the rates cannot foresee, is judged by what it realised once it
        has been tried a few times."""
        return self._estimate(drafter, shape, self._accept_table(drafter, request))

    def _estimate(self, drafter: str, shape: TreeShape, table: list[list[float]]) -> float:
        if shape.kind == DYNAMIC:
            observed = self.costs.shape_tokens.get((drafter, shape))
            if observed is not None and observed.weight > 0.2:
                return observed.value()
        return _expected_tokens(table, shape)

    def decide(
        self,
        request: int,
        available: Iterable[str],
        batch_size: int,
        max_nodes: int,
        catch_up: Mapping[str, int] | None = None,
    ) -> SpecDecision | None:
        """This round's choice for `request` (None: decode plainly). `max_nodes` caps the draft
        (tokens left before max_tokens or the context end, minus the one the target adds).
        `catch_up`: per drafter, the tokens it must prefill before it can draft for this request
        (the whole prompt the first time); that one-off cost is spread over the rounds left."""
        state = self._requests.setdefault(request, _RequestState())
        names = [n for n in available if n in self.drafters]
        if not names or max_nodes < 1:
            return None
        batch = max(1, batch_size)
        plain = max(self._forward_seconds(batch), 1e-9)
        best: tuple[float, str, TreeShape, float] | None = None  # speedup, drafter, shape, tokens
        for name in names:
            table = self._accept_table(name, request)
            info = self.drafters[name]
            per_forward = self.costs.draft[name].value(default=info.relative_cost * plain)
            pending = (catch_up or {}).get(name, 0)
            prefill = pending * self.costs.draft_prefill[name].value(default=per_forward / PREFILL_SPEEDUP)
            for shape, nodes, depth in self._shapes(info.kind):
                if nodes > max_nodes:
                    shape = shape.limited(max_nodes)
                    nodes, depth = shape.max_nodes, shape.depth
                tokens = self._estimate(name, shape, table)
                forwards = depth if info.kind != NGRAM else 1
                rounds_left = max(1.0, (max_nodes + 1) / tokens)
                seconds = forwards * per_forward + self._forward_seconds(batch * (nodes + 1))
                cost = (seconds + prefill / rounds_left) / plain
                speedup = tokens / cost
                if best is None or speedup > best[0] + 1e-9:
                    best = (speedup, name, shape, tokens)
        assert best is not None
        best_decision = SpecDecision(best[1], best[2], best[3], best[0])
        return self._switch(state, best_decision)

    def _switch(self, state: _RequestState, best: SpecDecision) -> SpecDecision | None:
        """Speculate with `best`, or decode plainly when it loses. A request that decodes plainly
        probes now and then with the cheapest draft (one token), so that a change in its text is
        noticed; each probe that confirms the loss doubles the wait for the next (from
        `probe_every`, ×4 for a free drafter whose shadow rounds keep its numbers live), so
        probing costs little where drafting never pays."""
        pair = self.pairs[best.drafter]
        config = self.config
        if config.adaptive and best.expected_speedup < config.min_speedup:
            state.off_rounds += 1
            if not state.probe_interval:
                free = self.drafters[best.drafter].kind == NGRAM
                state.probe_interval = config.probe_every * (4 if free else 1)
            if state.off_rounds < state.probe_interval:
                pair.decisions_off += 1
                return None
            state.off_rounds = 0
            state.probe_interval = min(2 * state.probe_interval, MAX_PROBE_INTERVAL)
            pair.decisions_on += 1
            probe = TreeShape.chain(1)
            return SpecDecision(best.drafter, probe, best.expected_tokens, best.expected_speedup)
        state.off_rounds = 0
        state.probe_interval = 0
        pair.decisions_on += 1
        return best

    def plain_step_due(self, batch_size: int) -> bool:
        """Whether this step should decode plainly for every request, to measure the baseline
        t(B) the decisions compare against: never measured for this batch size, or not for
        `REMEASURE_EVERY` steps (speculation that is always on would otherwise be judged against
        a guess, or against a stale number when the machine's load changes)."""
        if not self.config.adaptive or not self.drafters:
            return False
        batch = max(1, batch_size)
        since = self._steps_since_plain.get(batch, 0)
        if not self.costs.verify.measured(batch) or since >= REMEASURE_EVERY:
            self._steps_since_plain[batch] = 0
            return True
        self._steps_since_plain[batch] = since + 1
        return False

    # ------------------------------------------------------------------ feedback

    def record_round(
        self,
        request: int,
        drafter: str,
        shape: TreeShape,
        draft_nodes: int,
        accepted: int,
        rank_events: Sequence[tuple[int, int | None]],
        is_chain: bool,
    ) -> None:
        """One verified round of one request: nodes proposed, accepted, and per expanded node on
        the walk (depth of its children, rank of the target's token among its candidates)."""
        pair = self.pairs[drafter]
        pair.rounds += 1
        pair.draft_tokens += draft_nodes
        pair.accepted_tokens += accepted
        pair.emitted_tokens += accepted + 1
        if is_chain:
            pair.chain_rounds += 1
        else:
            pair.tree_rounds += 1
        state = self._requests.setdefault(request, _RequestState())
        state.rounds += 1
        for depth, rank in rank_events:
            pair.acceptance.record(depth, rank)
            state.acceptance.record(depth, rank)
        self.costs.shape_tokens.setdefault((drafter, shape), Ema(0.95)).add(accepted + 1)

    def record_shadow(self, request: int, drafter: str, rank: int | None) -> None:
        """A plain decode step scored for a free drafter: the target's token was its depth-1
        candidate `rank` (None: not among them)."""
        self.pairs[drafter].acceptance.record(1, rank)
        self._requests.setdefault(request, _RequestState()).acceptance.record(1, rank)

    def record_draft_cost(self, drafter: str, seconds: float, forwards: int) -> None:
        """Seconds the drafter spent in one step over `forwards` forward passes (or lookups); with
        forwards = 0 the seconds are only accounted (see `record_draft_step_cost`)."""
        pair = self.pairs[drafter]
        pair.draft_seconds += seconds
        if forwards > 0:
            self.costs.draft[drafter].add(seconds / forwards)

    def record_draft_prefill(self, drafter: str, tokens: int, seconds: float) -> None:
        """The drafter prefilled `tokens` of a request's context (its first round) in `seconds`."""
        if tokens > 0:
            self.costs.draft_prefill[drafter].add(seconds / tokens)

    def record_draft_step_cost(self, drafter: str, forwards: int, seconds: float) -> None:
        """The drafter's own timing of its draft steps (a new request's prompt prefill apart,
        which is paid once and says nothing about the next round)."""
        if forwards > 0:
            self.costs.draft[drafter].add(seconds / forwards)

    def record_target_forward(self, tokens: int, seconds: float, drafters: Iterable[str] = ()) -> None:
        """A target forward over `tokens` new tokens (a plain decode step, or a verify pass whose
        time is charged to the pairs in `drafters`, shared equally)."""
        self.costs.verify.add(tokens, seconds)
        names = list(drafters)
        for name in names:
            self.pairs[name].verify_seconds += seconds / len(names)

    # ------------------------------------------------------------------ internals

    def _shapes(self, kind: str) -> list[tuple[TreeShape, int, int]]:
        if kind not in self._shape_cache:
            self._shape_cache[kind] = [(s, s.max_nodes, s.depth) for s in self.candidate_shapes(kind)]
        return self._shape_cache[kind]

    def _accept_table(self, drafter: str, request: int | None) -> list[list[float]]:
        """table[d][k]: chance to accept one of k top-ranked children at depth d (k ≤ MAX_RANK):
        the pair's statistics, with the request's own (weighted up) where it has any."""
        pair = self.pairs[drafter].acceptance
        prior = _PRIORS[self.drafters[drafter].kind]
        state = self._requests.get(request) if request is not None else None
        if state is None or state.acceptance.events == 0:
            return pair.table(prior)
        return pair.table(prior, extra=state.acceptance, extra_weight=3.0, own_cap=8.0)

    def _forward_seconds(self, tokens: int) -> float:
        """The target's forward over `tokens` new tokens: measured fit, else relative units."""
        verify = self.costs.verify
        if verify.seen:
            return verify.predict(tokens)
        return 1.0 + verify.prior_slope_share * (tokens - 1)


@functools.cache
def _dynamic_branchings(shape: TreeShape) -> tuple[tuple[int, ...], ...]:
    """The top-k branchings a dynamic tree of this depth and budget could take the shape of."""
    found = [(1,) * min(shape.depth, shape.budget)]
    for head in ((2,), (3,), (2, 2), (4,), (3, 2), (4, 2)):
        for depth in range(len(head), shape.depth + 1):
            branching = (*head, *([1] * (depth - len(head))))
            if sum(_level_sizes(branching)) <= shape.budget:
                found.append(branching)
    return tuple(found)


def _level_sizes(branching: Sequence[int]) -> list[int]:
    sizes, level = [], 1
    for k in branching:
        level *= k
        sizes.append(level)
    return sizes


def _expected(table: list[list[float]], branching: Sequence[int]) -> float:
    """1 + Σ_d P(the accepted path reaches depth d), with top-branching[d] children per node."""
    expected, reach = 1.0, 1.0
    for depth, children in enumerate(branching, start=1):
        reach *= table[min(depth, MAX_DEPTH)][min(children, MAX_RANK)]
        expected += reach
    return expected


def _expected_tokens(table: list[list[float]], shape: TreeShape) -> float:
    if shape.kind == TOPK:
        return _expected(table, shape.branching)
    if shape.kind == CHAIN:
        return _expected(table, [1] * shape.depth)
    if shape.kind == DYNAMIC:
        # at least as good as the best top-k tree it could have grown within its budget
        return max(_expected(table, branching) for branching in _dynamic_branchings(shape))
    return _expected(table, [shape.width] + [1] * (shape.depth - 1))  # beam


__all__ = [
    "AUTO",
    "NGRAM",
    "TWIN_PREFIX",
    "AcceptanceStats",
    "DrafterInfo",
    "PairStats",
    "SpecController",
    "SpecDecision",
    "SpeculationConfig",
    "parse_shape",
]
