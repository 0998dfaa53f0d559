"""What `polylane bench` reports, and the arithmetic behind every number. Pure: no torch.

What this module owns: the per-request timeline a driver records, the engine counters a driver
reads, and the functions that turn them into a phase summary, a median over repeats and the ratio
to a baseline. Drivers (in-process engine, HTTP server, transformers, one process per model) only
record; every number is computed here, the same way for every system.

Per request (`RequestTimeline`, seconds from the start of the phase, on the client's clock):
    sent          when the client sent the request (its scheduled arrival, or later if the
                  concurrency cap held it back).
    first_token   when its first output token reached the client (in-process: the first stream
                  event carrying a token; HTTP: the first SSE chunk with text, what a user sees).
    last_token    when its last output token reached the client.
    ttft          first_token − sent (time to first token).
    tpot          (last_token − first_token) / (output_tokens − 1): time per output token after the
                  first; only for requests with at least two output tokens.
    prompt_tokens, cached_tokens (prompt tokens served from the prefix cache), output_tokens.

Per phase (`summarise`, one run of one system over one phase of a workload; requests that ended
in an error count in `errors` and nowhere else):
    wall_seconds            last token of any request − first send of any request.
    throughput_tokens_per_s Σ output tokens / wall_seconds: what the system delivered.
    requests_per_s          completed requests / wall_seconds.
    ttft_p50_s, ttft_p99_s  percentiles of ttft over the requests; tpot_p50_s, tpot_p99_s the same
                            for tpot. Percentiles interpolate linearly between the two nearest
                            ranks (numpy's default, "linear"); None when there are no values.
    prefill_tokens_per_s    Σ (prompt − cached tokens) / Σ ttft. The prefill speed when requests
                            run one at a time (ttft is then one prompt's prefill plus one step).
    stream_decode_tokens_per_s     Σ (output_tokens − 1) / Σ (last_token − first_token): the
                            decode speed one stream sees (with one request at a time: batch-1
                            decode speed, the prefill excluded).
    aggregate_decode_tokens_per_s  Σ (output_tokens − 1) / (latest last_token − earliest
                            first_token): every stream together (with a batch of requests sent
                            at once: the batch's decode speed).
    prefix_hit_rate         Σ cached tokens / Σ prompt tokens.
    per_model               per model: requests, output tokens, token_share (its output tokens /
                            all), ttft and tpot p50 and p99.
    per_category            per request category (a prompt kind; in the cross-model shared-prefix
                            workload provider / shared / cold): requests, output tokens, prompt and
                            cached tokens, ttft and tpot p50 and p99, stream_decode_tokens_per_s.
    engine                  engine-side counters over the phase (`EngineCounters.delta`), None
                            for a system without an engine (transformers):
        decode_steps, switches  engine steps with a decode batch; changes of the lane owner.
        lane_share          per model: its decode steps / all decode steps (the decode lane's
                            time share, in steps).
        max_concurrent_decode  the most models ever observed inside a decode step at once (the
                            lane monitor's high-water mark, since the engine started; None where
                            it cannot be observed, e.g. across separate processes).
        decode_batch_mean   decode tokens / decode steps (mean requests per decode step).
        preemptions         requests preempted for KV room.
        residency_hits, residency_misses  lease acquisitions that found the model resident /
                            had to load it; residency_evictions: models evicted (any cause);
                            page_in_seconds: seconds spent loading models.
        speculation         drafted, accepted and emitted tokens and verify passes, summed over
                            the engine's (target, drafter) pairs; None when the engine reports no
                            pair. acceptance_rate = accepted / drafted; tokens_per_verify =
                            emitted / verify passes (tokens one target pass yields, the bonus or
                            recovered token included); chain_rounds / tree_rounds: verify passes
                            of each shape; decisions_on / decisions_off: the controller's choices
                            to draft or to decode plainly.
        cross_model         per consumer model, the prefill shared across models (None when no
                            model reused another's prefix): hits (sequences that reused a peer's
                            cached prefix), imported_tokens (prompt tokens whose lower-band KV came
                            from the peer), layers_per_token (skipped layer-tokens / imported
                            tokens: the shared band's depth, when the engine reports it).

Across repeats (`median_summary`): every number is the median of the repeats' numbers (None
values are left out; None if all are None). Repeats alternate the systems' order, so drift of a
shared machine hits every system alike.

Ratios (`ratios`): for each baseline and phase, how many times better polylane is; above 1
polylane is better. For rates (tokens/s, requests/s) polylane ÷ baseline; for latencies (ttft,
tpot) baseline ÷ polylane; computed on the medians over repeats. Paired ratios
(`paired_ratios`): the same ratio within each repeat (polylane's run against the baseline's run
of that repeat), then the median over repeats. In the `spec` workload the ratio of
stream_decode_tokens_per_s to the `plain` baseline is the wall-clock speedup of speculation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

# (key, better): the metrics a ratio is given for. "higher": a rate; "lower": a latency.
RATIO_METRICS: tuple[tuple[str, str], ...] = (
    ("throughput_tokens_per_s", "higher"),
    ("requests_per_s", "higher"),
    ("ttft_p50_s", "lower"),
    ("ttft_p99_s", "lower"),
    ("tpot_p50_s", "lower"),
    ("tpot_p99_s", "lower"),
    ("prefill_tokens_per_s", "higher"),
    ("stream_decode_tokens_per_s", "higher"),
    ("aggregate_decode_tokens_per_s", "higher"),
)


@dataclass(frozen=True)
class RequestTimeline:
    """One request as the client saw it (seconds from the phase start)."""

    request_id: str
    model: str
    category: str
    sent: float
    first_token: float | None
    last_token: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str  # stop | length | abort | error
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error" and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestTimeline:
        return cls(**data)

    def shifted(self, seconds: float) -> RequestTimeline:
        """The same timeline on a clock `seconds` later (to merge runs of separate processes)."""

        def move(t: float | None) -> float | None:
            return None if t is None else t + seconds

        return RequestTimeline(
            self.request_id,
            self.model,
            self.category,
            self.sent + seconds,
            move(self.first_token),
            move(self.last_token),
            self.prompt_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.finish_reason,
            self.error,
        )


@dataclass(frozen=True)
class SpeculationCounters:
    drafted_tokens: int
    accepted_tokens: int
    emitted_tokens: int  # tokens verify passes produced (accepted + one bonus/recovered each)
    verify_steps: int
    chain_rounds: int = 0
    tree_rounds: int = 0
    decisions_on: int = 0
    decisions_off: int = 0

    def minus(self, other: SpeculationCounters) -> SpeculationCounters:
        return SpeculationCounters(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @staticmethod
    def total(parts: Sequence[SpeculationCounters]) -> SpeculationCounters:
        return SpeculationCounters(*(sum(values) for values in zip(*map(astuple, parts), strict=True)))

    @property
    def acceptance_rate(self) -> float | None:
        return rate(self.accepted_tokens, self.drafted_tokens)

    @property
    def tokens_per_verify(self) -> float | None:
        return rate(self.emitted_tokens, self.verify_steps)


@dataclass(frozen=True)
class EngineCounters:
    """Monotone engine counters at one instant (or their difference over a phase)."""

    steps: int = 0
    decode_steps: int = 0
    switches: int = 0
    preemptions: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    lane_steps: dict[str, int] = field(default_factory=dict)
    max_concurrent_decode: int | None = None  # a high-water mark, not a counter
    residency_hits: int = 0
    residency_misses: int = 0
    residency_evictions: int = 0
    page_in_seconds: float = 0.0
    speculation: SpeculationCounters | None = None
    cross_model_hits: dict[str, int] = field(default_factory=dict)  # per consumer model
    cross_model_tokens: dict[str, int] = field(default_factory=dict)  # imported prompt tokens
    cross_model_layer_tokens: dict[str, int] = field(default_factory=dict)  # skipped layer-tokens

    def delta(self, before: EngineCounters) -> EngineCounters:
        """What happened between `before` and this snapshot (the high-water mark is kept as is)."""
        lane = _minus(self.lane_steps, before.lane_steps)
        spec = None
        if self.speculation is not None:
            spec = self.speculation.minus(before.speculation or SpeculationCounters(0, 0, 0, 0))
        return EngineCounters(
            steps=self.steps - before.steps,
            decode_steps=self.decode_steps - before.decode_steps,
            switches=self.switches - before.switches,
            preemptions=self.preemptions - before.preemptions,
            decode_tokens=self.decode_tokens - before.decode_tokens,
            prefill_tokens=self.prefill_tokens - before.prefill_tokens,
            lane_steps=lane,
            max_concurrent_decode=self.max_concurrent_decode,
            residency_hits=self.residency_hits - before.residency_hits,
            residency_misses=self.residency_misses - before.residency_misses,
            residency_evictions=self.residency_evictions - before.residency_evictions,
            page_in_seconds=self.page_in_seconds - before.page_in_seconds,
            speculation=spec,
            cross_model_hits=_minus(self.cross_model_hits, before.cross_model_hits),
            cross_model_tokens=_minus(self.cross_model_tokens, before.cross_model_tokens),
            cross_model_layer_tokens=_minus(self.cross_model_layer_tokens, before.cross_model_layer_tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineCounters:
        values = dict(data)
        if values.get("speculation") is not None:
            values["speculation"] = SpeculationCounters(**values["speculation"])
        return cls(**values)


def _minus(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """Per-name differences, the names whose count moved."""
    return {name: n - before.get(name, 0) for name, n in after.items() if n - before.get(name, 0)}


def _plus(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for name, n in part.items():
            out[name] = out.get(name, 0) + n
    return out


def merge_counters(parts: Sequence[EngineCounters]) -> EngineCounters:
    """Counters of separate engines (one process per model) added up. No engine observes the
    others, so `max_concurrent_decode` is None: the processes' decode steps may overlap freely."""
    lane = _plus(p.lane_steps for p in parts)
    specs = [p.speculation for p in parts if p.speculation is not None]
    spec = SpeculationCounters.total(specs) if specs else None
    return EngineCounters(
        steps=sum(p.steps for p in parts),
        decode_steps=sum(p.decode_steps for p in parts),
        switches=sum(p.switches for p in parts),
        preemptions=sum(p.preemptions for p in parts),
        decode_tokens=sum(p.decode_tokens for p in parts),
        prefill_tokens=sum(p.prefill_tokens for p in parts),
        lane_steps=lane,
        max_concurrent_decode=None,
        residency_hits=sum(p.residency_hits for p in parts),
        residency_misses=sum(p.residency_misses for p in parts),
        residency_evictions=sum(p.residency_evictions for p in parts),
        page_in_seconds=sum(p.page_in_seconds for p in parts),
        speculation=spec,
        cross_model_hits=_plus(p.cross_model_hits for p in parts),
        cross_model_tokens=_plus(p.cross_model_tokens for p in parts),
        cross_model_layer_tokens=_plus(p.cross_model_layer_tokens for p in parts),
    )


# ---------------------------------------------------------------------------------- arithmetic


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 ≤ q ≤ 100), interpolating linearly between the two nearest ranks
    (numpy's default method); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def rate(amount: float, seconds: float) -> float | None:
    """amount / seconds; None when nothing was timed (seconds ≤ 0)."""
    return amount / seconds if seconds > 0 else None


def ratio(ours: float | None, baseline: float | None, better: str) -> float | None:
    """How many times better `ours` is than `baseline` (> 1: ours is better); None when either is
    missing or the divisor is 0. `better` is "higher" (rates) or "lower" (latencies)."""
    if ours is None or baseline is None:
        return None
    if better == "higher":
        return ours / baseline if baseline > 0 else None
    if better == "lower":
        return baseline / ours if ours > 0 else None
    raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")


# ---------------------------------------------------------------------------------- summaries


def _end(t: RequestTimeline) -> float:
    for moment in (t.last_token, t.first_token):
        if moment is not None:
            return moment
    return t.sent


def _latency(timelines: Sequence[RequestTimeline]) -> dict[str, float | None]:
    ttft = [t.ttft for t in timelines if t.ttft is not None]
    tpot = [t.tpot for t in timelines if t.tpot is not None]
    return {
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
    }


def summarise(timelines: Sequence[RequestTimeline], engine: EngineCounters | None = None) -> dict[str, Any]:
    """One phase run of one system → its summary (see the module docstring for each key)."""
    done = [t for t in timelines if t.ok]
    errors = len(timelines) - len(done)
    output = sum(t.output_tokens for t in done)
    prompt = sum(t.prompt_tokens for t in done)
    cached = sum(t.cached_tokens for t in done)
    wall = 0.0
    if done:
        wall = max(_end(t) for t in done) - min(t.sent for t in done)
    decoding = [t for t in done if t.last_token is not None and t.first_token is not None]
    after_first = sum(t.output_tokens - 1 for t in decoding)
    stream_seconds = sum(t.last_token - t.first_token for t in decoding)  # type: ignore[operator]
    span = 0.0
    if decoding:
        span = max(t.last_token for t in decoding) - min(t.first_token for t in decoding)  # type: ignore[type-var]
    per_model: dict[str, dict[str, Any]] = {}
    for model in sorted({t.model for t in timelines}):
        mine = [t for t in done if t.model == model]
        tokens = sum(t.output_tokens for t in mine)
        per_model[model] = {
            "requests": sum(1 for t in timelines if t.model == model),
            "output_tokens": tokens,
            "token_share": tokens / output if output else None,
            **_latency(mine),
        }
    per_category: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(t.category for t in timelines):
        mine = [t for t in decoding if t.category == category]
        per_category[category] = {
            "requests": sum(1 for t in timelines if t.category == category),
            "output_tokens": sum(t.output_tokens for t in done if t.category == category),
            "prompt_tokens": sum(t.prompt_tokens for t in done if t.category == category),
            "cached_tokens": sum(t.cached_tokens for t in done if t.category == category),
            **_latency([t for t in done if t.category == category]),
            "stream_decode_tokens_per_s": rate(
                sum(t.output_tokens - 1 for t in mine),
                sum(t.last_token - t.first_token for t in mine),  # type: ignore[operator]
            ),
        }
    return {
        "requests": len(timelines),
        "completed": len(done),
        "errors": errors,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "wall_seconds": wall,
        "throughput_tokens_per_s": rate(output, wall),
        "requests_per_s": rate(len(done), wall),
        **_latency(done),
        "prefill_tokens_per_s": rate(prompt - cached, sum(t.ttft for t in done)),  # type: ignore[misc]
        "stream_decode_tokens_per_s": rate(after_first, stream_seconds),
        "aggregate_decode_tokens_per_s": rate(after_first, span),
        "prefix_hit_rate": cached / prompt if prompt else None,
        "per_model": per_model,
        "per_category": per_category,
        "engine": None if engine is None else engine_summary(engine),
    }


def engine_summary(counters: EngineCounters) -> dict[str, Any]:
    """The engine-side part of a phase summary, from the counters' delta over the phase."""
    spec = counters.speculation
    return {
        "decode_steps": counters.decode_steps,
        "switches": counters.switches,
        "lane_share": {
            name: steps / counters.decode_steps for name, steps in sorted(counters.lane_steps.items())
        }
        if counters.decode_steps
        else {},
        "max_concurrent_decode": counters.max_concurrent_decode,
        "decode_batch_mean": rate(counters.decode_tokens, counters.decode_steps),
        "preemptions": counters.preemptions,
        "residency_hits": counters.residency_hits,
        "residency_misses": counters.residency_misses,
        "residency_evictions": counters.residency_evictions,
        "page_in_seconds": counters.page_in_seconds,
        "speculation": None
        if spec is None
        else {
            "drafted_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "emitted_tokens": spec.emitted_tokens,
            "verify_steps": spec.verify_steps,
            "acceptance_rate": spec.acceptance_rate,
            "tokens_per_verify": spec.tokens_per_verify,
            "chain_rounds": spec.chain_rounds,
            "tree_rounds": spec.tree_rounds,
            "decisions_on": spec.decisions_on,
            "decisions_off": spec.decisions_off,
        },
        "cross_model": {
            name: {
                "hits": counters.cross_model_hits.get(name, 0),
                "imported_tokens": tokens,
                "layers_per_token": rate(counters.cross_model_layer_tokens[name], tokens)
                if name in counters.cross_model_layer_tokens
                else None,
            }
            for name, tokens in sorted(counters.cross_model_tokens.items())
        }
        or None,
    }


def median_summary(runs: Sequence[Any]) -> Any:
    """The element-wise median of several summaries of the same shape (nested dicts of numbers).

    Numbers: the median of those present (None if none is). Dicts: recursively, over the union of
    keys. Anything else (strings): the first run's value.
    """
    present = [r for r in runs if r is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        keys: list[str] = []
        for run in present:
            keys += [k for k in run if k not in keys]
        return {k: median_summary([r.get(k) for r in present if isinstance(r, dict)]) for k in keys}
    if isinstance(first, bool):
        return first
    if isinstance(first, int | float):
        numbers = [r for r in present if isinstance(r, int | float) and not isinstance(r, bool)]
        return statistics.median(numbers) if numbers else None
    return first


def ratios(ours: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, float | None]:
    """For one phase: each `RATIO_METRICS` key → how many times better `ours` is (> 1: better)."""
    return {key: ratio(ours.get(key), baseline.get(key), better) for key, better in RATIO_METRICS}


def paired_ratios(
    ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]]
) -> dict[str, float | None]:
    """For one phase, repeat by repeat: the ratio of polylane's run to the baseline's run of the
    same repeat, then the median over repeats (missing values left out). The two runs of a repeat
    are adjacent in time, so this cancels slow drift of the machine better than a ratio of medians."""
    out: dict[str, float | None] = {}
    for key, better in RATIO_METRICS:
        values = [ratio(o.get(key), t.get(key), better) for o, t in zip(ours, theirs, strict=True)]
        present = [v for v in values if v is not None]
        out[key] = statistics.median(present) if present else None
    return out
