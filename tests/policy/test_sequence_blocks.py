"""SequenceBlocks: fork, copy-on-write, truncate and compact over a BlockPool, by hand and as a
stateful property test against a simulated cache.

The simulation stores one value per cache slot and applies every `BlockCopy` / `SlotMove` the
policy returns. Its contract: every live sequence reads back exactly the values it wrote (so a
write by one fork is never seen by another), pool reference counts equal the table entries that
hold each block, and a refused write or compaction changes nothing.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from polylane.policy.kv.blocks import BlockPool, OutOfBlocksError
from polylane.policy.kv.sequence_blocks import (
    BlockCopy,
    Compaction,
    SequenceBlocks,
    SlotMove,
    validate_path,
    validate_tree,
)

B = 4


def written(pool: BlockPool, tokens: int) -> SequenceBlocks:
    sequence = SequenceBlocks(pool)
    sequence.prepare_write(tokens)
    sequence.advance(tokens)
    return sequence


def test_fork_shares_and_a_write_copies_only_the_shared_partial_block() -> None:
    pool = BlockPool(8, B)
    parent = written(pool, 6)  # one full block, two slots of the second
    child = parent.fork()
    assert child.table == parent.table and child.num_tokens == 6
    assert [pool.ref_count(b) for b in parent.table] == [2, 2]
    old = parent.table[1]
    copies = child.prepare_write(3)  # slots 6..8: into the shared partial block, then a new one
    assert copies == [BlockCopy(old, child.table[1])], f"{copies}"
    assert parent.table[1] == old and child.table[1] != old, "the other sequence must keep the old block"
    assert child.table[0] == parent.table[0] and len(child.table) == 3
    assert [pool.ref_count(b) for b in parent.table] == [2, 1]
    assert parent.prepare_write(2) == [], "the parent's partial block is now its own"


def test_write_after_a_full_shared_block_copies_nothing() -> None:
    pool = BlockPool(8, B)
    parent = written(pool, 4)
    child = parent.fork()
    assert child.blocks_needed(3) == 1
    assert child.prepare_write(3) == [] and child.table[0] == parent.table[0]


def test_blocks_needed_is_what_prepare_write_takes() -> None:
    pool = BlockPool(16, B)
    parent = written(pool, 7)
    child = parent.fork()
    for sequence, new in ((child, 10), (parent, 1), (written(pool, 0), 9)):
        free = pool.num_free
        needed = sequence.blocks_needed(new)
        sequence.prepare_write(new)
        assert free - pool.num_free == needed, f"took {free - pool.num_free}, promised {needed}"


def test_out_of_blocks_changes_nothing() -> None:
    pool = BlockPool(3, B)
    parent = written(pool, 6)
    child = parent.fork()
    before = (list(child.table), child.num_tokens, pool.num_free, [pool.ref_count(b) for b in range(3)])
    with pytest.raises(OutOfBlocksError):
        child.prepare_write(7)  # a copy of block 2 plus two new blocks; one is free
    after = (list(child.table), child.num_tokens, pool.num_free, [pool.ref_count(b) for b in range(3)])
    assert after == before


def test_truncate_frees_tail_blocks_and_keeps_the_prefix_slots() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 11)
    slots = [sequence.slot(i) for i in range(5)]
    sequence.truncate(5)
    assert len(sequence.table) == 2 and pool.num_free == 6
    assert [sequence.slot(i) for i in range(5)] == slots
    with pytest.raises(ValueError, match="truncate"):
        sequence.truncate(6)


def test_truncate_into_a_shared_block_keeps_it_and_a_later_write_copies_it() -> None:
    pool = BlockPool(8, B)
    parent = written(pool, 8)
    child = parent.fork()
    shared = child.table[1]
    child.truncate(5)  # keeps one slot of the shared second block
    assert child.table == parent.table[:2] and pool.ref_count(shared) == 2
    copies = child.prepare_write(1)
    assert copies == [BlockCopy(shared, child.table[1])] and parent.table[1] == shared
    assert pool.ref_count(shared) == 1


def test_truncate_to_zero_frees_everything_it_owned() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 9)
    sequence.truncate(0)
    assert (sequence.table, sequence.num_tokens, pool.num_free) == ([], 0, 8)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_compact_of_a_chain_moves_nothing(k: int) -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 9)  # base 5, a 4-token chain
    slots = [sequence.slot(i) for i in range(5 + k)]
    assert sequence.compact(5, (-1, 0, 1, 2), list(range(k))) == Compaction([], [])
    assert sequence.num_tokens == 5 + k and len(sequence.table) == pool.blocks_for(5 + k)
    assert [sequence.slot(i) for i in range(5 + k)] == slots


def test_compact_moves_the_accepted_path_to_its_depths() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 3 + 5)  # base 3, tree of 5 nodes
    slot = [sequence.slot(i) for i in range(8)]
    compaction = sequence.compact(3, (-1, -1, 0, 1, 3), [1, 3, 4])
    assert compaction.copies == [], "no block is shared, so nothing to copy"
    expected = [SlotMove(slot[4], slot[3]), SlotMove(slot[6], slot[4]), SlotMove(slot[7], slot[5])]
    assert compaction.moves == expected, f"{compaction.moves}"
    assert sequence.num_tokens == 6 and len(sequence.table) == 2


@pytest.mark.parametrize(
    "path",
    [
        [2],  # not a child of the committed prefix
        [3],
        [0, 3],  # 3's parent is 1: skips a link
        [1, 4],  # 4's parent is 3: skips a link
        [1, 1],
        [0, 2, 1],
        [5],  # out of range
        [1, 3, 5],
        [-1],
    ],
)
def test_bad_path_raises_and_changes_nothing(path: list[int]) -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 8)
    before = (list(sequence.table), sequence.num_tokens, [pool.ref_count(b) for b in range(8)])
    with pytest.raises(ValueError):
        sequence.compact(3, (-1, -1, 0, 1, 3), path)
    after = (list(sequence.table), sequence.num_tokens, [pool.ref_count(b) for b in range(8)])
    assert after == before and pool.num_free == 6


def test_compact_of_a_tree_past_the_written_slots_raises() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 7)
    with pytest.raises(ValueError, match="exceeds"):
        sequence.compact(3, (-1, -1, 0, 1, 3), [1])
    assert sequence.num_tokens == 7 and len(sequence.table) == 2


@pytest.mark.parametrize("parents", [(0,), (1, -1), (-2,), (-1, 1), (-1, 0, 3, 1)])
def test_validate_tree_rejects_parents_that_do_not_come_first(parents: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="parent"):
        validate_tree(parents)


def test_validate_path_accepts_every_root_to_node_chain() -> None:
    parents = (-1, -1, 0, 1, 3)
    for path in ([], [0], [1], [0, 2], [1, 3], [1, 3, 4]):
        validate_path(parents, path)


def test_released_sequence_refuses_everything_and_bad_construction_raises() -> None:
    pool = BlockPool(4, B)
    sequence = written(pool, 5)
    sequence.release()
    assert pool.num_free == 4
    assert (sequence.table, sequence.num_tokens) == ([], 0)
    operations = (
        lambda: sequence.prepare_write(1),
        lambda: sequence.advance(0),
        lambda: sequence.truncate(0),
        lambda: sequence.compact(0, (), []),
        sequence.fork,
        sequence.release,
    )
    for operation in operations:
        with pytest.raises(ValueError, match="released"):
            operation()
    assert pool.num_free == 4, "a refused operation on a released sequence touched the pool"


@pytest.mark.parametrize(("blocks", "tokens"), [(0, 1), (1, B + 1), (2, 2 * B + 1), (1, -1)])
def test_construction_with_tokens_past_the_blocks_raises(blocks: int, tokens: int) -> None:
    pool = BlockPool(4, B)
    held = pool.allocate(blocks)
    with pytest.raises(ValueError, match="do not fit"):
        SequenceBlocks(pool, held, num_tokens=tokens)
    adopted = SequenceBlocks(pool, held, num_tokens=len(held) * B)
    adopted.release()
    assert pool.num_free == 4


def test_advance_past_the_held_blocks_raises() -> None:
    pool = BlockPool(4, B)
    sequence = SequenceBlocks(pool)
    sequence.prepare_write(3)
    with pytest.raises(ValueError):
        sequence.advance(B + 1)
    with pytest.raises(ValueError):
        sequence.advance(-1)
    sequence.advance(B)
    assert sequence.num_tokens == B


# ---------------------------------------------------------------- compact: copy-on-write and input checks


def test_compact_copies_a_shared_target_block_before_moving_into_it() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 6)  # base 2, tree (-1, -1, 0, 1) at slots 2..5
    fork = sequence.fork()  # a fork taken after the tree was written shares both blocks
    old = list(sequence.table)
    fork_slots = [fork.slot(i) for i in range(6)]
    compaction = sequence.compact(2, (-1, -1, 0, 1), [1, 3])
    assert compaction.copies == [BlockCopy(old[0], sequence.table[0])], f"{compaction.copies}"
    assert sequence.table[0] != old[0] and fork.table == old, "the fork must keep its blocks"
    assert [fork.slot(i) for i in range(6)] == fork_slots and fork.num_tokens == 6
    read_by_fork = set(fork_slots)
    assert not [move for move in compaction.moves if move.target in read_by_fork], f"{compaction}"
    own = sequence.table[0]  # the copies run first, so a source in the copied block reads the copy
    assert compaction.moves == [
        SlotMove(own * B + 3, own * B + 2),  # node 1 (slot 3) to slot 2
        SlotMove(old[1] * B + 1, own * B + 3),  # node 3 (slot 5, still the shared block) to slot 3
    ], f"{compaction.moves}"
    assert sequence.num_tokens == 4 and sequence.table == [own] and [pool.ref_count(b) for b in old] == [1, 1]
    assert pool.ref_count(sequence.table[0]) == 1


def test_compact_of_a_chain_copies_nothing_even_when_shared() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 6)
    fork = sequence.fork()
    assert sequence.compact(2, (-1, 0, 1), [0, 1]) == Compaction([], [])
    assert sequence.table == fork.table[:1] and sequence.num_tokens == 4


def test_compact_out_of_blocks_for_its_copy_changes_nothing() -> None:
    pool = BlockPool(2, B)
    sequence = written(pool, 6)
    fork = sequence.fork()
    before = (list(sequence.table), sequence.num_tokens, [pool.ref_count(b) for b in range(2)])
    with pytest.raises(OutOfBlocksError):
        sequence.compact(2, (-1, -1, 0, 1), [1, 3])
    after = (list(sequence.table), sequence.num_tokens, [pool.ref_count(b) for b in range(2)])
    assert after == before and fork.table == before[0]


@pytest.mark.parametrize("base", [-1, -3])
def test_compact_rejects_a_negative_base(base: int) -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 3)
    with pytest.raises(ValueError):
        sequence.compact(base, (-1,), [0])
    assert sequence.num_tokens == 3 and len(sequence.table) == 1


def test_compact_rejects_parents_that_are_not_topologically_ordered() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 2)
    with pytest.raises(ValueError, match="parent"):
        sequence.compact(0, (1, -1), [1, 0])  # a swap: applied in order, node 0's KV would be lost
    assert sequence.num_tokens == 2 and pool.ref_count(sequence.table[0]) == 1


# ---------------------------------------------------------------- stateful property test


class ForkWriteTruncate(RuleBasedStateMachine):
    """Random new / write / fork / truncate / tree-verify-and-compact / release over a small pool.

    `cache` simulates the paged KV cache (slot -> value); every value written is unique, and each
    live sequence carries the list of values it must read back through `slot(i)`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, B)
        self.cache: dict[int, object] = {}
        self.live: list[tuple[SequenceBlocks, list[int]]] = []  # (sequence, expected values)
        self.values = itertools.count(1)

    def _snapshot(self, sequence: SequenceBlocks) -> tuple:
        counts = [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        return list(sequence.table), sequence.num_tokens, self.pool.num_free, counts

    def _write(self, sequence: SequenceBlocks, expected: list[int], count: int) -> bool:
        before = self._snapshot(sequence)
        needed = sequence.blocks_needed(count)
        try:
            copies = sequence.prepare_write(count)
        except OutOfBlocksError:
            assert needed > self.pool.num_free, f"refused a write needing {needed}, {self.pool.num_free} free"
            assert self._snapshot(sequence) == before, "a refused write changed the table or the pool"
            return False
        taken = before[2] - self.pool.num_free
        assert taken == needed, f"prepare_write({count}) took {taken} blocks, blocks_needed said {needed}"
        assert sequence.num_tokens == before[1], "prepare_write advanced num_tokens"
        first, end = sequence.num_tokens // B, self.pool.blocks_for(sequence.num_tokens + count)
        if count:
            private = [self.pool.ref_count(sequence.table[i]) for i in range(first, end)]
            assert private == [1] * len(private), f"blocks to be written are shared: {private}"
        for copy in copies:
            assert copy.source in before[0] and copy.target in sequence.table, f"{copy}"
            assert copy.source not in sequence.table, f"{copy}: the copied block is still in the table"
            for offset in range(B):  # the runtime copies the whole block
                source, target = copy.source * B + offset, copy.target * B + offset
                if source in self.cache:
                    self.cache[target] = self.cache[source]
                else:
                    self.cache.pop(target, None)
        for index in range(sequence.num_tokens, sequence.num_tokens + count):
            value = next(self.values)
            self.cache[sequence.slot(index)] = value
            expected.append(value)
        sequence.advance(count)
        return True

    @rule(count=st.integers(0, 9))
    def new_sequence(self, count: int) -> None:
        sequence, expected = SequenceBlocks(self.pool), []
        if self._write(sequence, expected, count):
            self.live.append((sequence, expected))
        else:
            sequence.release()

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), count=st.integers(0, 9))
    def write(self, pick: int, count: int) -> None:
        self._write(*self.live[pick % len(self.live)], count)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick: int) -> None:
        sequence, expected = self.live[pick % len(self.live)]
        child = sequence.fork()
        assert child.table == sequence.table and child.num_tokens == sequence.num_tokens
        self.live.append((child, list(expected)))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), data=st.data())
    def truncate(self, pick: int, data: st.DataObject) -> None:
        sequence, expected = self.live[pick % len(self.live)]
        keep = data.draw(st.integers(0, sequence.num_tokens), label="keep")
        slots = [sequence.slot(i) for i in range(keep)]
        sequence.truncate(keep)
        assert sequence.num_tokens == keep and len(sequence.table) == self.pool.blocks_for(keep)
        assert [sequence.slot(i) for i in range(keep)] == slots, "truncate moved kept slots"
        del expected[keep:]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), extra=st.integers(1, 5))
    def truncate_past_the_end(self, pick: int, extra: int) -> None:
        sequence, _ = self.live[pick % len(self.live)]
        before = self._snapshot(sequence)
        with pytest.raises(ValueError):
            sequence.truncate(sequence.num_tokens + extra)
        assert self._snapshot(sequence) == before

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), fork_first=st.booleans(), data=st.data())
    def verify_tree(self, pick: int, fork_first: bool, data: st.DataObject) -> None:
        """Write a tree's nodes, maybe fork (the fork keeps the whole tree), then compact."""
        sequence, expected = self.live[pick % len(self.live)]
        size = data.draw(st.integers(1, 6), label="tree size")
        parents = tuple(data.draw(st.integers(-1, node - 1)) for node in range(size))
        base = sequence.num_tokens
        if not self._write(sequence, expected, size):
            return
        if fork_first:
            self.live.append((sequence.fork(), list(expected)))
        node = data.draw(st.integers(-1, size - 1), label="accepted node")
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        tree_values = expected[base:]
        before = self._snapshot(sequence)
        try:
            compaction = sequence.compact(base, parents, path)
        except OutOfBlocksError:
            assert self._snapshot(sequence) == before, "a refused compaction changed the table or the pool"
            return  # the whole tree stays written, as `expected` says
        for copy in compaction.copies:  # copies first, whole blocks
            assert copy.source in before[0] and copy.target in sequence.table, f"{copy}"
            for offset in range(B):
                source, target = copy.source * B + offset, copy.target * B + offset
                if source in self.cache:
                    self.cache[target] = self.cache[source]
                else:
                    self.cache.pop(target, None)
        for move in compaction.moves:  # then the moves, in order, as the runtime applies them
            assert self.pool.ref_count(move.target // B) == 1, f"{move} lands in a shared block"
            self.cache[move.target] = self.cache[move.source]
        assert sequence.num_tokens == base + len(path)
        assert len(sequence.table) == self.pool.blocks_for(base + len(path))
        expected[base:] = [tree_values[node] for node in path]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def release(self, pick: int) -> None:
        sequence, _ = self.live.pop(pick % len(self.live))
        sequence.release()
        assert (sequence.table, sequence.num_tokens) == ([], 0)

    @invariant()
    def every_sequence_reads_what_it_wrote(self) -> None:
        for sequence, expected in self.live:
            assert sequence.num_tokens == len(expected)
            got = [self.cache.get(sequence.slot(i)) for i in range(sequence.num_tokens)]
            assert got == expected, f"sequence reads {got}, wrote {expected}"

    @invariant()
    def reference_counts_are_conserved(self) -> None:
        owners = [0] * self.pool.num_blocks
        for sequence, _ in self.live:
            assert len(sequence.table) == self.pool.blocks_for(sequence.num_tokens), "stray blocks"
            for block in sequence.table:
                owners[block] += 1
        counts = [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        assert owners == counts, f"table entries {owners}, pool counts {counts}"
        referenced = sum(1 for count in owners if count)
        assert self.pool.num_free == self.pool.num_blocks - referenced

    def teardown(self) -> None:
        for sequence, _ in self.live:
            sequence.release()
        assert self.pool.num_free == self.pool.num_blocks, "blocks leaked"
        assert all(self.pool.ref_count(b) == 0 for b in range(self.pool.num_blocks))


TestForkWriteTruncate = ForkWriteTruncate.TestCase
TestForkWriteTruncate.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
