"""Which drafters a target model may use, and its `Speculator` built from leased models.

What this module owns: the engine's side of speculation setup, apart from the engine loop.

- `twin_name` / `twin_formats`: a target's quantised twin is a model of its own in the residency
  manager, named `<target>:int4` (or `:int8`), so its bytes count in the budget like any other.
- `drafter_plans`: the drafters a `SpeculationConfig` asks for, checked against the served
  models: a model drafter must have a tokenizer identical to the target's (`Tokenizer.digest`:
  token list, merges, special ids) and stream fewer weight bytes per token. "auto" means every
  other served model that qualifies (used only while it is resident: idle models draft) plus
  n-gram lookup; a model named explicitly is loaded for drafting if it is not resident.
- `build_speculator`: a `Speculator` over the leases the engine took, each drafter's cost prior
  being its bytes over the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from polylane.policy.scheduling.lane import LaneMonitor
from polylane.policy.speculation.control import AUTO, NGRAM, TWIN_PREFIX, PairStats, SpeculationConfig
from polylane.policy.speculation.cost import SpecMeasurements
from polylane.runtime.loading.model_record import ModelRecord
from polylane.runtime.residency.manager import ModelLease, ResidencyManager
from polylane.runtime.runner import Runner
from polylane.runtime.speculation.drafters import ModelDrafter, NgramDrafter
from polylane.runtime.speculation.speculator import Speculator

log = logging.getLogger(__name__)

NGRAM_RELATIVE_COST = 0.002  # a dictionary lookup against a target forward


class ServedLike(Protocol):
    """What `drafter_plans` reads of a served model (its `ModelRecord`)."""

    name: str
    weight_bytes: int

    @property
    def tokenizer_digest(self) -> str: ...


@dataclass(frozen=True)
class DrafterPlan:
    """One drafter for a target: `name` as reported (a model name, `twin:int4`, `ngram`), its kind
    ("model" | "twin" | "ngram"), the residency name of its model (None for n-gram), and whether
    the engine may load that model for drafting (False: use it only when already resident)."""

    name: str
    kind: str
    model: str | None
    load: bool


def twin_formats(config: SpeculationConfig) -> list[str]:
    """The quantised formats of the twins the config asks for ("int4", "int8")."""
    formats = []
    for drafter in config.drafters:
        if drafter.startswith(TWIN_PREFIX):
            fmt = drafter.partition(":")[2] or "int4"
            if fmt not in formats:
                formats.append(fmt)
    return formats


def twin_name(target: str, fmt: str) -> str:
    return f"{target}:{fmt}"


def drafter_plans(
    target: str, config: SpeculationConfig, served: Mapping[str, ServedLike]
) -> list[DrafterPlan]:
    """The drafters `config` gives `target`, in the config's order (see the module docstring)."""
    me = served[target]
    plans: list[DrafterPlan] = []
    seen: set[str] = set()

    def add(plan: DrafterPlan) -> None:
        if plan.name not in seen:
            seen.add(plan.name)
            plans.append(plan)

    for entry in config.drafters:
        if entry == NGRAM:
            add(DrafterPlan(NGRAM, NGRAM, None, load=False))
        elif entry.startswith(TWIN_PREFIX):
            fmt = entry.partition(":")[2] or "int4"
            add(DrafterPlan(f"twin:{fmt}", "twin", twin_name(target, fmt), load=True))
        elif entry == AUTO:
            for name, other in served.items():
                if name != target and _qualifies(me, other):
                    add(DrafterPlan(name, "model", name, load=False))
            add(DrafterPlan(NGRAM, NGRAM, None, load=False))
        elif entry in served and entry != target:
            why = _why_not(me, served[entry])
            if why:
                log.warning("model %s cannot draft for %s: %s", entry, target, why)
                continue
            add(DrafterPlan(entry, "model", entry, load=True))
        else:
            log.warning("speculation for %s: drafter %r is not a served model; ignored", target, entry)
    return plans


def build_speculator(
    target: str,
    target_bytes: int,
    config: SpeculationConfig,
    plans: Sequence[DrafterPlan],
    leases: Mapping[str, ModelLease],
    monitor: LaneMonitor,
    pairs: dict[str, PairStats] | None = None,
    costs: SpecMeasurements | None = None,
) -> Speculator:
    """A speculator with every planned drafter whose model is leased (`leases` by plan name)."""
    speculator = Speculator(target, config, monitor, pairs=pairs, costs=costs)
    for plan in plans:
        if plan.kind == NGRAM:
            speculator.add_drafter(NgramDrafter(config.ngram_min, config.ngram_max), NGRAM_RELATIVE_COST)
            continue
        lease = leases.get(plan.name)
        if lease is None:
            continue
        add_model_drafter(speculator, plan, lease, target_bytes, monitor)
    return speculator


def add_model_drafter(
    speculator: Speculator, plan: DrafterPlan, lease: ModelLease, target_bytes: int, monitor: LaneMonitor
) -> None:
    drafter = ModelDrafter(plan.name, plan.kind, lease.kv, speculator.target, monitor)
    relative = lease.model.weight_bytes / target_bytes if target_bytes > 0 else 0.5
    speculator.add_drafter(drafter, relative)


def _qualifies(target: ServedLike, other: ServedLike) -> bool:
    return not _why_not(target, other)


def _why_not(target: ServedLike, other: ServedLike) -> str:
    if other.tokenizer_digest != target.tokenizer_digest:
        return "its tokenizer differs from the target's (token list, merges or special ids)"
    if target.weight_bytes and other.weight_bytes >= target.weight_bytes:
        return (
            f"it streams {other.weight_bytes} bytes per token, not fewer than the target's "
            f"{target.weight_bytes}"
        )
    return ""


@dataclass(frozen=True)
class PairSnapshot:
    """One (target, drafter) pair's numbers at a moment (for `EngineStats` and /metrics)."""

    target: str
    drafter: str
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    acceptance_rate: float
    tokens_per_verify: float
    draft_seconds: float
    verify_seconds: float
    draft_cost_share: float
    chain_rounds: int
    tree_rounds: int
    decisions_on: int
    decisions_off: int


class SpeculationSetup:
    """The engine's speculation bookkeeping: configs per target, twins registered with the
    residency manager, drafter leases taken (loader thread) and speculators attached to the runner
    (engine thread), and pair statistics and measured costs kept across reloads: the scheduler
    lets a target's lease go whenever it has no requests, and a speculator rebuilt from scratch
    would measure its verify costs again for every request."""

    def __init__(self, manager: ResidencyManager, runner: Runner) -> None:
        self.manager = manager
        self.runner = runner
        self.configs: dict[str, SpeculationConfig] = {}
        self.served: dict[str, ServedLike] = {}
        self.pairs: dict[str, dict[str, PairStats]] = {}  # target → drafter → statistics
        self.costs: dict[str, SpecMeasurements] = {}  # target → what its speculation costs

    def register(self, record: ModelRecord) -> None:
        """A served model (every one, so that it can be found as a drafter); with a speculation
        config, it speculates, and its twins become models of the residency manager (cold until
        used: the same record under the twin's name and format)."""
        self.served[record.name] = record
        config = record.speculation
        if config is None:
            return
        self.configs[record.name] = config
        self.pairs.setdefault(record.name, {})
        self.costs.setdefault(record.name, SpecMeasurements())
        for fmt in twin_formats(config):
            self.manager.register(record.twin(twin_name(record.name, fmt), fmt))

    def acquire_drafters(self, target: str) -> dict[str, ModelLease]:
        """Loader thread: leases on the target's drafter models (loading the ones it may load);
        a drafter that cannot be had is skipped (logged), never an error of the target."""
        config = self.configs.get(target)
        if config is None:
            return {}
        leases: dict[str, ModelLease] = {}
        for plan in drafter_plans(target, config, self.served):
            if plan.model is None:
                continue
            try:
                lease = (
                    self.manager.acquire(plan.model) if plan.load else self.manager.try_acquire(plan.model)
                )
            except Exception as error:  # no room, a broken file: speculate without it
                log.warning("drafter %s for %s is unavailable: %s", plan.name, target, error)
                continue
            if lease is not None:
                leases[plan.name] = lease
        return leases

    def attach(self, target: str, lease: ModelLease, drafters: dict[str, ModelLease]) -> None:
        """Engine thread, the target just attached: build and attach its speculator."""
        config = self.configs.get(target)
        if config is None or target in self.runner.speculators:
            for drafter in drafters.values():
                drafter.release()
            return
        plans = drafter_plans(target, config, self.served)
        speculator = build_speculator(
            target,
            lease.model.weight_bytes,
            config,
            plans,
            drafters,
            self.runner.monitor,
            self.pairs[target],
            self.costs[target],
        )
        used = [d for name, d in drafters.items() if name in speculator.drafters]
        for name, drafter in drafters.items():
            if name not in speculator.drafters:
                drafter.release()
        self.runner.attach_speculator(target, speculator, used)

    def offer(self, model: str) -> None:
        """Engine thread, `model` just became resident: attached targets that may draft with it
        (and do not yet) take a lease on it."""
        for target, speculator in list(self.runner.speculators.items()):
            if target == model or model in speculator.drafters:
                continue
            plan = next(
                (p for p in drafter_plans(target, self.configs[target], self.served) if p.model == model),
                None,
            )
            if plan is None or plan.kind == "twin":
                continue
            lease = self.manager.try_acquire(model)
            if lease is None:
                continue
            target_lease = self.runner.leases.get(target)
            target_bytes = target_lease.model.weight_bytes if target_lease is not None else 0
            add_model_drafter(speculator, plan, lease, target_bytes, self.runner.monitor)
            self.runner.add_drafter_lease(target, lease)

    def lookahead(self, target: str) -> int:
        """Slots past its token that a decode step of `target` reserves for a verify pass: its
        largest draft (0 while it has no speculator or no drafter)."""
        speculator = self.runner.speculators.get(target)
        if speculator is None or not speculator.drafters:
            return 0
        return max(speculator.config.max_draft_tokens, speculator.config.max_tree_nodes)

    def snapshot(self) -> list[PairSnapshot]:
        out = []
        for target, pairs in list(self.pairs.items()):
            for drafter, pair in list(pairs.items()):
                out.append(
                    PairSnapshot(
                        target,
                        drafter,
                        pair.rounds,
                        pair.draft_tokens,
                        pair.accepted_tokens,
                        pair.emitted_tokens,
                        pair.acceptance_rate,
                        pair.tokens_per_verify,
                        pair.draft_seconds,
                        pair.verify_seconds,
                        pair.draft_cost_share,
                        pair.chain_rounds,
                        pair.tree_rounds,
                        pair.decisions_on,
                        pair.decisions_off,
                    )
                )
        return out


__all__ = [
    "DrafterPlan",
    "PairSnapshot",
    "SpeculationSetup",
    "add_model_drafter",
    "build_speculator",
    "drafter_plans",
    "twin_formats",
    "twin_name",
]
