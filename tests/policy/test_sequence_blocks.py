"""SequenceBlocks: fork, copy-on-write, truncate and compact over a BlockPool, by hand and as a
stateful property test against a simulated cache.

The simulation stores one value per cache slot and applies every `BlockCopy` / `SlotMove` the
policy returns. Its contract: every live sequence reads back exactly the values it wrote (so a
write by one fork is never seen by another), pool reference counts equal the table entries that
hold each block, and a refused write changes nothing.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from polylane.policy.blocks import BlockPool, OutOfBlocksError
from polylane.policy.sequence_blocks import BlockCopy, SequenceBlocks, SlotMove

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
    assert [pool.ref_count(b) for b in parent.table] == [2, 2]
    copies = child.prepare_write(3)  # slots 6..8: into the shared partial block, then a new one
    assert copies == [BlockCopy(parent.table[1], child.table[1])], f"{copies}"
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


def test_compact_of_a_chain_moves_nothing() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 9)  # base 5, a 4-token chain
    assert sequence.compact(5, (-1, 0, 1, 2), [0, 1]) == []
    assert sequence.num_tokens == 7


def test_compact_moves_the_accepted_path_to_its_depths() -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 3 + 5)  # base 3, tree of 5 nodes
    slot = [sequence.slot(i) for i in range(8)]
    moves = sequence.compact(3, (-1, -1, 0, 1, 3), [1, 3, 4])
    assert moves == [SlotMove(slot[4], slot[3]), SlotMove(slot[6], slot[4]), SlotMove(slot[7], slot[5])]
    assert sequence.num_tokens == 6 and len(sequence.table) == 2


@pytest.mark.parametrize("path", [[2], [0, 3], [1, 1], [5], [0, 2, 1]])
def test_bad_path_raises_and_changes_nothing(path: list[int]) -> None:
    pool = BlockPool(8, B)
    sequence = written(pool, 8)
    table = list(sequence.table)
    with pytest.raises(ValueError):
        sequence.compact(3, (-1, -1, 0, 1, 3), path)
    assert (sequence.table, sequence.num_tokens, pool.num_free) == (table, 8, 6)


def test_released_sequence_refuses_everything_and_bad_construction_raises() -> None:
    pool = BlockPool(4, B)
    sequence = written(pool, 5)
    sequence.release()
    assert pool.num_free == 4
    for operation in (lambda: sequence.prepare_write(1), sequence.fork, sequence.release):
        with pytest.raises(ValueError, match="released"):
            operation()
    with pytest.raises(ValueError, match="do not fit"):
        SequenceBlocks(pool, pool.allocate(1), num_tokens=B + 1)


class ForkWriteTruncate(RuleBasedStateMachine):
    """Random sequences of write / fork / truncate / compact / release over a small pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, B)
        self.cache: dict[int, int] = {}  # slot → value
        self.live: list[tuple[SequenceBlocks, list[int]]] = []  # (sequence, expected values)
        self.values = itertools.count(1)

    def _snapshot(self, sequence: SequenceBlocks) -> tuple:
        counts = [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        return list(sequence.table), sequence.num_tokens, self.pool.num_free, counts

    def _write(self, sequence: SequenceBlocks, expected: list[int], count: int) -> bool:
        before = self._snapshot(sequence)
        try:
            copies = sequence.prepare_write(count)
        except OutOfBlocksError:
            assert self._snapshot(sequence) == before, "a refused write changed the pool"
            return False
        for copy in copies:
            for offset in range(B):
                source = copy.source * B + offset
                if source in self.cache:
                    self.cache[copy.target * B + offset] = self.cache[source]
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
        self.live.append((sequence.fork(), list(expected)))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), fraction=st.floats(0, 1))
    def truncate(self, pick: int, fraction: float) -> None:
        sequence, expected = self.live[pick % len(self.live)]
        keep = int(sequence.num_tokens * fraction)
        sequence.truncate(keep)
        del expected[keep:]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), data=st.data())
    def verify_tree(self, pick: int, data: st.DataObject) -> None:
        sequence, expected = self.live[pick % len(self.live)]
        size = data.draw(st.integers(1, 6))
        parents = tuple(data.draw(st.integers(-1, node - 1)) for node in range(size))
        base = sequence.num_tokens
        if not self._write(sequence, expected, size):
            return
        node = data.draw(st.integers(-1, size - 1))
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        tree_values = expected[base:]
        moves = sequence.compact(base, parents, path)
        staged = {move.target: self.cache[move.source] for move in moves}
        self.cache.update(staged)
        expected[base:] = [tree_values[node] for node in path]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def release(self, pick: int) -> None:
        sequence, _ = self.live.pop(pick % len(self.live))
        sequence.release()

    @invariant()
    def every_sequence_reads_what_it_wrote(self) -> None:
        for sequence, expected in self.live:
            got = [self.cache[sequence.slot(i)] for i in range(sequence.num_tokens)]
            assert got == expected, f"sequence reads {got}, wrote {expected}"

    @invariant()
    def reference_counts_are_conserved(self) -> None:
        owners = [0] * self.pool.num_blocks
        for sequence, _ in self.live:
            for block in sequence.table:
                owners[block] += 1
        assert owners == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        assert self.pool.num_free == sum(1 for count in owners if count == 0)

    def teardown(self) -> None:
        for sequence, _ in self.live:
            sequence.release()
        assert self.pool.num_free == self.pool.num_blocks, "blocks leaked"


TestForkWriteTruncate = ForkWriteTruncate.TestCase
TestForkWriteTruncate.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
