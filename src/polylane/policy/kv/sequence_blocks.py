"""One sequence's block table over a `BlockPool`: grow, fork, copy-on-write, truncate, compact.

What this module owns: which blocks hold a sequence's KV, how many of its logical slots are
written (`num_tokens`), and the copies the runtime must make so that a write never lands in a
block another owner can read. It never touches KV bytes: every operation that needs bytes moved
returns plain copy instructions (`BlockCopy`, `SlotMove`) for the runtime's paged cache.

Rules:
- Logical slot `i` of the sequence lives in block `table[i // block_size]` at offset
  `i % block_size`.
- A block may be shared (a `fork`, a prefix-cache hit, the prefix tree's own reference). Before
  slots `[num_tokens, num_tokens + n)` are written, `prepare_write(n)` gives every shared block in
  that range a private copy (copy-on-write: new block, `BlockCopy` of the old one's bytes, one
  reference to the old block dropped) and allocates blocks for the rest. It is all or nothing:
  when the pool cannot supply every block it raises `OutOfBlocksError` and changes nothing.
- `truncate(n)` keeps slots `[0, n)` and frees whole blocks past them; the kept slots' bytes are
  never rewritten (a later write into the last kept block goes through copy-on-write if that
  block is shared).
- After a token-tree verify wrote its nodes at slots `[base, base + P)`, `compact(base, parents,
  path)` returns the copies and moves that put the accepted path's KV at `[base, base + len(path))`
  and truncates the rest away, so the accepted tokens are never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from polylane.policy.kv.blocks import BlockPool, OutOfBlocksError


@dataclass(frozen=True)
class BlockCopy:
    """Copy every slot of block `source` into block `target` (copy-on-write)."""

    source: int
    target: int


@dataclass(frozen=True)
class SlotMove:
    """Copy the KV of cache slot `source` into cache slot `target` (tree compaction)."""

    source: int
    target: int


@dataclass(frozen=True)
class Compaction:
    """What the runtime does to accept a tree path: the block copies first, then the slot moves."""

    copies: list[BlockCopy]
    moves: list[SlotMove]


class SequenceBlocks:
    """The block table of one sequence; owns one pool reference per entry of `table`."""

    def __init__(self, pool: BlockPool, blocks: Sequence[int] = (), num_tokens: int = 0) -> None:
        """Adopt `blocks` (the caller hands over one reference to each, e.g. a prefix match's)
        holding `num_tokens` written slots."""
        if not 0 <= num_tokens <= len(blocks) * pool.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(blocks)} blocks of {pool.block_size}")
        self.pool = pool
        self.block_size = pool.block_size
        self.table: list[int] = list(blocks)
        self.num_tokens = num_tokens
        self._released = False

    def slot(self, index: int) -> int:
        """Cache slot of logical slot `index`."""
        block, offset = divmod(index, self.block_size)
        return self.table[block] * self.block_size + offset

    def blocks_needed(self, num_new: int) -> int:
        """Blocks `prepare_write(num_new)` would take from the pool (new ones plus copies)."""
        return len(self._shared_in_range(num_new)) + max(
            0, self.pool.blocks_for(self.num_tokens + num_new) - len(self.table)
        )

    def prepare_write(self, num_new: int) -> list[BlockCopy]:
        """Make slots `[num_tokens, num_tokens + num_new)` private and allocated; return the
        block copies the runtime must perform before the write. Does not advance `num_tokens`."""
        self._check_open()
        if num_new < 0:
            raise ValueError(f"cannot write {num_new} tokens")
        shared = self._shared_in_range(num_new)
        missing = max(0, self.pool.blocks_for(self.num_tokens + num_new) - len(self.table))
        if not self.pool.can_allocate(len(shared) + missing):
            raise OutOfBlocksError(
                f"writing {num_new} tokens needs {len(shared) + missing} blocks, {self.pool.num_free} free"
            )
        fresh = self.pool.allocate(len(shared) + missing)
        copies = []
        for position, target in zip(shared, fresh, strict=False):
            source = self.table[position]
            copies.append(BlockCopy(source, target))
            self.table[position] = target
        self.pool.free([copy.source for copy in copies])
        self.table.extend(fresh[len(shared) :])
        return copies

    def advance(self, num_new: int) -> None:
        """Record that `num_new` more slots were written (after `prepare_write`)."""
        self._check_open()
        if num_new < 0 or self.num_tokens + num_new > len(self.table) * self.block_size:
            raise ValueError(f"cannot advance {num_new} slots past the {len(self.table)} blocks held")
        self.num_tokens += num_new

    def fork(self) -> SequenceBlocks:
        """A second sequence sharing every block (and written slot) of this one."""
        self._check_open()
        self.pool.share(self.table)
        return SequenceBlocks(self.pool, self.table, self.num_tokens)

    def truncate(self, num_tokens: int, keep: int = 0) -> None:
        """Keep slots `[0, num_tokens)` written; free the blocks past them, or with `keep` past
        `keep` slots (blocks held for writes to come)."""
        self._check_open()
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a {self.num_tokens}-token sequence to {num_tokens}")
        keep = min(len(self.table), self.pool.blocks_for(max(num_tokens, keep)))
        self.pool.free(self.table[keep:])
        del self.table[keep:]
        self.num_tokens = num_tokens

    def compact(self, base: int, parents: Sequence[int], path: Sequence[int]) -> Compaction:
        """Keep a verified tree's accepted root-to-node `path` (indexes into the tree's nodes,
        which were written at slots `[base, base + len(parents))`); return the block copies and
        slot moves that put node `path[j]` at slot `base + j`, and truncate to `base + len(path)`.

        A target block another owner shares (a fork taken after the tree was written) is copied
        first (copy-on-write), so no other sequence sees the moves. Moves run in order: a target
        `base + j` never equals a later source, since a path node's index is at least its depth.
        Raises ValueError for a bad tree or path and OutOfBlocksError when a copy finds no free
        block, changing nothing either way.
        """
        self._check_open()
        if base < 0 or base + len(parents) > self.num_tokens:
            raise ValueError(
                f"tree of {len(parents)} nodes at {base} exceeds the {self.num_tokens} slots written"
            )
        validate_path(parents, path)
        moved = [(depth, node) for depth, node in enumerate(path) if node != depth]
        target_blocks = sorted({(base + depth) // self.block_size for depth, _ in moved})
        shared = [i for i in target_blocks if self.pool.ref_count(self.table[i]) > 1]
        if not self.pool.can_allocate(len(shared)):
            raise OutOfBlocksError(
                f"compaction needs {len(shared)} blocks to copy, {self.pool.num_free} free"
            )
        copies = []
        for position, target in zip(shared, self.pool.allocate(len(shared)), strict=True):
            copies.append(BlockCopy(self.table[position], target))
            self.pool.free([self.table[position]])
            self.table[position] = target
        moves = path_moves(self.slot, base, path)
        self.truncate(base + len(path))
        return Compaction(copies, moves)

    def release(self) -> None:
        """Drop this sequence's reference to every block (once)."""
        self._check_open()
        self.pool.free(self.table)
        self.table = []
        self.num_tokens = 0
        self._released = True

    def _shared_in_range(self, num_new: int) -> list[int]:
        first = self.num_tokens // self.block_size
        last = min(len(self.table), self.pool.blocks_for(self.num_tokens + num_new))
        if num_new == 0:
            return []
        return [i for i in range(first, last) if self.pool.ref_count(self.table[i]) > 1]

    def _check_open(self) -> None:
        if self._released:
            raise ValueError("this sequence's blocks were released")


def path_moves(slot: Callable[[int], int], base: int, path: Sequence[int]) -> list[SlotMove]:
    """The slot moves that put a verified tree's node `path[j]` (written at logical slot
    `base + path[j]`) at logical slot `base + j`, in an order that is safe to run (see `compact`);
    `slot` maps a logical slot to its cache slot."""
    return [
        SlotMove(slot(base + node), slot(base + depth)) for depth, node in enumerate(path) if node != depth
    ]


def validate_tree(parents: Sequence[int]) -> None:
    """Each node's parent is an earlier node or -1 (the committed prefix): no cycles, no forward links."""
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(
                f"tree node {node} has parent {parent}: parents must come before their children "
                "(-1 for the committed prefix)"
            )


def validate_path(parents: Sequence[int], path: Sequence[int]) -> None:
    """`parents` must be a valid tree and `path` must start at a child of the committed prefix
    and follow parent → child links."""
    validate_tree(parents)
    previous = -1
    for node in path:
        if not 0 <= node < len(parents):
            raise ValueError(f"path node {node} is not in a tree of {len(parents)} nodes")
        if parents[node] != previous:
            raise ValueError(
                f"path {list(path)} is not a root-to-node chain: node {node}'s parent is "
                f"{parents[node]}, not {previous}"
            )
        previous = node


__all__ = [
    "BlockCopy",
    "Compaction",
    "OutOfBlocksError",
    "SequenceBlocks",
    "SlotMove",
    "path_moves",
    "validate_path",
    "validate_tree",
]
