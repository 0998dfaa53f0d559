"""The speculation controller with hand-fed measurements: K follows acceptance, trees win when
the second-ranked candidate is often right, cheap drafters beat costly ones, speculation switches
off when it loses (and probes again), configuration is validated."""

from __future__ import annotations

import random

import pytest

from polylane.policy.speculation.control import DrafterInfo, SpecController, SpeculationConfig, parse_shape
from polylane.policy.speculation.tree import CHAIN, TOPK, TreeShape


def _controller(
    config: SpeculationConfig | None = None, drafters=(("small", "model", 0.2),)
) -> SpecController:
    controller = SpecController("target", config or SpeculationConfig())
    for name, kind, cost in drafters:
        controller.add_drafter(DrafterInfo(name, kind, cost))
    return controller


def _feed(controller, drafter, rank_by_depth, rounds=200, request=None, depth=8):
    """Rounds in which the target's token at each depth had the given rank (None: a miss)."""
    for i in range(rounds):
        events = []
        for d in range(1, depth + 1):
            rank = rank_by_depth(d, i)
            events.append((d, rank))
            if rank != 0:
                break
        accepted = sum(1 for _, r in events if r == 0)
        controller.record_round(
            request if request is not None else 10_000 + i,
            drafter,
            TreeShape.chain(depth),
            depth,
            accepted,
            events,
            True,
        )


def _costs(controller, step=0.02, slope=0.001):
    for tokens in (1, 2, 4, 8, 16):
        for _ in range(5):
            controller.record_target_forward(tokens, step + slope * tokens)


def test_high_acceptance_gives_long_chains_low_gives_short():
    controller = _controller()
    _costs(controller)
    controller.record_draft_cost("small", 0.002 * 4, 4)  # 2 ms per drafter forward
    _feed(controller, "small", lambda d, i: 0)  # always right
    high = controller.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert high is not None and high.shape.kind == CHAIN and high.shape.depth >= 6, high

    low = _controller()
    _costs(low)
    low.record_draft_cost("small", 0.002, 1)
    _feed(low, "small", lambda d, i: 0 if random.Random(i * 31 + d).random() < 0.5 else None)  # half
    decision = low.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert decision is not None and decision.shape.max_nodes <= 4, decision
    assert decision.expected_speedup > 1.0


def test_tree_wins_when_the_runner_up_is_often_right():
    controller = _controller()
    _costs(controller, slope=0.0002)  # verify width nearly free (bf16 on AMX, PERF.md)
    controller.record_draft_cost("small", 0.001, 1)
    _feed(controller, "small", lambda d, i: 0 if i % 2 else 1)  # top-1 or top-2, never a miss
    decision = controller.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert decision is not None and decision.shape.kind == TOPK, decision
    chain_only = _controller(SpeculationConfig(mode="chain"))
    assert all(s.kind == CHAIN for s in chain_only.candidate_shapes("model"))


def test_speculation_switches_off_when_it_loses_and_probes_again():
    config = SpeculationConfig(probe_every=4)
    controller = _controller(config)
    _costs(controller)
    controller.record_draft_cost("small", 0.02, 1)  # as costly as the target: cannot pay
    _feed(controller, "small", lambda d, i: None, request=7)  # never right
    decisions = [controller.decide(7, ["small"], batch_size=1, max_nodes=16) for _ in range(16)]
    probes = [i for i, d in enumerate(decisions) if d is not None]
    assert probes == [3, 11], decisions  # after 4 plain rounds, then 8 (each probe doubles the wait)
    assert all(decisions[i].shape == TreeShape.chain(1) for i in probes)  # the cheapest draft
    pair = controller.pairs["small"]
    assert pair.decisions_off == 14 and pair.decisions_on == 2
    # a non-adaptive config speculates anyway
    forced = _controller(SpeculationConfig(adaptive=False, shape=TreeShape.chain(3)))
    _costs(forced)
    forced.record_draft_cost("small", 0.02, 1)
    _feed(forced, "small", lambda d, i: None, request=7)
    assert forced.decide(7, ["small"], batch_size=1, max_nodes=16).shape == TreeShape.chain(3)


def test_acceptance_is_per_request_as_well_as_per_pair():
    controller = _controller(drafters=(("ngram", "ngram", 0.0),))
    _costs(controller)
    controller.record_draft_cost("ngram", 0.0001, 1)
    _feed(controller, "ngram", lambda d, i: 0, rounds=50, request=1)  # a copy-heavy request
    _feed(controller, "ngram", lambda d, i: None, rounds=50, request=2)  # free-form text
    copying = controller.decide(1, ["ngram"], batch_size=2, max_nodes=16)
    free_form = [controller.decide(2, ["ngram"], batch_size=2, max_nodes=16) for _ in range(3)]
    assert copying is not None and copying.shape.max_nodes >= 4
    assert free_form == [None, None, None]


def _cliff_costs(controller, jump_at=9, counts=(*range(1, 17), 24)):
    """A native kernel up to jump_at - 1 tokens (20 ms + 0.2 ms per token), torch above (60 ms)."""
    for tokens in counts:
        seconds = 0.020 + 0.0002 * tokens if tokens < jump_at else 0.060 + 0.0002 * tokens
        for _ in range(2):  # the first of a count is warm-up
            controller.record_target_forward(tokens, seconds)


def test_k_stops_short_of_a_jump_in_verify_cost():
    flat = _controller(SpeculationConfig(mode="chain"))
    _cliff_costs(flat, jump_at=100)
    flat.record_draft_cost("small", 0.001, 1)
    _feed(flat, "small", lambda d, i: 0)  # always right
    assert flat.decide(1, ["small"], batch_size=1, max_nodes=64).shape == TreeShape.chain(8, 0.4)

    cliff = _controller()  # auto: chains and trees
    _cliff_costs(cliff)  # verify passes of 9 tokens or more cost 3×
    cliff.record_draft_cost("small", 0.001, 1)
    _feed(cliff, "small", lambda d, i: 0)
    decision = cliff.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert decision is not None and decision.shape.max_nodes + 1 <= 8, decision
    assert decision.shape.kind == CHAIN and decision.shape.depth == 7
    # two requests in a batch: two verify rows each, so the jump comes at K = 3
    _cliff_costs(cliff, counts=range(2, 33, 2))
    batched = cliff.decide(1, ["small"], batch_size=2, max_nodes=64)
    assert batched is not None and 2 * (batched.shape.max_nodes + 1) <= 8, batched


def test_an_unmeasured_verify_size_is_tried_then_known():
    controller = _controller(SpeculationConfig(mode="chain"))
    _cliff_costs(controller, counts=(1, 2))  # only plain steps and one-token drafts measured
    controller.record_draft_cost("small", 0.001, 1)
    _feed(controller, "small", lambda d, i: 0)
    first = controller.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert first is not None and first.shape.depth == 8  # 9 tokens not measured: worth a try
    _cliff_costs(controller, counts=(9,))  # it costs 3×
    second = controller.decide(1, ["small"], batch_size=1, max_nodes=64)
    assert second is not None and second.shape.depth < 8, second


def test_a_cheap_drafter_that_is_seldom_right_is_switched_off():
    controller = _controller(drafters=(("twin", "twin", 0.15),))
    _cliff_costs(controller)
    controller.record_draft_cost("twin", 0.003, 1)
    _feed(controller, "twin", lambda d, i: 0 if random.Random(i * 7 + d).random() < 0.1 else None)
    decisions = [controller.decide(1, ["twin"], batch_size=1, max_nodes=64) for _ in range(10)]
    assert decisions == [None] * 10  # plain decode (a probe comes after probe_every rounds)
    assert controller.pairs["twin"].decisions_off == 10


def test_measured_costs_outlive_the_controller():
    controller = _controller()
    _cliff_costs(controller)
    fresh = _controller()
    assert fresh.plain_step_due(1)  # a controller of its own measures t(1) first
    again = SpecController("target", SpeculationConfig(), controller.pairs, controller.costs)
    again.add_drafter(DrafterInfo("small", "model", 0.2))
    assert not again.plain_step_due(1)  # t(1) is known: no plain step needed to measure it
    assert again.costs.verify.predict(12) == controller.costs.verify.predict(12)


def test_the_cheaper_drafter_wins_at_equal_acceptance():
    controller = _controller(drafters=(("big", "model", 0.4), ("twin", "twin", 0.15)))
    _costs(controller)
    controller.record_draft_cost("big", 0.008, 1)
    controller.record_draft_cost("twin", 0.003, 1)
    for name in ("big", "twin"):
        _feed(controller, name, lambda d, i: 0 if i % 5 else None)
    decision = controller.decide(1, ["big", "twin"], batch_size=1, max_nodes=16)
    assert decision is not None and decision.drafter == "twin"
    assert controller.decide(1, ["big"], batch_size=1, max_nodes=16).drafter == "big"
    assert controller.decide(1, [], batch_size=1, max_nodes=16) is None
    assert controller.decide(1, ["twin"], batch_size=1, max_nodes=0) is None


def test_a_drafters_prompt_prefill_must_pay_for_itself():
    controller = _controller()
    _costs(controller)
    controller.record_draft_cost("small", 0.004, 1)
    controller.record_draft_prefill("small", 100, 0.2)  # 2 ms per prompt token
    _feed(controller, "small", lambda d, i: 0 if i % 4 else None)
    catch_up = {"small": 400}  # a 400-token prompt the drafter has not seen: 0.8 s
    assert controller.decide(1, ["small"], batch_size=1, max_nodes=4, catch_up=catch_up) is None
    assert controller.decide(2, ["small"], batch_size=1, max_nodes=500, catch_up=catch_up) is not None
    assert controller.decide(3, ["small"], batch_size=1, max_nodes=4, catch_up={"small": 1}) is not None


def test_plain_steps_measure_the_baseline_now_and_then():
    controller = _controller()
    assert controller.plain_step_due(3)  # t(3) never measured: decode plainly and measure it
    controller.record_target_forward(3, 0.05)  # the first of a shape is warm-up
    assert controller.plain_step_due(3)
    controller.record_target_forward(3, 0.05)
    due = [controller.plain_step_due(3) for _ in range(130)]
    assert due.count(True) == 2 and not any(due[:64])  # then one every REMEASURE_EVERY steps
    assert not _controller(SpeculationConfig(adaptive=False)).plain_step_due(1)


def test_max_nodes_limits_the_shape():
    controller = _controller()
    _costs(controller)
    _feed(controller, "small", lambda d, i: 0)
    decision = controller.decide(1, ["small"], batch_size=1, max_nodes=2)
    assert decision is not None and decision.shape.max_nodes <= 2


def test_pair_statistics():
    controller = _controller()
    controller.record_round(1, "small", TreeShape.chain(4), 4, 3, [(1, 0), (2, 0), (3, 0), (4, 1)], True)
    controller.record_round(1, "small", TreeShape.topk(2, 1), 4, 0, [(1, None)], False)
    controller.record_draft_cost("small", 0.01, 4)
    controller.record_target_forward(6, 0.03, ["small"])
    pair = controller.pairs["small"]
    assert pair.acceptance_rate == 3 / 8
    assert pair.tokens_per_verify == (4 + 1) / 2
    assert pair.chain_rounds == 1 and pair.tree_rounds == 1
    assert pair.draft_cost_share == pytest.approx(0.01 / 0.04)


def test_shadow_rounds_switch_a_free_drafter_back_on():
    controller = _controller(SpeculationConfig(probe_every=100), drafters=(("ngram", "ngram", 0.0),))
    _costs(controller)
    _feed(controller, "ngram", lambda d, i: None, rounds=20, request=5)  # free-form so far: off
    assert controller.decide(5, ["ngram"], batch_size=1, max_nodes=8) is None
    for _ in range(12):  # the text turns copy-heavy: plain steps scored for the n-gram index
        controller.record_shadow(5, "ngram", 0)
    assert controller.decide(5, ["ngram"], batch_size=1, max_nodes=8) is not None


def test_config_parsing_and_validation():
    assert SpeculationConfig.parse(None) is None and SpeculationConfig.parse(False) is None
    assert SpeculationConfig.parse(True) == SpeculationConfig()
    assert SpeculationConfig.parse("ngram").drafters == ("ngram",)
    assert SpeculationConfig.parse(["twin", "ngram"]).drafters == ("twin", "ngram")
    parsed = SpeculationConfig.parse({"drafters": "twin:int8", "shape": "topk:3,2,1", "mode": "tree"})
    assert parsed.shape == TreeShape.topk(3, 2, 1) and parsed.drafters == ("twin:int8",)
    assert parse_shape("chain:5") == TreeShape.chain(5)
    assert parse_shape("beam:2x4") == TreeShape.beam(2, 4)
    assert parse_shape("dynamic:6,3,16") == TreeShape.dynamic(6, 3, 16)
    for bad in ({"colour": "red"}, {"mode": "zigzag"}, {"drafters": "twin:int3"}, 3.5):
        with pytest.raises(ValueError):
            SpeculationConfig.parse(bad)
    with pytest.raises(ValueError):
        parse_shape("spiral:3")
    with pytest.raises(ValueError):
        SpeculationConfig(max_draft_tokens=0)
