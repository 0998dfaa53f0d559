"""Paged KV tensors of one resident model.

The cache is a flat array of slots per layer: slot `block * block_size + offset` holds the key and
value of one token. Which blocks a sequence owns is policy (`policy.blocks`); this class only
stores bytes and reads or writes them by slot index. It never decides anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polylane.policy.sequence_blocks import BlockCopy, SlotMove
from polylane.runtime.model_config import ModelConfig


class PagedKVCache:
    """K and V for `num_blocks` blocks of `block_size` tokens, per layer.

    keys[layer] and values[layer] have shape (num_blocks * block_size, num_kv_heads * head_dim):
    one row per slot, so gathering a sequence's context is a row `index_select` (or a plain
    slice when its slots are consecutive).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks * block_size, config.num_kv_heads * config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new tokens' K/V (T, num_kv_heads, head_dim) at `slots` (T,)."""
        self.keys[layer].index_copy_(0, slots, keys.reshape(keys.shape[0], -1))
        self.values[layer].index_copy_(0, slots, values.reshape(values.shape[0], -1))

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy whole blocks (copy-on-write), every layer; sources are read before any write."""
        if not copies:
            return
        size = self.block_size
        offsets = torch.arange(size)
        sources = torch.tensor([c.source for c in copies])[:, None] * size + offsets
        targets = torch.tensor([c.target for c in copies])[:, None] * size + offsets
        self._copy_slots(sources.flatten(), targets.flatten())

    def move_slots(self, moves: Sequence[SlotMove]) -> None:
        """Apply tree-compaction moves in order (a target is never a later move's source)."""
        if moves:
            self._copy_slots(torch.tensor([m.source for m in moves]), torch.tensor([m.target for m in moves]))

    def _copy_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        device = self.keys[0].device
        sources, targets = sources.to(device), targets.to(device)
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, targets, cache.index_select(0, sources))
