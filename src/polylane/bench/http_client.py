"""A running server as a bench client (`polylane bench --url`): the official `openai` client,
streaming, and the server's `/metrics`. No torch.

What this module owns: sending one `BenchRequest` to an OpenAI-compatible server (chat completions
when the request is a chat and the model has a chat template, plain completions otherwise),
greedy, streamed, with `stream_options.include_usage` so token counts come from the server; timing
the first and last SSE chunk that carries text (what a user sees); and turning two scrapes of
polylane's Prometheus `/metrics` into `EngineCounters`.

From `/metrics`: decode steps, switches, preemptions, lane steps per model, the observed max
concurrent decode, residency hits/misses/evictions and page-in seconds; decode tokens are
decode_batch_mean × decode_steps. Speculation counters are read from `polylane_spec_drafted_tokens`,
`polylane_spec_accepted_tokens`, `polylane_spec_emitted_tokens` and `polylane_spec_verify_steps`
when the server exports them. A server that is not polylane gives no `/metrics` and the engine
part of the report stays empty.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from polylane.bench.metrics import EngineCounters, RequestTimeline, SpeculationCounters
from polylane.bench.replay import Clock
from polylane.bench.workloads import BenchRequest


class HttpClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 1800.0) -> None:
        try:
            import openai
        except ImportError as error:  # pragma: no cover - openai ships with the test extra
            raise RuntimeError("polylane bench --url needs the openai package: pip install openai") from error
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0, timeout=timeout
        )
        self.chat_models = self._chat_models()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _chat_models(self) -> dict[str, bool]:
        """Served model → whether it takes chat messages (polylane's `chat` field; assumed yes)."""
        response = httpx.get(f"{self.url}/v1/models", headers=self._headers(), timeout=60)
        response.raise_for_status()
        return {m["id"]: bool(m.get("chat", True)) for m in response.json().get("data", [])}

    @property
    def models(self) -> list[str]:
        return list(self.chat_models)

    async def send(self, request: BenchRequest, now: Clock) -> RequestTimeline:
        sent = now()
        common: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.ignore_eos:
            common["extra_body"] = {"ignore_eos": True}
        if request.json_schema:
            schema = {"name": "bench", "schema": json.loads(request.json_schema), "strict": True}
            common["response_format"] = {"type": "json_schema", "json_schema": schema}
        chat = request.chat and self.chat_models.get(request.model, True)
        if chat:
            stream = await self.client.chat.completions.create(messages=request.messages(), **common)
        else:
            stream = await self.client.completions.create(prompt=request.text(), **common)
        first: float | None = None
        last: float | None = None
        chunks = 0
        usage = None
        finish = "error"
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content if chat else choice.text  # type: ignore[union-attr]
                if text:
                    last = now()
                    chunks += 1
                    if first is None:
                        first = last
                if choice.finish_reason:
                    finish = choice.finish_reason
        prompt_tokens = usage.prompt_tokens if usage is not None else 0
        output_tokens = usage.completion_tokens if usage is not None else chunks
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        return RequestTimeline(
            request.request_id,
            request.model,
            request.category,
            sent,
            first,
            last,
            prompt_tokens,
            cached,
            output_tokens,
            finish,
            None if first is not None else "no text was streamed",
        )

    def counters(self) -> EngineCounters | None:
        """The server's engine counters now, from `/metrics`; None if it has none."""
        try:
            response = httpx.get(f"{self.url}/metrics", headers=self._headers(), timeout=60)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return counters_from_metrics(response.text)

    async def close(self) -> None:
        await self.client.close()


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def counters_from_metrics(text: str) -> EngineCounters | None:
    """`EngineCounters` from polylane's Prometheus text; None if it has no polylane engine metrics."""
    samples = _samples(text)

    def value(name: str) -> float | None:
        for key in (f"{name}_total", name):
            if key in samples:
                return sum(v for _, v in samples[key])
        return None

    decode_steps = value("polylane_decode_steps")
    if decode_steps is None:
        return None
    lane = {
        labels["model"]: int(v)
        for labels, v in samples.get("polylane_lane_steps_total", samples.get("polylane_lane_steps", []))
        if v
    }
    batch_mean = value("polylane_decode_batch_mean") or 0.0
    drafted = value("polylane_spec_drafted_tokens")
    spec = None
    if drafted is not None:
        spec = SpeculationCounters(
            int(drafted),
            int(value("polylane_spec_accepted_tokens") or 0),
            int(value("polylane_spec_emitted_tokens") or 0),
            int(value("polylane_spec_verify_steps") or 0),
        )
    max_concurrent = value("polylane_max_concurrent_decode")
    return EngineCounters(
        steps=int(value("polylane_steps") or 0),
        decode_steps=int(decode_steps),
        switches=int(value("polylane_lane_switches") or 0),
        preemptions=int(value("polylane_preemptions") or 0),
        decode_tokens=round(batch_mean * decode_steps),
        prefill_tokens=0,  # not exported
        lane_steps=lane,
        max_concurrent_decode=None if max_concurrent is None else int(max_concurrent),
        residency_hits=int(value("polylane_residency_hits") or 0),
        residency_misses=int(value("polylane_residency_misses") or 0),
        residency_evictions=int(value("polylane_evictions") or 0),
        page_in_seconds=value("polylane_page_in_seconds") or 0.0,
        speculation=spec,
    )
