"""Cross-model layer share, pure policy: bands from digests, boundaries, source choice, counters,
and the prefix tree's read-only peek that a consumer reads a provider's blocks through."""

from __future__ import annotations

import dataclasses

import pytest

from polylane.policy.kv.blocks import BlockPool
from polylane.policy.kv.radix import PrefixTree
from polylane.policy.sharing.layer_share import (
    CrossCandidate,
    CrossModelCounters,
    ModelDigest,
    boundary_layers,
    choose_source,
    shared_band,
)


def digest(num_layers: int = 8, changed_from: int | None = None, **parts: str) -> ModelDigest:
    """A fake digest: layer i is "L{i}", or "X{i}" from `changed_from` on."""
    layers = tuple(
        f"X{i}" if changed_from is not None and i >= changed_from else f"L{i}" for i in range(num_layers)
    )
    fields = dict(embedding="E", head="H", tokenizer="T", rope="R", kv_layout="K", compute="C")
    fields.update(parts)
    return ModelDigest(layers=layers, **fields)


def test_identical_models_share_every_layer() -> None:
    band = shared_band(digest(), digest())
    assert (band.layers, band.identical, band.reason) == (8, True, "identical")


@pytest.mark.parametrize("changed", [0, 1, 4, 7])
def test_band_ends_at_the_first_differing_layer(changed: int) -> None:
    band = shared_band(digest(), digest(changed_from=changed))
    assert band.layers == changed and not band.identical
    assert band.reason == f"layer {changed} differs"
    assert shared_band(digest(changed_from=changed), digest()) == band, "not symmetric"


def test_a_layer_differing_in_the_middle_ends_the_band_there() -> None:
    other = digest()
    other = dataclasses.replace(other, layers=(*other.layers[:3], "Y3", *other.layers[4:]))
    assert shared_band(digest(), other).layers == 3


@pytest.mark.parametrize(
    ("part", "label"),
    [
        ("tokenizer", "tokenizer"),
        ("rope", "RoPE configuration"),
        ("kv_layout", "KV layout"),
        ("compute", "layer hyper-parameters"),
        ("embedding", "embedding"),
    ],
)
def test_anything_below_layer_zero_differing_shares_nothing(part: str, label: str) -> None:
    band = shared_band(digest(), digest(**{part: "other"}))
    assert (band.layers, band.identical, band.reason) == (0, False, f"{label} differs")


def test_head_alone_differing_keeps_every_layer_but_is_not_identical() -> None:
    band = shared_band(digest(), digest(head="other"))
    assert band.layers == 8 and not band.identical


def test_deeper_model_extending_another_shares_the_shallower_depth() -> None:
    band = shared_band(digest(8), digest(12))
    assert band.layers == 8 and not band.identical
    assert "shallower" in band.reason


def test_boundary_layers() -> None:
    own = digest(8)
    peers = [
        digest(8),
        digest(8, changed_from=3),
        digest(8, changed_from=0),
        digest(12),
        digest(tokenizer="x"),
    ]
    # identical peer: no boundary (nothing above to resume); layer-0 or tokenizer mismatch: none;
    # a deeper peer extending this model needs the final hidden state (boundary 8).
    assert boundary_layers(own, peers) == frozenset({3, 8})
    assert boundary_layers(own, []) == frozenset()


def test_choose_source_maximises_saved_layer_tokens() -> None:
    deep_short = CrossCandidate("a", band=6, num_tokens=64)
    shallow_long = CrossCandidate("b", band=2, num_tokens=160)
    # savings over an own prefix of 32: a (64-32)*6 = 192, b (160-32)*2 = 256
    assert choose_source([deep_short, shallow_long], own_tokens=32, num_layers=8) == shallow_long
    # over an own prefix of 128: a saves nothing, b (32)*2 = 64
    assert choose_source([deep_short, shallow_long], own_tokens=128, num_layers=8) == shallow_long
    assert choose_source([deep_short, shallow_long], own_tokens=160, num_layers=8) is None
    assert choose_source([], own_tokens=0, num_layers=8) is None


def test_choose_source_ties_are_deterministic_and_bands_capped() -> None:
    first, second = CrossCandidate("m1", 4, 64), CrossCandidate("m2", 4, 64)
    assert choose_source([second, first], 0, 8) == first
    assert choose_source([first, second], 0, 8) == first
    # a band deeper than the consumer (a deeper provider) saves at most the consumer's layers
    deeper = CrossCandidate("deep", 12, 64)
    assert choose_source([deeper, CrossCandidate("full", 8, 64)], 0, 8).provider == "deep"  # type: ignore[union-attr]


def test_counters() -> None:
    counters = CrossModelCounters()
    assert counters.snapshot().hit_rate == 0.0
    counters.lookup()
    counters.lookup()
    counters.hit("provider", num_tokens=96, band=15)
    stats = counters.snapshot()
    assert (stats.lookups, stats.hits, stats.imported_tokens) == (2, 1, 96)
    assert stats.skipped_layer_tokens == 96 * 15 and stats.by_provider == {"provider": 96}
    assert stats.hit_rate == 0.5
    counters.hit("provider", 16, 15)
    assert stats.by_provider == {"provider": 96}, "a snapshot must not change afterwards"


def test_digest_json_round_trip() -> None:
    original = digest(5, changed_from=2)
    assert ModelDigest.from_json(original.to_json()) == original
    assert original.num_layers == 5
    broken = original.to_json()
    broken["layers"] = "L0"
    with pytest.raises(ValueError):
        ModelDigest.from_json(broken)
    with pytest.raises(KeyError):
        ModelDigest.from_json({"layers": []})


# ---------------------------------------------------------------- PrefixTree.peek_blocks


def _tree(num_blocks: int = 16, block_size: int = 4) -> tuple[BlockPool, PrefixTree]:
    pool = BlockPool(num_blocks, block_size)
    return pool, PrefixTree(pool, "provider")


def _cache(pool: BlockPool, tree: PrefixTree, tokens: list[int]) -> list[int]:
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    tree.insert(tokens, blocks)
    pool.free(blocks)
    return blocks


def test_peek_returns_cached_whole_blocks_without_lease_split_or_stats() -> None:
    pool, tree = _tree()
    blocks = _cache(pool, tree, list(range(12)))  # 3 blocks
    refs = [pool.ref_count(b) for b in blocks]
    before = tree.stats
    assert tree.peek_blocks([*range(12), 99]) == tuple(blocks)
    assert tree.peek_blocks(list(range(10))) == tuple(blocks[:2]), "whole blocks only"
    assert tree.peek_blocks([0, 1, 2, 3, 7, 7, 7, 7]) == tuple(blocks[:1]), "match ends inside an edge"
    assert tree.peek_blocks([5, 5, 5, 5]) == ()
    assert [pool.ref_count(b) for b in blocks] == refs, "peek took pool references"
    assert tree.num_locks == 0
    after = tree.stats
    assert (after.lookups, after.matched_tokens) == (before.lookups, before.matched_tokens)
    tree.validate()
    # no split happened: one edge still holds all three blocks, so evicting one block takes its tail
    assert tree.evict(1) == 1 and tree.peek_blocks(list(range(12))) == tuple(blocks[:2])


def test_peek_touches_lru() -> None:
    pool, tree = _tree()
    old = _cache(pool, tree, [1] * 4)
    new = _cache(pool, tree, [2] * 4)
    tree.peek_blocks([1] * 4)  # a peer reused the older prefix: it is now the more recent
    assert tree.evict(1) == 1
    assert tree.peek_blocks([1] * 4) == tuple(old) and tree.peek_blocks([2] * 4) == ()
    assert pool.ref_count(new[0]) == 0
