"""`polylane bench single --baseline llama.cpp` on SmolLM2's GGUF at tiny size: llama.cpp's
bindings serve every request of every phase with the tokens asked for, beside polylane at int4.
The test command installs it (`scripts/install-llamacpp`); skipped where it is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_smoke import bench

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bash scripts/install-llamacpp)")


def test_single_against_llama_cpp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    results, last = bench(
        capsys, tmp_path, "single", "--requests", "1", "--max-tokens", "4", "--prompt-tokens", "64",
        "--batch", "2", "--baseline", "llama.cpp", "--dtype", "int4",
    )  # fmt: skip
    summary = results["systems"]["llama.cpp"]["summary"]
    assert summary["prefill"]["prompt_tokens"] >= 40
    assert summary["decode"]["output_tokens"] == 4
    assert summary["batch-2"]["output_tokens"] == 8
    assert last["ratios"]["llama.cpp"]["decode"]["stream_decode_tokens_per_s"] > 0
