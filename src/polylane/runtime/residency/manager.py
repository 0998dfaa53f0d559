"""Many models in one process under one byte budget: the runtime side of residency.

What this module owns: turning the `ResidencyPool` policy into loaded models and freed memory.
`acquire(name)` returns a lease on a resident model (its weights and its `ModelKV`), loading it
first if needed; the bytes a model counts are measured after loading (parameter bytes + its KV
cache reservation), not guessed. Evicting drops every reference the manager holds, so the memory
goes back (and asks the C allocator to return freed pages to the OS).

Thread-safe: one lock guards the pool; a load runs outside it (other models keep serving), and
threads wanting a model that is loading wait for that load. A model's bytes (weights and KV
reservation) are estimated from its file's header once, when it is registered, so one that does
not fit is refused before anything is evicted; a load that fails (a file unreadable past its
header, or gone since) fails only its own admission, with a clear error, and returns the
reservation. All models run on one device (`device`, CPU or CUDA): on CPU the host tier is the
device; on CUDA the budget counts device memory, and an evicted model is dropped, not paged out to
the host (its next use loads it again).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from polylane.policy.residency.eviction import DEFAULT_EVICTION
from polylane.policy.residency.pool import (
    LOADING,
    Eviction,
    ModelState,
    NoRoomError,
    ResidencyCounters,
    ResidencyError,
    ResidencyPool,
)
from polylane.runtime.kv.model_kv import ModelKV
from polylane.runtime.loading.load_thread import run_in_transient_thread
from polylane.runtime.loading.loaded_model import LoadedModel, kv_cache_bytes, load_model
from polylane.runtime.loading.loader import (
    IN_PLACE_ACTIVATION_BITS,
    LoadError,
    estimate_weight_bytes,
    parse_dtype,
)
from polylane.runtime.loading.model_record import ModelRecord
from polylane.runtime.model.device import resolve_device
from polylane.runtime.model.quantize import QUANTISED_FORMATS

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


class ModelLoadError(RuntimeError):
    """Loading one model failed; the pool and every other model are unchanged."""


@dataclass
class ResidentModel:
    """What a resident model holds: weights, tokenizer, KV; the pool's handle for it."""

    model: LoadedModel
    kv: ModelKV
    bytes: int
    load_seconds: float
    rss_delta_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """One model's residency state, for `snapshot()` (and the server's /v1/models)."""

    name: str
    source: str
    dtype: str
    state: str  # cold | loading | resident
    bytes: int  # measured when resident, estimated from the file header otherwise
    pinned: bool
    in_flight: int
    last_used: int
    loads: int
    load_seconds: float | None  # of the current residency


@dataclass(frozen=True)
class KVBlocks:
    """A resident model's KV blocks: all of its reservation, those requests alone hold, and those in
    the prefix cache (reusable; requests may share them; the unshared ones are dropped for room)."""

    total: int
    held: int
    cached: int


@dataclass(frozen=True)
class ManagerCounters:
    pool: ResidencyCounters
    load_seconds: float  # total seconds spent loading (paging in)


class ModelLease:
    """A model held in memory for one request; `release()` (or leave the `with`) exactly once."""

    def __init__(self, manager: ResidencyManager, name: str, resident: ResidentModel) -> None:
        self.name = name
        self.model = resident.model
        self.kv = resident.kv
        self._manager = manager
        self._released = False

    def release(self) -> None:
        if self._released:
            raise ResidencyError(f"lease on {self.name!r} released twice")
        self._released = True
        self._manager._release(self.name)

    def __enter__(self) -> ModelLease:
        return self

    def __exit__(self, *_: Any) -> None:
        if not self._released:
            self.release()


class ResidencyManager:
    def __init__(
        self,
        budget_bytes: int,
        *,
        eviction: str = DEFAULT_EVICTION,
        block_size: int = DEFAULT_BLOCK_SIZE,
        quiet: bool = True,
        prefix_cache: bool = True,
        device: str | torch.device = "auto",
    ) -> None:
        """`eviction`: a policy of `policy/residency/eviction.py` ("lru", or "cost": cost-aware, fed each
        model's measured load seconds). `prefix_cache`: give each loaded model's KV a prefix tree (off: every
        prompt is prefilled in full, e.g. the `plain` bench baseline). `device`: where every model
        runs ("auto": CUDA when torch sees a GPU, else CPU; `runtime.model.device`)."""
        self.device = resolve_device(device)
        self.block_size = block_size
        self.quiet = quiet
        self.prefix_cache = prefix_cache
        _set_mmap_threshold(RUN_MMAP_THRESHOLD)
        self._pool = ResidencyPool(budget_bytes, eviction=eviction)
        self._records: dict[str, ModelRecord] = {}
        self._estimates: dict[str, int] = {}  # bytes each will hold once loaded, from its header
        self._load_seconds = 0.0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    # ------------------------------------------------------------------ registry

    def register(self, record: ModelRecord) -> None:
        """Declare a model (cold), sized once from its file's header: weights and KV reservation, so
        that it is admitted, and others evicted for it, by what it takes (`runtime.loading.
        model_record`: resolved once; loads read `record.file`). An unreadable header raises
        ModelLoadError here."""
        if record.dtype not in (*QUANTISED_FORMATS, *IN_PLACE_ACTIVATION_BITS):
            parse_dtype(record.dtype)
        if record.kv_tokens < self.block_size:
            raise ResidencyError(
                f"model {record.name!r}: kv_tokens must be >= {self.block_size}, got {record.kv_tokens}"
            )
        estimate = self._estimate(record)
        with self._lock:
            self._pool.register(record.name, estimate, record.pinned)
            self._records[record.name] = record
            self._estimates[record.name] = estimate

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._records)

    # ------------------------------------------------------------------ acquire / release

    def acquire(self, name: str) -> ModelLease:
        """A lease on `name`, loading it (and evicting idle models) if it is not resident.

        A request that finds the model loading waits for that load; if it fails, the request tries
        the load itself, so it reports its own error (no room, a broken file) rather than another's.
        """
        with self._lock:
            while self._pool.state(name).state == LOADING:
                self._changed.wait()
            if self._pool.state(name).state == "resident":
                self._pool.begin_load(name)  # a hit: refreshes recency
                return ModelLease(self, name, self._pool.acquire(name))  # type: ignore[arg-type]
            record = self._records[name]
            self._drop(self._pool.begin_load(name, self._estimates[name]))  # cold: admit it
        return self._load_and_lease(name, record)

    def try_acquire(self, name: str) -> ModelLease | None:
        """A lease on `name` if it is resident now (a hit), else None; never loads or waits."""
        with self._lock:
            if name not in self._records or self._pool.state(name).state != "resident":
                return None
            self._pool.begin_load(name)  # a hit: refreshes recency
            return ModelLease(self, name, self._pool.acquire(name))  # type: ignore[arg-type]

    def _load_and_lease(self, name: str, record: ModelRecord) -> ModelLease:
        try:
            resident = self._load(record)
        except BaseException as error:
            with self._lock:
                self._pool.abort_load(name)
                self._changed.notify_all()
            if isinstance(error, (LoadError, OSError)):
                raise ModelLoadError(f"cannot load model {name!r} from {record.source}: {error}") from error
            raise
        with self._lock:
            try:
                self._drop(self._pool.finish_load(name, resident.bytes, resident))
            except ResidencyError as error:
                self._changed.notify_all()
                kind = NoRoomError if isinstance(error, NoRoomError) else ModelLoadError
                raise kind(f"model {name!r} measured {resident.bytes} bytes: {error}") from error
            self._pool.set_reload_cost(name, resident.load_seconds)  # the last measured load
            self._load_seconds += resident.load_seconds
            # The model's objects (and all others alive) go out of the collector's passes: with them
            # in, a pass over the oldest generation took 176-195 ms (SmolLM2 resident), every thread
            # stopped, and Python makes one whenever the objects surviving since the last reach a
            # quarter of the old ones, whatever step is running. _drop puts them back to collect.
            _freeze_alive()
            handle = self._pool.acquire(name)
            self._changed.notify_all()
            return ModelLease(self, name, handle)  # type: ignore[arg-type]

    def _release(self, name: str) -> None:
        with self._lock:
            self._pool.release(name)

    # ------------------------------------------------------------------ control

    def pin(self, name: str) -> None:
        with self._lock:
            self._pool.pin(name)
        log.info("pinned %s: never evicted for room until unpinned", name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pool.unpin(name)
        log.info("unpinned %s", name)

    def evict(self, name: str, force: bool = False) -> None:
        with self._lock:
            self._drop([self._pool.evict(name, force)])

    def set_budget(self, budget_bytes: int) -> list[str]:
        """Change the budget; returns the models evicted to fit it (in eviction order)."""
        with self._lock:
            before = self._pool.budget_bytes
            evictions = self._pool.set_budget(budget_bytes)
            names = [e.name for e in evictions]
            self._drop(evictions)
        log.info(
            "budget %.2f → %.2f GiB%s",
            before / 2**30,
            budget_bytes / 2**30,
            f", evicted {', '.join(names)}" if names else "",
        )
        return names

    @property
    def budget_bytes(self) -> int:
        return self._pool.budget_bytes

    @property
    def eviction(self) -> str:
        """The eviction policy's name (`policy/residency/eviction.py`)."""
        return self._pool.eviction

    def snapshot(self) -> list[ModelInfo]:
        with self._lock:
            return [self._info(state) for state in self._pool.snapshot()]

    def kv_blocks(self) -> dict[str, KVBlocks]:
        """Per resident model, its KV blocks (read without the engine's lock: a scrape's view)."""
        with self._lock:
            handles = {state.name: self._pool.handle(state.name) for state in self._pool.snapshot()}
        blocks = {}
        for name, resident in handles.items():
            if resident is None:
                continue
            pool, cached = resident.kv.pool, resident.kv.tree.num_cached_blocks
            blocks[name] = KVBlocks(pool.num_blocks, pool.num_blocks - pool.num_free - cached, cached)
        return blocks

    def counters(self) -> ManagerCounters:
        with self._lock:
            return ManagerCounters(self._pool.counters(), self._load_seconds)

    def close(self) -> None:
        """Evict everything (forcing pins); models in flight stay until released."""
        with self._lock:
            for state in self._pool.snapshot():
                if state.state == "resident" and not state.in_flight:
                    self._drop([self._pool.evict(state.name, force=True)])

    # ------------------------------------------------------------------ internals

    def _estimate(self, record: ModelRecord) -> int:
        try:
            return self._holding(record)
        except (LoadError, OSError) as error:
            message = f"cannot load model {record.name!r} from {record.source}: {error}"
            raise ModelLoadError(message) from error

    def _holding(self, record: ModelRecord) -> int:
        file = record.file
        weights = estimate_weight_bytes(file.path, file.format, _estimate_dtype(record.dtype))
        slots = -(-record.kv_tokens // self.block_size) * self.block_size
        config = record.config
        if record.dtype in IN_PLACE_ACTIVATION_BITS and file.format == "gguf":
            # the in-place model's Q and K row maps (int64 per row, where rotary order reorders them)
            weights += config.num_layers * (config.num_heads + config.num_kv_heads) * config.head_dim * 8
        return weights + kv_cache_bytes(file, record.dtype, config, slots, self.device)

    def _load(self, record: ModelRecord) -> ResidentModel:
        """Load on a thread that ends with the load, whichever thread asks (the server's main
        thread, a request pool, the engine's loader): a live thread that has run torch ops slows
        every op of the engine thread from then on (see `runtime.loading.load_thread`)."""
        return run_in_transient_thread(self._load_here, record)

    def _load_here(self, record: ModelRecord) -> ResidentModel:
        rss_before = psutil.Process().memory_info().rss
        started = time.perf_counter()
        with _weights_in_own_mappings():
            model = load_model(record.file, record.dtype, quiet=self.quiet, device=self.device)
            num_blocks = -(-record.kv_tokens // self.block_size)
            kv = ModelKV(
                model, num_blocks=num_blocks, block_size=self.block_size, prefix_cache=self.prefix_cache
            )
        seconds = time.perf_counter() - started
        measured = model.weight_bytes + kv.cache.nbytes
        rss_delta = psutil.Process().memory_info().rss - rss_before
        log.info(
            "loaded %s (%s, %s) in %.2f s: %.1f MiB weights + %.1f MiB KV; computed by %s",
            record.name,
            record.source,
            record.dtype,
            seconds,
            model.weight_bytes / 2**20,
            kv.cache.nbytes / 2**20,
            model.compute_path,
        )
        return ResidentModel(model, kv, measured, seconds, rss_delta)

    def _drop(self, evictions: list[Eviction]) -> None:
        """Let go of evicted models' memory (called with the lock held)."""
        if not evictions:
            return
        # (through a comprehension: no name left holding an evicted model through the collection)
        for name, size, cause in [(e.name, e.bytes, e.cause) for e in evictions]:
            log.info("evicted %s (%d bytes, %s)", name, size, cause)
        del evictions[:]
        gc.unfreeze()  # the evicted models' objects were frozen when they loaded (_load_and_lease)
        gc.collect()
        _freeze_alive()
        _return_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # torch's caching allocator hands the device memory back

    def _info(self, state: ModelState) -> ModelInfo:
        record = self._records[state.name]
        handle = self._pool.handle(state.name)
        return ModelInfo(
            name=state.name,
            source=record.source,
            dtype=record.dtype,
            state=state.state,
            bytes=state.bytes,
            pinned=state.pinned,
            in_flight=state.in_flight,
            last_used=state.last_used,
            loads=state.loads,
            load_seconds=handle.load_seconds if handle is not None else None,
        )


def _estimate_dtype(dtype: str) -> str:
    """The dtype to estimate a model's bytes at: a quantised twin (int4/int8 projections, bf16
    embedding) ends at most as large as the bf16 model, so its estimate is the bf16 size."""
    return "bf16" if dtype in QUANTISED_FORMATS else dtype


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


LOAD_MMAP_THRESHOLD = 1 << 20  # while loading: every weight and KV tensor gets its own mapping
RUN_MMAP_THRESHOLD = 32 << 20  # otherwise (glibc's largest): transient tensors reuse heap memory


def _set_mmap_threshold(size: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, size)


@contextlib.contextmanager
def _weights_in_own_mappings() -> Iterator[None]:
    """Allocations of 1 MiB or more made inside get their own mapping, returned to the OS when freed.

    glibc raises its mmap threshold after large blocks are freed (up to 32 MiB), and from then on
    weight tensors come from the heap, where an unload cannot hand them back: measured on Qwen
    0.5B bf16, RSS stayed 686 MiB above its pre-load level after a second load/unload, against
    72 MiB with the threshold fixed. Only while loading, though: with a 1 MiB threshold at run
    time every activation of a prefill chunk was a fresh mapping, page-faulted in and unmapped
    again (`python bench/engine_paths.py --dtype int4`: docs/profile.md).
    Setting the threshold also stops glibc's dynamic adjustment.
    """
    _set_mmap_threshold(LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _set_mmap_threshold(RUN_MMAP_THRESHOLD)


def _freeze_alive() -> None:
    """Move every object alive out of the collector's passes until an eviction or the process's
    exit puts them back (at exit, so that the interpreter's last collection frees them: extension
    modules that check for leaks, torch's triton among them, would report every frozen object)."""
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    gc.freeze()


_unfreeze_at_exit = False


def _return_freed_memory() -> None:
    """Ask glibc to hand freed heap pages back to the OS, so RSS falls after an unload."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


__all__ = ["ManagerCounters", "ModelInfo", "ModelLease", "ModelLoadError", "ResidencyManager"]
