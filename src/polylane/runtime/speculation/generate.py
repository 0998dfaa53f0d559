"""Run a set of requests of one target model with speculative decoding, outside the engine.

What this module owns: a plain driver like `runtime.generate.Generator`, with a `Speculator` in
the decode loop, for tests, benchmarks and `polylane generate`: chunked prefill, then rounds in
which every decoding request either speculates (drafts verified in the batch's one target forward)
or decodes one token, until EOS or max_tokens. It records what speculation did per request.
Without a speculator it is plain batched decoding over the same code path (the baseline).

The engine does the same inside its runner (`runtime.runner`), one step at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polylane.runtime.generate import GenerationRequest
from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.loading.loaded_model import LoadedModel
from polylane.runtime.sampling.sampler import RequestSampler, sample_rows
from polylane.runtime.speculation.speculator import SpecRequest, Speculator


@dataclass
class SpecOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    rounds: int = 0  # speculative rounds (verify passes that carried a draft)
    plain_steps: int = 0  # decode steps without a draft
    accepted: int = 0  # draft tokens accepted
    drafted: int = 0  # draft tokens proposed
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0  # from the first token to the last

    @property
    def tokens_per_verify(self) -> float:
        spec_tokens = self.accepted + self.rounds
        return spec_tokens / self.rounds if self.rounds else 0.0


@dataclass
class _Running:
    index: int
    request: GenerationRequest
    sampler: RequestSampler
    kv: KVSequence | None = None
    generated: list[int] = field(default_factory=list)
    output: SpecOutput = field(default_factory=lambda: SpecOutput([], "length"))
    checked: int = 0  # generated tokens already checked for a stop token
    started: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0


def split_rows(extends: Sequence[Extend], logits: torch.Tensor) -> list[torch.Tensor]:
    """The logits rows of each extend of one forward (0, 1 or len(tokens) rows each)."""
    out, start = [], 0
    for extend in extends:
        count = {"none": 0, "last": 1, "all": len(extend.token_ids)}[extend.logits]
        out.append(logits[start : start + count])
        start += count
    return out


class SpeculativeGenerator:
    def __init__(
        self,
        model: LoadedModel,
        speculator: Speculator | None,
        *,
        kv: ModelKV | None = None,
        num_blocks: int = 256,
        block_size: int = 16,
        prefill_chunk: int = 512,
    ) -> None:
        self.model = model
        self.speculator = speculator
        self.kv = kv or ModelKV(model, num_blocks=num_blocks, block_size=block_size, prefix_cache=False)
        self.prefill_chunk = prefill_chunk

    def generate(self, requests: Sequence[GenerationRequest]) -> list[SpecOutput]:
        running = [_Running(i, r, RequestSampler(r.params)) for i, r in enumerate(requests)]
        stop_ids = self.model.tokenizer.stop_token_ids if self.model.tokenizer is not None else frozenset()
        try:
            self._prefill(running)
            active = [r for r in running if self._check_done(r, stop_ids) is None]
            while active:
                self._decode_step(active)
                active = [r for r in active if self._check_done(r, stop_ids) is None]
        finally:
            for r in running:
                if self.speculator is not None:
                    self.speculator.drop(r.index)
                if r.kv is not None and not r.kv.closed:
                    self.kv.close(r.kv, cache=False)
        for r in running:
            r.output.token_ids = r.generated[: r.request.params.max_tokens]
            r.output.ttft_seconds = r.first_at - r.started
            r.output.decode_seconds = r.last_at - r.first_at
        return [r.output for r in running]

    def _prefill(self, running: list[_Running]) -> None:
        for r in running:
            r.started = time.perf_counter()
            r.kv = self.kv.open(r.request.prompt_ids)
        pending = list(running)
        while pending:
            extends = []
            for r in pending:
                prompt, done = r.request.prompt_ids, r.kv.num_tokens  # type: ignore[union-attr]
                end = min(len(prompt), done + self.prefill_chunk)
                logits = "last" if end == len(prompt) else "none"
                extends.append(Extend(r.kv, prompt[done:end], logits=logits))  # type: ignore[arg-type]
            rows = self.kv.forward(extends)
            finishing = [r for r, e in zip(pending, extends, strict=True) if e.logits == "last"]
            tokens = sample_rows(rows, [r.sampler for r in finishing]) if finishing else []
            now = time.perf_counter()
            for r, token in zip(finishing, tokens, strict=True):
                r.generated.append(token)
                r.first_at = r.last_at = now
            pending = [r for r in pending if r not in finishing]

    def _decode_step(self, active: list[_Running]) -> None:
        speculator = self.speculator
        verify: dict[int, Extend] = {}
        if speculator is not None:
            specs = [
                SpecRequest(r.index, r.kv, [*r.kv.token_ids, r.generated[-1]], r.sampler, self._room(r))  # type: ignore[union-attr]
                for r in active
            ]
            verify = speculator.prepare(specs, batch_size=len(active))
        extends = [verify.get(r.index) or Extend(r.kv, (r.generated[-1],)) for r in active]  # type: ignore[arg-type]
        started = time.perf_counter()
        logits = self.kv.forward(extends)
        seconds = time.perf_counter() - started
        rows = split_rows(extends, logits)
        plain = [(r, row) for r, row in zip(active, rows, strict=True) if r.index not in verify]
        greedy_rows = [row[-1] for r, row in plain]
        tokens = sample_rows(torch.stack(greedy_rows), [r.sampler for r, _ in plain]) if plain else []
        now = time.perf_counter()
        for (r, _), token in zip(plain, tokens, strict=True):
            r.generated.append(token)
            r.output.plain_steps += 1
            r.last_at = now
        if speculator is not None:
            drafters = sorted({d for d in (speculator.round_drafter(i) for i in verify) if d})
            speculator.record_forward(sum(len(e.token_ids) for e in extends), seconds, drafters)
            for r, row in zip(active, rows, strict=True):
                if r.index not in verify:
                    continue
                drafted = len(verify[r.index].token_ids) - 1
                new = speculator.finish(self.kv, r.index, row)
                r.generated.extend(new)
                if not drafted:  # nothing was drafted (no n-gram match): a plain step
                    r.output.plain_steps += 1
                    r.last_at = time.perf_counter()
                    continue
                r.output.rounds += 1
                r.output.drafted += drafted
                r.output.accepted += len(new) - 1
                r.last_at = time.perf_counter()

    def _room(self, r: _Running) -> int:
        """Tokens the request may still produce (max_tokens and the context)."""
        left = r.request.params.max_tokens - len(r.generated)
        context_room = self.model.config.max_context - len(r.request.prompt_ids) - len(r.generated)
        return max(0, min(left, context_room))

    @staticmethod
    def _check_done(r: _Running, stop_ids: frozenset[int]) -> str | None:
        """Finish reason once the request is done (tokens past a stop token are dropped)."""
        if r.request.stop_at_eos:
            for position in range(r.checked, min(len(r.generated), r.request.params.max_tokens)):
                if r.generated[position] in stop_ids:
                    del r.generated[position + 1 :]
                    r.output.finish_reason = "stop"
                    return "stop"
            r.checked = len(r.generated)
        if len(r.generated) >= r.request.params.max_tokens:
            del r.generated[r.request.params.max_tokens :]
            r.output.finish_reason = "length"
            return "length"
        return None


__all__ = ["SpecOutput", "SpeculativeGenerator", "split_rows"]
