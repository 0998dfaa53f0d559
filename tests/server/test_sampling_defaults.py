"""Sampling fields a request leaves unset take the model's defaults (its file's settings, serve's
flags over them, else llama-server's temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); a field the
request sets always wins, and `temperature: 0` stays greedy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFWriter

from polylane.runtime.sampling.defaults import read_sampling_defaults
from polylane.server.config import ConfigError, sampling_overrides
from polylane.types import SamplingDefaults
from tests.server.conftest import SMOL

LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
PROMPT = "Write a short poem about the sea."


def _completion(http, **fields) -> str:
    body = {"model": SMOL, "prompt": PROMPT, "max_tokens": 24, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_unset_fields_sample_with_the_documented_defaults(shared_server):
    with shared_server.client() as http:
        for seed in (1, 2, 3):
            assert _completion(http, seed=seed) == _completion(http, seed=seed, **LLAMA_SERVER)
        outputs = {_completion(http, seed=seed) for seed in range(4)}
        assert len(outputs) > 1, "unset temperature sampled nothing: every seed gave the same text"
        greedy = _completion(http, temperature=0)
        assert _completion(http, temperature=0, seed=5) == greedy, "explicit temperature 0 is greedy"


def test_serve_flags_replace_the_defaults_and_requests_still_win(shared_server):
    state = shared_server.state
    with shared_server.client() as http:
        greedy = _completion(http, temperature=0)
        state.sampling = {"temperature": 0.0}
        try:
            assert state.sampling_defaults(SMOL).source == "serve's flags"
            assert _completion(http, seed=7) == greedy, "serve --temperature 0 made unset requests greedy"
            hot = {_completion(http, seed=seed, temperature=1.5) for seed in range(4)}
            assert len(hot) > 1, "a request's own temperature did not win over the flag"
        finally:
            state.sampling = {}


def test_a_gguf_header_and_a_generation_config_give_the_models_own(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    own = read_sampling_defaults(path, "gguf")
    assert (own.temperature, own.top_k, own.top_p, own.min_p) == pytest.approx((0.6, 20, 0.95, 0.05))
    assert "tiny.gguf's header" in own.source

    folder = tmp_path / "hf"
    folder.mkdir()
    assert read_sampling_defaults(folder, "hf") == SamplingDefaults()
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_p": 0.8}))
    greedy = read_sampling_defaults(folder, "hf")
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 0.8, 40)


def test_serve_sampling_settings_are_checked_like_a_requests():
    assert sampling_overrides({"temperature": 0.2, "top_k": None}, {"top_k": 10}) == {
        "temperature": 0.2,
        "top_k": 10,
    }
    for flags, file_data in (({"top_p": 0.0}, {}), ({}, {"top_k": 1.5}), ({}, {"temperature": "hot"})):
        with pytest.raises(ConfigError):
            sampling_overrides(flags, file_data)
