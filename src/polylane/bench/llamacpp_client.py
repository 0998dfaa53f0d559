"""llama.cpp as a bench baseline: its Python bindings (`llama-cpp-python`) on the same GGUF file.

What this module owns: loading each model's GGUF into a `llama_cpp.Llama`, running a phase's
requests through it and timing each token as it comes out. llama.cpp runs the file's own
quantised weights (e.g. SmolLM2's Q4_1) with its own kernels; `dtype` does not apply to it.

- Prompts are tokenised by polylane's tokenizer (chat template included), so llama.cpp sees the
  same token ids polylane does; decoding is greedy (top-k 1, no repetition penalty).
- The bindings serve one sequence at a time: requests run one after another in arrival order, and
  a batch phase measures what one llama.cpp process gives several clients that way.
- Every request starts from an empty context (`reset`), so no prompt is served from an earlier
  request's KV: prefill is measured cold, like the `plain` system's.
- Threads: `threads` (0: the torch default of the worker, the same count polylane uses).

Install: `pip install polylane[llamacpp]` (builds llama.cpp from source, several minutes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polylane import catalog
from polylane.bench.metrics import RequestTimeline
from polylane.bench.workloads import BenchRequest, Phase
from polylane.runtime.sampling.tokenizer import Tokenizer, load_tokenizer

CONTEXT_TOKENS = 4096


def require_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as error:
        raise RuntimeError(
            "the llama.cpp baseline needs llama-cpp-python: pip install 'polylane[llamacpp]' "
            f"(it builds llama.cpp from source) — {error}"
        ) from None
    return llama_cpp


@dataclass
class _Loaded:
    llm: Any
    tokenizer: Tokenizer


class LlamaCppRunner:
    def __init__(self, models: Sequence[tuple[str, str]], threads: int = 0) -> None:
        """`models`: (name, catalogue name or .gguf path)."""
        self.sources = dict(models)
        self.threads = threads
        self._loaded: dict[str, _Loaded] = {}
        self.load_seconds = 0.0

    def load_all(self) -> None:
        llama_cpp = require_llama_cpp()
        import torch

        threads = self.threads or torch.get_num_threads()
        started = time.perf_counter()
        for name, source in self.sources.items():
            resolved = catalog.resolve(source, quiet=True)
            if resolved.format != "gguf":
                raise ValueError(f"llama.cpp runs GGUF files; {source!r} is a {resolved.format} model")
            llm = llama_cpp.Llama(
                model_path=str(resolved.path),
                n_ctx=CONTEXT_TOKENS,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            self._loaded[name] = _Loaded(llm, load_tokenizer(resolved))
        self.load_seconds = time.perf_counter() - started

    def prompt_ids(self, request: BenchRequest) -> list[int]:
        tokenizer = self._loaded[request.model].tokenizer
        if request.chat and tokenizer.has_chat_template:
            return tokenizer.render_chat(request.messages())
        return tokenizer.encode(request.text())

    def warm_up(self) -> None:
        for name in self.sources:
            request = BenchRequest("warm-up", name, "warm-up", "Warm-up: hello there.", 4, chat=False)
            self._generate(request, time.perf_counter)

    def run(
        self, phase: Phase, on_done: Callable[[RequestTimeline], None] | None = None
    ) -> list[RequestTimeline]:
        started = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - started

        timelines: dict[str, RequestTimeline] = {}
        for request in sorted(phase.requests, key=lambda r: r.arrival_s):
            delay = request.arrival_s - now()
            if delay > 0:
                time.sleep(delay)
            timeline = self._generate(request, now)
            timelines[request.request_id] = timeline
            if on_done is not None:
                on_done(timeline)
        return [timelines[r.request_id] for r in phase.requests]

    def _generate(self, request: BenchRequest, now: Callable[[], float]) -> RequestTimeline:
        loaded = self._loaded[request.model]
        prompt = self.prompt_ids(request)
        sent = now()
        if len(prompt) + request.max_tokens > CONTEXT_TOKENS:
            return _failed(request, sent, len(prompt), f"prompt + max_tokens exceeds {CONTEXT_TOKENS}")
        if request.json_schema:
            return _failed(
                request, sent, len(prompt), "structured outputs are not measured on llama.cpp here"
            )
        loaded.llm.reset()
        first = last = None
        count, reason = 0, "length"
        stop_ids = loaded.tokenizer.stop_token_ids
        for token in loaded.llm.generate(
            prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            last = now()
            first = last if first is None else first
            count += 1
            if token in stop_ids and not request.ignore_eos:
                reason = "stop"
                break
            if count >= request.max_tokens:
                break
        return RequestTimeline(
            request.request_id,
            request.model,
            request.category,
            sent,
            first,
            last,
            len(prompt),
            0,
            count,
            reason if count else "error",
            None if count else "no tokens generated",
        )


def _failed(request: BenchRequest, sent: float, prompt_tokens: int, message: str) -> RequestTimeline:
    return RequestTimeline(
        request.request_id,
        request.model,
        request.category,
        sent,
        None,
        None,
        prompt_tokens,
        0,
        0,
        "error",
        message,
    )
