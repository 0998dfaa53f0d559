"""BlockPool: unit cases, and a stateful property test against a reference dict of ref counts.

The reference model is the contract of `policy.kv.blocks`: a block has a count of owners; `allocate`
hands out blocks with none, `share` adds one, `free` drops one, and a block with none is free.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from polylane.policy.kv.blocks import BlockPool, OutOfBlocksError

# ---------------------------------------------------------------- unit cases


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (-1, 16), (4, -2)])
def test_rejects_empty_pool(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for(tokens: int, blocks: int) -> None:
    got = BlockPool(8, 16).blocks_for(tokens)
    assert got == blocks, f"{tokens} tokens need {blocks} blocks of 16, got {got}"


def test_allocate_hands_out_distinct_owned_blocks() -> None:
    pool = BlockPool(6, 4)
    first, second = pool.allocate(2), pool.allocate(3)
    assert len(first) == 2 and len(second) == 3, f"{first}, {second}"
    everything = first + second
    assert len(set(everything)) == 5, f"a block was handed out twice: {everything}"
    assert all(0 <= block < 6 for block in everything), f"ids out of range: {everything}"
    assert [pool.ref_count(block) for block in everything] == [1] * 5
    assert pool.num_free == 1, f"{pool.num_free} free, expected 1"


def test_allocate_zero_is_empty() -> None:
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    assert pool.num_free == 2, f"{pool.num_free} free"


def test_out_of_blocks_changes_nothing() -> None:
    pool = BlockPool(4, 4)
    held = pool.allocate(3)
    assert not pool.can_allocate(2), "can_allocate(2) with 1 free"
    with pytest.raises(OutOfBlocksError, match="2"):
        pool.allocate(2)
    assert pool.num_free == 1, f"{pool.num_free} free after a refused allocate"
    assert [pool.ref_count(block) for block in held] == [1, 1, 1]
    assert pool.can_allocate(1)
    [last] = pool.allocate(1)
    assert last not in held, f"block {last} handed out while held"


def test_fork_keeps_blocks_until_last_owner_frees() -> None:
    pool = BlockPool(4, 4)
    prefix = pool.allocate(2)
    pool.share(prefix)  # a fork of the sequence
    assert [pool.ref_count(b) for b in prefix] == [2, 2]
    pool.free(prefix)  # the original finishes
    assert [pool.ref_count(b) for b in prefix] == [1, 1]
    assert pool.num_free == 2, f"{pool.num_free} free while the fork holds its blocks"
    pool.free(prefix)  # the fork finishes
    assert [pool.ref_count(b) for b in prefix] == [0, 0]
    assert pool.num_free == 4, f"{pool.num_free} free after the last owner freed"


def test_freed_blocks_are_reused() -> None:
    pool = BlockPool(2, 4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    again = pool.allocate(2)
    assert sorted(again) == sorted(blocks), f"{again} after freeing {blocks}"


def test_over_free_raises() -> None:
    pool = BlockPool(3, 4)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])
    assert pool.num_free == 3, f"{pool.num_free} free after an over-free"


def test_share_of_free_block_raises() -> None:
    pool = BlockPool(3, 4)
    with pytest.raises(ValueError, match="free"):
        pool.share([1])
    assert pool.ref_count(1) == 0 and pool.num_free == 3


@pytest.mark.parametrize("block", [3, 100])
def test_out_of_range_ids_raise(block: int) -> None:
    pool = BlockPool(3, 4)
    pool.allocate(3)
    for operation in (pool.free, pool.share):
        with pytest.raises((ValueError, IndexError)):
            operation([block])
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("operation", ["free", "share"])
def test_negative_ids_raise(operation: str) -> None:
    pool = BlockPool(3, 4)
    pool.allocate(3)
    with pytest.raises((ValueError, IndexError)):
        getattr(pool, operation)([-1])
    counts = [pool.ref_count(b) for b in range(3)]
    assert counts == [1, 1, 1] and pool.num_free == 0, f"counts {counts}, {pool.num_free} free"


# ---------------------------------------------------------------- stateful property test

NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free against a dict of expected owner counts.

    A handle is one ownership of a list of blocks: what `allocate` returned, or a prefix of
    another handle that was `share`d (a fork). Freeing a handle drops exactly that ownership.
    """

    handles = Bundle("handles")

    @initialize(block_size=st.integers(1, 32))
    def make_pool(self, block_size: int) -> None:
        self.pool = BlockPool(NUM_BLOCKS, block_size)
        self.expected = dict.fromkeys(range(NUM_BLOCKS), 0)  # block → owners

    def _free_blocks(self) -> int:
        return sum(1 for owners in self.expected.values() if owners == 0)

    @rule(target=handles, count=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, count: int):
        free_before = self._free_blocks()
        assert self.pool.can_allocate(count) == (count <= free_before), (
            f"can_allocate({count}) = {self.pool.can_allocate(count)} with {free_before} free"
        )
        if count > free_before:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(count)
            return multiple()
        blocks = self.pool.allocate(count)
        assert len(blocks) == count, f"asked for {count}, got {blocks}"
        assert len(set(blocks)) == count, f"duplicate blocks {blocks}"
        for block in blocks:
            assert self.expected[block] == 0, f"block {block} handed out with owners"
            self.expected[block] = 1
        return tuple(blocks)

    @rule(target=handles, handle=handles, data=st.data())
    def fork(self, handle: tuple[int, ...], data: st.DataObject):
        prefix = handle[: data.draw(st.integers(0, len(handle)), label="prefix length")]
        self.pool.share(prefix)
        for block in prefix:
            self.expected[block] += 1
        return prefix

    @rule(handle=consumes(handles))
    def free(self, handle: tuple[int, ...]) -> None:
        self.pool.free(handle)
        for block in handle:
            self.expected[block] -= 1

    @precondition(lambda self: any(owners == 0 for owners in self.expected.values()))
    @rule(data=st.data())
    def misuse_free_block(self, data: st.DataObject) -> None:
        unowned = sorted(b for b, owners in self.expected.items() if owners == 0)
        block = data.draw(st.sampled_from(unowned), label="free block")
        free_before = self.pool.num_free
        with pytest.raises(ValueError):
            self.pool.free([block])
        with pytest.raises(ValueError):
            self.pool.share([block])
        assert self.pool.num_free == free_before, f"{self.pool.num_free} free, was {free_before}"

    @invariant()
    def ref_counts_match(self) -> None:
        actual = {block: self.pool.ref_count(block) for block in range(NUM_BLOCKS)}
        assert actual == self.expected, f"ref counts {actual}, expected {self.expected}"

    @invariant()
    def free_plus_owned_is_total(self) -> None:
        owned = sum(1 for owners in self.expected.values() if owners > 0)
        assert self.pool.num_free + owned == NUM_BLOCKS, (
            f"{self.pool.num_free} free + {owned} owned != {NUM_BLOCKS}"
        )
        assert self.pool.num_free == self._free_blocks(), (
            f"{self.pool.num_free} free, reference says {self._free_blocks()}"
        )


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


def test_drain_everything_returns_all_blocks() -> None:
    # After any history, freeing every ownership returns the pool to full.
    pool = BlockPool(NUM_BLOCKS, 4)
    owned = [pool.allocate(3), pool.allocate(2)]
    pool.share(owned[0][:2])
    owned.append(owned[0][:2])
    for blocks in owned:
        pool.free(blocks)
    assert pool.num_free == NUM_BLOCKS, f"{pool.num_free} of {NUM_BLOCKS} free after draining"
    assert sorted(pool.allocate(NUM_BLOCKS)) == list(range(NUM_BLOCKS))
