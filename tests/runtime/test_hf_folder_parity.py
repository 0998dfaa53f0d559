"""The Hugging Face folder loader and our decoder against `transformers`, on random tiny models.

For each architecture (Llama, Qwen2, Gemma 3) a tiny random-weight model is built with
`transformers` in float32, its weights spread out so that every tensor matters, saved with
`save_pretrained`, and read back with `load_hf_folder`. Our forward over the paged KV cache must
give the logits `transformers` gives for the same token ids: all positions of a prefill, and each
position of a token-by-token decode continuing through the cache. The block tables are shuffled so
that paging (not contiguous slots) is what is tested.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.loading.loader import LoadedWeights, load_hf_folder
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.model_config import GLOBAL, SLIDING
from polylane.types import SequenceChunk

VOCAB = 128
PROMPT_LEN = 24  # longer than Gemma's sliding window of 8, so sliding layers differ from global
PREFILL_LEN = 12  # the decode test prefills this much, then feeds the rest token by token
BLOCK_SIZE = 4
FP32_TOLERANCE = 1e-4
BF16_MIN_ARGMAX_AGREEMENT = 0.9


def _llama() -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50_000.0,  # not the default, so a loader that ignores it fails
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _qwen2() -> PreTrainedModel:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=20_000.0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config)


def _gemma3(same_rope_base: bool = False) -> PreTrainedModel:
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": GEMMA_GLOBAL_THETA},
        "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA_LOCAL_THETA},
    }
    if same_rope_base:
        rope["full_attention"]["rope_theta"] = GEMMA_LOCAL_THETA
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=7,  # default pattern of 6: layers 0-4 and 6 sliding, layer 5 global
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
        query_pre_attn_scalar=32,
        final_logit_softcapping=30.0,
        rope_parameters=rope,
        attn_implementation="eager",
    )
    return Gemma3ForCausalLM(config)


GEMMA_GLOBAL_THETA = 1_000_000.0
GEMMA_LOCAL_THETA = 10_000.0
EXPECTED_THETAS = {  # (global layers, sliding layers)
    "llama": (50_000.0, None),
    "qwen2": (20_000.0, None),
    "gemma3": (GEMMA_GLOBAL_THETA, GEMMA_LOCAL_THETA),
    "gemma3-same-rope-base": (GEMMA_LOCAL_THETA, GEMMA_LOCAL_THETA),
}
BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gemma3": _gemma3,
    # The same Gemma 3 model with one RoPE base for both layer kinds.
    "gemma3-same-rope-base": lambda: _gemma3(same_rope_base=True),
}

ALL = ["llama", "qwen2", "gemma3", "gemma3-same-rope-base"]


def _randomise(model: PreTrainedModel, gemma_norms: bool) -> None:
    """Spread the weights so activations are O(1) and every norm weight differs from the rest."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                # Llama/Qwen multiply by w (near 1); Gemma by 1 + w (w near 0).
                centre = 0.0 if gemma_norms else 1.0
                parameter.copy_(centre + 0.2 * torch.randn_like(parameter))
            elif "embed_tokens" in name or "lm_head" in name:
                parameter.normal_(0.0, 1.0)
            else:
                parameter.normal_(0.0, 1.0 / parameter.shape[-1] ** 0.5)


@dataclass
class SavedModel:
    arch: str
    folder: Path
    prompt: torch.Tensor  # (PROMPT_LEN,) token ids
    reference: torch.Tensor  # (PROMPT_LEN, VOCAB) transformers' float32 logits


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SavedModel]:
    """Build, save and run each random model once per module, on first use."""
    built: dict[str, SavedModel] = {}

    def get(arch: str) -> SavedModel:
        if arch not in built:
            torch.manual_seed(1234)
            model = BUILDERS[arch]().float().eval()
            _randomise(model, gemma_norms=arch.startswith("gemma3"))
            folder = tmp_path_factory.mktemp(f"hf-{arch}")
            model.save_pretrained(folder, safe_serialization=True)
            generator = torch.Generator().manual_seed(7)
            prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=generator)
            with torch.no_grad():
                reference = model(prompt[None, :]).logits[0].float()  # (T, V)
            built[arch] = SavedModel(arch, folder, prompt, reference)
        return built[arch]

    return get


def _shuffled_block_table(num_tokens: int, seed: int) -> tuple[list[int], int]:
    """A non-contiguous block table for `num_tokens` tokens, and the pool size it lives in."""
    needed = -(-num_tokens // BLOCK_SIZE)
    num_blocks = needed + 3
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    return blocks[:needed], num_blocks


def _prefill(weights: LoadedWeights, prompt: torch.Tensor) -> torch.Tensor:
    table, num_blocks = _shuffled_block_table(len(prompt), seed=0)
    cache = PagedKVCache(weights.config, num_blocks, BLOCK_SIZE, _dtype(weights))
    chunk = SequenceChunk(
        token_ids=tuple(prompt.tolist()), num_cached=0, block_table=tuple(table), logits="all"
    )
    batch = build_forward_batch([chunk], BLOCK_SIZE, weights.config)
    return weights.model(batch, cache)  # (T, V)


def _prefill_then_decode(weights: LoadedWeights, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of positions PREFILL_LEN - 1 … T - 1: the last prefill row, then one per decode."""
    ids = prompt.tolist()
    table, num_blocks = _shuffled_block_table(len(ids), seed=1)
    cache = PagedKVCache(weights.config, num_blocks, BLOCK_SIZE, _dtype(weights))
    rows = []
    first = SequenceChunk(
        token_ids=tuple(ids[:PREFILL_LEN]), num_cached=0, block_table=tuple(table), logits="last"
    )
    rows.append(weights.model(build_forward_batch([first], BLOCK_SIZE, weights.config), cache))
    for index in range(PREFILL_LEN, len(ids)):
        step = SequenceChunk(
            token_ids=(ids[index],), num_cached=index, block_table=tuple(table), logits="last"
        )
        rows.append(weights.model(build_forward_batch([step], BLOCK_SIZE, weights.config), cache))
    return torch.cat(rows)  # (T - PREFILL_LEN + 1, V)


def _dtype(weights: LoadedWeights) -> torch.dtype:
    return weights.model.weight_dtype


@pytest.mark.parametrize("arch", ALL)
def test_config_reads_the_folder(saved_models: Callable[[str], SavedModel], arch: str) -> None:
    config = load_hf_folder(saved_models(arch).folder, "fp32").config
    expected_arch = arch.partition("-")[0]
    assert config.architecture == expected_arch, f"architecture {config.architecture!r}"
    assert config.vocab_size == VOCAB, f"vocab {config.vocab_size}, expected {VOCAB}"
    global_theta, local_theta = EXPECTED_THETAS[arch]
    assert config.rope_theta == global_theta, (
        f"{arch}: RoPE base {config.rope_theta}, expected {global_theta}"
    )
    if expected_arch == "gemma3":
        expected_types = (SLIDING,) * 5 + (GLOBAL, SLIDING)
        assert config.layer_types == expected_types, f"layer types {config.layer_types}"
        assert config.sliding_window == 8, f"sliding window {config.sliding_window}"
        assert config.final_logit_softcap == 30.0, f"softcap {config.final_logit_softcap}"
        local = config.rope_local_theta or config.rope_theta
        assert local == local_theta, f"{arch}: sliding RoPE base {local}, expected {local_theta}"


@pytest.mark.parametrize("arch", ALL)
def test_fp32_prefill_logits_match_transformers(
    saved_models: Callable[[str], SavedModel],
    arch: str,
    record_property: Callable[[str, object], None],
) -> None:
    saved = saved_models(arch)
    ours = _prefill(load_hf_folder(saved.folder, "fp32"), saved.prompt)
    assert ours.shape == saved.reference.shape, f"{arch}: shape {tuple(ours.shape)}"
    diff = (ours - saved.reference).abs()
    scale = saved.reference.abs().max().item()
    record_property("prefill_max_abs", diff.max().item())
    assert diff.max().item() < FP32_TOLERANCE, (
        f"{arch}: prefill max-abs {diff.max().item():.3e} (mean {diff.mean().item():.3e}, "
        f"worst position {int(diff.amax(-1).argmax())}, logit scale {scale:.2f}) "
        f">= {FP32_TOLERANCE}"
    )
    # The comparison means something only if the logits are not all near zero.
    assert scale > 1.0, f"{arch}: logits too small to compare (max |logit| {scale:.3e})"


@pytest.mark.parametrize("arch", ALL)
def test_fp32_decode_through_cache_matches_transformers(
    saved_models: Callable[[str], SavedModel], arch: str, record_property: Callable[[str, object], None]
) -> None:
    saved = saved_models(arch)
    ours = _prefill_then_decode(load_hf_folder(saved.folder, "fp32"), saved.prompt)
    expected = saved.reference[PREFILL_LEN - 1 :]
    diff = (ours - expected).abs()
    per_position = diff.amax(-1)
    record_property("decode_max_abs", diff.max().item())
    assert diff.max().item() < FP32_TOLERANCE, (
        f"{arch}: decode max-abs {diff.max().item():.3e} (mean {diff.mean().item():.3e}); "
        f"per position from {PREFILL_LEN - 1}: "
        + ", ".join(f"{value:.1e}" for value in per_position.tolist())
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gemma3-same-rope-base"])
def test_bf16_argmax_agrees_with_transformers(
    saved_models: Callable[[str], SavedModel],
    arch: str,
    record_property: Callable[[str, object], None],
) -> None:
    saved = saved_models(arch)
    weights = load_hf_folder(saved.folder, "bf16")
    assert _dtype(weights) == torch.bfloat16, f"{arch}: weights are {_dtype(weights)}"
    ours = _prefill(weights, saved.prompt)
    agreement = (ours.argmax(-1) == saved.reference.argmax(-1)).float().mean().item()
    max_abs = (ours - saved.reference).abs().max().item()
    record_property("bf16_top1_agreement", agreement)
    record_property("bf16_max_abs", max_abs)
    assert agreement >= BF16_MIN_ARGMAX_AGREEMENT, (
        f"{arch}: bf16 top-1 agreement {agreement:.3f} < {BF16_MIN_ARGMAX_AGREEMENT} (max-abs {max_abs:.3e})"
    )
