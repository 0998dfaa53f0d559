"""The four bench workloads as seeded, reproducible request lists. Pure: no torch, no clocks.

What this module owns: the prompt library shipped in `polylane/bench/prompts/*.jsonl` (chat, code,
extraction, summarisation, code edits, repetitive copying, creative writing, and long system
prompts with questions for them), and turning (workload name, options, seed, repeat) into a
`Workload`: phases of `BenchRequest`s with arrival times, token limits and a concurrency cap.
The same arguments always give the same requests.

Workloads:
- `single`: one model (the first given), one stream at a time. Phase `prefill`: long document
  prompts (about `prompt_tokens` tokens, sent as plain text), one output token each: TTFT is the
  prefill. Phase `decode`: chat prompts, `max_tokens` tokens each, one at a time. Phase
  `batch-<B>`: B chat prompts sent at once (the batch-B decode speed).
- `mix`: many models; each request picks its model by Zipf popularity (weight 1 / rank^s, rank
  by the order models are given), its category (chat, code, extraction, summarisation) uniformly
  and a prompt of that category; arrivals are a Poisson process of `rate` requests/s (0: all at
  once); at most `concurrency` requests are in flight; output lengths are uniform in
  [max_tokens / 2, max_tokens].
- `shared-prefix`: `prefixes` long system prompts (about 600 tokens each), each shared by many
  requests that ask short questions under it; models by Zipf popularity, Poisson arrivals.
- `shared-prefix` with `cross_model`: the prefill shared across models. The first model is the
  provider, every other one a consumer (a model sharing a layer band with it: a sibling, or an
  alias). One phase per consumer, named after it, one request at a time: for each of `requests`
  document prompts of about `prompt_tokens` tokens (sent as plain text), the provider prefills
  it (category `provider`), then the consumer gets the same prompt (`shared`: its lower band comes
  from the provider's cache) and one that no model has seen (`cold`: the same notes under another
  reference tag, so the same length but no cached block in common), in alternating order so drift
  falls on both alike.
- `structured`: structured outputs. Extraction prompts to the first model, one at a time, to the
  end of sequence: phase `free` as they are, phase `json` with a JSON schema the output must match
  (`STRUCTURED_SCHEMA`, sent as `response_format`); the same prompts under other reference tags, so
  the constrained phase finds nothing of the free one in a prefix cache. Run beside `plain`
  (speculation off), it gives tokens/s constrained vs free, with and without speculation.
- `spec`: one phase per prompt category (`categories`; default code, chat and extraction; also
  code-edit, repetitive, creative, summarisation), all requests to the first model (the target;
  any other model is served only to draft for it), one at a time, stopping at end of sequence
  (output lengths are then the model's own).

Every request starts with a short reference tag drawn from (seed, repeat, index), so repeats never
find each other's prompts in a prefix cache (a server that stays up between repeats would
otherwise serve repeat 2 from repeat 1's KV); in `shared-prefix` the tag of each system prompt is
drawn per repeat, so requests of one repeat share it and repeats do not. Requests ignore the end of
sequence (except in `spec`) so that every system generates exactly the same number of tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

WORKLOADS = ("single", "mix", "shared-prefix", "spec", "structured")
MIX_CATEGORIES = ("chat", "code", "extraction", "summarisation")
SPEC_CATEGORIES = ("code", "chat", "extraction")  # issue 8's list; drafting pays most on extraction
PROMPT_CATEGORIES = ("chat", "code", "extraction", "summarisation", "code-edit", "repetitive", "creative")
CROSS_MODEL_CATEGORIES = ("provider", "shared", "cold")
DOCUMENT_SOURCES = ("summarisation", "extraction", "system")


@dataclass(frozen=True)
class PromptEntry:
    id: str
    category: str
    prompt: str
    questions: tuple[str, ...] = ()


@cache
def load_prompts(category: str) -> tuple[PromptEntry, ...]:
    """The shipped prompts of one category (`prompts/<category>.jsonl`), in file order."""
    path = resources.files("polylane.bench").joinpath("prompts", f"{category}.jsonl")
    if not path.is_file():
        raise ValueError(f"no prompt file for category {category!r}")
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = json.loads(line)
            entries.append(
                PromptEntry(data["id"], data["category"], data["prompt"], tuple(data.get("questions", ())))
            )
    return tuple(entries)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Drivers send it as chat messages (`messages()`) when `chat` is
    set and the model has a chat template, and as a plain completion prompt (`text()`) otherwise."""

    request_id: str
    model: str
    category: str
    user: str
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the phase starts
    system: str | None = None
    chat: bool = True
    ignore_eos: bool = True
    json_schema: str | None = None  # structured outputs: the schema the output must match (JSON text)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.user}]

    def text(self) -> str:
        return f"{self.system}\n\n{self.user}" if self.system else self.user

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRequest:
        return cls(**data)


@dataclass(frozen=True)
class Phase:
    """Requests replayed together: each is sent at its arrival time, at most `concurrency` at once
    (0: no cap)."""

    name: str
    requests: tuple[BenchRequest, ...]
    concurrency: int = 0
    description: str = ""
    cpu_hog: int = 0  # busy-loop processes the harness keeps running while this phase runs

    @property
    def models(self) -> list[str]:
        return sorted({r.model for r in self.requests})

    def only(self, model: str) -> Phase:
        """This phase's requests for one model (one process per model), the cap scaled to its share:
        max(1, round(concurrency × its share of the requests))."""
        mine = tuple(r for r in self.requests if r.model == model)
        cap = self.concurrency
        if cap and self.requests:
            cap = max(1, round(cap * len(mine) / len(self.requests)))
        return replace(self, requests=mine, concurrency=cap)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "description": self.description,
            "requests": [r.to_dict() for r in self.requests],
            "cpu_hog": self.cpu_hog,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Phase:
        requests = tuple(BenchRequest.from_dict(r) for r in data["requests"])
        return cls(
            data["name"], requests, data["concurrency"], data.get("description", ""), data.get("cpu_hog", 0)
        )


@dataclass(frozen=True)
class Workload:
    name: str
    phases: tuple[Phase, ...]
    options: WorkloadOptions

    @property
    def models(self) -> list[str]:
        names: list[str] = []
        for phase in self.phases:
            names += [m for m in (r.model for r in phase.requests) if m not in names]
        return names


@dataclass(frozen=True)
class WorkloadOptions:
    """What shapes a workload. None means the workload's default (`DEFAULTS`)."""

    models: tuple[str, ...]
    seed: int = 0
    requests: int | None = None  # per phase (single, spec) or in all (mix, shared-prefix)
    max_tokens: int | None = None
    concurrency: int | None = None
    rate: float | None = None  # Poisson arrivals per second; 0: all at once
    zipf_s: float = 1.1
    prompt_tokens: int = 512  # single: the prefill prompt's length (approximate)
    batch: int = 8  # single: requests decoding together in the batch phase
    prefixes: int = 3  # shared-prefix: distinct system prompts
    categories: tuple[str, ...] = SPEC_CATEGORIES  # spec: one phase per prompt category
    cross_model: bool = False  # shared-prefix: across models (first provider, others consumers)
    cpu_hog: int = 0  # >0: every phase again, under that many busy-loop processes (HOG_SUFFIX)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a workload needs at least one model")
        for name, value in (("requests", self.requests), ("max_tokens", self.max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.concurrency is not None and self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (0: no cap), got {self.concurrency}")
        if self.rate is not None and self.rate < 0:
            raise ValueError(f"rate must be >= 0 (0: all at once), got {self.rate}")
        if self.batch < 1 or self.prefixes < 1 or self.prompt_tokens < 16:
            raise ValueError("batch and prefixes must be >= 1, prompt_tokens >= 16")
        unknown = [c for c in self.categories if c not in PROMPT_CATEGORIES]
        if unknown or not self.categories:
            raise ValueError(f"categories must be among {', '.join(PROMPT_CATEGORIES)}, got {unknown}")
        if self.cpu_hog < 0:
            raise ValueError(f"cpu_hog must be >= 0, got {self.cpu_hog}")
        if self.cross_model and len(self.models) < 2:
            raise ValueError("cross-model shared-prefix needs a provider and at least one consumer model")

    def defaults_key(self, workload: str) -> str:
        """The key of `DEFAULTS` for this workload and mode."""
        return "cross-model" if workload == "shared-prefix" and self.cross_model else workload

    def resolved(self, workload: str) -> WorkloadOptions:
        """These options with the workload's defaults filled in."""
        defaults = DEFAULTS[self.defaults_key(workload)]
        return replace(
            self,
            requests=self.requests if self.requests is not None else defaults["requests"],
            max_tokens=self.max_tokens if self.max_tokens is not None else defaults["max_tokens"],
            concurrency=self.concurrency if self.concurrency is not None else defaults["concurrency"],
            rate=self.rate if self.rate is not None else defaults["rate"],
        )


DEFAULTS: dict[str, dict[str, Any]] = {
    "single": {"requests": 3, "max_tokens": 64, "concurrency": 1, "rate": 0.0},
    "mix": {"requests": 48, "max_tokens": 48, "concurrency": 8, "rate": 1.0},
    "shared-prefix": {"requests": 24, "max_tokens": 32, "concurrency": 4, "rate": 1.0},
    "spec": {"requests": 4, "max_tokens": 64, "concurrency": 1, "rate": 0.0},
    "structured": {"requests": 4, "max_tokens": 128, "concurrency": 1, "rate": 0.0},
    "cross-model": {"requests": 3, "max_tokens": 1, "concurrency": 1, "rate": 0.0},
}


# `--cpu-hog`: the twin of each phase, run while busy-loop processes keep cores busy
HOG_SUFFIX = "+hog"
HOG_REPEAT_OFFSET = 1_000_000  # the twins' prompts are those of another repeat (other reference tags)


def zipf_weights(count: int, s: float) -> list[float]:
    """Popularity of ranks 1..count: 1 / rank^s, normalised to sum to 1."""
    raw = [1.0 / (rank**s) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (s) of a Poisson process: exponential gaps of mean 1 / rate; rate 0: all at 0."""
    if rate <= 0:
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def tag(seed: int, repeat: int, index: int | str) -> str:
    """A short reference code, the same for the same arguments."""
    return f"{random.Random(f'{seed}:{repeat}:{index}').randrange(16**6):06x}"


def build(name: str, options: WorkloadOptions, repeat: int = 0) -> Workload:
    """The workload `name` for one repeat (same arguments, same requests)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    options = options.resolved(name)
    rng = random.Random(f"{name}:{options.seed}:{repeat}")
    builders = {"single": _single, "mix": _mix, "shared-prefix": _shared_prefix, "spec": _spec}
    builder = builders.get(name, _structured)
    phases = builder(options, rng, repeat)
    if options.cpu_hog:
        # every phase idle, then each again under load with other prompts (nothing cached by the idle
        # one); the loaded twins last, so that no idle phase follows a loaded one (the engine's
        # thread count would still be recovering from the neighbour: `policy/scheduling/threads.py`)
        busy_rng = random.Random(f"{name}:{options.seed}:{repeat}{HOG_SUFFIX}")
        busy = builder(options, busy_rng, HOG_REPEAT_OFFSET + repeat)
        described = f" — with {options.cpu_hog} busy-loop process(es) running"
        phases += tuple(
            replace(
                twin,
                name=idle.name + HOG_SUFFIX,
                cpu_hog=options.cpu_hog,
                description=idle.description + described,
            )
            for idle, twin in zip(phases, busy, strict=True)
        )
    return Workload(name, phases, options)


def idle_phase_name(name: str) -> str:
    """The phase a `+hog` twin repeats ("decode+hog" → "decode"); other names unchanged."""
    return name.removesuffix(HOG_SUFFIX)


def _user(options: WorkloadOptions, repeat: int, index: int, text: str) -> str:
    return f"(ref {tag(options.seed, repeat, index)}) {text}"


def document(rng: random.Random, words: int) -> str:
    """Passages of the shipped prompts, in a seeded order, until about `words` words."""
    passages = [e.prompt for category in DOCUMENT_SOURCES for e in load_prompts(category)]
    rng.shuffle(passages)
    chosen: list[str] = []
    count = 0
    while count < words:
        passage = passages[len(chosen) % len(passages)]
        chosen.append(passage)
        count += len(passage.split())
    return " ".join(" ".join(chosen).split()[:words])


def _single(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    model, count, max_tokens = options.models[0], options.requests or 1, options.max_tokens or 1
    chats = list(load_prompts("chat"))
    words = max(8, round(options.prompt_tokens * 0.75))  # English: about 4/3 tokens per word
    prefill = tuple(
        BenchRequest(
            f"prefill-{i}",
            model,
            "document",
            _user(options, repeat, f"prefill-{i}", f"Read these notes.\n\n{document(rng, words)}"),
            max_tokens=1,
            chat=False,
        )
        for i in range(count)
    )
    decode = tuple(
        BenchRequest(
            f"decode-{i}",
            model,
            "chat",
            _user(options, repeat, f"decode-{i}", rng.choice(chats).prompt),
            max_tokens,
        )
        for i in range(count)
    )
    batch = tuple(
        BenchRequest(
            f"batch-{i}",
            model,
            "chat",
            _user(options, repeat, f"batch-{i}", chats[(i + repeat) % len(chats)].prompt),
            max_tokens,
        )
        for i in range(options.batch)
    )
    return (
        Phase(
            "prefill",
            prefill,
            1,
            f"{_plural(count, 'prompt')} of about {options.prompt_tokens} tokens, one at a time",
        ),
        Phase("decode", decode, 1, f"{_plural(count, 'stream')} of {max_tokens} tokens, one at a time"),
        Phase(
            f"batch-{options.batch}",
            batch,
            options.batch,
            f"{options.batch} streams of {max_tokens} tokens sent at once",
        ),
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _lengths(options: WorkloadOptions, rng: random.Random) -> int:
    top = options.max_tokens or 1
    return rng.randint(max(1, top // 2), top)


def _mix(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    count = options.requests or 1
    weights = zipf_weights(len(options.models), options.zipf_s)
    arrivals = poisson_arrivals(count, options.rate or 0.0, rng)
    requests = []
    for i, arrival in enumerate(arrivals):
        model = rng.choices(options.models, weights)[0]
        category = rng.choice(MIX_CATEGORIES)
        prompt = rng.choice(load_prompts(category)).prompt
        requests.append(
            BenchRequest(
                f"mix-{i}",
                model,
                category,
                _user(options, repeat, i, prompt),
                _lengths(options, rng),
                arrival,
            )
        )
    description = (
        f"{count} requests over {len(options.models)} models (Zipf s={options.zipf_s}), Poisson "
        f"{options.rate}/s, at most {options.concurrency or 'any'} in flight"
    )
    return (Phase("mix", tuple(requests), options.concurrency or 0, description),)


def _shared_prefix(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    if options.cross_model:
        return _cross_model(options, rng, repeat)
    count = options.requests or 1
    systems = list(load_prompts("system"))[: options.prefixes]
    if len(systems) < options.prefixes:
        raise ValueError(f"only {len(systems)} system prompts are shipped; asked for {options.prefixes}")
    weights = zipf_weights(len(options.models), options.zipf_s)
    arrivals = poisson_arrivals(count, options.rate or 0.0, rng)
    requests = []
    for i, arrival in enumerate(arrivals):
        entry = systems[i % len(systems)] if i < len(systems) else rng.choice(systems)
        system = f"Session {tag(options.seed, repeat, entry.id)}.\n{entry.prompt}"
        question = rng.choice(entry.questions)
        requests.append(
            BenchRequest(
                f"shared-{i}",
                rng.choices(options.models, weights)[0],
                entry.id,
                _user(options, repeat, i, question),
                _lengths(options, rng),
                arrival,
                system=system,
            )
        )
    description = (
        f"{count} requests sharing {len(systems)} system prompts, Poisson {options.rate}/s, "
        f"at most {options.concurrency or 'any'} in flight"
    )
    return (Phase("shared-prefix", tuple(requests), options.concurrency or 0, description),)


def _cross_model(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    count, max_tokens = options.requests or 1, options.max_tokens or 1
    provider, consumers = options.models[0], options.models[1:]
    words = max(8, round(options.prompt_tokens * 0.75))  # English: about 4/3 tokens per word

    phases = []
    for consumer in consumers:
        requests: list[BenchRequest] = []
        for i in range(count):
            # The same notes under two tags: the same length, but no whole block in common.
            notes = f"Read these notes.\n\n{document(rng, words)}"
            shared = _user(options, repeat, f"{consumer}-shared-{i}", notes)
            cold = _user(options, repeat, f"{consumer}-cold-{i}", notes)
            made = {
                kind: BenchRequest(f"{consumer}-{kind}-{i}", model, kind, text, max_tokens, chat=False)
                for kind, model, text in (
                    ("provider", provider, shared),
                    ("shared", consumer, shared),
                    ("cold", consumer, cold),
                )
            }
            order = ("shared", "cold") if (i + repeat) % 2 == 0 else ("cold", "shared")
            requests += [made["provider"], made[order[0]], made[order[1]]]
        phases.append(
            Phase(
                consumer,
                tuple(requests),
                1,
                f"{_plural(count, 'prompt')} of about {options.prompt_tokens} tokens: {provider} prefills "
                f"each, then {consumer} gets it (shared) and an unseen one (cold), one at a time",
            )
        )
    return tuple(phases)


def _spec(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    count, max_tokens = options.requests or 1, options.max_tokens or 1
    target = options.models[0]
    phases = []
    for category in options.categories:
        pool = list(load_prompts(category))
        rng.shuffle(pool)
        requests = tuple(
            BenchRequest(
                f"{category}-{i}",
                target,
                category,
                _user(options, repeat, f"{category}-{i}", pool[i % len(pool)].prompt),
                max_tokens,
                ignore_eos=False,
            )
            for i in range(count)
        )
        phases.append(
            Phase(category, requests, 1, f"{_plural(count, category + ' prompt')}, one at a time, to EOS")
        )
    return tuple(phases)


# What the `structured` workload's constrained phase asks for: the facts of an extraction prompt.
STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
            "maxItems": 12,
        },
        "count": {"type": "integer", "minimum": 0},
    },
    "required": ["items", "count"],
    "additionalProperties": False,
}


def _structured(options: WorkloadOptions, rng: random.Random, repeat: int) -> tuple[Phase, ...]:
    count, max_tokens = options.requests or 1, options.max_tokens or 1
    pool = list(load_prompts("extraction"))
    rng.shuffle(pool)
    phases = []
    for name, schema in (("free", None), ("json", json.dumps(STRUCTURED_SCHEMA))):
        requests = tuple(
            BenchRequest(
                f"{name}-{i}",
                options.models[0],
                "extraction",
                _user(options, repeat, f"{name}-{i}", pool[i % len(pool)].prompt),
                max_tokens,
                ignore_eos=False,
                json_schema=schema,
            )
            for i in range(count)
        )
        what = "free text" if schema is None else "output matching a JSON schema"
        phases.append(
            Phase(name, requests, 1, f"{_plural(count, 'extraction prompt')}, one at a time, {what}")
        )
    return tuple(phases)


def describe(workload: Workload) -> list[dict[str, Any]]:
    """Per phase: name, description, concurrency, request counts per model and per category, the
    last arrival and the total of max_tokens."""
    out = []
    for phase in workload.phases:
        models: dict[str, int] = {}
        categories: dict[str, int] = {}
        for r in phase.requests:
            models[r.model] = models.get(r.model, 0) + 1
            categories[r.category] = categories.get(r.category, 0) + 1
        out.append(
            {
                "name": phase.name,
                "description": phase.description,
                "requests": len(phase.requests),
                "concurrency": phase.concurrency,
                "models": models,
                "categories": categories,
                "last_arrival_s": max((r.arrival_s for r in phase.requests), default=0.0),
                "max_tokens_total": sum(r.max_tokens for r in phase.requests),
            }
        )
    return out
