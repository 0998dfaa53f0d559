"""Radix prefix tree over token ids → KV blocks (RadixAttention), with locks and LRU eviction.

What this module owns: the map from cached token prefixes to the block ids holding their KV, one
pool reference per cached block, the lock counts that keep in-use prefixes from being evicted,
the LRU clock, and hit statistics. What it does not own: the KV bytes (the runtime's paged cache),
the blocks of running sequences (their block tables: `policy/kv/manager.py` for served requests,
`runtime/kv/model_kv.py` for the runtime's scratch sequences), and the pool itself.

Keys are whole blocks. An edge holds a token tuple whose length is a multiple of
`pool.block_size` and one block id per `block_size` tokens; a partial last block is never cached.
A match is whole blocks, and with `match(..., partial=True)` it may go on into the first tokens of
one more cached block (the caller then reads that block's leading slots and, before writing into
it, copies it: copy-on-write, see `policy.kv.sequence_blocks`). The root holds nothing. One tree
serves one model's pool: `namespace` names that model (recorded and reported only, for now).

Ownership rules, for a caller that is the scheduler of one model:

- The tree holds exactly one pool reference to every block it caches (taken by `insert` with
  `pool.share`, dropped by eviction with `pool.free`).
- `match` is a lock. It takes one pool reference per matched block *for the caller* (the caller
  now owns them, typically as the head of its sequence's block table, and frees them through
  `pool.free` like any other block of the sequence) and locks the matched nodes, so that they are
  not evicted while the sequence uses them. The caller gives the lock back with `release(match)`,
  once, when the sequence ends (finished or aborted), next to freeing its blocks. Releasing does
  not free blocks and freeing blocks does not release the lock.
- `insert` is the only way in, and callers call it only for *completed* requests whose KV was fully
  written: the KV of an aborted or failed request never enters the tree (it releases its match and
  frees its blocks, nothing else). Insert never takes the caller's references; for a prefix that
  is already cached the tree keeps its own block and the caller's duplicate is simply not
  referenced, so the caller frees its whole block table as usual after inserting.
- Eviction frees only the tree's reference. A block another owner still holds (a sequence that
  released its lock early, a fork) stays allocated until that owner frees it.

Not thread-safe: the engine thread owns the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from polylane.policy.kv.blocks import BlockPool


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a lookup, and the lock that holds it.

    Without `partial`, `num_tokens` is a multiple of the block size: a match that would end inside
    a block stops at the block boundary before it. With it, the last of `blocks` may be used only
    in part (its first `num_tokens % block_size` slots; it is shared, so the caller copies it before
    writing). The caller owns one pool reference to each of `blocks` (free them with `pool.free`)
    and must `release` the match exactly once.
    """

    num_tokens: int
    blocks: tuple[int, ...]
    lock_id: int


@dataclass(frozen=True)
class PrefixTreeStats:
    """A snapshot of the tree's counters since it was made.

    lookups: calls to `match`. prompt_tokens: tokens looked up (all of them, partial blocks
    included). matched_tokens: tokens served from the cache. hit_rate: matched / prompt tokens
    (0.0 before any lookup). inserted_tokens: tokens newly cached by `insert`. dropped_tokens:
    tokens `insert` left out because the `max_cached_blocks` budget was full of locked blocks.
    evicted_blocks: tree references dropped by eviction (explicit or for the budget).
    cached_blocks: blocks the tree holds now. locked_blocks: of those, blocks locked by a lock.
    """

    namespace: str
    lookups: int
    prompt_tokens: int
    matched_tokens: int
    inserted_tokens: int
    dropped_tokens: int
    evicted_blocks: int
    cached_blocks: int
    locked_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # edge label: len(blocks) * block_size tokens
    blocks: list[int]
    parent: _Node | None
    serial: int  # creation order: breaks LRU ties deterministically
    last_access: int = 0
    lock_count: int = 0  # locks whose matched path runs through this node
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # keyed by first block


class PrefixTree:
    """Longest-prefix match, insert and LRU eviction over whole KV blocks of one model's pool.

    `max_cached_blocks` bounds the blocks the tree holds (None: only the pool bounds it). The LRU
    clock is a counter advanced by every `match` and `insert`, not wall time, so that eviction
    order is deterministic; ties go to the older node.
    """

    def __init__(self, pool: BlockPool, namespace: str = "", max_cached_blocks: int | None = None) -> None:
        if max_cached_blocks is not None and max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks must be >= 0 or None, got {max_cached_blocks}")
        self.pool = pool
        self.namespace = namespace
        self.max_cached_blocks = max_cached_blocks
        self.block_size = pool.block_size
        self._serials = itertools.count()
        self._root = _Node(tokens=(), blocks=[], parent=None, serial=next(self._serials))
        self._clock = 0
        self._held: set[int] = set()  # blocks the tree holds one reference to
        self._num_locked_blocks = 0
        self._locks: dict[int, _Node] = {}  # lock id → deepest matched node (the root if none)
        self._lock_ids = itertools.count()
        self._lookups = 0
        self._prompt_tokens = 0
        self._matched_tokens = 0
        self._inserted_tokens = 0
        self._dropped_tokens = 0
        self._evicted_blocks = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_cached_blocks(self) -> int:
        return len(self._held)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no lock locks: what `evict` can free right now, leaves first."""
        return len(self._held) - self._num_locked_blocks

    @property
    def num_locks(self) -> int:
        return len(self._locks)

    @property
    def stats(self) -> PrefixTreeStats:
        return PrefixTreeStats(
            namespace=self.namespace,
            lookups=self._lookups,
            prompt_tokens=self._prompt_tokens,
            matched_tokens=self._matched_tokens,
            inserted_tokens=self._inserted_tokens,
            dropped_tokens=self._dropped_tokens,
            evicted_blocks=self._evicted_blocks,
            cached_blocks=len(self._held),
            locked_blocks=self._num_locked_blocks,
        )

    def held_blocks(self) -> frozenset[int]:
        """The blocks the tree holds a reference to (one each)."""
        return frozenset(self._held)

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Length of the cached prefix of `token_ids` in whole blocks, without a lock.

        Read-only: no split, no LRU touch, no statistics. For estimates (admission cost); a caller
        that will use the blocks calls `match`.
        """
        tokens = self._full_block_tokens(token_ids)
        _, num_tokens, child, common_blocks, _ = self._descend(tokens)
        return num_tokens + common_blocks * self.block_size if child is not None else num_tokens

    def peek_blocks(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The blocks of the cached whole-block prefix of `token_ids`, for another model to read.

        No lock and no pool reference: the blocks are only valid until the tree changes, so the
        caller (the owner thread, e.g. a model reading a peer's KV through a shared layer band,
        `runtime.sharing.layer_share`) copies what it needs at once. No split and no statistics (the
        peer's hit rate stays its own); the nodes read are touched for LRU, as a reuse.
        """
        tokens = self._full_block_tokens(token_ids)
        _, _, child, common_blocks, path = self._descend(tokens)
        if path or child is not None:
            self._clock += 1
        for node in path:
            node.last_access = self._clock
        blocks = [block for node in path for block in node.blocks]
        if child is not None:
            child.last_access = self._clock
            blocks.extend(child.blocks[:common_blocks])
        return tuple(blocks)

    # ------------------------------------------------------------------ match / release

    def match(self, token_ids: Sequence[int], partial: bool = False) -> PrefixMatch:
        """Lock the longest cached prefix of `token_ids`: whole blocks, and with `partial` the
        leading tokens of one more block (the cached block sharing most of the next tokens).

        The caller receives one pool reference per returned block and a lock on the matched nodes;
        see the module docstring. A match ending inside an edge splits the edge at that block
        boundary so that the lock covers exactly the matched blocks. The tree does not hold back the
        last prompt token: a caller that needs its logits matches `token_ids[:-1]`. Matching nothing
        still returns a lock (of no blocks) to release.
        """
        tokens = self._full_block_tokens(token_ids)
        self._clock += 1
        node, num_tokens, child, common_blocks, path = self._descend(tokens)
        if child is not None:
            node = self._split(child, common_blocks)
            path.append(node)
            num_tokens += common_blocks * self.block_size
        if partial:
            tail = tuple(token_ids[num_tokens : num_tokens + self.block_size])
            partial_child, common_tokens = self._best_partial_child(node, tail)
            if partial_child is not None:
                if len(partial_child.blocks) > 1:
                    partial_child = self._split(partial_child, 1)
                node = partial_child
                path.append(node)
                num_tokens += common_tokens
        blocks = tuple(block for path_node in path for block in path_node.blocks)
        for path_node in path:
            path_node.last_access = self._clock
        self._lock(node)
        self.pool.share(blocks)
        lock_id = next(self._lock_ids)
        self._locks[lock_id] = node
        self._lookups += 1
        self._prompt_tokens += len(token_ids)
        self._matched_tokens += num_tokens
        return PrefixMatch(num_tokens=num_tokens, blocks=blocks, lock_id=lock_id)

    def release(self, match: PrefixMatch) -> None:
        """Unlock the nodes `match` locked; once per match. The caller's block references are its
        own to free (`pool.free(match.blocks)` or with the rest of its block table)."""
        node = self._locks.pop(match.lock_id, None)
        if node is None:
            raise ValueError(f"lock {match.lock_id} is not held (released twice, or another tree's)")
        self._unlock(node)

    # ------------------------------------------------------------------ insert

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache the full-block prefix of a *completed* request; return the tokens newly cached.

        `blocks` is the request's block table: block `i` holds tokens `[i*B, (i+1)*B)`; at least
        one block per full block of `token_ids` (a partial tail block, if any, is ignored). Blocks
        of prefixes already cached are not referenced (the tree keeps its own); for the new suffix
        the tree takes one reference per block (`pool.share`), so the caller frees its own
        references as usual. With a `max_cached_blocks` budget, least recently used unlocked leaves
        are evicted to make room; if locks make that impossible, only the first blocks of the new
        suffix that fit are cached (the return value is then short by the rest, also counted in
        `stats.dropped_tokens`). Raises ValueError, changing nothing, for a block table too short,
        a block that is free or out of range, or a new block that the tree already caches
        elsewhere or that is repeated.
        """
        tokens = self._full_block_tokens(token_ids)
        num_blocks = len(tokens) // self.block_size
        if len(blocks) < num_blocks:
            raise ValueError(f"{num_blocks} full blocks of tokens but only {len(blocks)} blocks given")
        node, num_tokens, child, common_blocks, path = self._descend(tokens)
        first_new = num_tokens // self.block_size + common_blocks
        new_blocks = list(blocks[first_new:num_blocks])
        self._check_new_blocks(new_blocks)
        self._clock += 1
        for path_node in path:
            path_node.last_access = self._clock
        if not new_blocks:
            if child is not None:
                child.last_access = self._clock
            return 0
        if child is not None:
            node = self._split(child, common_blocks)
            node.last_access = self._clock
        room = len(new_blocks)
        if self.max_cached_blocks is not None:
            shortfall = len(self._held) + len(new_blocks) - self.max_cached_blocks
            if shortfall > 0:
                self._lock(node)  # the attach point and its ancestors must survive
                self._evict(shortfall)
                self._unlock(node)
            room = min(len(new_blocks), self.max_cached_blocks - len(self._held))
        kept = new_blocks[:room]
        self._dropped_tokens += (len(new_blocks) - len(kept)) * self.block_size
        if kept:
            self.pool.share(kept)
            start = first_new * self.block_size
            leaf = _Node(
                tokens=tokens[start : start + len(kept) * self.block_size],
                blocks=kept,
                parent=node,
                serial=next(self._serials),
                last_access=self._clock,
            )
            node.children[leaf.tokens[: self.block_size]] = leaf
            self._held.update(kept)
        self._inserted_tokens += len(kept) * self.block_size
        return len(kept) * self.block_size

    # ------------------------------------------------------------------ evict

    def evict(self, num_blocks: int) -> int:
        """Drop the tree's reference to up to `num_blocks` blocks; return how many were dropped.

        Least recently used unlocked leaves go first, from the tail of their edge, and a parent
        left without children becomes a candidate in turn. Locked nodes are never touched, so the
        result is `min(num_blocks, num_evictable_blocks)`. `evict(0)` does nothing and returns 0.
        A dropped block returns to the pool's free list only if nobody else holds it.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot evict {num_blocks} blocks")
        return self._evict(num_blocks)

    def _evict(self, num_blocks: int) -> int:
        if num_blocks == 0:
            return 0
        heap = [
            (node.last_access, node.serial, node) for node in self._nodes() if self._is_evictable_leaf(node)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - freed, len(leaf.blocks))
            dropped = leaf.blocks[len(leaf.blocks) - take :]
            self.pool.free(dropped)
            self._held.difference_update(dropped)
            freed += take
            if take < len(leaf.blocks):  # the request is met: the leaf keeps its head
                del leaf.blocks[len(leaf.blocks) - take :]
                leaf.tokens = leaf.tokens[: len(leaf.blocks) * self.block_size]
                continue
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[: self.block_size]]
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        self._evicted_blocks += freed
        return freed

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Check the tree's internal invariants; raise RuntimeError naming the first broken one.

        For tests and debugging: cost is linear in the tree's size.
        """
        seen: list[int] = []
        lock_counts: dict[int, int] = {}
        for node in self._locks.values():
            while node.parent is not None:
                lock_counts[id(node)] = lock_counts.get(id(node), 0) + 1
                node = node.parent
        locked_blocks = 0
        for node in self._nodes():
            if node is self._root:
                continue
            if not node.blocks or len(node.tokens) != len(node.blocks) * self.block_size:
                raise RuntimeError(f"edge of {len(node.tokens)} tokens holds {len(node.blocks)} blocks")
            assert node.parent is not None
            if node.parent.children.get(node.tokens[: self.block_size]) is not node:
                raise RuntimeError(f"node {node.serial} is not its parent's child under its first block")
            if node.lock_count != lock_counts.get(id(node), 0):
                raise RuntimeError(
                    f"node {node.serial} has lock count {node.lock_count}, "
                    f"locks through it: {lock_counts.get(id(node), 0)}"
                )
            if node.lock_count:
                locked_blocks += len(node.blocks)
            seen.extend(node.blocks)
        if len(seen) != len(set(seen)) or set(seen) != self._held:
            raise RuntimeError(
                f"tree holds {len(seen)} block slots, {len(set(seen))} distinct, {len(self._held)} held"
            )
        if locked_blocks != self._num_locked_blocks:
            raise RuntimeError(
                f"{locked_blocks} locked blocks in the tree, counter says {self._num_locked_blocks}"
            )
        if self.max_cached_blocks is not None and len(self._held) > self.max_cached_blocks:
            raise RuntimeError(f"{len(self._held)} blocks cached over a budget of {self.max_cached_blocks}")
        for block in self._held:
            if self.pool.ref_count(block) < 1:
                raise RuntimeError(f"cached block {block} is free in the pool")

    # ------------------------------------------------------------------ internals

    def _full_block_tokens(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(token_ids[: len(token_ids) // self.block_size * self.block_size])

    def _descend(self, tokens: tuple[int, ...]) -> tuple[_Node, int, _Node | None, int, list[_Node]]:
        """Walk the longest cached prefix of block-aligned `tokens` without changing anything.

        Returns (node, num_tokens, child, common_blocks, path): the deepest node whose whole edge
        matched (the root if none), the tokens matched up to it, the nodes from the root's child to
        it, and — when the match goes on into part of one more edge — that child and the number of
        its blocks that match (else None, 0).
        """
        size = self.block_size
        node, position, path = self._root, 0, []
        while position < len(tokens):
            child = node.children.get(tokens[position : position + size])
            if child is None:
                break
            common = 1
            while (
                common < len(child.blocks)
                and position + (common + 1) * size <= len(tokens)
                and child.tokens[common * size : (common + 1) * size]
                == tokens[position + common * size : position + (common + 1) * size]
            ):
                common += 1
            if common < len(child.blocks):
                return node, position, child, common, path
            node, position = child, position + len(child.tokens)
            path.append(child)
        return node, position, None, 0, path

    def _best_partial_child(self, node: _Node, tail: tuple[int, ...]) -> tuple[_Node | None, int]:
        """The child of `node` whose first block shares the most leading tokens with `tail`
        (at least one; fewer than a whole block, or the whole-block descent would have taken it),
        and how many; (None, 0) if none shares any."""
        best, best_common = None, 0
        for child in sorted(node.children.values(), key=lambda c: c.serial):
            common = 0
            while common < len(tail) and child.tokens[common] == tail[common]:
                common += 1
            if common > best_common:  # ties go to the older child (children iterate by age)
                best, best_common = child, common
        return (best, best_common) if best_common > 0 else (None, 0)

    def _split(self, child: _Node, num_blocks: int) -> _Node:
        """Cut `child`'s edge after `num_blocks` blocks; return the new upper node.

        The upper node inherits the lock count (every lock through `child` runs through it) and
        the last access; `child` keeps its identity, so locks ending at it stay valid.
        """
        parent = child.parent
        assert parent is not None and 0 < num_blocks < len(child.blocks)
        cut = num_blocks * self.block_size
        upper = _Node(
            tokens=child.tokens[:cut],
            blocks=child.blocks[:num_blocks],
            parent=parent,
            serial=next(self._serials),
            last_access=child.last_access,
            lock_count=child.lock_count,
        )
        parent.children[upper.tokens[: self.block_size]] = upper
        child.tokens = child.tokens[cut:]
        child.blocks = child.blocks[num_blocks:]
        child.parent = upper
        upper.children[child.tokens[: self.block_size]] = child
        return upper

    def _lock(self, node: _Node) -> None:
        while node.parent is not None:
            if node.lock_count == 0:
                self._num_locked_blocks += len(node.blocks)
            node.lock_count += 1
            node = node.parent

    def _unlock(self, node: _Node) -> None:
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_locked_blocks -= len(node.blocks)
            node = node.parent

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return node.parent is not None and not node.children and node.lock_count == 0

    def _nodes(self) -> list[_Node]:
        nodes, stack = [], [self._root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _check_new_blocks(self, new_blocks: list[int]) -> None:
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"block table repeats a block: {new_blocks}")
        for block in new_blocks:
            if not 0 <= block < self.pool.num_blocks:
                raise ValueError(f"block id {block} is outside the pool (0..{self.pool.num_blocks - 1})")
            if self.pool.ref_count(block) == 0:
                raise ValueError(f"block {block} is free; insert only blocks the request still holds")
            if block in self._held:
                raise ValueError(f"block {block} is already cached for another prefix")
