"""llama.cpp's own speed on a GGUF file, through its Python bindings: the reference of docs/profile.md.

Run:  python bench/llamacpp_time.py [--model smollm2-135m-instruct] [--threads 2] [--repeats 3]
      [--decode-tokens 64] [--prompt-tokens 512]

Decode: a 5-token prompt is evaluated, then --decode-tokens single tokens one `eval` each (batch 1,
what one llama.cpp stream does per step); prefill: one `eval` of --prompt-tokens tokens from an
empty context. Needs `pip install 'polylane[llamacpp]'`. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import time

from polylane import catalog
from polylane.bench.llamacpp_client import require_llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    llama_cpp = require_llama_cpp()
    source = catalog.resolve(args.model, quiet=True)
    llm = llama_cpp.Llama(
        model_path=str(source.path),
        n_ctx=max(2048, args.prompt_tokens + 16),
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    decode, prefill = [], []
    for _ in range(args.repeats):
        llm.reset()
        llm.eval([100, 200, 300, 400, 500])
        started = time.perf_counter()
        for i in range(args.decode_tokens):
            llm.eval([5 + i])
        decode.append(args.decode_tokens / (time.perf_counter() - started))
        llm.reset()
        prompt = [100 + (i * 37) % 1000 for i in range(args.prompt_tokens)]
        started = time.perf_counter()
        llm.eval(prompt)
        prefill.append(args.prompt_tokens / (time.perf_counter() - started))
    print(f"{source.path.name}, {args.threads} threads")
    print("decode tokens/s (batch 1): " + ", ".join(f"{v:.1f}" for v in decode))
    print(f"prefill tokens/s ({args.prompt_tokens} tokens): " + ", ".join(f"{v:.1f}" for v in prefill))
    print(
        json.dumps(
            {
                "model": args.model,
                "file": source.path.name,
                "threads": args.threads,
                "decode_tokens_per_s": decode,
                "prefill_tokens_per_s": prefill,
            }
        )
    )


if __name__ == "__main__":
    main()
