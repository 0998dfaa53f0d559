"""A draft under a grammar (`runtime/speculation/grammar.py`), on SmolLM2's real tokenizer: the forced
tokens come first, a forbidden token is never proposed (its subtree goes with it), and each verify
row is masked with the grammar's state after its own node's path."""

from __future__ import annotations

import pytest
import torch

from polylane import catalog
from polylane.grammar_spec import grammar_for
from polylane.policy.speculation.tree import DraftTree, TreeShape
from polylane.runtime.sampling.grammar import Constraint
from polylane.runtime.sampling.sampler import RequestSampler
from polylane.runtime.sampling.tokenizer import load_tokenizer
from polylane.runtime.speculation.drafters import DraftJob
from polylane.runtime.speculation.grammar import constrain_draft, masked_rows
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tokenizer():
    fetch_or_skip(SMOL)
    return load_tokenizer(catalog.resolve(SMOL, quiet=True))


def _job(tree: DraftTree) -> DraftJob:
    job = DraftJob(1, (0,), TreeShape.chain(8), RequestSampler(SamplingParams()))
    job.tree = tree
    return job


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_forced_tokens_start_the_draft_and_a_disagreeing_draft_is_dropped(tokenizer):
    constraint = Constraint(grammar_for("choice", ["yes-indeed", "no-never"]), tokenizer)
    job = _job(DraftTree.chain(_ids(tokenizer, "maybe")))
    assert constrain_draft(job, constraint, 8) == 0  # a choice: nothing forced yet
    assert len(job.tree) == 0  # "maybe" is forbidden: not proposed
    constraint.accept_all(_ids(tokenizer, "yes"))
    forced = constraint.forced_tokens()
    assert forced and tokenizer.decode(forced) == "-indeed"
    job = _job(DraftTree.chain(_ids(tokenizer, " whatever")))
    assert constrain_draft(job, constraint, 8) == len(forced)
    assert list(job.tree.token_ids) == forced
    assert constraint.forced_tokens() == forced  # nothing was taken


def test_a_tree_loses_every_forbidden_node_and_its_subtree(tokenizer):
    constraint = Constraint(grammar_for("regex", "[0-9]+ apples"), tokenizer)
    digit, other, space = _ids(tokenizer, "7")[0], _ids(tokenizer, "x")[0], _ids(tokenizer, " apples")
    # root children: 7 (valid), x (forbidden, with a child); 7's children: 7 and " apples"
    tree = DraftTree(
        (digit, other, digit, space[0], digit),
        (-1, -1, 0, 0, 1),
        (0.5,) * 5,
        (0.5,) * 5,
        (0, 1, 0, 1, 0),
        (1, 1, 2, 2, 2),
    )
    job = _job(tree)
    job.candidates = {-1: [digit, other], 0: [digit, space[0]], 1: [digit]}
    constrain_draft(job, constraint, 8)
    assert job.tree.token_ids == (digit, digit, space[0])
    assert job.tree.parents == (-1, 0, 0)
    assert set(job.candidates) == {-1, 0}
    rows = torch.zeros(1 + len(job.tree), tokenizer.vocab_size)
    masked = masked_rows(rows, job.tree, constraint)
    assert masked[0, digit] == 0 and masked[0, other] == float("-inf")  # before anything: a digit
    assert masked[3, digit] == float("-inf")  # after "7 apples": the end only
    assert constraint.valid_prefix([digit]) == 1  # the state is back where it began
