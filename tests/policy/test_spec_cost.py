"""The measured cost model of speculation: a table of the target's forward cost by token count
(warm-up dropped, monotone, optimistic between measured counts), and decayed means."""

from __future__ import annotations

import pytest

from polylane.policy.speculation.cost import CostTable, Ema, SpecMeasurements


def _measure(table: CostTable, tokens: int, seconds: float) -> None:
    table.add(tokens, seconds)  # the first forward of a count is warm-up: dropped
    table.add(tokens, seconds)


def test_a_counts_first_forward_is_dropped_then_measured():
    table = CostTable()
    assert table.predict(3) == 0.0 and not table.seen
    table.add(1, 0.500)
    assert not table.seen and not table.measured(1)
    table.add(1, 0.020)
    assert table.measured(1) and table.predict(1) == pytest.approx(0.020)
    assert table.predict(11) == pytest.approx(0.020 * (1 + 0.05 * 10))  # the prior slope past it


def test_a_jump_is_kept_not_smoothed_into_a_line():
    table = CostTable()
    for tokens in range(1, 9):  # native below 9 tokens: 2 ms per token
        _measure(table, tokens, 0.020 + 0.002 * tokens)
    for tokens in (9, 12, 16):  # torch from 9: a jump
        _measure(table, tokens, 0.060 + 0.001 * tokens)
    assert table.predict(4) == pytest.approx(0.028)  # measured, not pulled up by the jump
    assert table.predict(8) == pytest.approx(0.036)
    assert table.predict(9) == pytest.approx(0.069)
    assert table.predict(10) == pytest.approx(0.070)  # between 9 and 12: the line
    assert table.predict(20) > table.predict(16)


def test_an_unmeasured_count_is_predicted_optimistically_between_neighbours():
    table = CostTable()
    _measure(table, 1, 0.020)
    _measure(table, 2, 0.022)
    _measure(table, 9, 0.070)
    # the line from 2 to 9 would say 0.063 at 8; the jump may lie past 8: one more token each
    assert table.predict(8) == pytest.approx(0.022 + 6 * 0.001)
    assert table.predict(3) == pytest.approx(0.023)
    assert table.predict(9) == pytest.approx(0.070)


def test_a_slow_forward_does_not_bar_a_count_for_good():
    table = CostTable()
    _measure(table, 4, 0.090)  # a slow outlier (another process, a page fault)
    _measure(table, 5, 0.030)
    assert table.predict(4) == pytest.approx(0.030)  # never above a larger count's cost
    assert table.predict(2) <= table.predict(4)


def test_measurements_carry_drafters_and_shapes():
    costs = SpecMeasurements()
    costs.add_drafter("twin")
    costs.draft["twin"].add(0.004)
    costs.add_drafter("twin")  # again (a reload): what was measured stays
    assert costs.draft["twin"].value() == pytest.approx(0.004)
    assert not costs.draft_prefill["twin"].seen


def test_ema():
    ema = Ema(0.5)
    assert ema.value(7.0) == 7.0
    ema.add(2.0)
    assert ema.value() == pytest.approx(2.0)
    ema.add(4.0)
    assert 2.0 < ema.value() < 4.0
