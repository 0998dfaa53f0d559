"""How close to the file each engine computes: polylane's default (dtype auto), polylane's
auto-fp32 and llama.cpp, side by side, against an fp32 forward of the same GGUF file's weights
dequantised by `gguf`.

For each model, one prompt of `--positions` tokens: logits at every position from polylane at
dtype auto (the file's blocks in place, activations rounded to 8 bits per group of 16 for integer
dot products), at auto-fp32 (the same blocks, float32 activations), from llama.cpp
(llama-cpp-python, `logits_all`, which also rounds activations to 8 bits), and from polylane's
fp32 load (the reference). Printed per model and engine: top-1 agreement with the reference and
the mean-abs difference of the logits, and llama.cpp's mean-abs over each polylane path's.

    python bench/file_fidelity.py                     # the four catalogue models
    python bench/file_fidelity.py --models smollm2-135m-instruct --positions 256
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from polylane import catalog
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.loaded_model import load_model

CATALOGUE = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
]
TEXT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 23} stones; "
    f"{['we counted them twice', 'nobody checked', 'the ledger agrees', 'see the note below'][i % 4]}."
    for i in range(80)
)


def polylane_logits(name: str, dtype: str, ids: list[int]) -> np.ndarray:
    model = load_model(name, dtype, quiet=True)
    kv = ModelKV(model, num_blocks=-(-len(ids) // 16) + 2, block_size=16, prefix_cache=False)
    sequence = kv.open(tuple(ids))
    logits = kv.forward([Extend(sequence, tuple(ids), logits="all")])
    return np.stack([row.numpy() for row in logits])


def llama_cpp_logits(path: str, ids: list[int], threads: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=len(ids) + 8, n_threads=threads, n_threads_batch=threads,
        logits_all=True, verbose=False,
    )  # fmt: skip
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    del llm
    return scores


def compare(got: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    vocab = min(got.shape[1], reference.shape[1])  # llama.cpp may pad the vocabulary
    got, reference = got[:, :vocab], reference[:, :vocab]
    return {
        "top1": float((got.argmax(-1) == reference.argmax(-1)).mean()),
        "mean_abs": float(np.abs(got - reference).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=CATALOGUE)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    results = {}
    for name in args.models:
        source = catalog.resolve(name, quiet=True)
        model = load_model(name, "auto", quiet=True)
        ids = model.tokenizer.encode(TEXT)[: args.positions]
        del model
        reference = polylane_logits(name, "fp32", ids)
        rows = {
            "polylane auto": compare(polylane_logits(name, "auto", ids), reference),
            "polylane auto-fp32": compare(polylane_logits(name, "auto-fp32", ids), reference),
            "llama.cpp": compare(llama_cpp_logits(str(source.path), ids, args.threads), reference),
        }
        results[name] = rows
        print(f"{name} ({len(ids)} positions, against fp32 of the file's weights):")
        for engine, row in rows.items():
            print(f"  {engine:18} top-1 {row['top1']:.4f}  mean-abs {row['mean_abs']:.3e}")
        for engine in ("polylane auto", "polylane auto-fp32"):
            ratio = rows["llama.cpp"]["mean_abs"] / max(rows[engine]["mean_abs"], 1e-30)
            print(f"  llama.cpp's mean-abs is {ratio:.3g}x {engine}'s")
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(json.dumps(results))


if __name__ == "__main__":
    main()
