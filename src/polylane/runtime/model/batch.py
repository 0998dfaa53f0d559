"""Turn a list of `SequenceChunk`s into the tensors of one forward pass.

A forward pass runs over a flat batch of T new tokens from B sequences (prefill chunks, decode
tokens and token trees mixed). Attention runs over a padded view: B sequences × Q query rows
(Q = the longest chunk) × C key slots (C = the longest context). This module builds, once per
forward, everything the layers need to go between the flat and the padded view: which cache slot
each new token is written to, which slots each sequence reads, and the boolean attention mask
(committed prefix + causal or tree visibility among new tokens + sliding window). The flat index
arrays are built with numpy at once; the padded layouts only when the torch path asks for them
(the native stack reads the chunks and their context slots instead).

It decides nothing about which sequences run; the scheduler does that.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig
from polylane.types import SequenceChunk


@dataclass
class AttentionLayout:
    """How one kind of layer (global or sliding) attends in this forward.

    Queries: the flat (T, H, D) batch viewed as (B, Q, H, D) through `query_index`
    ((B, Q) rows of the flat batch; None when B == 1); `out_index` ((T,) rows of the padded
    B * Q output that are real tokens; None when B == 1).
    Keys/values, (B, C, Hkv, D), come from exactly one of: `kv_range`, a (start, stop) slice of
    consecutive cache slots (B == 1); `kv_index`, (B * C,) slots gathered row by row; or neither,
    when a fresh prefill attends only to its own new K/V.
    mask: (B, 1, Q, C) bool, True where a query may see a key; None when everything is visible
    or `is_causal` says it all.
    """

    batch_size: int
    context_len: int
    query_index: torch.Tensor | None
    out_index: torch.Tensor | None
    kv_range: tuple[int, int] | None
    kv_index: torch.Tensor | None
    mask: torch.Tensor | None
    is_causal: bool


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (T,) cache slot each new token's K/V is written to
    logit_rows: torch.Tensor  # (R,) rows of the flat batch whose logits are returned
    chunks: tuple[SequenceChunk, ...]
    context_slots: list[np.ndarray]  # per chunk, the cache slot of each index of its context
    host_positions: np.ndarray  # `positions` on the host (reading them off a device would wait)
    config: ModelConfig = field(repr=False)
    device: torch.device | str = "cpu"

    def select(self, chunk_indexes: Sequence[int]) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """The forward of only the chunks `chunk_indexes` (in that order): (sub-batch, the flat rows
        of this batch its tokens are, the rows of this batch's logits its logit rows are). Logit rows
        are kept as this batch has them (also when set by hand)."""
        starts = np.cumsum([0, *(c.num_new for c in self.chunks)])
        token_rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in chunk_indexes])
        new_index = np.full(int(starts[-1]), -1, dtype=np.int64)
        new_index[token_rows] = np.arange(len(token_rows))
        logit_rows = self.logit_rows.cpu().numpy()
        kept = np.flatnonzero(new_index[logit_rows] >= 0)  # (R',) indexes into this batch's logit rows

        def rows(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(self.device)

        tokens = rows(token_rows)
        sub = ForwardBatch(
            token_ids=self.token_ids[tokens],
            positions=self.positions[tokens],
            slot_mapping=self.slot_mapping[tokens],
            logit_rows=rows(new_index[logit_rows[kept]]),
            chunks=tuple(self.chunks[i] for i in chunk_indexes),
            context_slots=[self.context_slots[i] for i in chunk_indexes],
            host_positions=self.host_positions[token_rows],
            config=self.config,
            device=self.device,
        )
        return sub, tokens, rows(kept)

    @functools.cached_property
    def longest_context(self) -> int:
        """C: every position of the batch is below it (known on the host, unlike `positions.max()`)."""
        return max(c.context_len for c in self.chunks)

    @functools.cached_property
    def layouts(self) -> dict[str, AttentionLayout]:
        """The padded attention layout of each layer type (global, sliding), built on first use."""
        layer_types = (GLOBAL, SLIDING) if self.config.has_sliding_layers else (GLOBAL,)
        positions = self.host_positions.tolist()
        longest_context = self.longest_context
        source = functools.cache(lambda: _context_source(self.context_slots, longest_context, self.device))
        return {
            kind: _layout(self.chunks, positions, kind == SLIDING, self.config, source, self.device)
            for kind in layer_types
        }


def _tree_depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def new_token_visibility(chunk: SequenceChunk) -> np.ndarray:
    """(n, n) bool for a chunk's n new tokens: token q may see token k (causal, or
    ancestor-or-self in a tree)."""
    n = chunk.num_new
    if chunk.tree_parents is None:
        return np.tri(n, dtype=bool)
    visible = np.zeros((n, n), dtype=bool)
    for node, parent in enumerate(chunk.tree_parents):
        if parent >= 0:
            visible[node] = visible[parent]
        visible[node, node] = True
    return visible


def _visibility(chunk: SequenceChunk, size: int) -> torch.Tensor:
    """(size, size) bool: `new_token_visibility` padded with nothing visible."""
    n = chunk.num_new
    visible = torch.zeros(size, size, dtype=torch.bool)
    visible[:n, :n] = torch.from_numpy(new_token_visibility(chunk))
    return visible


def build_forward_batch(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    config: ModelConfig,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    if not chunks:
        raise ValueError("a forward pass needs at least one chunk")
    for chunk in chunks:
        if chunk.context_len > len(chunk.block_table) * block_size:
            raise ValueError(
                f"chunk needs {chunk.context_len} slots but its block table holds "
                f"{len(chunk.block_table)} blocks of {block_size}"
            )
    slots = _context_slots(chunks, block_size)
    token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64)
    positions = np.concatenate(
        [
            np.arange(c.num_cached, c.context_len, dtype=np.int64)
            if c.tree_parents is None
            else c.num_cached - 1 + np.array(_tree_depths(c.tree_parents), dtype=np.int64)
            for c in chunks
        ]
    )
    slot_mapping = np.concatenate([row[c.num_cached :] for c, row in zip(chunks, slots, strict=True)])
    logit_rows: list[int] = []
    start = 0
    for chunk in chunks:
        end = start + chunk.num_new
        logit_rows.extend({"none": (), "last": (end - 1,), "all": range(start, end)}[chunk.logits])
        start = end

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device)

    return ForwardBatch(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slot_mapping),
        logit_rows=tensor(np.array(logit_rows, dtype=np.int64)),
        chunks=tuple(chunks),
        context_slots=slots,
        host_positions=positions,
        config=config,
        device=device,
    )


def _layout(
    chunks: Sequence[SequenceChunk],
    flat_positions: list[int],
    sliding: bool,
    config: ModelConfig,
    context_source: Callable[[], tuple[tuple[int, int] | None, torch.Tensor | None]],
    device: torch.device | str,
) -> AttentionLayout:
    window = config.sliding_window if sliding else None
    batch = len(chunks)
    longest_chunk = max(c.num_new for c in chunks)
    longest_context = max(c.context_len for c in chunks)
    is_tree = any(c.tree_parents is not None for c in chunks)
    fits_window = window is None or longest_context <= window

    if batch == 1 and not is_tree and fits_window and chunks[0].num_cached == 0:
        # A fresh prefill sees only itself: plain causal attention over its own K/V.
        chunk = chunks[0]
        return AttentionLayout(1, chunk.num_new, None, None, None, None, None, is_causal=chunk.num_new > 1)
    kv_range, kv_index = context_source()
    if batch == 1 and not is_tree and fits_window:
        chunk = chunks[0]
        if chunk.num_new == 1:  # one decode token sees everything
            return AttentionLayout(1, longest_context, None, None, kv_range, kv_index, None, False)
    if longest_chunk == 1 and fits_window:
        # A batch of decode tokens (the lane's usual step): each sees its own context, no more.
        context_len = torch.tensor([c.context_len for c in chunks])
        mask = torch.arange(longest_context)[None, :] < context_len[:, None]  # (B, C)
        rows = torch.arange(batch, dtype=torch.long)
        return AttentionLayout(
            batch_size=batch,
            context_len=longest_context,
            query_index=rows[:, None].to(device),
            out_index=rows.to(device),
            kv_range=kv_range,
            kv_index=kv_index,
            mask=mask[:, None, None].to(device),
            is_causal=False,
        )

    # General case: padded view with an explicit mask.
    num_cached = torch.tensor([c.num_cached for c in chunks])
    context_len = torch.tensor([c.context_len for c in chunks])
    key_index = torch.arange(longest_context)
    committed = key_index[None, :] < num_cached[:, None]  # (B, C)
    new_index = key_index[None, :] - num_cached[:, None]  # (B, C) index into the chunk
    in_chunk = (new_index >= 0) & (key_index[None, :] < context_len[:, None])
    new_index = new_index.clamp(0, longest_chunk - 1)
    # (B, Q, Q): causal for chains (rows and columns past a chunk's end are padding, masked
    # below), ancestor-or-self for trees; one shared causal matrix, trees built per chunk
    causal = torch.ones(longest_chunk, longest_chunk, dtype=torch.bool).tril()
    if is_tree:
        visibility = torch.stack(
            [causal if c.tree_parents is None else _visibility(c, longest_chunk) for c in chunks]
        )
    else:
        visibility = causal.expand(batch, longest_chunk, longest_chunk)
    sees_new = visibility.gather(2, new_index[:, None, :].expand(batch, longest_chunk, -1))
    mask = committed[:, None, :] | (in_chunk[:, None, :] & sees_new)  # (B, Q, C)

    query_positions = torch.zeros(batch, longest_chunk, dtype=torch.long)
    query_index = torch.zeros(batch, longest_chunk, dtype=torch.long)
    out_index: list[int] = []
    start = 0
    for b, chunk in enumerate(chunks):
        n = chunk.num_new
        query_positions[b, :n] = torch.tensor(flat_positions[start : start + n])
        query_index[b, :n] = torch.arange(start, start + n)
        query_index[b, n:] = start  # padding rows repeat a real query; their output is dropped
        out_index.extend(range(b * longest_chunk, b * longest_chunk + n))
        start += n
    if window is not None:
        key_positions = torch.where(
            committed, key_index[None, :], query_positions.gather(1, new_index)
        )  # (B, C)
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        mask &= distance < window
    query_is_real = torch.arange(longest_chunk)[None, :] < torch.tensor([c.num_new for c in chunks])[:, None]
    mask[:, :, 0] |= ~query_is_real  # padding rows see one key, so their softmax stays finite

    return AttentionLayout(
        batch_size=batch,
        context_len=longest_context,
        query_index=query_index.to(device) if batch > 1 else None,
        out_index=torch.tensor(out_index, dtype=torch.long, device=device) if batch > 1 else None,
        kv_range=kv_range,
        kv_index=kv_index,
        mask=mask[:, None].to(device),
        is_causal=False,
    )


def _context_slots(chunks: Sequence[SequenceChunk], block_size: int) -> list[np.ndarray]:
    """Cache slot of every logical index of every sequence's context (vectorised: a decode step of
    8 sequences at 400 tokens would otherwise loop 3,200 times in Python)."""
    slots = []
    for chunk in chunks:
        index = np.arange(chunk.context_len, dtype=np.int64)
        table = np.asarray(chunk.block_table[: -(-chunk.context_len // block_size)], dtype=np.int64)
        slots.append(table[index // block_size] * block_size + index % block_size)
    return slots


def _context_source(
    slots: list[np.ndarray], longest_context: int, device: torch.device | str
) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """A slice when one sequence's slots are consecutive, else (B * C,) rows to gather.

    Shorter contexts are padded with their first slot; the mask hides the padding.
    """
    if len(slots) == 1:
        row = slots[0]
        if bool((np.diff(row) == 1).all()):  # consecutive slots (one alone is too)
            return (int(row[0]), int(row[0]) + len(row)), None
    rows = np.empty((len(slots), longest_context), dtype=np.int64)
    for b, row in enumerate(slots):
        rows[b, : len(row)] = row
        rows[b, len(row) :] = row[0]
    return None, torch.from_numpy(rows.reshape(-1)).to(device)
