"""Loader failures are clear: a `LoadError` that names the file and the problem, with no chain.

A broken model file must fail that model with one readable line (DESIGN §3), not a wall of
chained tracebacks from deep inside the `gguf` or `safetensors` packages. Each case here writes a
broken file under tmp_path: a truncated copy of the real SmolLM2 GGUF, a bad magic, a missing
path, an unknown architecture, a Hugging Face folder missing a tensor or of an unsupported type.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from polylane import catalog
from polylane.runtime.loading.loader import LoadError, load_gguf, load_hf_folder

HEADER_CUT_BYTES = 1_000
DROPPED_TENSOR = "model.layers.1.mlp.down_proj.weight"
DROPPED_FUSED_NAME = "layers.1.mlp.down_proj.weight"


def _assert_short_traceback(error: BaseException) -> None:
    """The error stands alone: raised `from None` or with no exception chained to it."""
    shown = "".join(traceback.format_exception(error))
    assert error.__cause__ is None, f"LoadError has a cause chained: {error.__cause__!r}"
    assert error.__context__ is None or error.__suppress_context__, (
        f"LoadError shows its context: {error.__context__!r}"
    )
    assert shown.count("Traceback (most recent call last)") == 1, (
        f"{shown.count('Traceback')} tracebacks printed:\n{shown}"
    )
    assert "During handling" not in shown and "direct cause" not in shown, shown


def _problem(error: BaseException, path: Path) -> str:
    """The message without the path, which must be in it (tmp_path names hold test names)."""
    message = str(error)
    assert str(path) in message, f"message does not name {path}: {message}"
    return message.replace(str(path), "<path>")


def _load_gguf_error(path: Path) -> str:
    """Load `path`, expect a short LoadError naming it; return the rest of its message."""
    with pytest.raises(LoadError) as caught:
        load_gguf(path)
    _assert_short_traceback(caught.value)
    return _problem(caught.value, path)


@pytest.fixture(scope="module")
def smollm2_bytes() -> bytes:
    try:
        source = catalog.resolve("smollm2-135m-instruct", quiet=True)
    except catalog.FetchError as error:
        pytest.skip(f"SmolLM2 GGUF is not cached and cannot be fetched here: {error}")
    return source.path.read_bytes()


# ---------------------------------------------------------------- GGUF files


def test_truncated_tensor_data_says_truncated(smollm2_bytes: bytes, tmp_path: Path) -> None:
    cut = int(len(smollm2_bytes) * 0.6)
    path = tmp_path / "smollm2-60pct.gguf"
    path.write_bytes(smollm2_bytes[:cut])
    error = _load_gguf_error(path)
    assert "truncated" in error.lower(), f"cut at {cut:,} of {len(smollm2_bytes):,}: {error}"
    assert f"{cut:,}" in error, f"message does not give the file size {cut:,}: {error}"


def _with_nan(smollm2_bytes: bytes, path: Path, tensor: str, byte: int) -> Path:
    """A copy of SmolLM2's file with the float at `byte` of `tensor`'s data set to NaN (a float32
    in an F32 tensor, else a float16: a block's scale)."""
    from polylane.runtime.loading.gguf_file import GGUFFile

    source = catalog.resolve("smollm2-135m-instruct", quiet=True).path
    info = GGUFFile(source).tensors[tensor]
    nan = np.array([np.nan], dtype=np.float32 if info.type_id == 0 else np.float16).tobytes()
    data = bytearray(smollm2_bytes)
    data[info.offset + byte : info.offset + byte + len(nan)] = nan
    path.write_bytes(bytes(data))
    return path


# (tensor, byte of it set to NaN, what the message calls it): a Q4_1 block's d and m, a Q8_0
# block's d (the embedding, also the output matrix), an F32 norm's values
NAN_CASES = [
    ("blk.3.ffn_down.weight", 20 * 7, "block scales"),
    ("blk.5.attn_q.weight", 20 * 3 + 2, "block scales"),
    ("token_embd.weight", 34 * 100, "block scales"),
    ("blk.2.attn_norm.weight", 4 * 10, "values"),
]


# every case in place (dtype auto); a block scale and a float value dequantised (fp32)
LOADS = [(*case, "auto") for case in NAN_CASES] + [(*NAN_CASES[0], "fp32"), (*NAN_CASES[3], "fp32")]


@pytest.mark.parametrize(("tensor", "byte", "kind", "dtype"), LOADS)
def test_a_nan_in_the_file_fails_its_load_naming_the_tensor(
    smollm2_bytes: bytes, tmp_path: Path, tensor: str, byte: int, kind: str, dtype: str
) -> None:
    from polylane.runtime.loading.gguf_in_place import load_gguf_in_place

    path = _with_nan(smollm2_bytes, tmp_path / "nan.gguf", tensor, byte)
    with pytest.raises(LoadError) as caught:
        load_gguf_in_place(path) if dtype == "auto" else load_gguf(path, dtype)
    _assert_short_traceback(caught.value)
    message = _problem(caught.value, path)
    assert f"tensor {tensor!r} has 1 NaN or infinite {kind}" in message, message
    assert "corrupt" in message, message


def test_the_nan_tests_change_bytes_the_model_reads(smollm2_bytes: bytes, tmp_path: Path) -> None:
    # The control: the same bytes made a finite float16 load, and change what the model computes.
    from polylane.runtime.loading.gguf_file import GGUFFile

    source = catalog.resolve("smollm2-135m-instruct", quiet=True).path
    intact = GGUFFile(source)
    for tensor, byte, _ in NAN_CASES:
        info = intact.tensors[tensor]
        assert byte + 4 <= info.num_bytes, f"{tensor}: byte {byte} is outside its data"
        assert intact.nonfinite_count(tensor) == 0, f"{tensor} is not finite in the intact file"
        changed = GGUFFile(_with_nan(smollm2_bytes, tmp_path / f"{tensor}.gguf", tensor, byte))
        assert changed.nonfinite_count(tensor) == 1, f"{tensor}: the NaN at byte {byte} is not a scale"
        assert not np.isfinite(changed.read(tensor)).all(), f"{tensor}: dequantised values stay finite"


def test_header_cut_is_a_clear_load_error(smollm2_bytes: bytes, tmp_path: Path) -> None:
    path = tmp_path / "smollm2-header.gguf"
    path.write_bytes(smollm2_bytes[:HEADER_CUT_BYTES])
    error = _load_gguf_error(path)
    assert "not a valid GGUF file" in error, f"cut at {HEADER_CUT_BYTES}: {error}"


@pytest.mark.parametrize("cut", [HEADER_CUT_BYTES, 100])
def test_header_cut_says_truncated(smollm2_bytes: bytes, tmp_path: Path, cut: int) -> None:
    path = tmp_path / f"smollm2-{cut}.gguf"
    path.write_bytes(smollm2_bytes[:cut])
    error = _load_gguf_error(path)
    assert "truncated" in error.lower(), f"cut at {cut} bytes: {error}"


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad-magic.gguf"
    path.write_bytes(b"GGUX" + bytes(range(256)) * 4)
    error = _load_gguf_error(path)
    assert "magic" in error, f"{error}"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "model.gguf"
    error = _load_gguf_error(path)
    assert "not found" in error, f"{error}"


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba9.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba9")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _load_gguf_error(path)
    assert "mamba9" in message, f"message does not name the architecture: {message}"
    for supported in ("llama", "qwen2", "gemma3"):
        assert supported in message, f"message does not list {supported!r}: {message}"


# ---------------------------------------------------------------- Hugging Face folders


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_tiny_llama_folder_loads(tiny_llama_folder: Path) -> None:
    # The control for the next test: the intact folder loads.
    weights = load_hf_folder(tiny_llama_folder, "fp32")
    assert weights.config.num_layers == 2, f"{weights.config.num_layers} layers"


def test_hf_folder_missing_tensor(tiny_llama_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "missing-tensor"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_folder / "config.json").read_text())
    tensors = load_file(tiny_llama_folder / "model.safetensors")
    assert DROPPED_TENSOR in tensors, f"fixture lacks {DROPPED_TENSOR}: {sorted(tensors)[:5]}"
    del tensors[DROPPED_TENSOR]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(LoadError) as caught:
        load_hf_folder(folder, "fp32")
    message = _problem(caught.value, folder)
    assert "missing" in message, f"{message}"
    assert DROPPED_FUSED_NAME in message, f"message does not name {DROPPED_FUSED_NAME}: {message}"
    assert "layers.0.mlp.down_proj" not in message, f"names a tensor that is there: {message}"
    _assert_short_traceback(caught.value)


def test_hf_folder_with_an_infinite_value_fails_naming_the_tensor(
    tiny_llama_folder: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "infinite"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama_folder / "config.json").read_text())
    tensors = load_file(tiny_llama_folder / "model.safetensors")
    tensors[DROPPED_TENSOR][3, 5] = float("inf")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError) as caught:
        load_hf_folder(folder, "fp32")
    message = str(caught.value)
    assert f"tensor {DROPPED_TENSOR!r} has 1 NaN or infinite values" in message, message
    _assert_short_traceback(caught.value)


def test_hf_folder_unsupported_model_type(tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    save_file({"embeddings.weight": torch.zeros(4, 4)}, folder / "model.safetensors")
    with pytest.raises(LoadError) as caught:
        load_hf_folder(folder, "fp32")
    message = _problem(caught.value, folder)
    assert "bert" in message and "not supported" in message, f"{message}"
    _assert_short_traceback(caught.value)


# ---------------------------------------------------------------- names and the command line


def test_resolve_unknown_name_lists_catalogue() -> None:
    with pytest.raises(catalog.ModelNotFoundError) as caught:
        catalog.resolve("no-such-model-7b", fetch_missing=False)
    message = str(caught.value)
    assert "no-such-model-7b" in message, f"{message}"
    for name in catalog.CATALOG:
        assert name in message, f"message does not list {name!r}: {message}"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polylane.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_one_error_line(completed: subprocess.CompletedProcess[str]) -> None:
    stderr = completed.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert completed.returncode == 2, f"exit code {completed.returncode}, stderr:\n{stderr}"
    assert len(errors) == 1, f"{len(errors)} error: lines in stderr:\n{stderr}"
    assert "Traceback" not in stderr, f"traceback printed:\n{stderr}"


def test_cli_generate_missing_file() -> None:
    completed = _run_cli("generate", "/nonexistent.gguf", "hi")
    _assert_one_error_line(completed)
    assert "/nonexistent.gguf" in completed.stderr, completed.stderr


def test_cli_generate_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUX" + bytes(64))
    completed = _run_cli("generate", str(path), "hi")
    _assert_one_error_line(completed)
    assert "magic" in completed.stderr, completed.stderr


def test_cli_serve_strict_exits_on_a_bad_file_among_good_ones(tmp_path: Path) -> None:
    # (without --strict the others serve: tests/server/test_load_failure.py)
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUX" + bytes(64))
    completed = _run_cli("serve", "smollm2-135m-instruct", str(path), "--strict", "--port", "1")
    _assert_one_error_line(completed)
    assert "magic" in completed.stderr and str(path) in completed.stderr, completed.stderr
