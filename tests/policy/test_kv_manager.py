"""KVManager alone: one model's pool, prefix tree and request block tables, as the scheduler drives
them. Hand cases: `admit` without a hit, with a whole-block hit and with a hit ending inside a
cached block (copy-on-write), never covering the prompt's last token, a refusal for headroom that
changes nothing, and a refusal when the evictable blocks are held elsewhere (a runtime scratch
sequence); `num_available` counting free and evictable cached blocks, and admission evicting them
least recently used first; `reserve` taking nothing within the table's room, free blocks first, then evicting
cached prefixes, and returning None (the table unchanged) when the pool cannot hold it; `commit`
advancing, freeing reserved blocks past `keep` (a verify pass's rollback) and truncating when given
fewer tokens; `close` with token ids caching only the whole blocks written, without them caching
nothing; the manager without a prefix cache. A stateful property test drives random
admits, reservations, writes with commits, and closes over a simulated cache of token ids: every
block is free or held (once per table holding it and once by the tree, never both free and held),
every sequence reads back its own tokens (prefix hits and copies included), and every open
sequence holds one prefix lock.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from polylane.policy.kv.manager import KVManager
from polylane.policy.kv.sequence_blocks import BlockCopy

B = 4  # block size


def tokens(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def conserved(kv: KVManager) -> None:
    """Every block is free, or held once per open sequence's table and once by the tree."""
    owners: Counter[int] = Counter()
    for seq in range(100):  # the hand cases' sequence ids
        if kv.holds(seq):
            owners.update(kv.table(seq))
    if kv.tree is not None:
        owners.update(kv.tree.held_blocks())
        kv.tree.validate()
    for block in range(kv.pool.num_blocks):
        assert kv.pool.ref_count(block) == owners[block], (block, owners)
    assert kv.pool.num_free == sum(1 for block in range(kv.pool.num_blocks) if not owners[block])


def completed(kv: KVManager, seq: int, prompt: list[int]) -> tuple[int, ...]:
    """Admit `prompt`, write all of it and close it cached: its whole blocks enter the tree.
    Returns the blocks it held."""
    assert kv.admit(seq, prompt) == []
    kv.commit(seq, len(prompt))
    table = kv.table(seq)
    kv.close(seq, prompt)
    return table


# ---------------------------------------------------------------------- admit


def test_admit_without_a_hit_reserves_the_whole_prompt_and_writes_nothing() -> None:
    kv = KVManager(8, B)
    assert kv.admit(1, tokens(0, 10)) == []
    assert kv.holds(1) and len(kv.table(1)) == 3
    assert kv.num_tokens(1) == 0
    assert kv.pool.num_free == 5
    with pytest.raises(ValueError, match="already admitted"):
        kv.admit(1, tokens(0, 4))
    with pytest.raises(ValueError, match="at least one token"):
        kv.admit(2, [])
    conserved(kv)


def test_admit_with_a_whole_block_hit_starts_at_the_hit_and_reserves_only_the_rest() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 12)
    first = completed(kv, 1, prompt)
    assert kv.tree.num_cached_blocks == 3 and kv.pool.num_free == 5
    assert kv.admit(2, [*prompt, 90, 91, 92, 93]) == []
    assert kv.num_tokens(2) == 12
    assert kv.table(2)[:3] == first and len(kv.table(2)) == 4
    assert kv.pool.num_free == 4  # one new block
    assert kv.tree.num_evictable_blocks == 0  # the hit is locked while 2 holds it
    conserved(kv)
    kv.close(2)
    assert kv.tree.num_evictable_blocks == 3 and kv.tree.num_locks == 0


def test_a_hit_never_covers_the_last_token_and_a_cached_block_used_in_part_is_copied() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 12)
    cached = completed(kv, 1, prompt)
    # The whole prompt is cached, but its last token's logits are needed: 11 tokens hit, 3 slots
    # of the third block, which is copied before the request writes slot 11.
    copies = kv.admit(2, prompt)
    assert kv.num_tokens(2) == 11
    assert copies == [BlockCopy(cached[2], kv.table(2)[2])]
    assert kv.table(2)[:2] == cached[:2] and kv.table(2)[2] != cached[2]
    assert kv.pool.ref_count(cached[2]) == 1  # the tree's: the request let its reference go
    assert kv.pool.num_free == 4
    conserved(kv)
    # 10 tokens in common with the cached 12: 2 whole blocks and 2 slots of the third.
    copies = kv.admit(3, [*prompt[:10], 70, 71, 72])
    assert kv.num_tokens(3) == 10 and copies == [BlockCopy(cached[2], kv.table(3)[2])]
    assert len(kv.table(3)) == 4
    conserved(kv)


@pytest.mark.parametrize(("headroom", "admitted"), [(1, True), (2, False)])
def test_admission_leaves_the_headroom_it_is_asked_for(headroom: int, admitted: bool) -> None:
    kv = KVManager(4, B)
    copies = kv.admit(1, tokens(0, 12), headroom)  # 3 blocks of the 4
    assert (copies is not None) is admitted and kv.holds(1) is admitted
    assert kv.pool.num_free == (1 if admitted else 4)
    conserved(kv)


def test_a_refused_admission_changes_nothing_even_after_a_prefix_match() -> None:
    kv = KVManager(6, B)
    prompt = tokens(0, 8)
    completed(kv, 1, prompt)
    held, free = kv.tree.held_blocks(), kv.pool.num_free
    assert kv.admit(2, [*prompt, *tokens(50, 12)], headroom=2) is None  # 8 cached, 3 + 2 of 4
    assert not kv.holds(2)
    assert (kv.tree.held_blocks(), kv.pool.num_free, kv.tree.num_locks) == (held, free, 0)
    assert kv.tree.num_evictable_blocks == 2  # the match it took was let go
    conserved(kv)
    assert kv.admit(2, [*prompt, *tokens(50, 12)]) == []  # without the headroom it fits
    assert kv.num_tokens(2) == 8


def test_num_available_counts_free_blocks_and_evictable_cached_ones() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 12)
    completed(kv, 1, prompt)
    assert (kv.pool.num_free, kv.num_available) == (5, 8)
    kv.admit(2, [*prompt, 99])  # locks the 3 cached blocks, takes 1 more
    assert (kv.pool.num_free, kv.num_available) == (4, 4)
    kv.close(2)
    assert kv.num_available == 8


def test_admission_evicts_cached_prefixes_it_needs_least_recently_used_first() -> None:
    kv = KVManager(4, B)
    completed(kv, 1, tokens(0, 4))
    completed(kv, 2, tokens(100, 8))  # 3 blocks cached, 1 free
    assert kv.num_available == 4
    assert kv.admit(3, tokens(200, 8)) == []  # 2 blocks: the free one and the oldest cached
    assert kv.tree.num_cached_blocks == 2
    assert kv.tree.num_cached_tokens(tokens(0, 4)) == 0  # 1's, used least recently, went
    assert kv.tree.num_cached_tokens(tokens(100, 8)) == 8
    conserved(kv)


def test_an_admission_that_evictable_blocks_held_elsewhere_cannot_serve_is_refused() -> None:
    # A runtime scratch sequence (a drafter's tree) may hold cached blocks the tree does not lock:
    # they count as evictable, but evicting them frees nothing.
    kv = KVManager(4, B)
    prompt = tokens(0, 8)
    completed(kv, 1, prompt)
    scratch = kv.tree.match(prompt)
    kv.tree.release(scratch)  # the lock is let go early; the references are kept
    assert kv.num_available == 4
    assert kv.admit(2, tokens(100, 12)) is None  # 3 blocks: 2 free, the 2 evicted free nothing
    assert not kv.holds(2) and kv.tree.num_locks == 0
    assert kv.pool.num_free == 2
    kv.pool.free(scratch.blocks)
    assert kv.pool.num_free == 4


def test_a_hit_ending_inside_a_block_that_does_not_fit_falls_back_to_a_fit_without_it() -> None:
    kv = KVManager(4, B)
    completed(kv, 1, tokens(0, 5))  # block [0, 1, 2, 3] cached, 3 free
    prompt = [0, 1, 90, *tokens(50, 10)]  # 13 tokens: 4 blocks, 2 slots into the cached one
    assert kv.admit(2, prompt) is not None


# ---------------------------------------------------------------------- reserve


def test_reserve_within_the_tables_room_takes_nothing() -> None:
    kv = KVManager(8, B)
    kv.admit(1, tokens(0, 6))  # 2 blocks, 6 of 8 slots used once written
    kv.commit(1, 6)
    assert kv.reserve(1, 2) == [] and len(kv.table(1)) == 2 and kv.pool.num_free == 6
    assert kv.reserve(1, 3) == [] and len(kv.table(1)) == 3 and kv.pool.num_free == 5
    assert kv.num_tokens(1) == 6  # reserving writes nothing


def test_reserve_takes_free_blocks_then_evicts_cached_prefixes() -> None:
    kv = KVManager(6, B)
    completed(kv, 1, tokens(0, 8))  # 2 cached
    kv.admit(2, tokens(100, 8))
    kv.commit(2, 8)
    assert (kv.pool.num_free, kv.tree.num_cached_blocks) == (2, 2)
    assert kv.reserve(2, 12) == []  # 3 blocks: the 2 free and one evicted
    assert (kv.pool.num_free, kv.tree.num_cached_blocks, len(kv.table(2))) == (0, 1, 5)
    conserved(kv)


def test_a_reserve_the_pool_cannot_hold_returns_none_and_leaves_the_table_as_it_was() -> None:
    kv = KVManager(4, B)
    kv.admit(1, tokens(0, 8))
    kv.commit(1, 8)
    table = kv.table(1)
    assert kv.reserve(1, 9) is None  # 3 more blocks, 2 free
    assert (kv.table(1), kv.num_tokens(1), kv.pool.num_free) == (table, 8, 2)
    assert kv.reserve(1, 8) == []  # all or nothing: 2 fit
    conserved(kv)


def test_a_reserve_that_cannot_fit_even_after_eviction_keeps_the_cached_prefixes() -> None:
    kv = KVManager(6, B)
    completed(kv, 1, tokens(0, 8))  # 2 cached
    kv.admit(2, tokens(100, 12))  # 3 blocks, 1 free
    kv.commit(2, 12)
    assert kv.num_available == 3
    assert kv.reserve(2, 16) is None  # 4 blocks
    assert kv.tree.num_cached_blocks == 2


# ---------------------------------------------------------------------- commit


def test_commit_advances_and_frees_reserved_blocks_past_keep() -> None:
    kv = KVManager(8, B)
    kv.admit(1, tokens(0, 4))
    kv.commit(1, 4)
    assert kv.reserve(1, 7) == []  # a verify pass: its token and 6 drafts, slots 4..10
    assert len(kv.table(1)) == 3 and kv.pool.num_free == 5
    kv.commit(1, 7)  # 2 drafts accepted: slots 7..10 rolled back, the third block with them
    assert (kv.num_tokens(1), len(kv.table(1)), kv.pool.num_free) == (7, 2, 6)
    kv.reserve(1, 7)
    kv.commit(1, 8, keep=12)  # a prefill that keeps its prompt's blocks
    assert (kv.num_tokens(1), len(kv.table(1))) == (8, 3)
    kv.commit(1, 8)
    assert len(kv.table(1)) == 2
    with pytest.raises(ValueError):
        kv.commit(1, 9)  # past the blocks held: reserve first
    conserved(kv)


def test_commit_with_fewer_tokens_truncates() -> None:
    kv = KVManager(8, B)
    kv.admit(1, tokens(0, 12))
    kv.commit(1, 12)
    kv.commit(1, 5)
    assert (kv.num_tokens(1), len(kv.table(1)), kv.pool.num_free) == (5, 2, 6)
    conserved(kv)


def test_a_truncating_commit_keeps_the_blocks_up_to_keep() -> None:
    kv = KVManager(8, B)
    kv.admit(1, tokens(0, 12))
    kv.commit(1, 8, keep=12)
    kv.commit(1, 5, keep=12)
    assert (kv.num_tokens(1), len(kv.table(1))) == (5, 3)


# ---------------------------------------------------------------------- close


def test_close_with_token_ids_caches_only_the_whole_blocks_written() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 12)
    kv.admit(1, prompt)  # 3 blocks reserved
    kv.commit(1, 10, keep=12)  # 10 written: 2 whole blocks
    kv.close(1, [*prompt, 77])
    assert not kv.holds(1)
    assert kv.tree.num_cached_blocks == 2 and kv.pool.num_free == 6
    assert kv.tree.num_cached_tokens(prompt) == 8
    assert kv.stats().inserted_tokens == 8  # type: ignore[union-attr]
    conserved(kv)


def test_close_without_token_ids_caches_nothing() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 12)
    kv.admit(1, prompt)
    kv.commit(1, 12)
    kv.close(1)
    assert kv.tree.num_cached_blocks == 0 and kv.pool.num_free == 8
    kv.close(1)  # already gone: nothing
    kv.close(42)
    conserved(kv)


def test_closing_a_hit_lets_its_lock_go_and_caches_what_it_added() -> None:
    kv = KVManager(8, B)
    prompt = tokens(0, 8)
    completed(kv, 1, prompt)
    kv.admit(2, [*prompt, *tokens(50, 5)])  # 8 hit, 13 tokens
    kv.commit(2, 13)
    kv.close(2, [*prompt, *tokens(50, 5)])
    assert kv.tree.num_locks == 0 and kv.tree.num_cached_blocks == 3  # 12 whole tokens
    assert kv.pool.num_free == 5
    conserved(kv)


def test_closing_every_sequence_uncached_keeps_only_what_completed_requests_cached() -> None:
    kv = KVManager(10, B)
    prompt = tokens(0, 8)
    completed(kv, 1, prompt)
    kv.admit(2, [*prompt, 5])
    kv.admit(3, tokens(100, 6))
    kv.commit(3, 6)
    kv.close(2)
    kv.close(3)
    assert not kv.holds(2) and not kv.holds(3)
    assert kv.tree.num_locks == 0 and kv.tree.num_cached_blocks == 2
    assert kv.pool.num_free == 8
    conserved(kv)


def test_without_a_prefix_cache_nothing_is_matched_or_cached() -> None:
    kv = KVManager(8, B, prefix_cache=False)
    assert kv.tree is None and kv.stats() is None
    prompt = tokens(0, 12)
    assert kv.admit(1, prompt) == []
    kv.commit(1, 12)
    kv.close(1, prompt)
    assert kv.admit(2, prompt) == [] and kv.num_tokens(2) == 0
    assert kv.num_available == kv.pool.num_free == 5
    kv.commit(2, 12)
    assert kv.reserve(2, 21) is None  # 6 more blocks, 5 free
    conserved(kv)


# ---------------------------------------------------------------------- property: a simulated cache


class KVManagerMachine(RuleBasedStateMachine):
    """Random admits, reservations, writes + commits and closes over 8 blocks of 4, with prompts
    from two token ids (so hits, whole and partial, are common). The simulated cache holds one
    token id per slot; the runner writes a sequence's tokens, then garbage past what it commits
    (rejected drafts), only within what was last reserved for it."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(8, B)
        self.cache: list[list[int | None]] = [[None] * B for _ in range(8)]
        self.tokens: dict[int, list[int]] = {}  # each open sequence's tokens: its KV, then its prompt's rest
        self.writable: dict[int, int] = {}  # slots it may write below: its reservations since a truncation
        self.next_id = 0

    def _copy(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            self.cache[copy.target] = list(self.cache[copy.source])

    def _state(self) -> tuple[object, ...]:
        tree = self.kv.tree
        assert tree is not None
        return self.kv.pool.num_free, tree.held_blocks(), tree.num_locks, tree.num_evictable_blocks

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=20), headroom=st.integers(0, 2))
    def admit(self, prompt: list[int], headroom: int) -> None:
        before = self._state()
        seq, self.next_id = self.next_id, self.next_id + 1
        copies = self.kv.admit(seq, prompt, headroom)
        if copies is None:
            assert not self.kv.holds(seq) and self._state() == before
            return
        self._copy(copies)
        self.tokens[seq], self.writable[seq] = list(prompt), len(prompt)
        assert self.kv.num_tokens(seq) < len(prompt)
        assert len(self.kv.table(seq)) == self.kv.blocks_for(len(prompt))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reserve(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        num_new = data.draw(st.integers(0, 12))
        table, written = self.kv.table(seq), self.kv.num_tokens(seq)
        copies = self.kv.reserve(seq, num_new)
        if copies is None:
            assert (self.kv.table(seq), self.kv.num_tokens(seq)) == (table, written)
            assert written + num_new > len(table) * B
            return
        self._copy(copies)
        assert len(self.kv.table(seq)) * B - written >= num_new
        self.writable[seq] = max(self.writable[seq], written + num_new)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def write_and_commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        written, end = self.kv.num_tokens(seq), self.writable[seq]
        committed = data.draw(st.integers(0, end))
        wrote = data.draw(st.integers(max(written, committed), max(written, end)))
        own = self.tokens[seq]
        missing = max(0, committed - len(own))  # generated tokens, past its prompt
        own += data.draw(st.lists(st.integers(0, 1), min_size=missing, max_size=missing))
        table = self.kv.table(seq)
        for position in range(written, wrote):
            value = own[position] if position < committed else -1
            self.cache[table[position // B]][position % B] = value
        keep = data.draw(st.none() | st.integers(committed, max(committed, end)))
        self.kv.commit(seq, committed, keep)
        assert self.kv.num_tokens(seq) == committed
        if committed < written:  # truncated: the last kept block may be shared, reserve again
            del own[committed:]
            self.writable[seq] = committed
        else:
            assert len(self.kv.table(seq)) == self.kv.blocks_for(max(committed, keep or 0))
            self.writable[seq] = min(end, len(self.kv.table(seq)) * B)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), cache=st.booleans())
    def close(self, data: st.DataObject, cache: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        own = self.tokens.pop(seq)
        self.kv.close(seq, own if cache else None)
        del self.writable[seq]
        assert not self.kv.holds(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Write everything reserved for a sequence, commit it and close it cached (its KV enters
        the tree: later prompts hit it)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        written, end = self.kv.num_tokens(seq), self.writable[seq]
        own = self.tokens.pop(seq)
        own += [0] * max(0, end - len(own))
        table = self.kv.table(seq)
        for position in range(written, end):
            self.cache[table[position // B]][position % B] = own[position]
        if end > written:
            self.kv.commit(seq, end)
        self.kv.close(seq, own)
        del self.writable[seq]

    @rule()
    def close_all(self) -> None:
        for seq in list(self.tokens):
            self.kv.close(seq)
        self.tokens.clear()
        self.writable.clear()

    @invariant()
    def blocks_are_conserved_and_every_sequence_reads_its_own_tokens(self) -> None:
        kv, tree = self.kv, self.kv.tree
        assert tree is not None
        owners = Counter(block for seq in self.tokens for block in kv.table(seq))
        owners.update(tree.held_blocks())
        for block in range(kv.pool.num_blocks):
            assert kv.pool.ref_count(block) == owners[block], (block, owners)
        assert kv.pool.num_free == sum(1 for block in range(kv.pool.num_blocks) if not owners[block])
        assert kv.num_available == kv.pool.num_free + tree.num_evictable_blocks
        assert tree.num_locks == len(self.tokens)
        tree.validate()
        for seq, own in self.tokens.items():
            table, written = kv.table(seq), kv.num_tokens(seq)
            assert written <= len(table) * B
            assert [self.cache[table[i // B]][i % B] for i in range(written)] == own[:written], seq


KVManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_kv_manager_keeps_blocks_conserved_and_contents_right = KVManagerMachine.TestCase
