"""`GET /metrics`: Prometheus text, every name prefixed `polylane_`.

What this module owns: what the server counts as requests end (tokens exactly as each response's
`usage` reports them: prompt, completion and prefix-cache tokens, counters that only go up; TTFT,
TPOT, end-to-end and queue-time histograms per model; HTTP responses by route and status) and a
collector that reads the engine at scrape time: per-model residency state and bytes, requests
running and waiting, KV blocks (held, cached, free), compute threads, the other processes' CPU load
and this process's CPU time, decode-lane steps, requests by finish reason, generated tokens,
evictions by cause, cross-model prefill hits, the observed most models decoding at once,
speculation per (target, drafter) pair, and the admission queue. Shares and rates are left to
PromQL (`rate()` of the counters), except speculation's per-pair ratios.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from polylane.engine import Completion, Engine
    from polylane.engine_stats import EngineStats
    from polylane.server.admission import Admission

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STATES = ("cold", "loading", "resident")


class _EngineCollector:
    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.engine, self.admission = engine, admission

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        snapshot = self.engine.manager.snapshot()
        state = GaugeMetricFamily(
            "polylane_model_state", "1 for the model's residency state", labels=["model", "state"]
        )
        size = GaugeMetricFamily(
            "polylane_model_bytes", "bytes a model counts against the budget", labels=["model"]
        )
        pinned = GaugeMetricFamily("polylane_model_pinned", "1 when the model is pinned", labels=["model"])
        in_flight = GaugeMetricFamily(
            "polylane_model_in_flight", "requests accepted and not yet ended", labels=["model"]
        )
        running = GaugeMetricFamily(
            "polylane_requests_running",
            "requests whose prefill has begun and that have not ended",
            labels=["model"],
        )
        waiting = GaugeMetricFamily(
            "polylane_requests_waiting", "requests accepted and not yet begun (queued)", labels=["model"]
        )
        requests = self.engine.requests_in_flight()
        queued = self.engine.requests_waiting()
        for info in snapshot:
            for name in _STATES:
                state.add_metric([info.name, name], 1.0 if info.state == name else 0.0)
            size.add_metric([info.name], info.bytes)
            pinned.add_metric([info.name], 1.0 if info.pinned else 0.0)
            in_flight.add_metric([info.name], requests.get(info.name, 0))
            running.add_metric([info.name], requests.get(info.name, 0) - queued.get(info.name, 0))
            waiting.add_metric([info.name], queued.get(info.name, 0))
        yield from (state, size, pinned, in_flight, running, waiting)

        blocks = GaugeMetricFamily(
            "polylane_kv_blocks",
            "a resident model's KV blocks: held by requests alone, in the prefix cache (reusable; "
            "requests may share them), or free",
            labels=["model", "use"],
        )
        usage = GaugeMetricFamily(
            "polylane_kv_usage", "share of a resident model's KV blocks requests alone hold", labels=["model"]
        )
        for name, kv in self.engine.manager.kv_blocks().items():
            blocks.add_metric([name, "held"], kv.held)
            blocks.add_metric([name, "cached"], kv.cached)
            blocks.add_metric([name, "free"], kv.total - kv.held - kv.cached)
            usage.add_metric([name], kv.held / kv.total)
        yield from (blocks, usage)

        counters = stats.residency.pool
        yield GaugeMetricFamily(
            "polylane_budget_bytes", "the residency byte budget", value=counters.budget_bytes
        )
        yield GaugeMetricFamily(
            "polylane_used_bytes", "bytes of loading and resident models", value=counters.used_bytes
        )
        evictions = CounterMetricFamily("polylane_evictions", "models evicted, by cause", labels=["cause"])
        for cause, count in counters.evictions_by_cause.items():
            evictions.add_metric([cause], count)
        yield evictions
        yield CounterMetricFamily(
            "polylane_residency_hits", "acquires of a resident model", value=counters.hits
        )
        yield CounterMetricFamily(
            "polylane_residency_misses", "acquires that loaded a model", value=counters.misses
        )
        yield CounterMetricFamily(
            "polylane_page_in_seconds", "seconds spent loading models", value=stats.residency.load_seconds
        )
        threads = self.engine.compute_threads
        yield GaugeMetricFamily(
            "polylane_compute_threads", "threads each compute op runs on now", value=threads.threads
        )
        yield GaugeMetricFamily(
            "polylane_compute_threads_max",
            "the most compute threads (the fixed count, or the adaptive ceiling)",
            value=threads.policy.fixed or threads.policy.max_threads or 0,
        )
        yield GaugeMetricFamily(
            "polylane_other_cpu_load",
            "cores other processes kept busy over the last interval (what adaptive threads follow)",
            value=threads.policy.other_load,
        )
        cpu_seconds = time.process_time()
        yield CounterMetricFamily(
            "polylane_process_cpu_seconds", "CPU time of this process (all threads)", value=cpu_seconds
        )

        lane_steps = CounterMetricFamily(
            "polylane_lane_steps", "decode steps owned by the model", labels=["model"]
        )
        requests = CounterMetricFamily("polylane_requests", "requests submitted", labels=["model"])
        finished = CounterMetricFamily(
            "polylane_requests_finished", "requests ended", labels=["model", "reason"]
        )
        tokens = CounterMetricFamily("polylane_generation_tokens", "tokens generated", labels=["model"])
        cross_tokens = CounterMetricFamily(
            "polylane_cross_model_hit_tokens",
            "prompt tokens whose lower-band KV came from another model (shared layers)",
            labels=["model"],
        )
        for name, model in stats.models.items():
            lane_steps.add_metric([name], model.lane_steps)
            requests.add_metric([name], model.requests)
            tokens.add_metric([name], model.output_tokens)
            cross_tokens.add_metric([name], model.cross_model_tokens)
            for reason, count in model.finished.items():
                finished.add_metric([name, reason], count)
        yield from (lane_steps, requests, finished, tokens, cross_tokens)

        yield CounterMetricFamily("polylane_steps", "engine steps", value=stats.steps)
        yield CounterMetricFamily(
            "polylane_decode_steps", "engine steps with a decode batch", value=stats.decode_steps
        )
        yield CounterMetricFamily("polylane_lane_switches", "decode lane owner changes", value=stats.switches)
        yield CounterMetricFamily(
            "polylane_preemptions", "requests preempted for KV room", value=stats.preemptions
        )
        yield GaugeMetricFamily(
            "polylane_max_concurrent_decode",
            "most models ever observed inside a decode step at once (the lane invariant: 1)",
            value=stats.max_concurrent_decode,
        )
        yield GaugeMetricFamily(
            "polylane_decode_batch_mean", "mean requests per decode step", value=stats.decode_tokens_per_step
        )
        yield from _speculation_metrics(stats)
        yield GaugeMetricFamily(
            "polylane_queue_requests", "unfinished requests admitted", value=self.admission.requests
        )
        yield GaugeMetricFamily(
            "polylane_queue_tokens", "tokens reserved by unfinished requests", value=self.admission.tokens
        )
        yield CounterMetricFamily(
            "polylane_queue_refused", "requests refused with 429", value=self.admission.refused
        )
        yield GaugeMetricFamily(
            "polylane_engine_alive", "1 while the engine loop runs", value=1.0 if self.engine.alive else 0.0
        )


def _speculation_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Per (target, drafter) pair: rounds, tokens, acceptance, tokens per verify, draft cost share,
    on/off decisions; and the most drafters seen inside a decode slot at once."""
    labels = ["target", "drafter"]
    rounds = CounterMetricFamily(
        "polylane_spec_rounds", "speculative rounds (verify passes), by shape", labels=[*labels, "shape"]
    )
    drafted = CounterMetricFamily("polylane_spec_drafted_tokens", "draft tokens proposed", labels=labels)
    verify_steps = CounterMetricFamily(
        "polylane_spec_verify_steps", "target verify passes that carried a draft", labels=labels
    )
    accepted = CounterMetricFamily("polylane_spec_accepted_tokens", "draft tokens accepted", labels=labels)
    emitted = CounterMetricFamily(
        "polylane_spec_emitted_tokens", "tokens produced by speculative rounds", labels=labels
    )
    rate = GaugeMetricFamily(
        "polylane_spec_acceptance_rate", "accepted over proposed draft tokens", labels=labels
    )
    per_verify = GaugeMetricFamily(
        "polylane_spec_tokens_per_verify", "tokens produced per target verify pass", labels=labels
    )
    share = GaugeMetricFamily(
        "polylane_spec_draft_cost_share", "drafting seconds over drafting + verify seconds", labels=labels
    )
    seconds = CounterMetricFamily(
        "polylane_spec_seconds", "seconds spent drafting and verifying", labels=[*labels, "phase"]
    )
    decisions = CounterMetricFamily(
        "polylane_spec_decisions",
        "controller decisions per request and round: on (speculate) or off (plain decode)",
        labels=[*labels, "decision"],
    )
    for pair in stats.speculation:
        key = [pair.target, pair.drafter]
        rounds.add_metric([*key, "chain"], pair.chain_rounds)
        rounds.add_metric([*key, "tree"], pair.tree_rounds)
        drafted.add_metric(key, pair.draft_tokens)
        verify_steps.add_metric(key, pair.rounds)
        accepted.add_metric(key, pair.accepted_tokens)
        emitted.add_metric(key, pair.emitted_tokens)
        rate.add_metric(key, pair.acceptance_rate)
        per_verify.add_metric(key, pair.tokens_per_verify)
        share.add_metric(key, pair.draft_cost_share)
        seconds.add_metric([*key, "draft"], pair.draft_seconds)
        seconds.add_metric([*key, "verify"], pair.verify_seconds)
        decisions.add_metric([*key, "on"], pair.decisions_on)
        decisions.add_metric([*key, "off"], pair.decisions_off)
    yield from (rounds, verify_steps, drafted, accepted, emitted, rate, per_verify, share, seconds, decisions)
    yield GaugeMetricFamily(
        "polylane_max_concurrent_drafters",
        "most drafters ever observed inside a decode slot at once (each inside its target's slot)",
        value=stats.max_concurrent_drafters,
    )


class ServerMetrics:
    """The collector above, and what the server counts itself as requests end: tokens as the
    responses' `usage` reports them (prompt, completion, prompt tokens served from the prefix
    cache: counters that only go up), latency histograms, and HTTP responses by route and status."""

    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, admission))  # type: ignore[arg-type]

        def histogram(name: str, what: str) -> Histogram:
            return Histogram(name, what, ["model"], registry=self.registry, buckets=_LATENCY_BUCKETS)

        self.ttft = histogram("polylane_ttft_seconds", "time to first token")
        self.tpot = histogram("polylane_tpot_seconds", "time per output token after the first")
        self.e2e = histogram("polylane_e2e_seconds", "from submission to the last token (or the end)")
        self.queue = histogram("polylane_queue_seconds", "from submission to the first prefill step")

        def counter(name: str, what: str, labels: tuple[str, ...] = ("model",)) -> Counter:
            return Counter(name, what, list(labels), registry=self.registry)

        self.prompt_tokens = counter("polylane_prompt_tokens", "prompt tokens of ended requests (usage)")
        self.completion_tokens = counter(
            "polylane_completion_tokens", "tokens generated for ended requests (usage)"
        )
        self.prefix_hit_tokens = counter(
            "polylane_prefix_hit_tokens", "prompt tokens served from the prefix cache (usage's cached_tokens)"
        )
        self.http = counter(
            "polylane_http_responses", "HTTP responses, by route and status", ("route", "status")
        )

    def served(self, completions: list[Completion]) -> None:
        """One request's choices have ended: count its tokens as its usage does, observe latencies."""
        first = completions[0]
        self.prompt_tokens.labels(first.model).inc(first.prompt_tokens)
        self.prefix_hit_tokens.labels(first.model).inc(first.cached_tokens)
        self.completion_tokens.labels(first.model).inc(sum(len(c.token_ids) for c in completions))
        for completion in completions:
            for histogram, value in (
                (self.ttft, completion.ttft_seconds),
                (self.tpot, completion.tpot_seconds),
                (self.e2e, completion.e2e_seconds),
                (self.queue, completion.queue_seconds),
            ):
                if value is not None:
                    histogram.labels(completion.model).observe(value)

    def http_response(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
