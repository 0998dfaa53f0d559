"""Paged KV tensors of one resident model.

The cache is a flat array of slots per layer: slot `block * block_size + offset` holds the key and
value of one token. Which blocks a sequence owns is policy (`policy.kv.blocks`); this class only
stores bytes and reads or writes them by slot index. It never decides anything.

Boundary states (for the cross-model prefill share, `runtime.sharing.layer_share`): for each layer `L`
registered with `add_boundary`, a slot also holds the hidden state that entered layer `L` for its
token, and a flag saying that this state belongs to the K/V now in the slot. Every path that
moves K/V between slots (copy-on-write, compaction, a band import) moves them along.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polylane.policy.kv.sequence_blocks import BlockCopy, SlotMove
from polylane.runtime.model.model_config import ModelConfig


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
        self.hidden_size = config.hidden_size
        self.boundary_states: dict[int, torch.Tensor] = {}  # layer → (num_slots, hidden): its input
        self.boundary_valid: dict[int, torch.Tensor] = {}  # layer → (num_slots,) bool

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        boundaries = sum(t.nbytes for t in (*self.boundary_states.values(), *self.boundary_valid.values()))
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values) + boundaries

    def add_boundary(self, layer: int) -> None:
        """Record, from now on, the hidden state entering `layer` of every token written (no slot
        holds a valid one yet). Idempotent."""
        if layer in self.boundary_states:
            return
        device = self.keys[0].device
        self.boundary_states[layer] = torch.zeros(
            (self.num_slots, self.hidden_size), dtype=self.dtype, device=device
        )
        self.boundary_valid[layer] = torch.zeros(self.num_slots, dtype=torch.bool, device=device)

    def write_boundary(self, layer: int, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """Store the input (T, hidden) of `layer` for the tokens at `slots` (T,)."""
        self.boundary_states[layer].index_copy_(0, slots, hidden.to(self.dtype))
        self.boundary_valid[layer].index_fill_(0, slots, True)

    def import_band(
        self, source: PagedKVCache, source_slots: torch.Tensor, slots: torch.Tensor, band: int
    ) -> None:
        """Copy K/V of layers `< band`, and the boundary states at layers `<= band`, of the tokens at
        `source_slots` in another model's cache (one sharing the band) into `slots` (T,) here.

        A boundary registered here but not in `source` is marked invalid for those slots; those
        above `band` are left to the forward that computes the layers above.
        """
        for layer in range(band):
            keys, values = source.keys[layer], source.values[layer]
            self.keys[layer].index_copy_(0, slots, keys.index_select(0, source_slots).to(self.dtype))
            self.values[layer].index_copy_(0, slots, values.index_select(0, source_slots).to(self.dtype))
        for layer, states in self.boundary_states.items():
            if layer > band:
                continue
            if layer in source.boundary_states:
                states.index_copy_(0, slots, source.boundary_states[layer].index_select(0, source_slots))
                valid = source.boundary_valid[layer].index_select(0, source_slots)
                self.boundary_valid[layer].index_copy_(0, slots, valid)
            else:
                self.boundary_valid[layer].index_fill_(0, slots, False)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new tokens' K/V (T, num_kv_heads, head_dim) at `slots` (T,)."""
        self.keys[layer].index_copy_(0, slots, keys.reshape(keys.shape[0], -1).to(self.dtype))
        self.values[layer].index_copy_(0, slots, values.reshape(values.shape[0], -1).to(self.dtype))

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
        boundaries = (*self.boundary_states.values(), *self.boundary_valid.values())
        for cache in (*self.keys, *self.values, *boundaries):
            cache.index_copy_(0, targets, cache.index_select(0, sources))
