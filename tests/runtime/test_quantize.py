"""Quantised twins: int4 (grouped) and int8 (per row) weight-only projections reproduce their
weights within quantisation error, a quantised model stays close to its bf16 original, and its
bytes are what it holds.

torch packs int4 weights in a layout that depends on the CPU capability its kernels run at
(AVX512, AVX2, DEFAULT): every int4 test here also runs in a subprocess at each capability this
CPU allows (ATEN_CPU_CAPABILITY), so each layout is checked on every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polylane.runtime.model.int4_layout import Int4Layout, packing_layout
from polylane.runtime.model.quantize import QuantizedProjection, module_bytes, quantize_model
from tests.runtime.test_spec_distribution import tiny_model

REPOSITORY = Path(__file__).resolve().parents[2]
# torch's CPU capabilities, lowest first; a CPU runs its own and every one below it
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


@pytest.mark.parametrize(("bits", "tolerance"), [(4, 0.08), (8, 0.01)])
def test_quantized_projection_matches_its_weight(bits, tolerance):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    projection = QuantizedProjection(weight, bias, bits)
    error = (projection.dequantized() - weight).abs().max() / weight.abs().max()
    assert error < tolerance, f"int{bits}: relative max error {error:.3f}"
    x = torch.randn(3, 64, generator=generator)
    y = projection(x)
    reference = x @ weight.t() + bias
    assert y.dtype == torch.float32 and y.shape == (3, 96)
    relative = (y - reference).abs().max() / reference.abs().max()
    assert relative < 2 * tolerance, f"int{bits}: output relative error {relative:.3f}"


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible"):
        QuantizedProjection(torch.randn(8, 40), None, 4)
    with pytest.raises(ValueError, match="int4 and int8"):
        QuantizedProjection(torch.randn(8, 64), None, 3)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_model_stays_close_to_float32(fmt):
    model = tiny_model(3, "tiny").module
    hidden = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([1, 4, 2])
    reference_logits = model.output_logits(hidden)
    reference_embedding = model.embed(tokens)
    before = module_bytes(model)
    quantize_model(model, fmt)
    assert model.lm_head is not None  # tied embeddings: the output projection got its own copy
    logits = model.output_logits(hidden)
    assert logits.dtype == torch.float32 and model.embed(tokens).dtype == torch.float32
    assert (logits - reference_logits).abs().max() < 0.1 * reference_logits.abs().max()
    assert (model.embed(tokens) - reference_embedding).abs().max() < 0.01 * reference_embedding.abs().max()
    assert 0 < module_bytes(model) < before
    with pytest.raises(ValueError, match="unknown"):
        quantize_model(model, "int2")


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(64, 32), (960, 576), (3072, 576), (576, 1536), (96, 64)]
)
def test_int4_unpacking_reads_torchs_cpu_packing(out_features, in_features):
    """The bf16 weight unpacked from torch's packed int4 equals what torch's own kernel multiplies
    by (its product with the identity), element for element, and any whole blocks of rows unpack to
    those rows."""
    torch.manual_seed(out_features + in_features)
    projection = QuantizedProjection(torch.randn(out_features, in_features), None, 4)
    unpacked = projection.dequantized_bf16()
    assert unpacked.dtype == torch.bfloat16 and unpacked.shape == (out_features, in_features)
    torch.testing.assert_close(unpacked.float(), projection.dequantized(), rtol=0, atol=0)
    layout = projection.packing_layout
    if layout is not None and out_features > layout.block_rows:
        start, stop = layout.block_rows, out_features
        assert torch.equal(projection.dequantized_bf16(start, stop), unpacked[start:stop])


def test_int4_packing_layout_is_found_by_probing():
    """The probe recognises the packing of this process's torch (a layout, not None), names the
    capability torch runs at, and reads back codes packed by torch itself."""
    layout = packing_layout()
    assert layout is not None, "torch's int4 packing is not of the known kind here"
    assert layout.capability == torch.backends.cpu.get_cpu_capability()
    assert sorted(layout.row_at) == list(range(layout.block_rows))
    codes = torch.randint(0, 16, (4 * layout.block_rows, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(layout.unpack(packed, 96, 0, codes.shape[0]).int(), codes)


@pytest.mark.parametrize("row_at", [(0, 2, 1, 3), (2, 0, 3, 1), (0, 1, 2, 3)])
def test_a_layouts_row_order_is_read_back(row_at):
    """A block's row order is undone by a transpose where it is one (low/high nibble interleaving,
    rows in order) and by a gather otherwise: both give each (row, column) its packed value."""
    layout = Int4Layout("TEST", 4, row_at)
    rows, columns = 8, 3
    values = torch.arange(rows * columns).view(rows, columns)
    by_position = torch.empty(rows * columns, dtype=torch.int64)
    for block in range(rows // 4):
        for column in range(columns):
            for position, row in enumerate(row_at):
                by_position[block * 4 * columns + column * 4 + position] = values[block * 4 + row, column]
    assert layout.interleave == {(0, 2, 1, 3): 2, (2, 0, 3, 1): None, (0, 1, 2, 3): 1}[row_at]
    assert torch.equal(layout.arrange(by_position, rows, columns), values)


def _capabilities_here() -> list[str]:
    here = torch.backends.cpu.get_cpu_capability()
    return list(CAPABILITIES[: CAPABILITIES.index(here) + 1]) if here in CAPABILITIES else []


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_int4_tests_pass_at_every_capability_torch_packs_for(capability):
    """The int4 tests of this file and of test_device.py, rerun in a process whose torch runs at
    `capability` and so packs int4 weights in that capability's layout."""
    if capability not in _capabilities_here():
        here = torch.backends.cpu.get_cpu_capability()
        pytest.skip(f"this CPU cannot run torch's {capability} kernels (it runs at most {here})")
    files = ["tests/runtime/test_quantize.py", "tests/runtime/test_device.py"]
    selected = ["-k", "int4 and not capability"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *selected],
        cwd=REPOSITORY,
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"int4 tests at {capability}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    assert " passed" in done.stdout and "no tests ran" not in done.stdout


def test_int4_many_rows_go_through_the_dequantised_weight(monkeypatch):
    """From DEQUANTIZE_MIN_ROWS rows a projection multiplies by the unpacked bf16 weight; the
    result agrees with torch's int4 kernel to bf16 rounding of the output."""
    import polylane.runtime.model.quantize as quantize

    torch.manual_seed(0)
    projection = QuantizedProjection(torch.randn(192, 96), torch.randn(192), 4)
    x = torch.randn(quantize.DEQUANTIZE_MIN_ROWS, 96)
    calls = []
    unpack = QuantizedProjection.dequantized_bf16

    def counted(self, *rows):
        calls.append(rows)
        return unpack(self, *rows)

    monkeypatch.setattr(QuantizedProjection, "dequantized_bf16", counted)
    dense = projection(x)
    assert calls, "many rows did not take the dequantised path"
    kernel = (
        torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), projection.qweight, quantize.INT4_GROUP, projection.scales
        ).float()
        + projection.bias.float()
    )
    assert (dense - kernel).abs().max() <= 2**-7 * kernel.abs().max()
    calls.clear()
    projection(x[: quantize.DEQUANTIZE_MIN_ROWS - 1])
    assert not calls, "a few rows took the dequantised path"


def test_int8_many_rows_go_through_a_bf16_gemm_of_the_codes(monkeypatch):
    """From INT8_GEMM_MIN_ROWS rows an int8 projection multiplies by its codes in bf16 (exact) and
    scales each output after; the result agrees with torch's int8 kernel to bf16 rounding."""
    import polylane.runtime.model.quantize as quantize

    torch.manual_seed(0)
    projection = QuantizedProjection(torch.randn(192, 96), torch.randn(192), 8)
    x = torch.randn(quantize.INT8_GEMM_MIN_ROWS, 96)
    kernel_calls = []
    int8_kernel = torch.ops.aten._weight_int8pack_mm

    def counted(*args):
        kernel_calls.append(args[0].shape[0])
        return int8_kernel(*args)

    monkeypatch.setattr(quantize.torch.ops.aten, "_weight_int8pack_mm", counted)
    dense = projection(x)
    assert not kernel_calls, "many rows took torch's int8 kernel"
    kernel = int8_kernel(x.to(torch.bfloat16), projection.qweight, projection.scales).float()
    kernel = kernel + projection.bias.float()
    assert (dense - kernel).abs().max() <= 2**-7 * kernel.abs().max()
    projection(x[: quantize.INT8_GEMM_MIN_ROWS - 1])
    assert kernel_calls == [quantize.INT8_GEMM_MIN_ROWS - 1], "a few rows did not take the int8 kernel"
