"""ResidencyManager on real models: a budget that holds two of three evicts the least recently used;
unloading gives the memory back; a broken file fails only its own registration (truncated, corrupt
header, missing: found when its record is resolved) or its own admission (NaN block scales: found by
the load); many threads never exceed the budget nor lose a model in use; a resident model's objects
stay out of the garbage collector's passes, and an evicted one's are collected, cycles included.
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

from polylane.catalog import ModelNotFoundError
from polylane.policy.residency.pool import NoRoomError
from polylane.runtime.kv.model_kv import Extend
from polylane.runtime.loading.gguf_file import GGUFFile
from polylane.runtime.loading.loader import estimate_weight_bytes
from polylane.runtime.loading.model_record import resolve_record
from polylane.runtime.residency.manager import ModelLoadError, ResidencyManager
from polylane.types import LoadError
from tests.conftest import fetch_or_skip

SMOL, GEMMA, QWEN = "smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"
KV_TOKENS = 256
KV_ALLOWANCE = 16 * 2**20  # more than any of these models' 256-token bf16 KV reservation


def _estimate(name: str) -> int:
    source = fetch_or_skip(name)
    return estimate_weight_bytes(source.path, source.format, "bf16")


def _next_token(lease, text: str = "The capital of France is") -> int:
    prompt = tuple(lease.model.tokenizer.encode(text))
    sequence = lease.kv.open(prompt)
    logits = lease.kv.forward([Extend(sequence, prompt[sequence.num_tokens :])])
    lease.kv.close(sequence, cache=False)
    return int(logits[0].argmax())


def _states(manager: ResidencyManager) -> dict[str, str]:
    return {info.name: info.state for info in manager.snapshot()}


def _pool_of(snapshot) -> list[tuple]:
    """What residency holds: each model's state, bytes, pin and loads (not when it was last asked
    for: a failed load past admission counts as a use)."""
    return [(i.name, i.state, i.bytes, i.pinned, i.in_flight, i.loads) for i in snapshot]


def _pool(manager: ResidencyManager) -> list[tuple]:
    return _pool_of(manager.snapshot())


def test_budget_for_two_of_three_evicts_the_least_recently_used(record_property):
    sizes = {name: _estimate(name) + KV_ALLOWANCE for name in (SMOL, GEMMA, QWEN)}
    budget = int(1.05 * (sizes[SMOL] + sizes[QWEN]))
    assert budget < sum(sizes.values()) - 0.5 * sizes[GEMMA], "the budget must not hold all three"
    manager = ResidencyManager(budget)
    for name in (SMOL, GEMMA, QWEN):
        manager.register(resolve_record(name, dtype="bf16", kv_tokens=KV_TOKENS))
    with manager.acquire(SMOL) as smol:
        smol_token = _next_token(smol)
    with manager.acquire(GEMMA):
        pass
    with manager.acquire(SMOL):  # GEMMA is now the least recently used
        pass
    with manager.acquire(QWEN) as qwen:
        _next_token(qwen)
        assert _states(manager) == {SMOL: "resident", GEMMA: "cold", QWEN: "resident"}
    counters = manager.counters().pool
    assert counters.evictions["room"] == 1 and counters.used_bytes <= budget, f"{counters}"
    assert (counters.hits, counters.misses) == (1, 3), f"{counters}"
    with manager.acquire(SMOL) as smol:
        assert _next_token(smol) == smol_token, "a model that stayed resident answers the same"
    for info in manager.snapshot():
        record_property(f"{info.name} bytes", info.bytes)
        if info.state == "resident":
            assert 0.9 * sizes[info.name] < info.bytes <= sizes[info.name], f"{info}: measured vs estimate"
    manager.close()


def test_resident_models_stay_out_of_collections_and_evicted_ones_are_collected():
    """A load freezes what is alive (a full collection with a model resident took 176 ms, every
    thread stopped); an eviction unfreezes before it collects, so a cycle through the evicted model
    does not keep it."""
    fetch_or_skip(SMOL)
    manager = ResidencyManager(8 * 2**30, device="cpu")
    manager.register(resolve_record(SMOL, dtype="auto", kv_tokens=KV_TOKENS))

    def load() -> weakref.ref:
        with manager.acquire(SMOL) as lease:
            module = lease.model.module
            assert not any(o is module for o in gc.get_objects()), "the resident model is still collected"
            module.cycle = [module]  # made after the load: only a collection with the model unfrozen frees it
            return weakref.ref(module)

    try:
        module = load()
        manager.evict(SMOL)
        assert module() is None, "the evicted model was not collected"
        module = load()  # and again: the next load freezes anew
        manager.evict(SMOL)
        assert module() is None
    finally:
        manager.close()


RSS_SCRIPT = """
import json, psutil
from polylane.runtime.loading.model_record import resolve_record
from polylane.runtime.residency.manager import ResidencyManager
rss = lambda: psutil.Process().memory_info().rss
manager = ResidencyManager(8 * 2**30, device="cpu")  # host memory is what this measures
manager.register(resolve_record("m", SOURCE, dtype="bf16", kv_tokens=256))
with manager.acquire("m"):  # a warm-up cycle: imports, tokenizer caches, a first conversion
    pass
manager.evict("m")
before = rss()
with manager.acquire("m"):
    loaded = rss()
[info] = manager.snapshot()
manager.evict("m")
print(json.dumps({"before": before, "loaded": loaded, "after": rss(), "bytes": info.bytes}))
"""


def test_unload_returns_memory(record_property):
    """In a fresh process (so other tests' heap does not blur RSS): load, unload, compare."""
    fetch_or_skip(QWEN)
    script = RSS_SCRIPT.replace("SOURCE", repr(QWEN))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    mib = {key: value / 2**20 for key, value in numbers.items()}
    print(
        f"RSS before load {mib['before']:.0f} MiB, loaded {mib['loaded']:.0f} MiB, after unload "
        f"{mib['after']:.0f} MiB; model {mib['bytes']:.0f} MiB"
    )
    record_property("rss_mib", mib)
    assert mib["loaded"] - mib["before"] > 0.8 * mib["bytes"], "loading did not allocate the model's bytes"
    assert mib["after"] - mib["before"] < 0.1 * mib["bytes"], (
        f"after unload RSS is {mib['after'] - mib['before']:.0f} MiB above its pre-load level"
    )


def test_a_broken_file_fails_only_its_own_admission(tmp_path):
    source = fetch_or_skip(SMOL)
    truncated = tmp_path / "truncated.gguf"
    with source.path.open("rb") as handle:
        truncated.write_bytes(handle.read(4 * 2**20))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    nan_scales = tmp_path / "nan-scales.gguf"  # a valid header, one block scale overwritten
    data = bytearray(source.path.read_bytes())
    start = GGUFFile(source.path).tensors["blk.4.ffn_up.weight"].offset
    data[start : start + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    nan_scales.write_bytes(bytes(data))
    manager = ResidencyManager(int(1.5 * (_estimate(SMOL) + KV_ALLOWANCE)))
    manager.register(resolve_record(SMOL, dtype="bf16", kv_tokens=KV_TOKENS))
    # a valid header, one block scale overwritten: found by the load
    manager.register(resolve_record("nan-scales", str(nan_scales), dtype="auto", kv_tokens=KV_TOKENS))
    manager.register(resolve_record("too-big", SMOL, dtype="fp32", kv_tokens=KV_TOKENS))
    with manager.acquire(SMOL) as lease:
        token = _next_token(lease)
    before = manager.snapshot()
    # a file cut short, not a model, or no file: refused when it is resolved, before registration
    with pytest.raises(LoadError, match="truncated"):
        resolve_record("truncated", str(truncated), dtype="bf16")
    with pytest.raises(LoadError, match="not a valid GGUF"):
        resolve_record("corrupt", str(corrupt), dtype="bf16")
    with pytest.raises(ModelNotFoundError, match=r"nowhere\.gguf"):
        resolve_record("missing", str(tmp_path / "nowhere.gguf"), dtype="bf16")
    for name, message in [
        ("nan-scales", "'blk.4.ffn_up.weight' has 1 NaN or infinite block scales"),
    ]:
        with pytest.raises(ModelLoadError, match=message):
            manager.acquire(name)
        assert _pool(manager) == _pool_of(before), f"a failed load of {name} changed the pool"
    with pytest.raises(NoRoomError, match="too-big"):
        manager.acquire("too-big")  # fp32 needs twice the bytes and the budget is pinned by nothing
    assert _pool(manager) == _pool_of(before)
    with manager.acquire(SMOL) as lease:
        assert _next_token(lease) == token, "the resident model stopped serving"
    manager.close()


def test_threads_never_exceed_the_budget_nor_lose_a_model_in_use():
    size = _estimate(SMOL) + KV_ALLOWANCE
    budget = int(2.2 * size)  # two of the three aliases
    manager = ResidencyManager(budget)
    names = ["a", "b", "c"]
    for name in names:
        manager.register(resolve_record(name, SMOL, dtype="bf16", kv_tokens=KV_TOKENS))
    failures: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            stop.wait(0.002)
            used = manager.counters().pool.used_bytes
            if used > budget:
                failures.append(f"used {used} > budget {budget}")

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(6):
                name = rng.choice(names)
                with manager.acquire(name) as lease:
                    assert lease.model.weight_bytes > 0
                    states = {i.name: i for i in manager.snapshot()}
                    if states[name].state != "resident" or states[name].in_flight < 1:
                        failures.append(f"{name} is {states[name]} while leased")
        except Exception as error:  # NoRoomError when both others are in flight is allowed
            if not isinstance(error, NoRoomError):
                failures.append(repr(error))

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    stop.set()
    watcher.join()
    assert not failures, failures[:5]
    assert all(info.in_flight == 0 for info in manager.snapshot())
    counters = manager.counters().pool
    assert counters.misses >= 3 and counters.evictions["room"] >= 1, f"{counters}"
    manager.close()


def test_admission_counts_the_kv_reservation_before_loading():
    source = fetch_or_skip(SMOL)
    weights = estimate_weight_bytes(source.path, source.format, "auto")
    manager = ResidencyManager(weights + 2**20)  # room for the weights, not for their 4,096-token KV
    manager.register(resolve_record(SMOL, dtype="auto", kv_tokens=4096))
    (cold,) = manager.snapshot()
    assert cold.bytes > weights + 40 * 2**20, (cold.bytes, weights)  # the KV is counted before the load
    with pytest.raises(NoRoomError) as caught:
        manager.acquire(SMOL)
    assert "measured" not in str(caught.value), caught.value  # refused at admission, not after a load
    (refused,) = manager.snapshot()
    assert refused.state == "cold" and refused.loads == 0, refused
    manager.set_budget(cold.bytes)  # exactly what residency expects it to hold
    with manager.acquire(SMOL) as lease:
        assert _next_token(lease) >= 0
        (loaded,) = manager.snapshot()
        assert loaded.loads == 1 and cold.bytes - 2**20 <= loaded.bytes <= cold.bytes, (cold, loaded)
        assert manager.counters().pool.used_bytes <= manager.budget_bytes
    manager.close()
