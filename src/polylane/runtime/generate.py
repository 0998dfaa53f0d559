"""Run a set of sequences of one model to completion: chunked prefill, then batched decode.

This is the plain single-model driver behind `polylane generate`, the parity tests and the
foundation benchmark. Every step is one forward over a flat batch that mixes the prefill chunks
of sequences still reading their prompt with one decode token of every other sequence. Blocks
come from a `BlockPool`; each sequence holds a block table into the model's `PagedKVCache`.
(The multi-model engine and its scheduler build on the same forward, `DecoderModel.forward`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from polylane.policy.blocks import BlockPool
from polylane.runtime.batch import build_forward_batch
from polylane.runtime.kv_cache import PagedKVCache
from polylane.runtime.loaded_model import LoadedModel
from polylane.runtime.sampler import RequestSampler, sample_rows
from polylane.types import SamplingParams, SequenceChunk


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
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    started: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.request.prompt_ids)


class Generator:
    """Owns one model's KV cache and block pool for the duration of some generations."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        prefill_chunk: int = 512,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        record_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[GenerationOutput]:
        """Run all requests to completion; `on_token(request_index, token_id)` streams tokens."""
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
        sequences = [
            _Sequence(request, RequestSampler(request.params), list(request.prompt_ids))
            for request in requests
        ]
        stop_ids = self.model.tokenizer.stop_token_ids
        step = 0
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
                chunks = [self._next_chunk(s) for _, s in active]
                batch = build_forward_batch(chunks, self.block_size, self.model.config)
                logits = self.model.module(batch, self.cache)  # (R, V)
                now = time.perf_counter()
                sampling = [(i, s) for (i, s), c in zip(active, chunks, strict=True) if c.logits != "none"]
                for (_, s), chunk in zip(active, chunks, strict=True):
                    s.num_cached = chunk.context_len
                tokens = sample_rows(logits, [s.sampler for _, s in sampling])
                for row, ((index, s), token) in enumerate(zip(sampling, tokens, strict=True)):
                    if record_logits:
                        s.logits.append(logits[row].clone())
                    s.generated.append(token)
                    s.token_ids.append(token)
                    s.first_token_at = s.first_token_at or now
                    s.last_token_at = now
                    if on_token is not None:
                        on_token(index, token)
                    if s.request.stop_at_eos and token in stop_ids:
                        s.finish_reason = "stop"
                    elif len(s.generated) >= s.request.params.max_tokens:
                        s.finish_reason = "length"
                    if s.finish_reason is not None:
                        self.pool.free(s.block_table)
                        s.block_table = []
        finally:
            for s in sequences:
                if s.block_table:
                    self.pool.free(s.block_table)
                    s.block_table = []
        return [
            GenerationOutput(
                token_ids=s.generated,
                finish_reason=s.finish_reason or "length",
                logits=s.logits,
                prompt_tokens=len(s.request.prompt_ids),
                ttft_seconds=s.first_token_at - s.started,
                decode_seconds=s.last_token_at - s.first_token_at,
            )
            for s in sequences
        ]

    def _next_chunk(self, sequence: _Sequence) -> SequenceChunk:
        if not sequence.started:
            sequence.started = time.perf_counter()
        prompt_len = len(sequence.request.prompt_ids)
        if sequence.prefilling:
            end = min(prompt_len, sequence.num_cached + self.prefill_chunk)
            new = sequence.token_ids[sequence.num_cached : end]
        else:
            new = sequence.token_ids[sequence.num_cached :]
        needed = self.pool.blocks_for(sequence.num_cached + len(new)) - len(sequence.block_table)
        if needed > 0:
            if not self.pool.can_allocate(needed):
                raise RuntimeError(
                    f"KV cache full: {self.pool.num_blocks} blocks of {self.block_size} tokens are "
                    "not enough for these sequences; raise num_blocks"
                )
            sequence.block_table.extend(self.pool.allocate(needed))
        reaches_end = sequence.num_cached + len(new) >= prompt_len
        return SequenceChunk(
            token_ids=tuple(new),
            num_cached=sequence.num_cached,
            block_table=tuple(sequence.block_table),
            logits="last" if reaches_end else "none",
        )
