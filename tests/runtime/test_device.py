"""Where models run: `--device` values, clear errors for a device that is not there, and (on a
machine with a CUDA GPU) models placed there computing what they compute on the CPU.

The CUDA tests skip, visibly, on machines without a GPU; the rest of the suite runs on CUDA there
by itself, since "auto" (every default) picks the GPU when torch sees one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.model.device import DeviceError, place_model, resolve_device
from polylane.runtime.model.quantize import QuantizedProjection, quantize_model
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip
from tests.runtime.test_spec_distribution import tiny_model

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch sees none here)")
SMOL = "smollm2-135m-instruct"


def test_auto_is_the_gpu_when_there_is_one_else_the_cpu():
    assert resolve_device("auto") == (torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu"))
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize(("name", "message"), [("tpu", "unknown device"), ("meta", "not supported")])
def test_a_device_polylane_cannot_run_on_is_refused(name, message):
    with pytest.raises(DeviceError, match=message):
        resolve_device(name)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match=r"sees no CUDA device.*--device cpu"):
        resolve_device("cuda")


@needs_cuda
def test_a_cuda_index_past_the_last_gpu_is_refused():
    with pytest.raises(DeviceError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", [["serve"], ["generate", SMOL, "hi"], ["bench", "single"]])
def test_the_cli_refuses_cuda_without_a_gpu_before_loading_anything(command, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "polylane.cli", *command, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "error: device 'cuda'" in done.stderr and "sees no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("out_features", [128, 48])  # the CPU packing's 64-row blocks, and another
def test_int4_codes_unpack_to_what_was_quantised(out_features):
    weight = torch.randn(out_features, 64, generator=torch.Generator().manual_seed(3))
    projection = QuantizedProjection(weight, None, 4)
    groups = weight.view(out_features, 2, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15.0
    expected = ((groups - low) / scale).round().clamp(0, 15).view(out_features, 64)
    assert torch.equal(projection.nibbles().float(), expected)
    start, stop = (64, 128) if out_features % 64 == 0 else (16, 48)  # the packing's row blocks
    assert torch.equal(projection.nibbles(start, stop).float(), expected[start:stop])


def test_placing_on_the_cpu_changes_nothing():
    model = tiny_model(5, "tiny").module
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert place_model(model, torch.device("cpu")) is model
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


# ---------------------------------------------------------------- on a CUDA GPU


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features", [128, 48])
def test_a_quantised_projection_on_cuda_multiplies_by_the_same_weight(bits, out_features):
    generator = torch.Generator().manual_seed(bits)
    weight = torch.randn(out_features, 96, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    projection = QuantizedProjection(weight, bias, bits)
    on_cpu = projection.dequantized()
    x = torch.randn(5, 96, generator=generator)
    expected = projection(x)
    projection.place(torch.device("cuda"))
    assert projection.qweight.is_cuda and projection.scales.is_cuda
    torch.testing.assert_close(projection.dequantized().cpu(), on_cpu, rtol=0, atol=1e-2 * on_cpu.abs().max())
    y = projection(x.cuda())
    assert y.is_cuda and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max())


@needs_cuda
@pytest.mark.parametrize("fmt", [None, "int4", "int8"])
def test_a_model_on_cuda_gives_the_logits_it_gives_on_the_cpu(fmt):
    cpu_model, cuda_model = tiny_model(7, "tiny"), tiny_model(7, "tiny")
    if fmt is not None:
        quantize_model(cpu_model.module, fmt)
        quantize_model(cuda_model.module, fmt)
    place_model(cuda_model.module, torch.device("cuda"))
    assert cuda_model.device.type == "cuda"
    prompt = (1, 5, 9, 2, 7, 3)
    rows = []
    for model in (cpu_model, cuda_model):
        kv = ModelKV(model, num_blocks=16, block_size=4, prefix_cache=False)
        assert kv.cache.keys[0].device.type == model.device.type
        sequence = kv.open(prompt)
        first = kv.forward([Extend(sequence, prompt)])[0]
        second = kv.forward([Extend(sequence, (4,))])[0]  # a decode step over the paged cache
        assert first.device.type == "cpu"  # logits come back to the host
        rows.append(torch.stack([first, second]))
    tolerance = 1e-4 if fmt is None else 5e-2
    torch.testing.assert_close(rows[1], rows[0], rtol=tolerance, atol=tolerance * rows[0].abs().max())


@needs_cuda
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_smollm2_on_cuda_decodes_what_it_decodes_on_the_cpu(dtype):
    from polylane.runtime.loading.loaded_model import load_model

    fetch_or_skip(SMOL)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        model = load_model(SMOL, dtype, quiet=True, device=device)
        assert model.device.type == device
        model.module.native_stack, model.kv_cache_dtype = None, None  # torch's path on both: its kernels
        prompt = tuple(model.tokenizer.render_chat([{"role": "user", "content": "Name three colours."}]))
        [output] = Generator(model, num_blocks=64).generate([GenerationRequest(prompt, params)])
        outputs[device] = output.token_ids
    agree = next((i for i, (a, b) in enumerate(zip(*outputs.values(), strict=True)) if a != b), 24)
    # fp32: the same numbers up to summation order; int4: the same codes, scales and zeros through
    # torch's CPU and CUDA kernels, which sum in other orders: a near tie may fork late, not early
    assert agree >= (24 if dtype == "fp32" else 8), f"{dtype}: CPU and CUDA fork at token {agree}: {outputs}"


@needs_cuda
def test_evicting_a_model_on_cuda_gives_its_device_memory_back():
    from polylane.runtime.loading.model_record import resolve_record
    from polylane.runtime.residency.manager import ResidencyManager

    fetch_or_skip(SMOL)
    manager = ResidencyManager(8 * 2**30, device="cuda")
    manager.register(resolve_record("m", SMOL, dtype="fp32", kv_tokens=256))
    before = torch.cuda.memory_allocated()
    with manager.acquire("m"):
        loaded = torch.cuda.memory_allocated()
    [info] = manager.snapshot()
    manager.evict("m")
    after = torch.cuda.memory_allocated()
    manager.close()
    assert loaded - before > 0.9 * info.bytes, "the model's bytes were not on the device"
    assert after - before < 0.05 * info.bytes, f"{(after - before) / 2**20:.0f} MiB still held after eviction"
