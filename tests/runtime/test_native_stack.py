"""The native stack (runtime/model/native): what the C kernels compute, and when they run.

- The matrix kernels (AMX tiles and AVX512-BF16 alike) multiply bf16-rounded activations by the
  weight the packed int4 stores ((q - 8) · scale + zero, `QuantizedProjection.dequantized_float`;
  for a prompt run on AMX, that weight rounded to bf16, `dequantized_bf16`) or by a bf16 weight,
  and float32 activations by a float32 weight in either layout, for any
  number of rows, bias included.
- Batch invariance: a row's result is bit for bit the same alone or among others, in the kernel
  and through the whole stack — a verify pass gives each token the logits its decode step gives,
  so speculation against the int4 target stays lossless.
- On real models the native stack agrees with the torch path: int4 within the tolerance of two
  roundings of the same 4-bit weights (the torch path rounds every projection's output to bf16),
  bf16 within bf16 tolerance (the native stack keeps float32 activations), float32 to 1e-3.
- Gemma 3 runs natively too (QK norms, sandwich norms, GELU, sliding layers with their own RoPE
  base): its sliding layers see exactly their window, past it as before it.
- It runs only where it can: no compiler or
  POLYLANE_NATIVE=0 means no native stack, with a log line saying why.
"""

from __future__ import annotations

import logging

import pytest
import torch

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.compute_paths import native_unavailable_reason, why_not_native
from polylane.runtime.model.layers import Projection
from polylane.runtime.model.native import build
from polylane.runtime.model.native import stack as native
from polylane.runtime.model.quantize import QuantizedProjection
from polylane.types import SequenceChunk

needs_native = pytest.mark.skipif(native.kernel_name() is None, reason=str(native_unavailable_reason()))
SMOL, QWEN, GEMMA = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press.\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


@pytest.fixture(params=["amx", "avx512-bf16"])
def kernel(request):
    """Run a test once per matrix kernel this CPU has (AMX can be switched off, not on)."""
    lib = native.library()
    if lib is None:
        pytest.skip(str(native_unavailable_reason()))
    lib.polylane_use_amx(int(request.param == "amx"))
    try:
        if native.kernel_name() != request.param:
            pytest.skip(f"this CPU has no {request.param} kernel")
        yield request.param
    finally:
        lib.polylane_use_amx(1)


def _projection(
    out_features: int, in_features: int, bias: bool, seed: int = 0, bits: int = 4
) -> QuantizedProjection:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias_values = torch.randn(out_features, generator=generator) if bias else None
    return QuantizedProjection(weight, bias_values, bits=bits)


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 130])
def test_matmul_multiplies_by_the_packed_weight(kernel, rows, prompt):
    projection = _projection(192, 160, bias=True)  # three 64-row blocks, five 32-column groups
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    # a prompt run on AMX multiplies by the weight rounded to bf16, once
    prompt_path = kernel == "amx" and prompt
    weight = (projection.dequantized_bf16() if prompt_path else projection.dequantized_float()).double()
    expected = x.to(torch.bfloat16).double() @ weight.t() + projection.bias.double()
    got = native.matmul(projection, x, prompt).double()
    error = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= 2e-5 * scale, (
        f"{kernel}, {rows} rows{', a prompt run' if prompt else ''}: max error {error:.3g} against values"
        f" up to {scale:.3g}"
    )


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_int8_matmul_multiplies_by_each_rows_scaled_codes(kernel, rows, prompt):
    # (a prompt run on AMX: the same products on tiles, summed in another order)
    projection = _projection(192, 160, bias=True, bits=8)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    weight = projection.qweight.double() * projection.scales.double()[:, None]  # w = q · scale
    expected = x.to(torch.bfloat16).double() @ weight.t() + projection.bias.double()
    got = native.matmul(projection, x, prompt).double()
    error = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= 2e-5 * scale, f"{kernel}, {rows} rows: max error {error:.3g} of {scale:.3g}"


def _dense(out_features: int, in_features: int, dtype: torch.dtype, input_major: bool) -> Projection:
    generator = torch.Generator().manual_seed(3)
    projection = Projection(in_features, out_features, bias=True)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    if input_major:
        projection.use_input_major_layout()
        projection.weight.data = weight.t().contiguous()
    else:
        projection.weight.data = weight.to(dtype)
    projection.bias.data = torch.randn(out_features, generator=generator).to(dtype)
    return projection


@pytest.mark.parametrize(
    ("dtype", "input_major"), [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)]
)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_dense_matmul_multiplies_by_the_weight(kernel, dtype, input_major, rows):
    projection = _dense(128, 96, dtype, input_major)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    weight = projection.weight.t() if input_major else projection.weight
    inputs = x.to(torch.bfloat16) if dtype == torch.bfloat16 else x
    expected = inputs.double() @ weight.double().t() + projection.bias.double()
    got = native.matmul(projection, x).double()
    error = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= 2e-5 * scale, f"{kernel}, {dtype}, {rows} rows: max error {error:.3g} of {scale:.3g}"


@pytest.mark.parametrize("dtype", ["int4", "int8", "bf16", "fp32"])
def test_each_row_is_the_same_alone_or_in_a_batch(kernel, dtype):
    if dtype in ("int4", "int8"):
        projection = _projection(256, 576, bias=False, seed=1, bits=int(dtype[3:]))
    else:
        projection = _dense(256, 576, torch.bfloat16 if dtype == "bf16" else torch.float32, False)
    x = torch.randn(23, 576, generator=torch.Generator().manual_seed(2))
    batched = native.matmul(projection, x)
    for start, stop in [(0, 1), (5, 6), (3, 8), (16, 23)]:
        alone = native.matmul(projection, x[start:stop])
        assert torch.equal(alone, batched[start:stop]), (
            f"{kernel}: rows {start}:{stop} changed with the batch"
        )


@needs_native
def test_a_long_prompt_chunk_without_logits_runs_natively(load_real_model):
    # a prompt's first chunk asks for no logits: every matmul but the output projection runs
    model = load_real_model(SMOL, "int4")
    module = _native(model)
    cache = PagedKVCache(module.config, 40, 16, model.kv_dtype)
    table = tuple(range(40))
    ids = tuple(100 + i % 500 for i in range(600))
    none = _forward(module, cache, [SequenceChunk(ids[:512], 0, table, logits="none")])
    assert none.shape == (0, module.config.vocab_size)
    last = _forward(module, cache, [SequenceChunk(ids[512:], 512, table)])
    assert last.shape == (1, module.config.vocab_size) and torch.isfinite(last).all()


@needs_native
@pytest.mark.parametrize(("name", "dtype"), [(SMOL, "int4"), (GEMMA, "int4"), (SMOL, "int8")])
def test_prompt_runs_on_tiles_agree_with_the_torch_path(load_real_model, name, dtype):
    # one prompt step: runs of 16+ tokens of one sequence attend on AMX tiles (a 300-token prompt,
    # a 17-token one with a 1-token last block, 150 tokens after a cached 100-token prefix, 600
    # tokens: past Gemma's 512-token sliding window), shorter ones (5 tokens) per token; then each
    # sequence decodes 6 steps, reading the KV cache the prompt step wrote (the native run's greedy
    # tokens, fed to both runs: a near tie must not fork them)
    model = load_real_model(name, dtype)
    module = _native(model)
    ids = tuple(model.tokenizer.encode(TEXT * 12))
    prompts = {
        "long": (ids[:300], 0),
        "odd": (ids[40:57], 0),
        "short": (ids[90:95], 0),
        "after": (ids[:250], 100),
        "past the window": (ids[:600], 0),
    }
    tables = {name: tuple(range(40 * i, 40 * i + 40)) for i, name in enumerate(prompts)}

    fed: list[list[int]] = []

    def run() -> torch.Tensor:
        cache = PagedKVCache(module.config, 40 * len(prompts), 16, model.kv_dtype)
        _forward(module, cache, [SequenceChunk(prompts["after"][0][:100], 0, tables["after"])])
        chunks = [SequenceChunk(p[start:], start, tables[name]) for name, (p, start) in prompts.items()]
        rows = [_forward(module, cache, chunks)]
        positions = {name: len(p) for name, (p, _) in prompts.items()}
        for step in range(6):
            if len(fed) == step:
                fed.append(rows[-1].argmax(-1).tolist())
            nexts = fed[step]
            steps = [
                SequenceChunk((t,), positions[name], tables[name])
                for name, t in zip(prompts, nexts, strict=True)
            ]
            rows.append(_forward(module, cache, steps))
            positions = {name: position + 1 for name, position in positions.items()}
        return torch.cat(rows)

    fast, reference = _native_and_torch(module, run)
    assert torch.isfinite(fast).all()
    min_top1, max_mean_abs = AGREEMENT[dtype]
    # every row, and the last prompt's alone (rows 4, 9, …: one per step)
    last_prompt = slice(len(prompts) - 1, None, len(prompts))
    for rows, label in ((slice(None), "all rows"), (last_prompt, "past the window")):
        top1 = (fast[rows].argmax(-1) == reference[rows].argmax(-1)).float().mean().item()
        mean_abs = (fast[rows] - reference[rows]).abs().mean().item()
        print(f"{name} {dtype}, {label}: top-1 {top1:.3f}, mean-abs {mean_abs:.3g}")
        assert top1 >= min_top1 and mean_abs <= max_mean_abs, (label, top1, mean_abs)


def _native(model):
    if model.module.native_stack is None:
        pytest.skip(f"this model runs on torch here: {why_not_native()}")
    return model.module


def _native_and_torch(module, run):
    """`run()` on the native stack, then on the torch path (the stack set aside meanwhile)."""
    fast = run()
    stack, module.native_stack = module.native_stack, None
    try:
        return fast, run()
    finally:
        module.native_stack = stack


def _counting_native_forwards(module, run):
    """`_native_and_torch(module, run)`, and whether each call of the native stack ran natively
    (False: it handed the forward to the torch path)."""
    stack, native_forwards = module.native_stack, []
    forward = stack.forward

    def counted(*args):
        logits = forward(*args)
        native_forwards.append(logits is not None)
        return logits

    stack.forward = counted
    try:
        return native_forwards, _native_and_torch(module, run)
    finally:
        del stack.forward


def _forward(module, cache, chunks):
    batch = build_forward_batch(chunks, cache.block_size, module.config)
    return module(batch, cache)


# (top-1 agreement at least, mean-abs difference at most) of the native stack against torch
AGREEMENT = {"int4": (0.85, 0.15), "int8": (0.85, 0.15), "bf16": (0.9, 0.3), "fp32": (1.0, 1e-4)}


@needs_native
@pytest.mark.parametrize(
    ("name", "dtype"), [(SMOL, "int4"), (QWEN, "int4"), (SMOL, "int8"), (SMOL, "bf16"), (SMOL, "fp32")]
)
def test_native_stack_agrees_with_the_torch_path(load_real_model, name, dtype):
    model = load_real_model(name, dtype)
    module = _native(model)
    ids = model.tokenizer.encode(TEXT)
    blocks = -(-len(ids) // 16)
    table = tuple(range(blocks))
    # one prefill forward where the native stack takes a whole prompt, else one token per step
    stepwise = len(ids) >= module.native_stack.max_tokens

    def all_logits() -> torch.Tensor:
        cache = PagedKVCache(module.config, blocks, 16, model.kv_dtype)
        if stepwise:
            return torch.cat(
                [_forward(module, cache, [SequenceChunk((t,), i, table)]) for i, t in enumerate(ids)]
            )
        batch = build_forward_batch([SequenceChunk(tuple(ids), 0, table)], 16, module.config)
        batch.logit_rows = torch.arange(len(ids))
        return module(batch, cache)

    fast, reference = _native_and_torch(module, all_logits)
    top1 = (fast.argmax(-1) == reference.argmax(-1)).float().mean().item()
    in_top5 = (reference.topk(5, -1).indices == fast.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    mean_abs = (fast - reference).abs().mean().item()
    max_abs = (fast - reference).abs().max().item()
    message = (
        f"{name} {dtype} over {len(ids)} positions: top-1 {top1:.3f}, in top-5 {in_top5:.3f}, "
        f"mean-abs {mean_abs:.3g}, max-abs {max_abs:.3g}"
    )
    print(message)
    min_top1, max_mean_abs = AGREEMENT[dtype]
    assert in_top5 == 1.0 and top1 >= min_top1 and mean_abs <= max_mean_abs, message


@needs_native
@pytest.mark.parametrize(("name", "dtype"), [(SMOL, "int4"), (SMOL, "int8"), (SMOL, "bf16"), (GEMMA, "int4")])
def test_verify_pass_and_batched_steps_give_decode_logits_exactly(load_real_model, name, dtype):
    model = load_real_model(name, dtype)
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


@needs_native
def test_a_prompt_run_and_a_decode_token_do_not_change_each_other(load_real_model, kernel):
    # a prompt run takes the prompt paths (AMX) by its own length alone: beside a decode token it
    # gives the logits it gives alone, and the decode token those of its step alone
    model = load_real_model(SMOL, "int4")
    module = _native(model)
    ids = tuple(model.tokenizer.encode(TEXT * 3))
    cache = PagedKVCache(module.config, 16, 16, model.kv_dtype)
    decoding, prompting = tuple(range(4)), tuple(range(4, 16))
    _forward(module, cache, [SequenceChunk(ids[:30], 0, decoding)])
    step = SequenceChunk((ids[30],), 30, decoding)
    prompt = SequenceChunk(ids[:140], 0, prompting)  # (the old rule: a 128-token step is a prompt)
    decode_alone = _forward(module, cache, [step])
    prompt_alone = _forward(module, cache, [prompt])
    together = _forward(module, cache, [prompt, step])
    assert torch.equal(together[0], prompt_alone[0]), f"{kernel}: a prompt run changed beside a decode token"
    assert torch.equal(together[1], decode_alone[0]), f"{kernel}: a decode token changed beside a prompt run"


def test_no_library_means_no_native_stack(load_real_model, monkeypatch):
    model = load_real_model(SMOL, "int4")
    monkeypatch.setattr(native, "load_library", lambda name: None)
    assert native.NativeStack.build(model.module) is None


def test_kernels_build_on_first_use_and_a_failed_build_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POLYLANE_CACHE_DIR", str(tmp_path / "models"))
    build_once = build.load_library.__wrapped__
    if build._compiler() is not None:
        lib = build_once("decoder")
        assert lib is not None and list((tmp_path / "kernels").glob("decoder-*.so"))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build_once("decoder") is None
    assert "kernels are unavailable" in caplog.text
    monkeypatch.setenv(build.NATIVE_ENV, "0")
    assert build_once("decoder") is None


@needs_native
@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-5), ("int4", 0.05)])
def test_boundary_states_are_recorded_as_the_torch_path_records_them(load_real_model, dtype, tolerance):
    # a model whose peer shares its lower layers keeps the hidden state entering the band's top
    # (and the last layer's output) per slot; natively as on torch, so it may stay native
    model = load_real_model(SMOL, dtype)
    module = _native(model)
    prompt = tuple(model.tokenizer.encode(TEXT))[:40]
    band, last = 15, module.config.num_layers
    step_by_step = len(prompt) >= module.native_stack.max_tokens  # fp32 runs only a few rows natively

    def run() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        cache = PagedKVCache(module.config, 8, 16, model.kv_dtype)
        cache.add_boundary(band)
        cache.add_boundary(last)
        table = tuple(range(8))
        if step_by_step:
            for i, token in enumerate(prompt):
                _forward(module, cache, [SequenceChunk((token,), i, table)])
        else:
            _forward(module, cache, [SequenceChunk(prompt, 0, table)])
            _forward(module, cache, [SequenceChunk((17,), len(prompt), table)])  # and a decode step
        kept = {layer: (cache.boundary_states[layer], cache.boundary_valid[layer]) for layer in (band, last)}
        return {layer: (states.clone(), valid.clone()) for layer, (states, valid) in kept.items()}

    native_forwards, (fast, reference) = _counting_native_forwards(module, run)
    assert native_forwards and all(native_forwards), "a forward keeping boundary states left the native stack"
    for layer in (band, last):
        (states, valid), (expected, expected_valid) = fast[layer], reference[layer]
        assert torch.equal(valid, expected_valid) and int(valid.sum()) == len(prompt) + (not step_by_step)
        relative = (states.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert relative <= tolerance, f"layer {layer}: states differ by {relative:.3g} of the largest"


@needs_native
def test_a_shared_band_continues_natively_as_on_the_torch_path(load_real_model):
    # a consumer copies a provider's K/V below the band and runs the layers above from the stored
    # boundary state (ModelKV.extend_from_band): natively too, agreeing with the torch path
    model = load_real_model(SMOL, "int4")
    module = _native(model)
    prompt = tuple(model.tokenizer.encode(TEXT))[:48]
    band, table = 15, tuple(range(4))
    provider = PagedKVCache(module.config, 4, 16, model.kv_dtype)
    provider.add_boundary(band)
    _forward(module, provider, [SequenceChunk(prompt, 0, table)])
    slots = torch.arange(len(prompt))

    def continue_from_band() -> torch.Tensor:
        consumer = PagedKVCache(module.config, 4, 16, model.kv_dtype)
        batch = build_forward_batch([SequenceChunk(prompt, 0, table)], 16, module.config)
        consumer.import_band(provider, slots, batch.slot_mapping, band)
        logits = module(batch, consumer, start_layer=band, hidden=provider.boundary_states[band][slots])
        keys = [consumer.keys[layer][: len(prompt)].float() for layer in (band, module.config.num_layers - 1)]
        return logits, torch.stack(keys)

    native_forwards, (fast, reference) = _counting_native_forwards(module, continue_from_band)
    assert native_forwards == [True], "the band's continuation left the native stack"
    (logits, keys), (expected_logits, expected_keys) = fast, reference
    assert logits.argmax(-1).tolist() == expected_logits.argmax(-1).tolist()
    for got, expected in ((logits, expected_logits), (keys, expected_keys)):
        relative = (got - expected).abs().max() / expected.abs().max()
        assert relative <= 0.05, f"the continuation differs by {relative:.3g} of its largest value"


@needs_native
@pytest.mark.parametrize("dtype", ["int4", "fp32"])
def test_gemma_sliding_layers_see_their_window_as_on_the_torch_path(load_real_model, dtype):
    # a prompt past the 512-token window (int4: one native forward; float32: torch's prefill), then
    # native decode steps whose sliding layers no longer see the prompt's first keys
    model = load_real_model(GEMMA, dtype)
    module = _native(model)
    window = module.config.sliding_window
    ids = model.tokenizer.encode(TEXT * 12)[: window + 24]
    prompt, blocks = ids[: window + 16], -(-len(ids) // 16)
    table = tuple(range(blocks))

    def all_logits() -> torch.Tensor:
        cache = PagedKVCache(module.config, blocks, 16, model.kv_dtype)
        batch = build_forward_batch([SequenceChunk(tuple(prompt), 0, table)], 16, module.config)
        batch.logit_rows = torch.arange(len(prompt))
        logits = [module(batch, cache)]
        for position in range(len(prompt), len(ids)):
            logits.append(_forward(module, cache, [SequenceChunk((ids[position],), position, table)]))
        return torch.cat(logits)

    native_forwards, (fast, reference) = _counting_native_forwards(module, all_logits)
    # (without AMX, int4 prompts of 128+ tokens go to torch: MAX_TOKENS_WITHOUT_AMX)
    prompt_native = dtype == "int4" and len(prompt) < module.native_stack.max_tokens
    assert native_forwards == [prompt_native] + [True] * (len(ids) - len(prompt))
    min_top1, max_mean_abs = AGREEMENT[dtype]
    # all positions, and those whose sliding layers no longer see position 0 (where a missing
    # window shows: there every logit moves, where before the window none does)
    for rows, label in ((slice(None), "all"), (slice(window, None), "past the window")):
        top1 = (fast[rows].argmax(-1) == reference[rows].argmax(-1)).float().mean().item()
        mean_abs = (fast[rows] - reference[rows]).abs().mean().item()
        message = f"Gemma {dtype}, {label} ({len(ids)} positions): top-1 {top1:.3f}, mean-abs {mean_abs:.3g}"
        print(message)
        assert top1 >= min_top1 and mean_abs <= max_mean_abs, message


@needs_native
def test_int8_steps_with_many_tokens_outside_prompt_runs_go_to_torch(load_real_model):
    # int8 decode and verify tokens take the dot products, which torch's GEMMs overtake from
    # MAX_EXACT_INT8_TOKENS tokens; a prompt run beside them takes the tiles and does not count
    if native.kernel_name() != "amx":
        pytest.skip("without AMX every int8 forward of 32+ tokens goes to torch (MAX_TOKENS_WITHOUT_AMX)")
    model = load_real_model(SMOL, "int8")
    module = _native(model)
    limit = native.MAX_EXACT_INT8_TOKENS
    cache = PagedKVCache(module.config, limit + 16, 16, model.kv_dtype)
    decode = [SequenceChunk((100 + i,), 0, (i,)) for i in range(limit)]
    prompt = SequenceChunk(tuple(range(100, 300)), 0, tuple(range(limit, limit + 13)))

    def runs_natively(chunks) -> bool:
        batch = build_forward_batch(chunks, 16, module.config)
        return module.native_stack.forward(module, batch, cache) is not None

    assert runs_natively(decode[:-1])
    assert not runs_natively(decode)
    assert runs_natively([*decode[:-1], prompt])
