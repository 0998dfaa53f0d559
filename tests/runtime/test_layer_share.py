"""Cross-model prefill share on real models (SmolLM2 fp32 and a sibling with its top 15 of 30
layers perturbed, written by `polylane models sibling`'s code):

- a prompt prefilled by one model and continued by the other through the shared band gives logits
  within fp32 tolerance of the consumer's own cold prefill and the same greedy tokens, both ways,
  through `LayerShare` directly and through the engine;
- aliases (one file under two names) share every layer and compute nothing for the prefix;
- digests come from the loaded bytes: one changed weight in layer k moves the band to [0, k);
  a different RoPE base or tokenizer shares nothing;
- a boundary state is only used for the K/V it was written with;
- `polylane models inspect` reports the band.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polylane.cli import main
from polylane.policy.sharing.layer_share import shared_band
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.digests import compute_digest
from polylane.runtime.loading.loaded_model import LoadedModel, load_model
from polylane.runtime.loading.loader import read_config
from polylane.runtime.residency.siblings import SIBLING_RECORD, SiblingSpec, ensure_sibling
from polylane.runtime.sharing.layer_share import LayerShare

BASE = "smollm2-135m-instruct"
SPEC = SiblingSpec(top_layers=15, seed=1)
BAND = 15
TOLERANCE = 1e-4  # float32 logits, max-abs, shared band vs cold prefill
BLOCK = 16
TEXT = (
    "Ada Lovelace wrote the first program for Charles Babbage's Analytical Engine in 1843. "
    "She saw that the machine could manipulate symbols, not only numbers, and might one day "
    "compose music. Her notes were three times longer than the article they annotated. "
    "A century later, Alan Turing read them and answered her objection in a famous paper. "
    "Today every phone holds more memory than all the machines of that century together."
)
SUFFIX = " Which of these facts surprised you most, and why?"


@pytest.fixture(scope="module")
def base(load_real_model) -> LoadedModel:
    return load_real_model(BASE)


@pytest.fixture(scope="module")
def sibling_path(base) -> Path:
    return ensure_sibling(BASE, SPEC)  # written once per machine, under the cache


@pytest.fixture(scope="module")
def sibling(sibling_path) -> LoadedModel:
    return load_model(str(sibling_path), "fp32", quiet=True)


def _prompts(model: LoadedModel) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompt = tuple(model.tokenizer.encode(TEXT))
    return prompt, prompt + tuple(model.tokenizer.encode(SUFFIX, add_special_tokens=False))


def _greedy(kv: ModelKV, sequence, logits: torch.Tensor, steps: int = 6) -> list[int]:
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = kv.forward([Extend(sequence, (tokens[-1],))])[0]
    return tokens


def _cold(model: LoadedModel, prompt: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
    kv = ModelKV(model, num_blocks=32, block_size=BLOCK, prefix_cache=False)
    sequence = kv.open(prompt)
    logits = kv.forward([Extend(sequence, prompt)])[0]
    return logits, _greedy(kv, sequence, logits)


def _prefill(share: LayerShare, name: str, kv: ModelKV, prompt: tuple[int, ...]) -> torch.Tensor:
    sequence = share.open(name, kv, prompt)
    logits = kv.forward([Extend(sequence, prompt[sequence.num_tokens :])])[0]
    kv.close(sequence)
    return logits


def _assert_same(label: str, logits, tokens, cold_logits, cold_tokens) -> float:
    diff = (logits - cold_logits).abs()
    assert diff.max().item() <= TOLERANCE, (
        f"{label}: logits differ from a cold prefill by max {diff.max().item():.2e} "
        f"(mean {diff.mean().item():.2e})"
    )
    assert tokens == cold_tokens, f"{label}: greedy {tokens} != cold {cold_tokens}"
    return diff.max().item()


def test_sibling_loads_and_shares_exactly_the_lower_band(base, sibling, sibling_path) -> None:
    assert read_config(sibling_path, "hf") == base.config
    record = json.loads((sibling_path / SIBLING_RECORD).read_text())
    assert record["changed_layers"] == SPEC.top_layers
    band = shared_band(base.digest, sibling.digest)
    assert (band.layers, band.identical) == (BAND, False), band
    assert base.digest.layers[BAND:] != sibling.digest.layers[BAND:]
    assert all(a != b for a, b in zip(base.digest.layers[BAND:], sibling.digest.layers[BAND:], strict=True))
    # the run-time tensors themselves: equal bytes below the band, different above
    ours, theirs = base.module.state_dict(), sibling.module.state_dict()
    for name in (f"layers.{BAND - 1}.mlp.down_proj.weight", "vocab_columns"):
        assert torch.equal(ours[name], theirs[name]), name
    assert not torch.equal(
        ours[f"layers.{BAND}.mlp.down_proj.weight"], theirs[f"layers.{BAND}.mlp.down_proj.weight"]
    )


@pytest.mark.parametrize("direction", ["base→sibling", "sibling→base"])
def test_consumer_continues_provider_prefix_through_the_band(base, sibling, direction) -> None:
    provider, consumer = (base, sibling) if direction == "base→sibling" else (sibling, base)
    share = LayerShare()
    provider_kv = ModelKV(provider, num_blocks=32, block_size=BLOCK)
    consumer_kv = ModelKV(consumer, num_blocks=32, block_size=BLOCK)
    share.attach("provider", provider_kv)
    share.attach("consumer", consumer_kv)
    assert BAND in provider_kv.cache.boundary_states and BAND in consumer_kv.cache.boundary_states
    prompt, longer = _prompts(provider)
    _prefill(share, "provider", provider_kv, prompt)

    sequence = share.open("consumer", consumer_kv, longer)
    imported = len(prompt) // BLOCK * BLOCK
    assert sequence.num_tokens == imported and sequence.cached_tokens == 0
    stats = share.stats()["consumer"]
    assert (stats.hits, stats.imported_tokens, stats.skipped_layer_tokens) == (1, imported, imported * BAND)
    logits = consumer_kv.forward([Extend(sequence, longer[imported:])])[0]
    tokens = _greedy(consumer_kv, sequence, logits)
    consumer_kv.close(sequence)
    _assert_same(direction, logits, tokens, *_cold(consumer, longer))

    # the consumer cached the prefix itself: the next open is its own prefix-tree hit
    again = share.open("consumer", consumer_kv, longer)
    assert again.cached_tokens >= imported and share.stats()["consumer"].hits == 1
    consumer_kv.close(again, cache=False)
    assert consumer_kv.pool.num_free + consumer_kv.tree.num_cached_blocks == consumer_kv.pool.num_blocks


def test_aliases_share_every_layer(base) -> None:
    share = LayerShare()
    first = ModelKV(base, num_blocks=32, block_size=BLOCK)
    second = ModelKV(base, num_blocks=32, block_size=BLOCK)  # the same file under another name
    share.attach("smol", first)
    share.attach("smol-alias", second)
    band = share.band("smol", "smol-alias")
    assert (band.layers, band.identical) == (base.config.num_layers, True)
    assert not first.cache.boundary_states, "identical models need no boundary state"
    prompt, longer = _prompts(base)
    _prefill(share, "smol", first, prompt)
    sequence = share.open("smol-alias", second, longer)
    imported = len(prompt) // BLOCK * BLOCK
    assert sequence.num_tokens == imported
    stats = share.stats()["smol-alias"]
    assert stats.skipped_layer_tokens == imported * base.config.num_layers, "the whole prefix skipped"
    slots = torch.tensor([sequence.blocks.slot(i) for i in range(imported)])
    first_slots = torch.tensor(list(range(imported)))  # first's only sequence used blocks 0.. in order
    assert torch.equal(second.cache.keys[29][slots], first.cache.keys[29][first_slots]), "KV not copied as is"
    logits = second.forward([Extend(sequence, longer[imported:])])[0]
    _assert_same("alias", logits, _greedy(second, sequence, logits), *_cold(base, longer))


@pytest.mark.parametrize("layer", [0, 7])
def test_one_changed_weight_moves_the_band(base, layer) -> None:
    before = compute_digest(base.module, base.config, base.tokenizer, base.dtype)
    assert before == base.digest, "the cached digest is not the loaded bytes' digest"
    weight = base.module.state_dict()[f"layers.{layer}.self_attn.o_proj.weight"]
    original = weight[3, 5].item()
    try:
        weight[3, 5] = original + 1e-3
        after = compute_digest(base.module, base.config, base.tokenizer, base.dtype)
    finally:
        weight[3, 5] = original
    band = shared_band(before, after)
    assert band.layers == layer and band.reason == f"layer {layer} differs"


@pytest.mark.parametrize("change", ["rope", "tokenizer"])
def test_different_rope_base_or_tokenizer_shares_nothing(sibling, sibling_path, tmp_path, change) -> None:
    variant = tmp_path / f"variant-{change}"
    variant.mkdir()
    for path in sibling_path.iterdir():
        if path.suffix == ".safetensors":
            (variant / path.name).symlink_to(path)  # the very same weights
        else:
            shutil.copy2(path, variant / path.name)
    if change == "rope":
        config = json.loads((variant / "config.json").read_text())
        config["rope_theta"] = config["rope_theta"] * 2
        (variant / "config.json").write_text(json.dumps(config))
    else:
        tokenizer = json.loads((variant / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]  # two tokens swap ids: same merges, other id meanings
        first, second = [t for t in vocab if t.isalpha() and len(t) > 4][:2]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (variant / "tokenizer.json").write_text(json.dumps(tokenizer))
    other = load_model(str(variant), "fp32", quiet=True)
    band = shared_band(sibling.digest, other.digest)
    label = {"rope": "RoPE configuration", "tokenizer": "tokenizer"}[change]
    assert (band.layers, band.reason) == (0, f"{label} differs")
    assert other.digest.layers == sibling.digest.layers, "same bytes, same layer digests"


def test_boundary_state_is_used_only_with_the_kv_it_was_written_with(base, sibling) -> None:
    provider_kv = ModelKV(base, num_blocks=32, block_size=BLOCK)
    consumer_kv = ModelKV(sibling, num_blocks=32, block_size=BLOCK)
    share = LayerShare()
    share.attach("provider", provider_kv)
    prompt, longer = _prompts(base)
    _prefill(share, "provider", provider_kv, prompt)  # no peer yet: no boundary recorded
    share.attach("consumer", consumer_kv)  # now the provider records boundary 15, from here on
    assert not provider_kv.cache.boundary_valid[BAND].any()
    sequence = share.open("consumer", consumer_kv, longer)
    assert sequence.num_tokens == 0 and share.stats()["consumer"].hits == 0
    consumer_kv.close(sequence, cache=False)
    # once the provider computes the prefix again (its cache evicted), it can be shared
    provider_kv.tree.evict(provider_kv.tree.num_evictable_blocks)
    _prefill(share, "provider", provider_kv, prompt)
    sequence = share.open("consumer", consumer_kv, longer)
    assert sequence.num_tokens == len(prompt) // BLOCK * BLOCK
    consumer_kv.close(sequence, cache=False)


def test_engine_consumer_reuses_provider_prefix(base, sibling, sibling_path) -> None:
    from polylane.engine import Engine, EngineConfig
    from polylane.types import SamplingParams

    prompt, longer = _prompts(base)
    _, cold_tokens = _cold(sibling, longer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with Engine(EngineConfig(budget_bytes=4 << 30, threads=torch.get_num_threads())) as engine:
        # fp32 both: the sibling folder holds the base's weights dequantised, which the GGUF's own
        # blocks (the default, auto) are not byte for byte
        engine.add_model("smol", BASE, dtype="fp32", kv_tokens=1024)
        engine.add_model("smol-top", str(sibling_path), dtype="fp32", kv_tokens=1024)
        engine.generate("smol", list(prompt), SamplingParams(max_tokens=1))
        completion = engine.generate("smol-top", list(longer), params)
        stats = engine.stats()
    assert completion.finish_reason == "length", completion
    assert completion.token_ids == cold_tokens, "engine output differs from the consumer's cold greedy"
    imported = len(prompt) // BLOCK * BLOCK
    model = stats.models["smol-top"]
    assert (model.cross_model_hits, model.cross_model_tokens) == (1, imported), model


def test_models_inspect_reports_the_band(base, sibling, sibling_path, capsys) -> None:
    assert main(["models", "inspect", BASE, str(sibling_path)]) == 0
    out = capsys.readouterr().out
    assert f"shared band: [0, {BAND}) — {BAND} of 30 layers (50%)" in out, out
    assert "layers with equal bytes  15 of 30 (first differing: 15)" in out, out
