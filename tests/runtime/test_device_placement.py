"""A forward on a device other than the host mixes in no host tensor and never waits on the device
to read a value back, checked without a GPU on torch's `meta` device (shapes only, no data: any
host tensor mixed in, and any read of a value, is an error there, as a mixed tensor is on CUDA).

Every architecture, float32 and the int8 quantised twin, prefill, batched decode over the paged
cache, a tree verify, copy-on-write block copies. (torch's meta kernel of the int4 matrix product
runs only under fake tensors: the int4 twin is checked up to its re-packed weight.)
"""

from __future__ import annotations

import pytest
import torch

from polylane.policy.kv.sequence_blocks import BlockCopy
from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.device import place_model
from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig
from polylane.runtime.model.quantize import quantize_model
from polylane.runtime.models import ARCHITECTURES
from polylane.types import SequenceChunk

META = torch.device("meta")
VOCAB = 128
BLOCK = 4


def _config(architecture: str) -> ModelConfig:
    gemma = architecture == "gemma3"
    return ModelConfig(
        architecture=architecture,
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        max_context=64,
        layer_types=(SLIDING, GLOBAL) if gemma else (GLOBAL, GLOBAL),
        sliding_window=8 if gemma else None,
        rope_local_theta=10_000.0 if gemma else None,
        qkv_bias=architecture == "qwen2",
        qk_norm=gemma,
        sandwich_norms=gemma,
        embedding_scale=8.0 if gemma else 1.0,
        activation="gelu_tanh" if gemma else "silu",
        final_logit_softcap=30.0 if gemma else None,
    )


def _model_on_meta(architecture: str, fmt: str | None):
    config = _config(architecture)
    model = ARCHITECTURES[architecture][0](config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.prepare()
    model.eval()
    if fmt is not None:
        quantize_model(model, fmt)
    place_model(model, META)
    return model, config


@pytest.mark.parametrize("fmt", [None, "int8"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_forward_off_the_host_mixes_in_no_host_tensor(architecture, fmt):
    model, config = _model_on_meta(architecture, fmt)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device == META for t in tensors)
    cache = PagedKVCache(config, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device=META)

    def forward(chunks: list[SequenceChunk]) -> torch.Tensor:
        logits = model(build_forward_batch(chunks, BLOCK, config, META), cache)
        assert logits.device == META and logits.dtype == torch.float32
        return logits

    prompt = tuple(range(1, 11))
    assert forward([SequenceChunk(prompt, 0, (0, 1, 2), None, "last")]).shape == (1, VOCAB)
    decode = [SequenceChunk((5,), 10, (0, 1, 2), None, "last"), SequenceChunk((6,), 3, (3,), None, "last")]
    assert forward(decode).shape == (2, VOCAB)
    tree = SequenceChunk((7, 8, 9, 3), 11, (0, 1, 2, 4), (-1, 0, 0, 1), "all")
    assert forward([tree]).shape == (4, VOCAB)
    cache.copy_blocks([BlockCopy(source=2, target=5)])


def test_int4_weights_are_repacked_for_the_device_kernel():
    model, config = _model_on_meta("llama", "int4")
    projection = model.layers[0].mlp.gate_up_proj
    # tinygemm's layout: (N / 8, K / (16 · inner k tiles), 32, inner k tiles / 2) int32; K = 64
    # takes 4 inner k tiles (8 would need K a multiple of 128)
    assert projection.qweight.shape == (2 * config.intermediate_size // 8, config.hidden_size // 64, 32, 2)
    assert projection.qweight.dtype == torch.int32 and projection.scales.device == META
