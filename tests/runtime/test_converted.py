"""The converted-weights cache: a GGUF model loaded from its safetensors conversion is bit-identical
to one dequantised from the GGUF file, and a corrupt conversion is discarded, never used."""

from __future__ import annotations

import pytest
import torch

from polylane.runtime import converted
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.loaded_model import load_model
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip


def _greedy(model) -> list[torch.Tensor]:
    ids = tuple(model.tokenizer.encode("Paged attention keeps the cache in blocks so that"))
    request = GenerationRequest(ids, SamplingParams(max_tokens=6), stop_at_eos=False)
    [output] = Generator(model, num_blocks=8).generate([request], record_logits=True)
    return output.logits


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_converted_load_is_bit_identical(tmp_path, monkeypatch, dtype):
    fetch_or_skip("smollm2-135m-instruct")
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path)
    direct = load_model("smollm2-135m-instruct", dtype, quiet=True, convert_cache=False)
    first = load_model("smollm2-135m-instruct", dtype, quiet=True)  # converts and writes
    [entry] = list(tmp_path.glob("*.safetensors"))
    assert dtype in entry.name
    second = load_model("smollm2-135m-instruct", dtype, quiet=True)  # reads the conversion
    want = dict(direct.module.named_parameters())
    for name, parameter in second.module.named_parameters():
        assert torch.equal(parameter, want[name]), f"{name} differs after conversion"
    for label, model in (("first", first), ("second", second)):
        for step, (a, b) in enumerate(zip(_greedy(model), _greedy(direct), strict=True)):
            assert torch.equal(a, b), f"{label} load, step {step}: max-abs {(a - b).abs().max():.2e}"


def test_corrupt_conversion_is_discarded(tmp_path, monkeypatch):
    source = fetch_or_skip("smollm2-135m-instruct")
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path)
    entry = converted.converted_path(source.path, torch.bfloat16)
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    model = load_model("smollm2-135m-instruct", "bf16", quiet=True)
    assert model.weight_bytes > 0
    assert entry.is_file() and entry.stat().st_size > 1_000_000, "the corrupt entry was not rewritten"
