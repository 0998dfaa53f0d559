"""The native int4 stack (runtime/native): what the C kernels compute, and when they run.

- The matrix kernel (AMX tiles and AVX512-BF16 alike) multiplies bf16-rounded activations by the
  weight the packed int4 stores ((q - 8) · scale + zero, `QuantizedProjection.dequantized_float`),
  for any number of rows, bias included.
- Batch invariance: a row's result is bit for bit the same alone or among others, in the kernel
  and through the whole stack — a verify pass gives each token the logits its decode step gives,
  so speculation against the int4 target stays lossless.
- On real models the native stack agrees with the torch int4 path within the tolerance of two
  roundings of the same 4-bit weights (the torch path rounds every projection's output to bf16).
- It runs only where it can: Gemma 3 and float models keep the torch path; no compiler or
  POLYLANE_NATIVE=0 means no native stack, with a log line saying why.
"""

from __future__ import annotations

import logging

import pytest
import torch

from polylane.runtime.batch import build_forward_batch
from polylane.runtime.kv_cache import PagedKVCache
from polylane.runtime.native import build, int4_stack
from polylane.runtime.quantize import QuantizedProjection
from polylane.types import SequenceChunk

needs_native = pytest.mark.skipif(
    int4_stack.library() is None, reason="no C compiler or no AVX512-BF16/VBMI CPU here"
)
SMOL, QWEN, GEMMA = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press.\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


@pytest.fixture(params=["amx", "avx512-bf16"])
def kernel(request):
    """Run a test once per matrix kernel this CPU has (AMX can be switched off, not on)."""
    lib = int4_stack.library()
    if lib is None:
        pytest.skip("no native int4 kernels on this machine")
    lib.polylane_int4_use_amx(int(request.param == "amx"))
    try:
        if int4_stack.kernel_name() != request.param:
            pytest.skip(f"this CPU has no {request.param} kernel")
        yield request.param
    finally:
        lib.polylane_int4_use_amx(1)


def _projection(out_features: int, in_features: int, bias: bool, seed: int = 0) -> QuantizedProjection:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias_values = torch.randn(out_features, generator=generator) if bias else None
    return QuantizedProjection(weight, bias_values, bits=4)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_matmul_multiplies_by_the_packed_weight(kernel, rows):
    projection = _projection(192, 160, bias=True)  # three 64-row blocks, five 32-column groups
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    weight = projection.dequantized_float().double()
    expected = x.to(torch.bfloat16).double() @ weight.t() + projection.bias.double()
    got = int4_stack.matmul(projection, x).double()
    error = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= 2e-5 * scale, (
        f"{kernel}, {rows} rows: max error {error:.3g} against values up to {scale:.3g}"
    )


def test_each_row_is_the_same_alone_or_in_a_batch(kernel):
    projection = _projection(256, 576, bias=False, seed=1)
    x = torch.randn(23, 576, generator=torch.Generator().manual_seed(2))
    batched = int4_stack.matmul(projection, x)
    for start, stop in [(0, 1), (5, 6), (3, 8), (16, 23)]:
        alone = int4_stack.matmul(projection, x[start:stop])
        assert torch.equal(alone, batched[start:stop]), (
            f"{kernel}: rows {start}:{stop} changed with the batch"
        )


def _native(model):
    if model.module.native_stack is None:
        pytest.skip("the native int4 stack does not run on this machine")
    return model.module


def _forward(module, cache, chunks):
    batch = build_forward_batch(chunks, cache.block_size, module.config)
    return module(batch, cache)


@needs_native
@pytest.mark.parametrize("name", [SMOL, QWEN])
def test_native_stack_agrees_with_the_torch_path(load_real_model, name):
    model = load_real_model(name, "int4")
    module = _native(model)
    ids = model.tokenizer.encode(TEXT)
    blocks = -(-len(ids) // 16)

    def all_logits() -> torch.Tensor:
        cache = PagedKVCache(module.config, blocks, 16, model.kv_dtype)
        batch = build_forward_batch([SequenceChunk(tuple(ids), 0, tuple(range(blocks)))], 16, module.config)
        batch.logit_rows = torch.arange(len(ids))
        return module(batch, cache)

    native = all_logits()
    stack, module.native_stack = module.native_stack, None
    try:
        reference = all_logits()
    finally:
        module.native_stack = stack
    top1 = (native.argmax(-1) == reference.argmax(-1)).float().mean().item()
    in_top5 = (reference.topk(5, -1).indices == native.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    mean_abs = (native - reference).abs().mean().item()
    message = (
        f"{name} over {len(ids)} positions: top-1 {top1:.3f}, in top-5 {in_top5:.3f}, mean-abs {mean_abs:.3f}"
    )
    print(message)
    assert in_top5 == 1.0 and top1 >= 0.85 and mean_abs <= 0.15, message


@needs_native
def test_verify_pass_and_batched_steps_give_decode_logits_exactly(load_real_model):
    model = load_real_model(SMOL, "int4")
    module = _native(model)
    prompt = tuple(model.tokenizer.encode("Count slowly: one, two, three,"))
    tables = [tuple(range(8 * s, 8 * s + 8)) for s in range(3)]
    cache = PagedKVCache(module.config, 24, 16, model.kv_dtype)
    for table in tables:
        _forward(module, cache, [SequenceChunk(prompt, 0, table)])

    # sequence 0 decodes six greedy tokens alone, one step each
    tokens, alone = [], []
    next_token = int(
        _forward(module, cache, [SequenceChunk(prompt[-1:], len(prompt) - 1, tables[0])])[-1].argmax()
    )
    for step in range(6):
        tokens.append(next_token)
        logits = _forward(module, cache, [SequenceChunk((next_token,), len(prompt) + step, tables[0])])
        alone.append(logits[-1])
        next_token = int(logits[-1].argmax())

    # sequence 1 verifies the same six tokens in one chain pass
    chain = SequenceChunk(tuple(tokens), len(prompt), tables[1], logits="all")
    verified = _forward(module, cache, [chain])
    # sequence 2 decodes them in steps shared with another sequence's verify chain
    shared = []
    other = [SequenceChunk((t,), len(prompt) + i, tables[1]) for i, t in enumerate(tokens)]
    for step, token in enumerate(tokens):
        logits = _forward(
            module,
            cache,
            [SequenceChunk((token,), len(prompt) + step, tables[2]), other[step]],
        )
        shared.append(logits[0])
    for step in range(6):
        assert torch.equal(verified[step], alone[step]), f"verify row {step} differs from its decode step"
        assert torch.equal(shared[step], alone[step]), f"batched step {step} differs from decoding alone"


@pytest.mark.parametrize(("name", "dtype"), [(GEMMA, "int4"), (SMOL, "fp32")])
def test_models_the_stack_cannot_run_keep_the_torch_path(load_real_model, name, dtype):
    model = load_real_model(name, dtype)
    assert model.module.native_stack is None


def test_no_library_means_no_native_stack(load_real_model, monkeypatch):
    model = load_real_model(SMOL, "int4")
    monkeypatch.setattr(int4_stack, "load_library", lambda name: None)
    assert int4_stack.Int4Stack.build(model.module) is None


def test_kernels_build_on_first_use_and_a_failed_build_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POLYLANE_CACHE_DIR", str(tmp_path / "models"))
    build_once = build.load_library.__wrapped__
    if build._compiler() is not None:
        lib = build_once("int4_decoder")
        assert lib is not None and list((tmp_path / "kernels").glob("int4_decoder-*.so"))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build_once("int4_decoder") is None
    assert "kernels are unavailable" in caplog.text
    monkeypatch.setenv(build.NATIVE_ENV, "0")
    assert build_once("int4_decoder") is None
