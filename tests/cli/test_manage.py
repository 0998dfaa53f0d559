"""`polylane pull`, `list` and `ps` (Ollama's verbs), `generate` without a model name, `chat`, and
the command line's readings of NAME=SOURCE, --kv-tokens and sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polylane import catalog
from polylane.cli import main
from polylane.runtime.loading import converted
from polylane.server.config import ConfigError, model_decl
from polylane.sizes import parse_bytes
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"


def test_list_shows_the_catalogue_what_is_cached_and_the_disk_it_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path))
    entry = catalog.CATALOG[SMOL]
    fetched = catalog.cached_path(entry)
    fetched.parent.mkdir(parents=True)
    fetched.write_bytes(bytes(3_000_000))
    copy = converted.converted_dir() / f"x-{entry.sha256[:32]}-fp32-v1.safetensors"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(bytes(2_000_000))
    assert main(["list"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line}
    assert set(catalog.CATALOG) <= set(rows)
    assert rows[SMOL][6] == "yes" and rows[SMOL][7:9] == ["2", "MB"], rows[SMOL]  # cached, its copy
    assert all(rows[name][6] == "no" for name in catalog.CATALOG if name != SMOL)
    assert rows["cache:"][2:4] == ["5", "MB"], rows["cache:"]  # the 3 MB file (as written) and the copy


def test_pull_of_a_cached_model_says_so_and_an_unknown_name_fetches_nothing(capsys):
    fetch_or_skip(SMOL)
    assert main(["pull", SMOL]) == 0
    assert capsys.readouterr().out.startswith(f"{SMOL}: already cached")
    assert main(["pull", SMOL, "no-such-model"]) == 2
    assert "'no-such-model' is not in the catalogue" in capsys.readouterr().err


def test_ps_lists_a_running_servers_models_and_says_when_none_answers(capsys):
    from tests.server.conftest import _free_port, start_server

    live = start_server((SMOL,), kv_tokens=256)
    try:
        with live.client() as http:
            body = {"model": SMOL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        assert main(["ps", "--url", live.base_url]) == 0
    finally:
        live.stop()
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["name", "state", "bytes", "dtype", "pinned", "requests", "idle"]
    fields = row.split()
    assert fields[:2] == [SMOL, "resident"] and fields[-3] == "0" and fields[-1] == "s", row  # idle seconds
    assert main(["ps", "--url", f"http://127.0.0.1:{_free_port()}"]) == 1
    assert "no server answers at" in capsys.readouterr().err


def test_generate_without_a_model_uses_the_default_and_chat_answers_until_bye(tmp_path):
    fetch_or_skip(SMOL)
    run = [sys.executable, "-m", "polylane.cli"]
    done = subprocess.run(
        [*run, "generate", "The capital of France is", "--max-tokens", "3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"[{SMOL} auto]" in done.stderr and "3 tokens" in done.stderr
    chat = subprocess.run(
        [*run, "chat", "--max-tokens", "4", "--temperature", "0"],
        input="Say hello.\nAnd again.\n/bye\nnever read\n",
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr[-2000:]
    replies = [line for line in chat.stdout.splitlines() if line.strip()]
    assert len(replies) == 2, chat.stdout


def test_serve_reads_name_equals_source_and_kv_tokens():
    decl = model_decl("coder=qwen2.5-coder-0.5b-instruct", set(), 1024)
    assert (decl.name, decl.source, decl.kv_tokens) == ("coder", "qwen2.5-coder-0.5b-instruct", 1024)
    assert model_decl("coder=qwen2.5-coder-0.5b-instruct", {"coder"}).pinned
    assert model_decl(SMOL, set()).name == SMOL
    with pytest.raises(ConfigError, match="NAME=SOURCE"):
        model_decl("coder=", set())


@pytest.mark.parametrize(
    "text, expected",
    [("6G", 6 * 10**9), ("6GB", 6 * 10**9), ("6GiB", 6 * 2**30), ("6gi", 6 * 2**30), ("6000MB", 6 * 10**9),
     ("1.5g", 1_500_000_000), ("4000000000", 4 * 10**9), ("512KiB", 512 * 1024), (7, 7)],
)  # fmt: skip
def test_every_size_reads_as_people_write_it(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["6X", "GiB", "-1", "6iB", "lots", True, -5])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError):
        parse_bytes(text)
