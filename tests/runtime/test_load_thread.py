"""The transient loader thread: calls run in order, one at a time, and the thread ends when the
queue is empty (a live thread that ran torch keeps an OpenMP team that slows the engine's ops)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from polylane.runtime.loading.load_thread import TransientWorker, run_in_transient_thread


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_calls_run_in_order_one_at_a_time_and_the_thread_ends():
    worker = TransientWorker("test-load")
    order: list[int] = []
    running = []
    gate = threading.Event()

    def call(index: int) -> None:
        running.append(index)
        assert len(running) == 1, "two calls ran at once"
        if index == 0:
            gate.wait(5)
        order.append(index)
        running.remove(index)

    for index in range(5):
        worker.submit(call, index)
    assert worker.running
    gate.set()
    _wait_until(lambda: not worker.running)
    assert order == [0, 1, 2, 3, 4]
    assert not [t for t in threading.enumerate() if t.name == "test-load"]
    worker.submit(call, 5)  # a later call starts a fresh thread
    worker.shutdown()
    assert order[-1] == 5 and not worker.running


def test_a_failing_call_does_not_stop_the_next():
    worker = TransientWorker("test-load-errors")
    done = []
    worker.submit(lambda: 1 / 0)
    worker.submit(done.append, "next")
    worker.shutdown()
    assert done == ["next"]
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(done.append, "late")


def test_run_in_transient_thread_returns_and_raises_in_the_caller():
    names = []

    def call(x: torch.Tensor) -> float:
        names.append(threading.current_thread().name)
        return float(x.sum())

    assert run_in_transient_thread(call, torch.ones(3)) == 3.0
    assert names[0] != threading.current_thread().name
    with pytest.raises(ZeroDivisionError):
        run_in_transient_thread(lambda: 1 / 0)
