"""One model's KV state in use: its paged cache, its `KVManager` (pool, prefix tree, served tables),
and the sequence operations that write KV bytes.

What this module owns: binding block tables to the bytes of a `PagedKVCache` and to the model's
forward. A served request's sequence is `planned`: the scheduler's `KVManager` chose its blocks and
reserved the slots this step may write (`StepPlan.tables`), so a forward over it allocates nothing
and accept/rollback only move and forget slots (the scheduler frees what is left at its next
`commit`). The runtime's own scratch sequences — a drafter model's drafts, `polylane generate`'s
plain loop — are `open`ed here and take blocks from the same pool as they go:

- `open(prompt)`: a new sequence, starting from the longest cached prefix of the prompt (a lock on
  the prefix tree's blocks; the last prompt token is always recomputed, since its logits are needed).
- `forward(extends)`: one forward pass over any mix of prefill chunks, decode tokens and token trees
  of several sequences; shared blocks about to be written are copied first (copy-on-write).
- `accept(sequence, path)`: after a tree (or chain) verify, keep the accepted root-to-node path, its
  KV moved into consecutive slots, nothing recomputed; the rest is dropped.
- `rollback(sequence, n)`: truncate to n tokens; the kept KV is never rewritten.
- `fork(sequence)`: a second sequence sharing every block.
- `close(sequence, cache=...)`: a completed sequence's KV enters the prefix tree; an aborted one's
  never does.

Not thread-safe: one engine thread owns a model's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polylane.policy.kv.blocks import OutOfBlocksError
from polylane.policy.kv.manager import KVManager
from polylane.policy.kv.radix import PrefixMatch, PrefixTreeStats
from polylane.policy.kv.sequence_blocks import Compaction, SequenceBlocks, path_moves, validate_path
from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.loading.loaded_model import LoadedModel
from polylane.runtime.model.batch import build_forward_batch
from polylane.types import SequenceChunk


@dataclass(frozen=True)
class PendingTree:
    """A verified token tree whose KV sits at slots [base, base + len(tokens)), awaiting `accept`."""

    base: int
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]


class PlannedBlocks:
    """A served request's block table for one step, as the plan gives it: `num_tokens` written, and
    every slot up to the table's end reserved for this step's writes (no pool references: the
    scheduler's `KVManager` holds them)."""

    def __init__(self, table: Sequence[int], num_tokens: int, block_size: int) -> None:
        if not 0 <= num_tokens <= len(table) * block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(table)} blocks of {block_size}")
        self.table = list(table)
        self.num_tokens = num_tokens
        self.block_size = block_size

    @property
    def room(self) -> int:
        """Slots reserved past the written tokens."""
        return len(self.table) * self.block_size - self.num_tokens

    def slot(self, index: int) -> int:
        block, offset = divmod(index, self.block_size)
        return self.table[block] * self.block_size + offset

    def blocks_needed(self, num_new: int) -> int:
        return 0

    def prepare_write(self, num_new: int) -> list:
        if num_new > self.room:
            raise ValueError(f"writing {num_new} tokens, but the plan reserved {self.room} slots")
        return []

    def advance(self, num_new: int) -> None:
        self.prepare_write(num_new)
        self.num_tokens += num_new

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a {self.num_tokens}-token sequence to {num_tokens}")
        self.num_tokens = num_tokens

    def compact(self, base: int, parents: Sequence[int], path: Sequence[int]) -> Compaction:
        """The moves that keep the accepted path (the reserved slots are private: no copies)."""
        validate_path(parents, path)
        moves = path_moves(self.slot, base, path)
        self.truncate(base + len(path))
        return Compaction([], moves)


@dataclass(eq=False)
class KVSequence:
    """A sequence's committed tokens (those whose KV is written) and its blocks."""

    blocks: SequenceBlocks | PlannedBlocks
    token_ids: list[int]
    cached_tokens: int = 0  # tokens served from the prefix tree when it was opened
    match: PrefixMatch | None = None
    pending: PendingTree | None = None
    closed: bool = field(default=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Extend:
    """New tokens for one sequence in a forward pass: a chain (`tree_parents` None) or a tree
    (parent index per node, -1 for a child of the committed tokens; parents before children)."""

    sequence: KVSequence
    token_ids: tuple[int, ...]
    tree_parents: tuple[int, ...] | None = None
    logits: str = "last"  # rows that need logits: "none", "last" or "all"


class ModelKV:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        prefix_cache: bool = True,
        max_cached_blocks: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.manager = KVManager(
            num_blocks,
            block_size,
            prefix_cache=prefix_cache,
            max_cached_blocks=max_cached_blocks,
            namespace=model.name,
        )
        self.pool = self.manager.pool
        self.tree = self.manager.tree
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.kv_dtype, model.device)

    def stats(self) -> PrefixTreeStats | None:
        return self.manager.stats()

    def planned(self, table: Sequence[int], token_ids: Sequence[int], cached_tokens: int = 0) -> KVSequence:
        """A served request's sequence for one step: `token_ids` written in `table`'s blocks, the
        rest of the table reserved by the plan."""
        return KVSequence(
            PlannedBlocks(table, len(token_ids), self.block_size), list(token_ids), cached_tokens
        )

    # ------------------------------------------------------------------ lifecycle

    def open(self, prompt_ids: Sequence[int]) -> KVSequence:
        """A sequence holding the cached prefix of `prompt_ids` (never the last token)."""
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if self.tree is None:
            return KVSequence(SequenceBlocks(self.pool), [])
        match = self.tree.match(prompt_ids[:-1], partial=True)
        blocks = SequenceBlocks(self.pool, match.blocks, match.num_tokens)
        return KVSequence(blocks, list(prompt_ids[: match.num_tokens]), match.num_tokens, match)

    def fork(self, sequence: KVSequence) -> KVSequence:
        """A new sequence sharing all of `sequence`'s KV; either may then diverge."""
        self._check_usable(sequence)
        return KVSequence(self._scratch(sequence).fork(), list(sequence.token_ids))

    def close(self, sequence: KVSequence, *, cache: bool = True) -> None:
        """End a sequence: with `cache`, its KV enters the prefix tree (completed requests only;
        an aborted or failed one closes with cache=False); its blocks and prefix lock are let go."""
        if sequence.closed:
            raise ValueError("sequence already closed")
        blocks = self._scratch(sequence)
        if cache and self.tree is not None and sequence.pending is None:
            self.tree.insert(sequence.token_ids, blocks.table)
        if sequence.match is not None:
            self.tree.release(sequence.match)
        blocks.release()
        sequence.closed = True

    # ------------------------------------------------------------------ forward

    def forward(self, extends: Sequence[Extend]) -> torch.Tensor:
        """One forward over every extend; returns float32 logits for the requested rows, in order,
        on the host (where sampling and acceptance run), whatever device the model is on."""
        if not extends:
            raise ValueError("a forward pass needs at least one sequence")
        if len({id(e.sequence) for e in extends}) != len(extends):
            raise ValueError("a sequence may appear only once in a forward pass")
        chunks = []
        for extend in extends:
            self._check_usable(extend.sequence)
            chunks.append(
                SequenceChunk(
                    token_ids=tuple(extend.token_ids),
                    num_cached=extend.sequence.num_tokens,
                    block_table=(),
                    tree_parents=extend.tree_parents,
                    logits=extend.logits,
                )
            )
        context_limit = self.model.config.max_context
        for chunk in chunks:
            if chunk.context_len > context_limit:
                raise ValueError(f"{chunk.context_len} tokens exceed the model's context of {context_limit}")
        self._reserve(extends)
        chunks = [
            SequenceChunk(c.token_ids, c.num_cached, tuple(e.sequence.blocks.table), c.tree_parents, c.logits)
            for c, e in zip(chunks, extends, strict=True)
        ]
        batch = build_forward_batch(chunks, self.block_size, self.model.config, self.cache.keys[0].device)
        logits = self.model.module(batch, self.cache).cpu()  # the step's one wait for the device
        for extend in extends:
            sequence = extend.sequence
            sequence.blocks.advance(len(extend.token_ids))
            if extend.tree_parents is None:
                sequence.token_ids.extend(extend.token_ids)
            else:
                sequence.pending = PendingTree(
                    sequence.num_tokens, tuple(extend.token_ids), tuple(extend.tree_parents)
                )
        return logits

    def extend_from_band(
        self,
        sequence: KVSequence,
        token_ids: Sequence[int],
        source: PagedKVCache,
        source_slots: Sequence[int],
        band: int,
    ) -> None:
        """Append `token_ids` to `sequence` from another model's KV, through a shared layer band.

        The caller (`runtime.sharing.layer_share`) has checked that the other model shares layers
        `[0, band)` with this one and that `source_slots` hold those tokens' K/V, at the same
        positions, with a valid boundary state at `band` (when `band` is below this model's
        depth). Their K/V of layers `< band` is copied, and only layers `>= band` run, from that
        boundary state. No logits: the caller prefills the rest (the prompt's last token at least).
        """
        self._check_usable(sequence)
        token_ids = tuple(token_ids)
        if not token_ids or len(source_slots) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens need as many source slots, got {len(source_slots)}")
        config = self.model.config
        if not 0 < band <= config.num_layers:
            raise ValueError(f"band of {band} layers for a {config.num_layers}-layer model")
        if sequence.num_tokens + len(token_ids) > config.max_context:
            raise ValueError(
                f"{sequence.num_tokens + len(token_ids)} tokens exceed the model's context of "
                f"{config.max_context}"
            )
        self._reserve([Extend(sequence, token_ids, logits="none")])
        chunk = SequenceChunk(token_ids, sequence.num_tokens, tuple(sequence.blocks.table), None, "none")
        device = self.cache.keys[0].device
        batch = build_forward_batch([chunk], self.block_size, config, device)
        sources = torch.tensor(list(source_slots), dtype=torch.long, device=device)
        self.cache.import_band(source, sources, batch.slot_mapping, band)
        if band < config.num_layers:
            hidden = source.boundary_states[band].index_select(0, sources)  # (T, E)
            self.model.module(batch, self.cache, start_layer=band, hidden=hidden)
        sequence.blocks.advance(len(token_ids))
        sequence.token_ids.extend(token_ids)

    def accept(self, sequence: KVSequence, path: Sequence[int]) -> None:
        """Keep the pending tree's root-to-node `path` (node indexes), KV compacted, drop the rest."""
        pending = sequence.pending
        if pending is None:
            raise ValueError("no verified tree to accept on this sequence")
        compaction = sequence.blocks.compact(pending.base, pending.parents, path)
        self.cache.copy_blocks(compaction.copies)
        self.cache.move_slots(compaction.moves)
        sequence.token_ids.extend(pending.token_ids[node] for node in path)
        sequence.pending = None

    def rollback(self, sequence: KVSequence, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; their KV is untouched, the tail's blocks are freed."""
        self._check_usable(sequence)
        if not 0 <= num_tokens <= sequence.num_tokens:
            raise ValueError(f"cannot roll a {sequence.num_tokens}-token sequence back to {num_tokens}")
        sequence.blocks.truncate(num_tokens)
        del sequence.token_ids[num_tokens:]

    # ------------------------------------------------------------------ internals

    def _reserve(self, extends: Sequence[Extend]) -> None:
        """Blocks for every extend, all or nothing, evicting cached prefixes if the pool is short."""
        needed = sum(e.sequence.blocks.blocks_needed(len(e.token_ids)) for e in extends)
        while needed > self.pool.num_free and self.tree is not None:
            if not self.tree.evict(needed - self.pool.num_free):
                break  # what is left is locked or also held by running sequences
        if needed > self.pool.num_free:
            raise OutOfBlocksError(
                f"KV cache full: this step needs {needed} blocks of {self.block_size} tokens, "
                f"{self.pool.num_free} of {self.pool.num_blocks} are free"
            )
        copies = []
        for extend in extends:
            copies.extend(extend.sequence.blocks.prepare_write(len(extend.token_ids)))
        self.cache.copy_blocks(copies)

    @staticmethod
    def _scratch(sequence: KVSequence) -> SequenceBlocks:
        """The blocks of a runtime scratch sequence; a served request's are the scheduler's."""
        if isinstance(sequence.blocks, PlannedBlocks):
            raise ValueError("a served request's KV belongs to the scheduler's KVManager")
        return sequence.blocks

    @staticmethod
    def _check_usable(sequence: KVSequence) -> None:
        if sequence.closed:
            raise ValueError("sequence is closed")
        if sequence.pending is not None:
            raise ValueError("accept (or reject) the verified tree before using this sequence again")
