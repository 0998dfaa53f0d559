"""Draft tree shapes grown by hand-fed candidates: chain, top-k per depth, width × depth (beam) and
dynamic by confidence (EAGLE-2); n-gram prompt lookup and its tries."""

from __future__ import annotations

import pytest

from polylane.policy.kv.sequence_blocks import validate_tree
from polylane.policy.speculation.ngram import NgramIndex, trie
from polylane.policy.speculation.tree import DraftTree, TreeBuilder, TreeShape, chain_parents


def _grow(shape: TreeShape, candidates) -> tuple[DraftTree, list[list[int]]]:
    """Feed `candidates(node, depth)` → [(token, prob)] until done; return the tree and the
    frontier asked for at each depth."""
    builder = TreeBuilder(shape)
    asked = []
    depth = 0
    while not builder.done:
        frontier = builder.frontier()
        asked.append(frontier)
        for node in frontier:
            builder.expand(node, candidates(node, depth))
        depth += 1
    tree = builder.tree()
    validate_tree(tree.parents)
    return tree, asked


def _ranked(node, depth):
    base = 100 * (node + 2) + 10 * depth
    return [(base + 1, 0.6), (base + 2, 0.3), (base + 3, 0.1)]


def test_chain_takes_the_best_candidate_at_each_depth():
    tree, asked = _grow(TreeShape.chain(3), _ranked)
    assert tree.parents == chain_parents(3) == (-1, 0, 1)
    assert tree.token_ids == (101, 211, 321)
    assert asked == [[-1], [0], [1]]  # the last node is not expanded: 3 drafter forwards
    assert tree.is_chain and tree.depth == 3
    assert tree.confidence == pytest.approx((0.6, 0.36, 0.216))


def test_chain_stops_where_the_drafter_is_unsure():
    probs = {0: 0.9, 1: 0.3, 2: 0.9}  # the second token is a guess

    tree, asked = _grow(TreeShape.chain(5, min_confidence=0.4), lambda node, depth: [(depth, probs[depth])])
    assert tree.token_ids == (0, 1) and asked == [[-1], [0]]  # drafted the guess, then stopped
    assert TreeShape.chain(5, 0.4).limited(3) == TreeShape.chain(3, 0.4)


def test_topk_per_depth():
    tree, asked = _grow(TreeShape.topk(2, 2, 1), _ranked)
    # depth 1: 2 children of the root; depth 2: 2 each; depth 3: 1 each → 2 + 4 + 4 nodes
    assert len(tree) == TreeShape.topk(2, 2, 1).max_nodes == 10
    assert tree.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert tree.ranks == (0, 1, 0, 1, 0, 1, 0, 0, 0, 0)
    assert asked == [[-1], [0, 1], [2, 3, 4, 5]]
    assert not tree.is_chain
    assert tree.path_to(7) == [0, 3, 7]


def test_beam_keeps_width_nodes_per_depth_by_path_confidence():
    def candidates(node, depth):
        if node == -1:
            return [(1, 0.5), (2, 0.4), (3, 0.1)]
        if node == 0:  # token 1's children: unsure
            return [(11, 0.3), (12, 0.3)]
        return [(21, 0.9), (22, 0.05)]  # token 2's children: sure

    tree, _ = _grow(TreeShape.beam(2, 3), candidates)
    assert len(tree) == 6  # width × depth
    # depth 2: 0.4 × 0.9 = 0.36 (under node 1) first, then 0.5 × 0.3 = 0.15 (the first of node 0's
    # tied pair); 0.4 × 0.05 is dropped. Kept nodes stay in (parent, rank) order.
    assert tree.parents[:4] == (-1, -1, 0, 1)
    assert tree.token_ids[:4] == (1, 2, 11, 21)


def test_dynamic_tree_follows_confidence_and_keeps_the_budget():
    def candidates(node, depth):
        if node == -1:
            return [(1, 0.9), (2, 0.05), (3, 0.05)]
        return [(node * 10 + 1, 0.95), (node * 10 + 2, 0.03), (node * 10 + 3, 0.02)]

    shape = TreeShape.dynamic(depth=4, top_k=2, budget=6)
    tree, asked = _grow(shape, candidates)
    assert len(tree) == 6
    validate_tree(tree.parents)
    # the sure path 1 → … is grown deep; the unsure siblings are dropped by the budget
    assert tree.token_ids[0] == 1 and tree.depth == 4
    assert asked[1] == [0, 1]  # top-2 by confidence at depth 1 are expanded
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            assert tree.confidence[node] <= tree.confidence[parent]


def test_dynamic_min_confidence_stops_expansion():
    shape = TreeShape.dynamic(depth=5, top_k=2, budget=20, min_confidence=0.5)
    tree, asked = _grow(shape, lambda node, depth: [(7, 0.4), (8, 0.3)])
    assert asked == [[-1]] and len(tree) == 2  # nothing at depth 1 reaches 0.5


def test_builder_refuses_out_of_order_use():
    builder = TreeBuilder(TreeShape.chain(2))
    with pytest.raises(ValueError, match="frontier"):
        builder.expand(0, [(1, 1.0)])
    with pytest.raises(ValueError, match="growing"):
        builder.tree()
    builder.expand(-1, [(1, 1.0)])
    with pytest.raises(ValueError, match="frontier"):
        builder.expand(-1, [(1, 1.0)])


def test_shape_validation_and_limits():
    with pytest.raises(ValueError):
        TreeShape("spiral", 2)
    with pytest.raises(ValueError):
        TreeShape.topk(2, 0)
    assert TreeShape.chain(6).limited(3) == TreeShape.chain(3)
    assert TreeShape.topk(3, 2).limited(4) == TreeShape.topk(3)
    assert TreeShape.topk(3, 2).limited(2) == TreeShape.chain(2)
    assert TreeShape.beam(2, 5).limited(7) == TreeShape.beam(2, 3)
    assert TreeShape.topk(2, 1, 1).is_chain is False and TreeShape.topk(1, 1).is_chain
    assert TreeShape.beam(3, 2).max_nodes == 6 and TreeShape.dynamic(4, 2, 100).max_nodes == 2 + 3 * 4


def test_ngram_lookup_copies_what_followed_the_last_match():
    index = NgramIndex(min_ngram=1, max_ngram=3)
    index.extend([5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert index.continuations(3) == [[8, 9, 1]]
    tree = index.propose(3)
    assert tree.token_ids == (8, 9, 1) and tree.is_chain
    index.extend([8])
    assert index.continuations(2) == [[9, 1]]
    index.extend([5, 6])  # "5 6" → 7 (twice, same start); "6" alone too; a 2-deep trie of one branch
    assert index.propose(max_nodes=6, max_branches=2, depth=2).token_ids == (7, 8)


def test_ngram_prefers_longer_and_earlier_matches():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 9, 2, 4, 1, 2])
    # "1 2" occurred at the start → 3; "2" alone also before 4, but the longer n-gram wins
    assert index.continuations(1) == [[3]]
    assert index.continuations(1, max_branches=2) == [[3], [4]]  # then a shorter n-gram's branch
    index = NgramIndex(1, 1)
    index.extend([2, 3, 2, 4, 2])
    assert index.continuations(1, max_branches=3) == [[3], [4]]  # earliest first, as transformers


def test_ngram_no_match_and_sync():
    index = NgramIndex(2, 3)
    index.extend([1, 2, 3])
    assert index.continuations(4) == [] and len(index.propose(4)) == 0
    index.sync([1, 2, 3, 1, 2])
    assert index.continuations(4) == [[3, 1, 2]]
    index.sync([7, 7])  # not an extension: rebuilt
    assert index.tokens == [7, 7]


def test_trie_merges_shared_prefixes():
    tree = trie([[1, 2, 3], [1, 2, 4], [5]], max_nodes=10)
    assert tree.token_ids == (1, 2, 3, 4, 5)
    assert tree.parents == (-1, 0, 1, 1, -1)
    assert tree.ranks == (0, 0, 0, 1, 1)
    assert len(trie([[1, 2, 3], [4, 5]], max_nodes=4)) == 4
