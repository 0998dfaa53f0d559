"""A speculator offers prompt lookup to the controller only where an n-gram matches: a round
with nothing to look up decodes plainly and leaves the choice to drafters that can draft."""

from __future__ import annotations

from polylane.policy.speculation.control import SpeculationConfig
from polylane.runtime.sampling.sampler import RequestSampler
from polylane.runtime.speculation.drafters import NgramDrafter
from polylane.runtime.speculation.speculator import SpecRequest, Speculator
from polylane.types import SamplingParams


def test_ngram_is_ready_only_where_an_ngram_matched_before():
    drafter = NgramDrafter(1, 3)
    assert not drafter.ready(1, [5, 6, 7, 8])  # no token seen twice: nothing to propose
    assert drafter.ready(1, [5, 6, 7, 8, 6])  # 6 came before, followed by 7
    assert drafter.ready(2, [1, 2, 1]) and not drafter.ready(3, [1, 2, 3])


def test_no_match_means_no_decision_for_prompt_lookup():
    speculator = Speculator("target", SpeculationConfig(drafters=("ngram",)))
    speculator.add_drafter(NgramDrafter(1, 3), 0.002)
    controller = speculator.controller
    for _ in range(3):  # the baseline t(1) is known: no plain step is due to measure it
        controller.record_target_forward(1, 0.02)
    sampler = RequestSampler(SamplingParams(max_tokens=16))
    request = SpecRequest(1, None, [10, 11, 12, 13], sampler, max_new=16)  # type: ignore[arg-type]
    assert speculator.prepare([request], batch_size=1) == {}
    pair = controller.pairs["ngram"]
    assert pair.decisions_on == 0 and pair.decisions_off == 0  # not weighed at all
