"""Compute threads on the real machine: a fixed count is applied and given back; the adaptive
count drops by one when a busy-loop process takes a core and comes back when it stops; the serve
setting parses."""

from __future__ import annotations

import os
import time

import pytest
import torch

from polylane.bench.cpu_hog import busy_loops
from polylane.runtime.cpu_load import ComputeThreads, busy_seconds, usable_cpus
from polylane.server.config import ConfigError, parse_threads


def _settle(threads: ComputeThreads, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        threads.step()
        time.sleep(0.02)


def test_a_fixed_count_is_applied_and_given_back() -> None:
    before = torch.get_num_threads()
    threads = ComputeThreads(1)
    assert torch.get_num_threads() == 1 and not threads.policy.adaptive
    _settle(threads, 0.3)
    assert torch.get_num_threads() == 1
    threads.restore()
    assert torch.get_num_threads() == before


def test_the_adaptive_count_gives_a_busy_core_away_and_takes_it_back() -> None:
    cpus = len(usable_cpus())
    if cpus < 2 or torch.get_num_threads() < 2:
        pytest.skip(f"needs 2 CPUs for 2 threads ({cpus} usable, torch has {torch.get_num_threads()})")
    threads = ComputeThreads(0)
    try:
        start = threads.threads
        _settle(threads, 0.6)
        assert threads.threads == start, f"idle, yet other load {threads.policy.other_load:.2f} cores"
        with busy_loops(1, settle_s=0.1):
            _settle(threads, 1.0)
            assert threads.threads == start - 1, f"other load {threads.policy.other_load:.2f} cores"
            assert torch.get_num_threads() == start - 1
        _settle(threads, 1.5)
        assert threads.threads == start, f"after the neighbour: other load {threads.policy.other_load:.2f}"
    finally:
        threads.restore()


def test_busy_time_is_read_from_proc_stat_for_our_cpus_only() -> None:
    text = "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 100 5 20 900 7 1 2 50 0 0\ncpu1 200 0 0 800 0 0 0 0 0 0\n"
    ticks = os.sysconf("SC_CLK_TCK")
    assert busy_seconds({0}, text) == pytest.approx((100 + 5 + 20 + 1 + 2) / ticks)
    assert busy_seconds({0, 1}, text) == pytest.approx((128 + 200) / ticks)
    assert busy_seconds({5}, text) is None


@pytest.mark.parametrize(("value", "expected"), [("auto", 0), (0, 0), ("2", 2), (4, 4)])
def test_serve_threads_setting_parses(value: object, expected: int) -> None:
    assert parse_threads(value) == expected


@pytest.mark.parametrize("value", [-1, "-2", "two", True, 1.5])
def test_a_nonsense_threads_setting_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="threads"):
        parse_threads(value)
