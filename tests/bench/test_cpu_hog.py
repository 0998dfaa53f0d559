"""The bench's busy-loop neighbours: they spin while the `with` body runs and are gone after it,
also when the body fails."""

from __future__ import annotations

import time

import psutil
import pytest

from polylane.bench.cpu_hog import busy_loops


def test_busy_loops_spin_and_stop() -> None:
    with busy_loops(2, settle_s=0.0) as pids:
        processes = [psutil.Process(pid) for pid in pids]
        before = [p.cpu_times().user for p in processes]
        time.sleep(0.5)
        after = [p.cpu_times().user for p in processes]
        assert all(b - a > 0.1 for a, b in zip(before, after, strict=True)), (before, after)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


def test_busy_loops_stop_when_the_body_fails() -> None:
    with pytest.raises(RuntimeError), busy_loops(1, settle_s=0.0) as pids:
        raise RuntimeError("phase failed")
    assert not psutil.pid_exists(pids[0])


def test_no_busy_loop_is_a_no_op() -> None:
    with busy_loops(0) as pids:
        assert pids == []
