"""GGUF block formats computed in place (blocks.c through `runtime.model.block_weights`).

Every format dequantises to exactly what the `gguf` package (ggml's reference code, ported) gives
for the same bytes; products agree with a float64 product of those values; each output row is the
same bits whatever the batch it is computed in and the thread count. The blocks are random bytes
with sane scales, so every code (and every high bit) occurs.

The kernels are compiled per instruction set: each test here also runs in a subprocess whose
kernels are built for AVX2 (`POLYLANE_NATIVE_MARCH=haswell`, where the CPU runs AVX2) and for the
portable C path with no intrinsics (`POLYLANE_NATIVE_PORTABLE=1`, what ARM compiles), so every
path the machine can run is checked on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from polylane.runtime.model.block_weights import (
    BLOCK_FORMATS,
    BlockEmbedding,
    BlockProjection,
    BlockTensor,
    isa_name,
    unsupported,
)

REPOSITORY = Path(__file__).resolve().parents[2]
# where each format keeps its float16 scale (and min) in a block
HALF_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
    "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_tensor(name: str, rows: int, columns: int, seed: int = 0) -> tuple[BlockTensor, np.ndarray]:
    """A (rows, columns) tensor of format `name` from random bytes, and its values by `gguf`."""
    import gguf

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[name]
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, columns)).astype(np.float32)
        if name == "F16":
            values = values.astype(np.float16)
        elif name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        raw = values.view(np.uint8).reshape(rows, -1)
    else:
        blocks = rng.integers(0, 256, size=(rows, columns // block_elements, block_bytes), dtype=np.uint8)
        for offset in HALF_OFFSETS[name]:
            scales = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
            blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
        raw = blocks.reshape(rows, -1)
    reference = gguf.quants.dequantize(raw, kind).astype(np.float32).reshape(rows, columns)
    return BlockTensor(f"test.{name}", int(kind), rows, columns, raw), reference


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_each_format_dequantises_as_ggml_does(name):
    tensor, reference = random_tensor(name, 24, 512)
    rows = BlockEmbedding(tensor)(torch.arange(24)).numpy()
    assert np.array_equal(rows, reference), f"{name}: max diff {np.abs(rows - reference).max()}"


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_each_format_multiplies_like_its_values(name):
    tensor, reference = random_tensor(name, 36, 768, seed=1)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(2))
    projection = BlockProjection([tensor], [None])
    together = projection(x)
    y = together.double().numpy()
    expected = x.double().numpy() @ reference.astype(np.float64).T
    relative = np.abs(y - expected).max() / np.abs(expected).max()
    assert relative < 1e-5, f"{name}: relative error {relative:.2e}"
    # one row alone (a decode step: dequantised in registers) gives the bits of the batched rows
    alone = torch.cat([projection(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(alone, together), f"{name}: a row alone differs from the same row in a batch"


def rounded_to_8_bits(x: np.ndarray) -> np.ndarray:
    """x as the 8-bit activation kernels see it: per group of 16, codes round(x·127/max|x|) times
    the scale max|x|/127 (float32 arithmetic, as in blocks_q8.c)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 16)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = amax / np.float32(127)
    inverse = (np.float32(127) / np.where(amax > 0, amax, np.float32(1))) * (amax > 0)
    codes = np.rint(blocks * inverse.astype(np.float32))
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_each_format_with_8_bit_activations_multiplies_like_its_values(name):
    """Integer dot products of the file's codes with 8-bit activations equal the float64 product of
    the file's values with the rounded activations (float formats keep float32 activations)."""
    columns = 768 if name.endswith("_K") else 800  # 800: a last half step of 32 columns
    tensor, reference = random_tensor(name, 36, columns, seed=7)
    scales = torch.linspace(0.01, 30, columns)
    x = torch.randn(5, columns, generator=torch.Generator().manual_seed(8)) * scales
    y = BlockProjection([tensor], [None], activation_bits=8)(x).double().numpy()
    rounded = x.double().numpy() if name in ("F32", "F16", "BF16") else rounded_to_8_bits(x.numpy())
    expected = rounded @ reference.astype(np.float64).T
    relative = np.abs(y - expected).max() / np.abs(expected).max()
    assert relative < 1e-5, f"{name}: relative error {relative:.2e}"


def test_activation_bits_other_than_32_or_8_are_refused():
    tensor, _ = random_tensor("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="activation bits"):
        BlockProjection([tensor], [None], activation_bits=4)


# 8,192 columns: prompts of 16+ rows code them in pieces and take 300 rows in two activation
# blocks (blocks_q8.c's MAX_CHUNK, CODED_BLOCK_BYTES), decode rows whole;
# 800: the last span of 256 (128 on AVX2) columns is short. 18 rows each: some tiles of four rows
# mix two formats (Q5_1 has no decode kernel of its own, blocks_q8_decode.c).
@pytest.mark.parametrize(
    ("columns", "names"),
    [(8192, ("Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0")), (800, ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))],
)
@pytest.mark.parametrize("bits", [32, 8])
def test_each_row_is_the_same_bits_whatever_its_batch_and_threads(bits, columns, names):
    """Decode (1 row), verify or a decode batch (a few: 5, and 19 = three passes of blocks_q8.c's
    DECODE_ROWS) and prompt (many, several activation blocks) rows of the same input give identical
    outputs, at 1 and 2 threads: the contract speculation relies on."""
    parts = [random_tensor(name, 18, columns, seed=i)[0] for i, name in enumerate(names)]
    projection = BlockProjection(parts, [None] * len(parts), activation_bits=bits)
    x = torch.randn(300, columns, generator=torch.Generator().manual_seed(3))
    together = projection(x)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start, size in ((0, 1), (7, 5), (31, 1), (40, 19), (64, 200)):
                alone = projection(x[start : start + size])
                assert torch.equal(alone, together[start : start + size]), (count, start, size)
    finally:
        torch.set_num_threads(threads)


def test_fused_segments_row_maps_and_bias():
    """A fused projection is its parts' rows in order, each read through its row map, plus bias."""
    first, first_values = random_tensor("Q5_0", 8, 256, seed=4)
    second, second_values = random_tensor("Q6_K", 12, 256, seed=5)
    order = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    projection = BlockProjection([first, second], [order, None], bias=True)
    projection.bias.copy_(torch.arange(20, dtype=torch.float32))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    weight = np.concatenate([first_values[order], second_values])
    expected = x.double().numpy() @ weight.astype(np.float64).T + np.arange(20)
    assert np.allclose(projection(x).numpy(), expected, rtol=1e-5, atol=1e-4)


def test_a_format_without_a_kernel_is_named():
    import gguf

    kind = gguf.GGMLQuantizationType.Q2_K
    tensor = BlockTensor("blk.3.ffn_down.weight", int(kind), 4, 256, np.zeros((4, 84), dtype=np.uint8))
    problem = unsupported(tensor)
    assert problem is not None and "blk.3.ffn_down.weight" in problem and "Q2_K" in problem
    odd, _ = random_tensor("F32", 4, 48)
    assert "not a multiple of 32" in str(unsupported(odd))


def test_token_ids_outside_the_table_are_refused():
    tensor, _ = random_tensor("Q8_0", 16, 64)
    with pytest.raises(IndexError, match=r"\[0, 16\)"):
        BlockEmbedding(tensor)(torch.tensor([3, 16]))


def _avx2_available() -> bool:
    return "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False


BUILDS = {
    "avx2": {"POLYLANE_NATIVE_MARCH": "haswell"},
    "portable C": {"POLYLANE_NATIVE_PORTABLE": "1"},
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_instruction_set_path_passes_these_tests(build):
    """This file's tests, rerun in a process whose block kernels are built for `build`."""
    if build == "avx2" and not _avx2_available():
        pytest.skip("this CPU has no AVX2")
    if build == isa_name():
        pytest.skip(f"the {build} kernels are this process's own (tested above)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("POLYLANE_NATIVE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not instruction_set",
        ],
        cwd=REPOSITORY,
        env={**env, **BUILDS[build], "POLYLANE_EXPECT_BLOCK_ISA": build},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{build}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
    assert " passed" in done.stdout and "no tests ran" not in done.stdout


def test_the_kernels_are_built_for_the_instruction_set_asked_for():
    expected = os.environ.get("POLYLANE_EXPECT_BLOCK_ISA")
    if expected is None:
        pytest.skip("runs in the per-instruction-set subprocesses")
    assert isa_name() == expected
