"""Hugging Face `transformers` as a bench baseline: `generate` on the same GGUF file, same dtype.

What this module owns: loading each model the way `bench/foundation.py` does
(`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`, dequantised to the same dtype as
polylane), turning a `BenchRequest` into the same token ids polylane runs (polylane's tokenizer:
the chat template when the request is a chat and the model has one, the plain text otherwise),
and timing `generate` with a streamer that notes when each step's tokens arrive.

How a phase runs here: `generate` has no online batching, so requests run in static batches of
the phase's concurrency, in arrival order; a batch starts when its last request has arrived (and
the previous batch is done), which is the batch's `sent` time. A batch is left-padded and decodes
the longest max_tokens among its requests; each request counts its own tokens (up to its
max_tokens, or its first end-of-sequence token unless it ignores EOS) and its last token's time.

Assisted generation (`assisted`): with a drafter model, `generate(assistant_model=...)`; with
"prompt-lookup", `generate(prompt_lookup_num_tokens=10)` (n-gram lookup in the prompt). It only
runs at batch 1 in transformers, so batches of more than one request use plain `generate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polylane import catalog
from polylane.bench.metrics import RequestTimeline
from polylane.bench.workloads import BenchRequest, Phase
from polylane.runtime.model.device import resolve_device
from polylane.runtime.sampling.tokenizer import Tokenizer, load_tokenizer

PROMPT_LOOKUP = "prompt-lookup"
PROMPT_LOOKUP_TOKENS = 10


def load_hf_model(source: str, dtype: str, device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers has no weight-only int8/int4 CPU path: a quantised polylane run is compared
    # with transformers at bf16, the nearest it has.
    torch_dtype = {"fp32": torch.float32}.get(dtype, torch.bfloat16)
    resolved = catalog.resolve(source, quiet=True)
    file = Path(resolved.path)
    if resolved.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(file, dtype=torch_dtype)
    return model.to(device).eval()


class _TimingStreamer:
    """A `generate` streamer: the time each step's new tokens arrived, and how many per row."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.prompt_seen = False
        self.times: list[float] = []
        self.counts: list[int] = []  # tokens per row in each put (assisted: several at once)

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        self.times.append(self.clock())
        self.counts.append(value.shape[-1] if value.dim() > 1 else 1)

    def end(self) -> None:
        pass


@dataclass
class _Loaded:
    model: Any
    tokenizer: Tokenizer


class TransformersRunner:
    def __init__(
        self,
        models: Sequence[tuple[str, str]],
        dtype: str = "fp32",
        assisted: str | None = None,
        device: str = "auto",
    ) -> None:
        """`models`: (name, catalogue name or path). `assisted`: None, "prompt-lookup", or the
        source of a drafter model (assisted generation). `device`: where the models run (the
        device polylane runs on in the same bench)."""
        self.sources = dict(models)
        self.dtype = dtype
        self.device = str(resolve_device(device))
        self.assisted = assisted
        self._loaded: dict[str, _Loaded] = {}
        self._drafter: Any = None
        self.load_seconds = 0.0

    def load_all(self) -> None:
        started = time.perf_counter()
        for name in self.sources:
            self._model(name)
        if self.assisted not in (None, PROMPT_LOOKUP):
            self._drafter = load_hf_model(self.assisted, self.dtype, self.device)  # type: ignore[arg-type]
        self.load_seconds = time.perf_counter() - started

    def _model(self, name: str) -> _Loaded:
        if name not in self._loaded:
            source = self.sources[name]
            self._loaded[name] = _Loaded(
                load_hf_model(source, self.dtype, self.device),
                load_tokenizer(catalog.resolve(source, quiet=True)),
            )
        return self._loaded[name]

    def prompt_ids(self, request: BenchRequest) -> list[int]:
        tokenizer = self._model(request.model).tokenizer
        if request.chat and tokenizer.has_chat_template:
            return tokenizer.render_chat(request.messages())
        return tokenizer.encode(request.text())

    def warm_up(self) -> None:
        for name in self.sources:
            request = BenchRequest("warm-up", name, "warm-up", "Warm-up: hello there.", 4, chat=False)
            self._generate([request], [self.prompt_ids(request)], time.perf_counter)

    def run(
        self, phase: Phase, on_done: Callable[[RequestTimeline], None] | None = None
    ) -> list[RequestTimeline]:
        started = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - started

        ordered = sorted(phase.requests, key=lambda r: r.arrival_s)
        size = phase.concurrency or len(ordered)
        timelines: dict[str, RequestTimeline] = {}
        for index in range(0, len(ordered), size):
            batch = ordered[index : index + size]
            for model in dict.fromkeys(r.model for r in batch):  # one generate per model
                group = [r for r in batch if r.model == model]
                delay = max(r.arrival_s for r in group) - now()
                if delay > 0:
                    time.sleep(delay)
                for timeline in self._generate(group, [self.prompt_ids(r) for r in group], now):
                    timelines[timeline.request_id] = timeline
                    if on_done is not None:
                        on_done(timeline)
        return [timelines[r.request_id] for r in phase.requests]

    def _generate(
        self, requests: Sequence[BenchRequest], prompts: Sequence[list[int]], now: Callable[[], float]
    ) -> list[RequestTimeline]:
        import torch

        if any(r.json_schema for r in requests):
            raise NotImplementedError("structured outputs are not measured on transformers here")
        loaded = self._model(requests[0].model)
        stop_ids = loaded.tokenizer.stop_token_ids
        pad = min(stop_ids) if stop_ids else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, T), left-padded
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        max_new = max(r.max_tokens for r in requests)
        ignore_eos = all(r.ignore_eos for r in requests)
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "pad_token_id": pad,
        }
        if ignore_eos:
            kwargs["min_new_tokens"] = max_new
        if len(requests) == 1 and self.assisted == PROMPT_LOOKUP:
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif len(requests) == 1 and self._drafter is not None:
            kwargs["assistant_model"] = self._drafter
        streamer = _TimingStreamer(now)
        sent = now()
        with torch.inference_mode():
            output = loaded.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                streamer=streamer,
                **kwargs,
            )
        generated = output[:, width:]  # (B, new tokens)
        arrival = [0.0] * generated.shape[1]  # time each generated position reached the client
        position = 0
        for moment, count in zip(streamer.times, streamer.counts, strict=True):
            for _ in range(count):
                if position < len(arrival):
                    arrival[position] = moment
                position += 1
        timelines = []
        for row, request in enumerate(requests):
            tokens = generated[row].tolist()[: request.max_tokens]
            count, reason = len(tokens), "length"
            if not request.ignore_eos:
                for i, token in enumerate(tokens):
                    if token in stop_ids:
                        count, reason = i + 1, "stop"
                        break
            timelines.append(
                RequestTimeline(
                    request.request_id,
                    request.model,
                    request.category,
                    sent,
                    arrival[0] if count else None,
                    arrival[count - 1] if count else None,
                    len(prompts[row]),
                    0,
                    count,
                    reason if count else "error",
                    None if count else "no tokens generated",
                )
            )
        return timelines
