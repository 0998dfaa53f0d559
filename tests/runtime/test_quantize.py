"""Quantised twins: int4 (grouped) and int8 (per row) weight-only projections reproduce their
weights within quantisation error, a quantised model stays close to its bf16 original, and its
bytes are what it holds."""

from __future__ import annotations

import pytest
import torch

from polylane.runtime.quantize import QuantizedProjection, module_bytes, quantize_model
from tests.runtime.test_spec_distribution import tiny_model


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
