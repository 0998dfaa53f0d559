"""Models that cannot be served, on a live server next to a good one. A file with a valid header and
NaN block scales fails at its first use: a request to it gets 503 in OpenAI's error shape naming the
tensor, streamed or not (never a 200 and then an error event), with Retry-After. A file whose header
is corrupt fails at start: the server starts without it (unless strict) and a request to it gets
503 saying why. The good model keeps serving throughout."""

from __future__ import annotations

import numpy as np
import pytest

from polylane.runtime.loading.gguf_file import GGUFFile
from polylane.server.app import build_state
from polylane.server.config import ModelDecl, ServerConfig
from tests.conftest import fetch_or_skip
from tests.server.conftest import SMOL, assert_error, start_server

BROKEN = "nan-scales"
TENSOR = "blk.4.ffn_up.weight"
BAD_HEADER = "bad-header"


def _bad_header(folder) -> ModelDecl:
    path = folder / "bad-header.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return ModelDecl(BAD_HEADER, str(path), dtype="auto")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    source = fetch_or_skip(SMOL).path
    data = bytearray(source.read_bytes())
    start = GGUFFile(source).tensors[TENSOR].offset
    data[start : start + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    broken = tmp_path_factory.mktemp("broken") / "nan-scales.gguf"
    broken.write_bytes(bytes(data))
    more = (ModelDecl(BROKEN, str(broken), dtype="auto"), _bad_header(broken.parent))
    server = start_server((SMOL,), dtype="auto", more=more)
    try:
        yield server
    finally:
        server.stop()


def _answer(http, stream: bool):
    body = {"model": SMOL, "prompt": "The capital of France is", "max_tokens": 4, "stream": stream}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_model_that_cannot_load_is_a_503_before_any_stream_begins(live, route, stream):
    body = {"model": BROKEN, "max_tokens": 4, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"}
    with live.client() as http:
        _answer(http, stream)
        response = http.post(route, json=body)
        error = assert_error(response, 503, code="model_unavailable")
        assert TENSOR in error["message"] and "NaN" in error["message"], error
        assert response.headers.get("retry-after") == "1", dict(response.headers)
        assert "text/event-stream" not in response.headers.get("content-type", ""), dict(response.headers)
        _answer(http, stream)


def test_a_model_whose_header_is_corrupt_is_left_out_at_start_and_says_why(live):
    assert live.state.unavailable.keys() == {BAD_HEADER}, live.state.unavailable
    with live.client() as http:
        response = http.post("/v1/completions", json={"model": BAD_HEADER, "prompt": "Hi", "max_tokens": 2})
        error = assert_error(response, 503, code="model_unavailable")
        assert "failed at start" in error["message"] and "GGUF" in error["message"], error
        _answer(http, False)


def test_strict_refuses_to_start_with_a_model_it_cannot_serve(tmp_path):
    fetch_or_skip(SMOL)
    models = (ModelDecl(SMOL, SMOL, dtype="auto"), _bad_header(tmp_path))
    with pytest.raises(Exception, match=r"bad-header\.gguf"):
        build_state(ServerConfig(models=models, budget_bytes=2**30, strict=True), quiet=True)
