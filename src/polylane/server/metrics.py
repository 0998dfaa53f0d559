"""`GET /metrics`: Prometheus text, every name prefixed `polylane_`.

What this module owns: the server's histograms (TTFT and TPOT per model, observed as requests
finish) and a collector that reads the engine at scrape time: per-model residency state and
bytes, KV blocks (held, cached, free), compute threads, the other processes' CPU load and this
process's CPU time, lane share and decode steps, requests by finish reason, generated tokens, evictions by
cause, prefix-cache hits, the observed most models decoding at once, speculation per (target,
drafter) pair, and the admission queue.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
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
        requests = self.engine.requests_in_flight()
        for info in snapshot:
            for name in _STATES:
                state.add_metric([info.name, name], 1.0 if info.state == name else 0.0)
            size.add_metric([info.name], info.bytes)
            pinned.add_metric([info.name], 1.0 if info.pinned else 0.0)
            in_flight.add_metric([info.name], requests.get(info.name, 0))
        yield from (state, size, pinned, in_flight)

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

        lane = GaugeMetricFamily(
            "polylane_lane_share", "share of decode steps owned by the model", labels=["model"]
        )
        lane_steps = CounterMetricFamily(
            "polylane_lane_steps", "decode steps owned by the model", labels=["model"]
        )
        requests = CounterMetricFamily("polylane_requests", "requests submitted", labels=["model"])
        finished = CounterMetricFamily(
            "polylane_requests_finished", "requests ended", labels=["model", "reason"]
        )
        tokens = CounterMetricFamily("polylane_generation_tokens", "tokens generated", labels=["model"])
        prefix = GaugeMetricFamily(
            "polylane_prefix_hit_rate", "prompt tokens served from the prefix cache", labels=["model"]
        )
        prefix_tokens = CounterMetricFamily(
            "polylane_prefix_hit_tokens", "prompt tokens served from cache", labels=["model"]
        )
        cross_tokens = CounterMetricFamily(
            "polylane_cross_model_hit_tokens",
            "prompt tokens whose lower-band KV came from another model (shared layers)",
            labels=["model"],
        )
        for name, model in stats.models.items():
            lane.add_metric([name], model.lane_share)
            lane_steps.add_metric([name], model.lane_steps)
            requests.add_metric([name], model.requests)
            tokens.add_metric([name], model.output_tokens)
            prefix.add_metric([name], model.prefix_hit_rate)
            prefix_tokens.add_metric([name], model.prefix_matched_tokens)
            cross_tokens.add_metric([name], model.cross_model_tokens)
            for reason, count in model.finished.items():
                finished.add_metric([name, reason], count)
        yield from (lane, lane_steps, requests, finished, tokens, prefix, prefix_tokens, cross_tokens)

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
    def __init__(self, engine: Engine, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, admission))  # type: ignore[arg-type]
        self.ttft = Histogram(
            "polylane_ttft_seconds",
            "time to first token",
            ["model"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "polylane_tpot_seconds",
            "time per output token after the first",
            ["model"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )

    def observe(self, completion: Completion) -> None:
        if completion.ttft_seconds is not None:
            self.ttft.labels(completion.model).observe(completion.ttft_seconds)
        if completion.tpot_seconds is not None:
            self.tpot.labels(completion.model).observe(completion.tpot_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
