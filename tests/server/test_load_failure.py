"""A model whose file cannot be loaded (valid header, NaN block scales: it fails at its first use,
not at start) on a live server next to a good one: a request to it gets 503 in OpenAI's error shape
naming the tensor, streamed or not (never a 200 and then an error event), with Retry-After; the
good model keeps serving, before and after."""

from __future__ import annotations

import numpy as np
import pytest

from polylane.runtime.gguf_file import GGUFFile
from polylane.server.config import ModelDecl
from tests.conftest import fetch_or_skip
from tests.server.conftest import SMOL, assert_error, start_server

BROKEN = "nan-scales"
TENSOR = "blk.4.ffn_up.weight"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    source = fetch_or_skip(SMOL).path
    data = bytearray(source.read_bytes())
    start = GGUFFile(source).tensors[TENSOR].offset
    data[start : start + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    broken = tmp_path_factory.mktemp("broken") / "nan-scales.gguf"
    broken.write_bytes(bytes(data))
    server = start_server((SMOL,), dtype="auto", more=(ModelDecl(BROKEN, str(broken), dtype="auto"),))
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
