"""One model's KV blocks as the scheduler decides them: the pool, the prefix tree, every request's table.

What this module owns: the `BlockPool` and `PrefixTree` of one model, and the block table of each
request the scheduler admitted (`SequenceBlocks`, keyed by request id), with the prefix match it
holds. The scheduler calls it at schedule time — `admit` (prefix match and the prompt's blocks),
`reserve` (the slots a step will write), `commit` (what the step wrote), `close` (cache a completed
request, or not) — and hands the resulting tables and block copies to the runner in the `StepPlan`;
the runner writes the KV bytes into those blocks and allocates nothing. The runtime's own scratch
sequences on the same pool (a drafter model's draft trees, `runtime.kv.model_kv`) take blocks
through `pool` and `tree` directly, so `num_available` always counts them.

Rules:
- Admission reserves every block the prompt needs (after its prefix-cache hit), so prefill chunks
  and a cross-model import never need more; a decode step reserves its token and any lookahead.
- Reserving takes free blocks first, then evicts cached prefixes (LRU); it is all or nothing.
- `commit` advances to the tokens written and frees reserved blocks past `keep` tokens (unused
  lookahead, the rejected part of a draft tree): rollback is the scheduler's decision.
- A completed request's written tokens enter the prefix tree (`close(..., token_ids)`); an aborted,
  failed or preempted-without-cache one's never do.

Pure policy: no torch. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polylane.policy.kv.blocks import BlockPool, OutOfBlocksError
from polylane.policy.kv.radix import PrefixMatch, PrefixTree, PrefixTreeStats
from polylane.policy.kv.sequence_blocks import BlockCopy, SequenceBlocks


@dataclass
class _Held:
    blocks: SequenceBlocks
    match: PrefixMatch | None  # its lock on the prefix tree (None without a tree)


class KVManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_cache: bool = True,
        max_cached_blocks: int | None = None,
        namespace: str = "",
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.tree = PrefixTree(self.pool, namespace, max_cached_blocks) if prefix_cache else None
        self._held: dict[int, _Held] = {}

    # ------------------------------------------------------------------ views

    @property
    def num_available(self) -> int:
        """Blocks a reservation could take now: free ones and cached prefixes no one has locked."""
        evictable = self.tree.num_evictable_blocks if self.tree is not None else 0
        return self.pool.num_free + evictable

    def stats(self) -> PrefixTreeStats | None:
        return self.tree.stats if self.tree is not None else None

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._held[seq_id].blocks.table)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of KV written for the sequence."""
        return self._held[seq_id].blocks.num_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    # ------------------------------------------------------------------ a sequence's life

    def admit(self, seq_id: int, token_ids: Sequence[int], headroom: int = 0) -> list[BlockCopy] | None:
        """Open `seq_id` at the longest cached prefix of `token_ids` (never its last token: its
        logits are needed) and reserve blocks for the rest, if that leaves `headroom` blocks
        available; the block copies to make before writing, or None (nothing changed)."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id} is already admitted")
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        held = self._open(token_ids, partial=True)
        if not self._fits(held, len(token_ids), headroom) and held.blocks.num_tokens % self.block_size:
            # a hit ending inside a cached block copies it and keeps it locked meanwhile: where
            # that leaves too little room, the whole blocks of the hit alone may still fit
            self._let_go(held)
            held = self._open(token_ids, partial=False)
        if not self._fits(held, len(token_ids), headroom):
            self._let_go(held)
            return None
        self._held[seq_id] = held
        copies = self.reserve(seq_id, len(token_ids) - held.blocks.num_tokens)
        if copies is None:  # evictable blocks still held by a running sequence: not free after all
            self._let_go(self._held.pop(seq_id))
        return copies

    def reserve(self, seq_id: int, num_new: int) -> list[BlockCopy] | None:
        """Make room for `num_new` more tokens past those written (private, allocated blocks),
        evicting cached prefixes if the pool is short; the copies to make first, or None when the
        pool cannot hold them (nothing changed)."""
        blocks = self._held[seq_id].blocks
        needed = blocks.blocks_needed(num_new)
        if needed > self.num_available:
            return None  # no eviction for a reservation that cannot fit anyway
        while needed > self.pool.num_free and self.tree is not None:
            if not self.tree.evict(needed - self.pool.num_free):
                break  # what is left is locked, or also held by running sequences
        try:
            return blocks.prepare_write(num_new)
        except OutOfBlocksError:
            return None

    def commit(self, seq_id: int, num_tokens: int, keep: int | None = None) -> None:
        """The sequence now holds `num_tokens` written tokens (fewer than before: a rollback); blocks
        past `keep` tokens (default: those written) go back to the pool."""
        blocks = self._held[seq_id].blocks
        if num_tokens > blocks.num_tokens:
            blocks.advance(num_tokens - blocks.num_tokens)
        blocks.truncate(num_tokens, keep or 0)

    def close(self, seq_id: int, token_ids: Sequence[int] | None = None) -> None:
        """End a sequence. With `token_ids` (a completed request's tokens; those written are
        cached) its KV enters the prefix tree; its blocks and prefix lock are let go."""
        held = self._held.pop(seq_id, None)
        if held is None:
            return
        if token_ids is not None and self.tree is not None:
            written = held.blocks.num_tokens
            self.tree.insert(token_ids[:written], held.blocks.table[: self.pool.blocks_for(written)])
        self._let_go(held)

    def _open(self, token_ids: Sequence[int], *, partial: bool) -> _Held:
        if self.tree is None:
            return _Held(SequenceBlocks(self.pool), None)
        match = self.tree.match(token_ids[:-1], partial=partial)
        return _Held(SequenceBlocks(self.pool, match.blocks, match.num_tokens), match)

    def _fits(self, held: _Held, num_tokens: int, headroom: int) -> bool:
        return self.num_available >= held.blocks.blocks_needed(num_tokens - held.blocks.num_tokens) + headroom

    def _let_go(self, held: _Held) -> None:
        if held.match is not None and self.tree is not None:
            self.tree.release(held.match)
        held.blocks.release()
