"""PrefixTree: hand cases for match / insert / split / evict / budget / locks, and a stateful
property test against a reference dict of cached block-aligned prefixes.

The reference is the contract of `policy.kv.radix`: the tree caches a prefix-closed set of whole-block
token prefixes, each mapped to the block its inserter gave for its last block; a lookup returns the
longest of them; the pool counts one owner per cached block plus one per block a request holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from polylane.policy.kv.blocks import BlockPool
from polylane.policy.kv.radix import PrefixMatch, PrefixTree

B = 4  # block size of the hand cases


def make_tree(num_blocks: int = 16, budget: int | None = None) -> tuple[BlockPool, PrefixTree]:
    pool = BlockPool(num_blocks, B)
    return pool, PrefixTree(pool, namespace="m", max_cached_blocks=budget)


def toks(*block_labels: int, tail: int = 0) -> list[int]:
    """Tokens of whole blocks: block label L is [L*10, L*10+1, L*10+2, L*10+3]; `tail` extra tokens."""
    tokens = [label * 10 + offset for label in block_labels for offset in range(B)]
    return tokens + [999] * tail


def complete(pool: BlockPool, tree: PrefixTree, tokens: list[int]) -> tuple[PrefixMatch, list[int], int]:
    """A request's whole life: match, allocate the rest, insert on completion, release, free."""
    match = tree.match(tokens)
    blocks = list(match.blocks) + pool.allocate(pool.blocks_for(len(tokens)) - len(match.blocks))
    newly_cached = tree.insert(tokens, blocks)
    tree.release(match)
    pool.free(blocks)
    return match, blocks, newly_cached


def insert_fresh(pool: BlockPool, tree: PrefixTree, tokens: list[int]) -> tuple[list[int], int]:
    """Insert `tokens` computed from scratch (no match) and free the request's own references."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    newly_cached = tree.insert(tokens, blocks)
    pool.free(blocks)
    return blocks, newly_cached


def refs(pool: BlockPool, blocks: list[int] | tuple[int, ...]) -> list[int]:
    return [pool.ref_count(block) for block in blocks]


# ---------------------------------------------------------------- match and insert


def test_empty_tree_matches_nothing() -> None:
    pool, tree = make_tree()
    match = tree.match(toks(1, 2))
    assert (match.num_tokens, match.blocks) == (0, ()), f"{match}"
    tree.release(match)
    assert pool.num_free == 16 and tree.num_locks == 0, f"{pool.num_free} free, {tree.num_locks} locks"


def test_insert_then_match_whole_blocks() -> None:
    pool, tree = make_tree()
    blocks, newly_cached = insert_fresh(pool, tree, toks(1, 2, 3))
    assert newly_cached == 12, f"{newly_cached} tokens newly cached, expected 12"
    assert refs(pool, blocks) == [1, 1, 1], f"tree refs {refs(pool, blocks)}, expected one each"
    match = tree.match(toks(1, 2, 3, 4))
    assert match.num_tokens == 12 and match.blocks == tuple(blocks), f"{match}, blocks {blocks}"
    assert refs(pool, blocks) == [2, 2, 2], f"refs {refs(pool, blocks)} with the caller's share"
    tree.release(match)
    pool.free(match.blocks)
    assert refs(pool, blocks) == [1, 1, 1], f"refs {refs(pool, blocks)} after the caller freed"
    tree.validate()


def test_match_ending_inside_a_block_returns_only_full_blocks() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))
    prompt = toks(1, 2, 3)[:10]  # two blocks and half of the third
    match = tree.match(prompt)
    assert match.num_tokens == 8, f"matched {match.num_tokens} of 10 tokens, expected 8 (whole blocks)"
    assert match.blocks == tuple(blocks[:2]), f"{match.blocks}, expected {blocks[:2]}"
    short = tree.match(toks(1)[:3])
    assert short.num_tokens == 0 and short.blocks == (), f"3-token prompt matched {short}"
    for lock in (match, short):
        tree.release(lock)
        pool.free(lock.blocks)
    tree.validate()


def test_partial_match_goes_into_one_more_block_and_leases_it() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))  # one edge of three blocks
    prompt = [*toks(1, 2, 3)[:10], 777]  # two blocks, two tokens of the third, then a new token
    match = tree.match(prompt, partial=True)
    assert match.num_tokens == 10, f"matched {match.num_tokens}, expected 8 whole + 2 of block 3"
    assert match.blocks == tuple(blocks), f"{match.blocks}, expected {blocks} (the third in part)"
    assert refs(pool, blocks) == [2, 2, 2], f"refs {refs(pool, blocks)}: the caller shares all three"
    assert tree.evict(100) == 0, "a block read in part must be locked like the rest"
    assert tree.stats.matched_tokens == 10, f"{tree.stats}"
    tree.release(match)
    pool.free(match.blocks)
    assert tree.evict(100) == 3 and pool.num_free == 16, f"{tree.stats}, {pool.num_free} free"
    tree.validate()


def test_partial_match_splits_a_long_edge_after_the_partial_block() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))  # one edge of three blocks
    match = tree.match(toks(1)[:3], partial=True)  # ends inside the very first block
    assert match.num_tokens == 3 and match.blocks == (blocks[0],), f"{match}"
    assert tree.evict(100) == 2, f"{tree.stats}: the blocks past the locked first one may go"
    assert refs(pool, blocks[:1]) == [2], f"refs {refs(pool, blocks[:1])}: tree and caller hold block 1"
    tree.release(match)
    pool.free(match.blocks)
    tree.validate()


def test_partial_match_picks_the_child_sharing_most_tokens() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, [1, 2, 8, 9])
    second, _ = insert_fresh(pool, tree, [1, 2, 3, 9])
    match = tree.match([1, 2, 3, 4], partial=True)
    assert match.num_tokens == 3 and match.blocks == (second[0],), f"{match}, expected 3 tokens of {second}"
    miss = tree.match([5, 6, 7], partial=True)
    assert miss.num_tokens == 0 and miss.blocks == (), f"{miss}"
    for lock in (match, miss):
        tree.release(lock)
        pool.free(lock.blocks)
    tree.validate()


def test_match_inside_an_edge_splits_it_at_the_block_boundary() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))  # one edge of three blocks
    match = tree.match(toks(1, 2, 7))
    assert match.num_tokens == 8 and match.blocks == tuple(blocks[:2]), f"{match}"
    tree.validate()
    # The lock covers exactly the two matched blocks: the third is evictable, the others are not.
    assert tree.num_evictable_blocks == 1, f"{tree.num_evictable_blocks} evictable, expected 1"
    freed = tree.evict(10)
    assert freed == 1, f"evicted {freed}, expected only the unlocked third block"
    assert tree.num_cached_tokens(toks(1, 2, 3)) == 8, f"{tree.num_cached_tokens(toks(1, 2, 3))} cached"
    assert pool.ref_count(blocks[2]) == 0, f"block {blocks[2]} has {pool.ref_count(blocks[2])} owners"
    tree.release(match)
    pool.free(match.blocks)
    tree.validate()


def test_diverging_insert_splits_and_keeps_the_cached_blocks() -> None:
    pool, tree = make_tree()
    first, _ = insert_fresh(pool, tree, toks(1, 2, 3))
    # A second request computed the same first two blocks into its own blocks, then diverged.
    second = pool.allocate(3)
    newly_cached = tree.insert(toks(1, 2, 4), second)
    assert newly_cached == 4, f"{newly_cached} tokens newly cached, expected 4 (one block)"
    assert refs(pool, second) == [1, 1, 2], f"refs {refs(pool, second)}: duplicates must not be referenced"
    pool.free(second)
    assert refs(pool, second) == [0, 0, 1], f"refs {refs(pool, second)} after the request freed"
    assert tree.held_blocks() == {*first, second[2]}, f"held {sorted(tree.held_blocks())}"
    match = tree.match(toks(1, 2, 4))
    assert match.blocks == (first[0], first[1], second[2]), f"{match.blocks}"
    tree.release(match)
    pool.free(match.blocks)
    tree.validate()


@pytest.mark.parametrize("tokens", [toks(1, 2, 3), toks(1, 2), toks(1), toks(1, 2, tail=3), toks(tail=3)])
def test_insert_of_a_cached_prefix_adds_nothing(tokens: list[int]) -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))
    free_before = pool.num_free
    _, newly_cached = insert_fresh(pool, tree, tokens)
    assert newly_cached == 0, f"{newly_cached} tokens newly cached for a cached prefix of {len(tokens)}"
    assert refs(pool, blocks) == [1, 1, 1] and pool.num_free == free_before, (
        f"refs {refs(pool, blocks)}, {pool.num_free} free (was {free_before})"
    )
    assert tree.stats.cached_blocks == 3, f"{tree.stats.cached_blocks} cached"
    tree.validate()


def test_request_that_reuses_a_match_caches_only_its_new_suffix() -> None:
    pool, tree = make_tree()
    base, _ = insert_fresh(pool, tree, toks(1, 2))
    match, blocks, newly_cached = complete(pool, tree, toks(1, 2, 5, 6, tail=2))
    assert match.num_tokens == 8 and newly_cached == 8, f"matched {match.num_tokens}, cached {newly_cached}"
    assert blocks[:2] == base, f"the request's table starts {blocks[:2]}, the cached blocks are {base}"
    assert refs(pool, blocks) == [1, 1, 1, 1, 0], f"refs {refs(pool, blocks)} (tail block freed)"
    assert tree.num_locks == 0 and tree.num_cached_blocks == 4, f"{tree.stats}"
    tree.validate()


def test_num_cached_tokens_is_read_only() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, toks(1, 2, 3))
    insert_fresh(pool, tree, toks(4))
    before = tree.stats
    got = tree.num_cached_tokens(toks(1, 2, 9))
    assert got == 8, f"{got} cached tokens, expected 8"
    assert tree.stats == before, f"stats changed: {tree.stats} vs {before}"
    # No LRU touch: [1,2,3] is still older than [4], so it loses its tail first.
    tree.evict(1)
    assert tree.num_cached_tokens(toks(1, 2, 3)) == 8, f"{tree.num_cached_tokens(toks(1, 2, 3))}"
    assert tree.num_cached_tokens(toks(4)) == 4, f"{tree.num_cached_tokens(toks(4))}"
    tree.validate()


# ---------------------------------------------------------------- eviction and locks


def test_evict_least_recently_used_leaf_first() -> None:
    pool, tree = make_tree()
    for label in (1, 2, 3):  # three branches of two blocks, inserted in this order
        insert_fresh(pool, tree, toks(label, label + 10))
    complete(pool, tree, toks(1, 11))  # touch branch 1: branch 2 is now the oldest
    freed = tree.evict(3)
    cached = [tree.num_cached_tokens(toks(label, label + 10)) for label in (1, 2, 3)]
    assert freed == 3, f"evicted {freed}, expected 3"
    assert cached == [8, 0, 4], f"cached tokens per branch {cached}: expected branch 2 gone, 3 trimmed"
    assert pool.num_free == 16 - 3, f"{pool.num_free} free"
    tree.validate()


def test_evict_climbs_to_parents_that_become_leaves() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, toks(1, 2, 3))
    insert_fresh(pool, tree, toks(1, 2, 4))  # nodes [1,2] → {[3], [4]}
    freed = tree.evict(3)
    assert freed == 3, f"evicted {freed}, expected 3"
    remaining = [tree.num_cached_tokens(toks(1, 2, last)) for last in (3, 4)]
    assert remaining == [4, 4], f"cached {remaining}: both leaves and then block 2 of the parent go"
    assert tree.evict(10) == 1 and tree.num_cached_blocks == 0, f"{tree.stats}"
    assert pool.num_free == 16, f"{pool.num_free} of 16 free after evicting everything"
    assert tree.stats.evicted_blocks == 4, f"{tree.stats.evicted_blocks} evictions counted"
    tree.validate()


def test_evict_zero_does_nothing_and_negative_raises() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, toks(1, 2))
    assert tree.evict(0) == 0 and tree.num_cached_blocks == 2, f"{tree.stats}"
    with pytest.raises(ValueError, match="-1"):
        tree.evict(-1)
    assert tree.num_cached_blocks == 2 and pool.num_free == 14, f"{tree.stats}, {pool.num_free} free"


def test_locked_blocks_survive_eviction() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1, 2, 3))
    insert_fresh(pool, tree, toks(5))
    match = tree.match(toks(1, 2))
    freed = tree.evict(100)
    assert freed == 2, f"evicted {freed}, expected 2 (block 3 of the branch and [5])"
    assert tree.num_cached_tokens(toks(1, 2, 3)) == 8, "the locked prefix was evicted"
    assert refs(pool, blocks[:2]) == [2, 2], f"locked refs {refs(pool, blocks[:2])}"
    tree.release(match)
    assert tree.evict(100) == 2, f"{tree.stats}: the released prefix should now be evictable"
    assert refs(pool, blocks[:2]) == [1, 1], f"refs {refs(pool, blocks[:2])}: the caller still holds them"
    pool.free(match.blocks)
    assert pool.num_free == 16, f"{pool.num_free} of 16 free"
    tree.validate()


def test_evicted_block_stays_allocated_while_a_sequence_holds_it() -> None:
    pool, tree = make_tree()
    blocks, _ = insert_fresh(pool, tree, toks(1))
    match = tree.match(toks(1))
    tree.release(match)  # released early, blocks still in the sequence's table
    assert tree.evict(1) == 1
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 15, (
        f"ref {pool.ref_count(blocks[0])}, {pool.num_free} free: the sequence's reference must remain"
    )
    pool.free(match.blocks)
    assert pool.num_free == 16, f"{pool.num_free} free"


def test_release_twice_raises() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, toks(1))
    match = tree.match(toks(1))
    tree.release(match)
    with pytest.raises(ValueError, match="not held"):
        tree.release(match)
    pool.free(match.blocks)
    tree.validate()


def test_eviction_order_is_deterministic() -> None:
    def run() -> frozenset[int]:
        pool, tree = make_tree()
        for label in (3, 1, 2, 4):
            insert_fresh(pool, tree, toks(label, label + 20))
        complete(pool, tree, toks(2, 9))
        complete(pool, tree, toks(3, 23))
        tree.evict(5)
        return tree.held_blocks()

    first, second = run(), run()
    assert first == second, f"held {sorted(first)} then {sorted(second)} from the same history"


# ---------------------------------------------------------------- budget


def test_budget_evicts_least_recently_used_to_make_room() -> None:
    pool, tree = make_tree(budget=3)
    insert_fresh(pool, tree, toks(1, 2))
    _, newly_cached = insert_fresh(pool, tree, toks(3, 4))
    assert newly_cached == 8, f"{newly_cached} tokens newly cached, expected 8"
    assert tree.num_cached_blocks == 3, f"{tree.num_cached_blocks} cached over a budget of 3"
    cached = [tree.num_cached_tokens(toks(1, 2)), tree.num_cached_tokens(toks(3, 4))]
    assert cached == [4, 8], f"cached {cached}: the older branch loses its tail"
    assert tree.stats.evicted_blocks == 1 and tree.stats.dropped_tokens == 0, f"{tree.stats}"
    assert pool.num_free == 13, f"{pool.num_free} free"
    tree.validate()


def test_budget_full_of_leases_caches_only_what_fits() -> None:
    pool, tree = make_tree(budget=3)
    insert_fresh(pool, tree, toks(1, 2))
    match = tree.match(toks(1, 2))
    _, newly_cached = insert_fresh(pool, tree, toks(3, 4))
    assert newly_cached == 4, f"{newly_cached} tokens newly cached, expected 4 (one block of room)"
    assert tree.stats.dropped_tokens == 4, f"{tree.stats.dropped_tokens} tokens dropped, expected 4"
    _, newly_cached = insert_fresh(pool, tree, toks(5))
    assert newly_cached == 4, f"{newly_cached}: the unlocked [3] should make room for [5]"
    match_two = tree.match(toks(5))
    _, newly_cached = insert_fresh(pool, tree, toks(6))
    assert newly_cached == 0 and tree.stats.dropped_tokens == 8, (
        f"{newly_cached} cached, {tree.stats.dropped_tokens} dropped with everything locked"
    )
    assert tree.num_cached_blocks == 3 and tree.stats.evicted_blocks == 1, f"{tree.stats}"
    assert tree.num_cached_tokens(toks(1, 2)) == 8, "a locked prefix was evicted for the budget"
    for lock in (match, match_two):
        tree.release(lock)
        pool.free(lock.blocks)
    tree.validate()


def test_budget_never_evicts_the_prefix_being_extended() -> None:
    pool, tree = make_tree(budget=2)
    insert_fresh(pool, tree, toks(1, 2))
    _, newly_cached = insert_fresh(pool, tree, toks(1, 2, 3, 4))
    assert newly_cached == 0, f"{newly_cached} tokens newly cached with no room beside the path"
    assert tree.num_cached_tokens(toks(1, 2)) == 8 and tree.num_cached_blocks == 2, f"{tree.stats}"
    insert_fresh(pool, tree, toks(1, 3))  # splits [1,2]: evicts [2], attaches [3] to [1]
    cached = [tree.num_cached_tokens(toks(1, 2)), tree.num_cached_tokens(toks(1, 3))]
    assert cached == [4, 8] and tree.num_cached_blocks == 2, f"cached {cached}, {tree.stats}"
    tree.validate()


@pytest.mark.parametrize("budget", [0, 1, 2, 5])
def test_budget_is_never_exceeded(budget: int) -> None:
    pool, tree = make_tree(num_blocks=32, budget=budget)
    locks = []
    for step, label in enumerate((1, 2, 3, 1, 4, 5, 2, 6)):
        complete(pool, tree, toks(label, label + 10, label + 20))
        if step % 3 == 0:
            locks.append(tree.match(toks(label, label + 10)))
        assert tree.num_cached_blocks <= budget, f"step {step}: {tree.num_cached_blocks} cached > {budget}"
        tree.validate()
    for lock in locks:
        tree.release(lock)
        pool.free(lock.blocks)
    tree.evict(32)
    assert pool.num_free == 32, f"{pool.num_free} of 32 free after draining"


def test_bad_budget_raises() -> None:
    with pytest.raises(ValueError, match="-1"):
        PrefixTree(BlockPool(4, B), max_cached_blocks=-1)


# ---------------------------------------------------------------- aborts, validation, statistics


def test_aborted_request_never_enters_the_tree_and_frees_its_blocks() -> None:
    pool, tree = make_tree()
    insert_fresh(pool, tree, toks(1, 2))
    held_before, stats_before, free_before = tree.held_blocks(), tree.stats, pool.num_free
    prompt = toks(1, 2, 3, 4, tail=1)
    match = tree.match(prompt)
    own = pool.allocate(pool.blocks_for(len(prompt)) - len(match.blocks))  # KV written, then aborted
    tree.release(match)
    pool.free([*match.blocks, *own])
    assert tree.held_blocks() == held_before, f"held {sorted(tree.held_blocks())}, was {sorted(held_before)}"
    assert tree.num_cached_tokens(prompt) == 8, f"{tree.num_cached_tokens(prompt)} tokens cached after abort"
    stats = tree.stats
    assert (stats.cached_blocks, stats.inserted_tokens) == (stats_before.cached_blocks, 8), f"{stats}"
    assert pool.num_free == free_before and tree.num_locks == 0, f"{pool.num_free} free, was {free_before}"
    tree.evict(16)
    assert pool.num_free == 16, f"{pool.num_free} of 16 free"


@pytest.mark.parametrize("problem", ["short", "free", "outside", "repeated", "cached"])
def test_insert_rejects_bad_block_tables_and_changes_nothing(problem: str) -> None:
    pool, tree = make_tree()
    cached, _ = insert_fresh(pool, tree, toks(1, 2))
    own = pool.allocate(3)
    free_block = next(block for block in range(16) if pool.ref_count(block) == 0)
    tables = {
        "short": own[:2],
        "free": [*own[:2], free_block],
        "outside": [*own[:2], 99],
        "repeated": [own[0], own[1], own[1]],
        "cached": [*own[:2], cached[0]],
    }
    held_before, stats_before = tree.held_blocks(), tree.stats
    with pytest.raises(ValueError):
        tree.insert(toks(3, 4, 5), tables[problem])
    assert tree.held_blocks() == held_before and tree.stats == stats_before, f"{tree.stats}"
    assert refs(pool, own) == [1, 1, 1] and pool.num_free == 11, f"refs {refs(pool, own)}, {pool.num_free}"
    tree.validate()


def test_stats_count_lookups_and_hit_rate() -> None:
    pool, tree = make_tree()
    assert tree.stats.hit_rate == 0.0, f"{tree.stats}"
    complete(pool, tree, toks(1, 2, tail=2))  # 10 prompt tokens, 0 matched, 8 cached
    complete(pool, tree, toks(1, 2, 3))  # 12 prompt tokens, 8 matched
    complete(pool, tree, toks(1, tail=2))  # 6 prompt tokens, 4 matched
    stats = tree.stats
    assert (stats.lookups, stats.prompt_tokens, stats.matched_tokens) == (3, 28, 12), f"{stats}"
    assert stats.hit_rate == pytest.approx(12 / 28), f"hit rate {stats.hit_rate}, expected {12 / 28}"
    assert (stats.inserted_tokens, stats.cached_blocks, stats.namespace) == (12, 3, "m"), f"{stats}"
    assert (stats.evicted_blocks, stats.locked_blocks) == (0, 0), f"{stats}"


# ---------------------------------------------------------------- stateful property test

NUM_BLOCKS = 24


@dataclass(eq=False)
class Running:
    tokens: tuple[int, ...]
    match: PrefixMatch
    blocks: tuple[int, ...]  # the request's block table: the matched blocks, then its own


class PrefixTreeMachine(RuleBasedStateMachine):
    """Random requests (match → allocate → finish/abort) and evictions against a reference.

    `cached` maps each block-aligned prefix the tree should hold to the block of its last block;
    `ever_inserted` keeps every prefix ever cached. Evictions are not modelled in LRU order: after
    one, the prefixes the tree lost are read back and checked (as many as evicted, closed under
    extension, none locked or on the path being extended) and dropped from `cached`.
    """

    requests = Bundle("requests")

    @initialize(
        block_size=st.integers(1, 3),
        budget=st.one_of(st.none(), st.integers(0, 10)),
    )
    def make_tree(self, block_size: int, budget: int | None) -> None:
        self.pool = BlockPool(NUM_BLOCKS, block_size)
        self.tree = PrefixTree(self.pool, namespace="prop", max_cached_blocks=budget)
        self.size, self.budget = block_size, budget
        self.cached: dict[tuple[int, ...], int] = {}
        self.ever_inserted: set[tuple[int, ...]] = set()
        self.running: dict[int, Running] = {}  # lock id → request

    def _prefixes(self, tokens: tuple[int, ...], num_blocks: int) -> list[tuple[int, ...]]:
        return [tokens[: (i + 1) * self.size] for i in range(num_blocks)]

    def _leased_prefixes(self) -> set[tuple[int, ...]]:
        return {
            prefix
            for request in self.running.values()
            for prefix in self._prefixes(request.tokens, len(request.match.blocks))
        }

    def _forget_evicted(self, expected: int, protected: set[tuple[int, ...]]) -> None:
        lost = {prefix for prefix in self.cached if self.tree.num_cached_tokens(prefix) != len(prefix)}
        assert len(lost) == expected, f"{len(lost)} prefixes lost, {expected} blocks evicted"
        assert not lost & protected, f"protected prefixes evicted: {sorted(lost & protected)}"
        for prefix in self.cached:
            if prefix[: len(prefix) - self.size] in lost:
                assert prefix in lost, f"{prefix} cached but its parent {prefix[: -self.size]} was evicted"
        for prefix in lost:
            del self.cached[prefix]

    def _evictable(self, protected: set[tuple[int, ...]]) -> int:
        return sum(1 for prefix in self.cached if prefix not in protected)

    @rule(target=requests, prompt=st.lists(st.integers(0, 2), max_size=12))
    def start_request(self, prompt: list[int]):
        tokens = tuple(prompt)
        full = self._prefixes(tokens, len(tokens) // self.size)
        expected = [prefix for prefix in full if prefix in self.cached]
        match = self.tree.match(tokens)
        assert match.num_tokens == len(expected) * self.size, (
            f"matched {match.num_tokens} tokens, reference has {len(expected) * self.size} cached"
        )
        assert match.blocks == tuple(self.cached[prefix] for prefix in expected), (
            f"blocks {match.blocks}, reference {[self.cached[prefix] for prefix in expected]}"
        )
        matched_prefix = tokens[: match.num_tokens]
        assert not matched_prefix or matched_prefix in self.ever_inserted, f"{matched_prefix} never inserted"
        need = self.pool.blocks_for(len(tokens)) - len(match.blocks)
        request = Running(tokens, match, match.blocks)
        self.running[match.lock_id] = request
        if need > self.pool.num_free:  # the scheduler makes room from the cache first
            evictable = self._evictable(self._leased_prefixes())
            assert self.tree.num_evictable_blocks == evictable, (
                f"{self.tree.num_evictable_blocks} evictable, reference {evictable}"
            )
            shortfall = need - self.pool.num_free
            freed = self.tree.evict(shortfall)
            assert freed == min(shortfall, evictable), (
                f"evict({shortfall}) freed {freed}, {evictable} evictable"
            )
            self._forget_evicted(freed, self._leased_prefixes())
        if need > self.pool.num_free:  # still no room: refused, as an abort
            self._end(request)
            return multiple()
        request.blocks = match.blocks + tuple(self.pool.allocate(need))
        return request

    def _end(self, request: Running) -> None:
        del self.running[request.match.lock_id]
        self.tree.release(request.match)
        self.pool.free(request.blocks)

    @rule(request=consumes(requests))
    def finish_request(self, request: Running) -> None:
        if request.match.lock_id not in self.running:
            return  # ended by drain_everything
        num_blocks = len(request.tokens) // self.size
        full = self._prefixes(request.tokens, num_blocks)
        path = {prefix for prefix in full if prefix in self.cached}
        new = [prefix for prefix in full if prefix not in self.cached]
        cached_before, evicted_before = self.tree.num_cached_blocks, self.tree.stats.evicted_blocks
        protected = self._leased_prefixes() | path
        evictable = self._evictable(protected)
        newly_cached = self.tree.insert(request.tokens, request.blocks)
        evicted = self.tree.stats.evicted_blocks - evicted_before
        if self.budget is None:
            expected_evicted, expected_new = 0, len(new)
        else:
            shortfall = max(0, cached_before + len(new) - self.budget)
            expected_evicted = min(shortfall, evictable) if new else 0
            expected_new = min(len(new), self.budget - (cached_before - expected_evicted))
        assert (evicted, newly_cached) == (expected_evicted, expected_new * self.size), (
            f"insert evicted {evicted} and cached {newly_cached} tokens; expected {expected_evicted} and "
            f"{expected_new * self.size} (budget {self.budget}, {cached_before} cached, {len(new)} new)"
        )
        self._forget_evicted(evicted, protected)
        for prefix in new[:expected_new]:
            self.cached[prefix] = request.blocks[len(prefix) // self.size - 1]
            self.ever_inserted.add(prefix)
        self._end(request)

    @rule(request=consumes(requests))
    def abort_request(self, request: Running) -> None:
        if request.match.lock_id not in self.running:
            return
        held_before = self.tree.held_blocks()
        self._end(request)
        assert self.tree.held_blocks() == held_before, "an abort changed the tree's blocks"

    @rule(num_blocks=st.integers(0, NUM_BLOCKS))
    def evict(self, num_blocks: int) -> None:
        evictable = self._evictable(self._leased_prefixes())
        freed = self.tree.evict(num_blocks)
        assert freed == min(num_blocks, evictable), (
            f"evict({num_blocks}) freed {freed}, {evictable} evictable"
        )
        self._forget_evicted(freed, self._leased_prefixes())

    @rule()
    def drain_everything(self) -> None:
        self._drain()

    def _drain(self) -> None:
        for request in list(self.running.values()):
            self._end(request)
        self.tree.evict(NUM_BLOCKS)
        self._forget_evicted(len(self.cached), set())
        assert self.pool.num_free == NUM_BLOCKS, f"{self.pool.num_free} of {NUM_BLOCKS} free after draining"
        assert self.tree.num_cached_blocks == 0 and self.tree.num_locks == 0, f"{self.tree.stats}"

    @invariant()
    def ref_counts_are_tree_plus_requests(self) -> None:
        expected = dict.fromkeys(range(NUM_BLOCKS), 0)
        for block in self.cached.values():
            expected[block] += 1
        for request in self.running.values():
            for block in request.blocks:
                expected[block] += 1
        actual = {block: self.pool.ref_count(block) for block in range(NUM_BLOCKS)}
        wrong = {
            block: (actual[block], expected[block]) for block in actual if actual[block] != expected[block]
        }
        assert not wrong, f"(actual, expected) ref counts differ: {wrong}"
        free = sum(1 for owners in expected.values() if owners == 0)
        assert self.pool.num_free == free, f"{self.pool.num_free} free, reference {free}"

    @invariant()
    def tree_matches_reference(self) -> None:
        held = self.tree.held_blocks()
        assert held == set(self.cached.values()), f"tree holds {sorted(held)}, reference {self.cached}"
        assert self.tree.num_locks == len(self.running), f"{self.tree.num_locks} locks, {len(self.running)}"
        if self.budget is not None:
            assert len(held) <= self.budget, f"{len(held)} cached over a budget of {self.budget}"
        self.tree.validate()

    def teardown(self) -> None:
        if hasattr(self, "tree"):
            self._drain()


PrefixTreeMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixTreeMachine = PrefixTreeMachine.TestCase
