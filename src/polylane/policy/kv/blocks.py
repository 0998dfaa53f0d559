"""Per-model pool of fixed-size KV blocks: free list and reference counts.

A block id names `block_size` consecutive slots of the model's paged KV cache. The pool only counts
owners; the bytes live in the runtime's cache. Contract: every `allocate` or `share` is matched by
one `free` of the same block, and a block returns to the free list when its last owner frees it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """More blocks were asked for than are free; callers check `can_allocate` first."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one owner to each of `blocks` (a fork or a cache hit); all or nothing."""
        blocks = list(blocks)
        for block in blocks:
            self._check_id(block)
            if self._ref_counts[block] == 0:
                raise ValueError(f"block {block} is free and cannot be shared")
        for block in blocks:
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one owner of each of `blocks`; blocks left with none return to the pool.

        All or nothing: a bad id or an over-free raises before any count changes.
        """
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            self._check_id(block)
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self._ref_counts[block]:
                raise ValueError(f"block {block} freed more often than it was owned")
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} is outside the pool (0..{self.num_blocks - 1})")

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
