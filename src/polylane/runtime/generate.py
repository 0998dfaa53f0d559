"""Run a set of sequences of one model to completion: chunked prefill, then batched decode.

This is the plain single-model driver behind `polylane generate`, the parity tests and the
foundation benchmark. Every step is one forward over a flat batch that mixes the prefill chunks
of sequences still reading their prompt with one decode token of every other sequence. KV lives
in a `ModelKV` (paged cache, block pool and, with `prefix_cache`, a prefix tree that persists
across `generate` calls, so a later prompt starts from the longest cached prefix).
(The multi-model engine and its scheduler build on the same `ModelKV.forward`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.loading.loaded_model import LoadedModel
from polylane.runtime.sampling.sampler import RequestSampler, sample_rows
from polylane.types import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    start_step: int = 0  # the step at which this sequence joins the batch
    stop_at_eos: bool = True


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length"
    logits: list[torch.Tensor]  # float32 (V,) per generated token, when recorded
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    ttft_seconds: float
    decode_seconds: float  # from the first token to the last

    @property
    def decode_tokens_per_second(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


@dataclass
class _Sequence:
    request: GenerationRequest
    sampler: RequestSampler
    kv: KVSequence | None = None
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    started: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class Generator:
    """Runs generations of one model over its `ModelKV` (owned here, or passed in to share)."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        prefill_chunk: int = 512,
        prefix_cache: bool = False,
        kv: ModelKV | None = None,
    ) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.kv = kv or ModelKV(
            model, num_blocks=num_blocks, block_size=block_size, prefix_cache=prefix_cache
        )

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        record_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[GenerationOutput]:
        """Run all requests to completion; `on_token(request_index, token_id)` streams tokens.

        Completed sequences enter the prefix cache (when on); if anything fails, none do.
        """
        context_limit = self.model.config.max_context
        for request in requests:
            needed = len(request.prompt_ids) + request.params.max_tokens
            if not request.prompt_ids:
                raise ValueError("a prompt needs at least one token")
            if needed > context_limit:
                raise ValueError(
                    f"prompt ({len(request.prompt_ids)} tokens) + max_tokens "
                    f"({request.params.max_tokens}) = {needed} exceeds the model's context of "
                    f"{context_limit} tokens"
                )
        sequences = [_Sequence(request, RequestSampler(request.params)) for request in requests]
        stop_ids = self.model.tokenizer.stop_token_ids
        step = 0
        completed = False
        try:
            while any(s.finish_reason is None for s in sequences):
                active = [
                    (i, s)
                    for i, s in enumerate(sequences)
                    if s.finish_reason is None and s.request.start_step <= step
                ]
                step += 1
                if not active:
                    continue
                extends = [self._next_extend(s) for _, s in active]
                logits = self.kv.forward(extends)  # (R, V)
                now = time.perf_counter()
                sampling = [(i, s) for (i, s), e in zip(active, extends, strict=True) if e.logits != "none"]
                tokens = sample_rows(logits, [s.sampler for _, s in sampling])
                for row, ((index, s), token) in enumerate(zip(sampling, tokens, strict=True)):
                    if record_logits:
                        s.logits.append(logits[row].clone())
                    s.generated.append(token)
                    s.first_token_at = s.first_token_at or now
                    s.last_token_at = now
                    if on_token is not None:
                        on_token(index, token)
                    if s.request.stop_at_eos and token in stop_ids:
                        s.finish_reason = "stop"
                    elif len(s.generated) >= s.request.params.max_tokens:
                        s.finish_reason = "length"
            completed = True
        finally:
            for s in sequences:
                if s.kv is not None:
                    self.kv.close(s.kv, cache=completed)
        return [
            GenerationOutput(
                token_ids=s.generated,
                finish_reason=s.finish_reason or "length",
                logits=s.logits,
                prompt_tokens=len(s.request.prompt_ids),
                cached_tokens=s.kv.cached_tokens if s.kv is not None else 0,
                ttft_seconds=s.first_token_at - s.started,
                decode_seconds=s.last_token_at - s.first_token_at,
            )
            for s in sequences
        ]

    def _next_extend(self, sequence: _Sequence) -> Extend:
        prompt = sequence.request.prompt_ids
        if sequence.kv is None:
            sequence.started = time.perf_counter()
            sequence.kv = self.kv.open(prompt)
        done = sequence.kv.num_tokens
        if done < len(prompt):
            end = min(len(prompt), done + self.prefill_chunk)
            return Extend(sequence.kv, prompt[done:end], logits="last" if end == len(prompt) else "none")
        return Extend(sequence.kv, (sequence.generated[-1],))
