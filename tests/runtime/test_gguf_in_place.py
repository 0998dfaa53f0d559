"""dtype auto on the real catalogue files: the file's own blocks, used in place, close to the file.

For each model, the logits at every position of a prompt of 200+ tokens agree with an fp32 forward
of the same file's weights dequantised by the `gguf` package (our fp32 load): top-1 agreement and
mean-abs difference are printed and recorded, for dtype auto (8-bit activations: within the
tolerance below, which llama.cpp's own logits on the same file do not meet — bench/file_fidelity.py)
and auto-fp32 (float32 activations: float32 noise). The model costs its file's tensor bytes
(nothing converted, nothing cached on disk), and a verify pass gives the decode steps' tokens and
logits. The native stack runs the layers between the block products on every build; the AVX2 and
portable C builds rerun the verify, closeness and native-stack tests in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.loader import estimate_weight_bytes
from polylane.runtime.model.block_weights import isa_name as block_isa_name
from polylane.runtime.model.compute_paths import stack_unavailable_reason
from tests.conftest import fetch_or_skip

TEXT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 23} stones."
    for i in range(30)
)
POSITIONS = 240
MODELS = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    "qwen2.5-coder-0.5b-instruct",
    pytest.param("qwen2.5-coder-1.5b-instruct", marks=pytest.mark.slow),
]


def _all_logits(model, ids: tuple[int, ...]) -> torch.Tensor:
    kv = ModelKV(model, num_blocks=-(-len(ids) // 16) + 2, block_size=16, prefix_cache=False)
    sequence = kv.open(ids)
    logits = kv.forward([Extend(sequence, ids, logits="all")])
    kv.close(sequence, cache=False)
    return torch.stack(list(logits)) if isinstance(logits, list) else logits


# dtype → (least top-1 agreement, largest mean-abs difference) against the fp32 forward
CLOSENESS = {"auto": (0.98, 0.16), "auto-fp32": (0.99, 1e-4)}
_REFERENCE: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("dtype", list(CLOSENESS))
@pytest.mark.parametrize("name", MODELS)
def test_logits_stay_close_to_the_dequantised_file(load_real_model, name, dtype, record_property):
    fetch_or_skip(name)
    ours = load_real_model(name, dtype)
    ids = tuple(ours.tokenizer.encode(TEXT))[:POSITIONS]
    assert len(ids) >= 200
    if name not in _REFERENCE:
        _REFERENCE[name] = _all_logits(load_real_model(name, "fp32"), ids)
    got, expected = _all_logits(ours, ids), _REFERENCE[name]
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    mean_abs = (got - expected).abs().mean().item()
    record_property("top1_agreement", top1)
    record_property("mean_abs", mean_abs)
    where = f"{name} {dtype} ({ours.compute_path}) vs fp32 over {len(ids)} positions"
    print(f"{where}: top-1 {top1:.4f}, mean-abs {mean_abs:.2e}")
    least_top1, most_mean_abs = CLOSENESS[dtype]
    assert top1 >= least_top1 and mean_abs < most_mean_abs, (
        f"{where}: top-1 {top1:.4f}, mean-abs {mean_abs:.2e}"
    )


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_the_model_costs_its_files_bytes_and_nothing_is_converted(
    load_real_model, name, tmp_path, monkeypatch
):
    source = fetch_or_skip(name)
    monkeypatch.setenv("POLYLANE_CACHE_DIR", str(tmp_path))  # a conversion would land here
    from polylane.runtime.loading.loaded_model import load_model

    model = load_model(str(source.path), "auto", quiet=True)
    file_bytes = estimate_weight_bytes(source.path, "gguf", "auto")
    assert model.weight_bytes <= 1.05 * file_bytes, (model.weight_bytes, file_bytes)
    assert "read in place" in model.compute_path
    assert not list(tmp_path.rglob("*.safetensors"))


@pytest.mark.parametrize("dtype", list(CLOSENESS))
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_verify_pass_equals_the_decode_steps(load_real_model, name, dtype):
    """Same greedy tokens and, where the native stack runs the layers between the block products,
    the same logits bit for bit (its every token's arithmetic is its own; the block products are
    the same bits whatever the batch, test_block_weights.py); where torch runs them, within float32
    noise (its attention is not bit-exact across batch shapes, as on the fp32 path, test_verify.py)."""
    model = load_real_model(name, dtype)
    prompt = tuple(model.tokenizer.encode(TEXT))[:40]
    kv = ModelKV(model, num_blocks=16, block_size=8, prefix_cache=False)
    sequence = kv.open(prompt)
    logits = kv.forward([Extend(sequence, prompt)])[0]
    tokens, sequential = [], []
    for _ in range(6):
        tokens.append(int(logits.argmax()))
        logits = kv.forward([Extend(sequence, (tokens[-1],))])[0]
        sequential.append(logits)
    kv.rollback(sequence, len(prompt))
    verified = kv.forward([Extend(sequence, tuple(tokens), logits="all")])
    assert [int(row.argmax()) for row in verified] == [*tokens[1:], int(sequential[-1].argmax())]
    max_abs = max((a - b).abs().max().item() for a, b in zip(verified, sequential, strict=True))
    bound = 0.0 if model.module.native_stack is not None else 1e-4
    assert max_abs <= bound, f"{name} ({model.compute_path}): verify against decode max-abs {max_abs:.2e}"
    kv.close(sequence)


def test_the_native_stack_runs_the_files_blocks_wherever_it_builds(load_real_model):
    """On every build (AVX-512, AVX2, portable C) the layers between the block products are C too."""
    if (reason := stack_unavailable_reason()) is not None:
        pytest.skip(reason)
    model = load_real_model("smollm2-135m-instruct", "auto")
    assert model.module.native_stack is not None
    assert "the native stack between" in model.compute_path, model.compute_path


BUILDS = {"avx2": {"POLYLANE_NATIVE_MARCH": "haswell"}, "portable C": {"POLYLANE_NATIVE_PORTABLE": "1"}}
# what each build reruns: the native stack runs there, a verify pass equals the decode steps, and
# (AVX2, whose layer arithmetic is the portable build's, stack_portable.c) Gemma's sliding layers and
# SmolLM2's closeness to the file; the portable build's block kernels are test_block_weights.py's
RERUN = {
    "avx2": "native_stack_runs or verify_pass or (close_to and smollm2 and not fp32)",  # (fp32 K/V too)
    "portable C": "native_stack_runs or (verify_pass and smollm2 and not fp32)",
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_instruction_set_path_runs_the_file_natively(build):
    """This file's tests named in RERUN[build], in a process whose kernels are built for `build` (the
    layers between the block products in plain C there, decoder.c stack_portable.c)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if build == "avx2" and " avx2 " not in flags:
        pytest.skip("this CPU has no AVX2")
    if build == block_isa_name():
        pytest.skip(f"the {build} kernels are this process's own (tested above)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("POLYLANE_NATIVE")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", RERUN[build]],
        cwd=Path(__file__).resolve().parents[2],
        env={**env, **BUILDS[build]},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{build}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
