"""One-pass verify on real models: a chain verify equals sequential decode steps; in a token tree
each node gets the logits of its own path and never sees its siblings (sliding windows included);
accepting a path compacts its KV so the continuation equals decoding that path directly.
"""

from __future__ import annotations

import pytest
import torch

from polylane.runtime.kv.model_kv import Extend, ModelKV

TOLERANCE = 1e-4  # float32 logits, max-abs
TEXT = "The history of the printing press begins in China, where woodblock printing was used"
# A tree of 9 nodes: two children of the prefix (0, 1), and paths up to 4 deep (1 → 4 → 7 → 8).
PARENTS = (-1, -1, 0, 0, 1, 2, 2, 4, 7)


def _prefilled(model, prompt: tuple[int, ...], num_blocks: int = 96, block_size: int = 8):
    kv = ModelKV(model, num_blocks=num_blocks, block_size=block_size, prefix_cache=False)
    sequence = kv.open(prompt)
    first = kv.forward([Extend(sequence, prompt)])[0]
    return kv, sequence, first


def _path(parents: tuple[int, ...], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _chain_logits(kv: ModelKV, sequence, tokens: list[int]) -> torch.Tensor:
    """Logits after each of `tokens`, from one chain verify on a fork (left untouched after)."""
    fork = kv.fork(sequence)
    logits = kv.forward([Extend(fork, tuple(tokens), logits="all")])
    kv.close(fork, cache=False)
    return logits


def _tree_tokens(model, first: torch.Tensor) -> tuple[int, ...]:
    """Plausible candidates: the two best first tokens, then arbitrary real words below them."""
    top = first.topk(2).indices.tolist()
    words = model.tokenizer.encode(" in the early years of the fifteenth century")
    return (top[0], top[1], *words[:7])


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_chain_verify_equals_sequential_decode(load_real_model, name, record_property):
    model = load_real_model(name)
    prompt = tuple(model.tokenizer.encode(TEXT))
    kv, sequence, first = _prefilled(model, prompt)
    sequential, logits = [], first
    tokens = []
    for _ in range(6):
        tokens.append(int(logits.argmax()))
        logits = kv.forward([Extend(sequence, (tokens[-1],))])[0]
        sequential.append(logits)
    kv.rollback(sequence, len(prompt))
    verified = kv.forward([Extend(sequence, tuple(tokens), logits="all")])
    max_abs = max((a - b).abs().max().item() for a, b in zip(verified, sequential, strict=True))
    record_property("chain_verify_max_abs", max_abs)
    print(f"{name}: chain verify of {len(tokens)} tokens vs sequential decode, max-abs {max_abs:.2e}")
    assert [int(row.argmax()) for row in verified] == [int(row.argmax()) for row in sequential]
    assert max_abs < TOLERANCE, f"{name}: chain verify max-abs {max_abs:.2e}"
    kv.rollback(sequence, len(prompt))
    chain_as_tree = tuple(range(-1, len(tokens) - 1))
    kv.forward([Extend(sequence, tuple(tokens), tree_parents=chain_as_tree, logits="all")])
    kv.accept(sequence, list(range(len(tokens))))
    assert sequence.token_ids == [*prompt, *tokens]
    kv.close(sequence)


def _check_tree(model, kv, sequence, first, parents, label, record_property) -> torch.Tensor:
    tokens = _tree_tokens(model, first)[: len(parents)]
    base = sequence.num_tokens
    tree_logits = kv.forward([Extend(sequence, tokens, tree_parents=parents, logits="all")])
    kv.accept(sequence, [])  # reject everything: back to the committed prefix
    assert sequence.num_tokens == base
    worst = 0.0
    for node in range(len(parents)):
        path = _path(parents, node)
        chain = _chain_logits(kv, sequence, [tokens[i] for i in path])[-1]
        max_abs = (tree_logits[node] - chain).abs().max().item()
        worst = max(worst, max_abs)
        assert int(tree_logits[node].argmax()) == int(chain.argmax()), f"{label}: node {node} argmax"
        assert max_abs < TOLERANCE, f"{label}: node {node} (path {path}) max-abs {max_abs:.2e} vs its chain"
    record_property(f"{label} tree_vs_chain_max_abs", worst)
    print(f"{label}: {len(parents)}-node tree vs chain verify of each path, max-abs {worst:.2e}")
    return tree_logits


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_tree_nodes_see_only_their_path(load_real_model, name, record_property):
    model = load_real_model(name)
    prompt = tuple(model.tokenizer.encode(TEXT))
    kv, sequence, first = _prefilled(model, prompt)
    tree_logits = _check_tree(model, kv, sequence, first, PARENTS, name, record_property)

    # Change node 1 (sibling of 0) and node 3 (sibling of 2): nodes 0, 2, 5, 6 must not notice.
    tokens = list(_tree_tokens(model, first))
    tokens[1], tokens[3] = tokens[3], tokens[1] + 1
    again = kv.forward([Extend(sequence, tuple(tokens), tree_parents=PARENTS, logits="all")])
    kv.accept(sequence, [])
    for node in (0, 2, 5, 6):
        max_abs = (again[node] - tree_logits[node]).abs().max().item()
        assert max_abs < TOLERANCE, f"{name}: node {node} saw a sibling change (max-abs {max_abs:.2e})"
    assert (again[4] - tree_logits[4]).abs().max().item() > TOLERANCE, "node 4's parent changed"
    kv.close(sequence)
    assert kv.pool.num_free == kv.pool.num_blocks, "blocks leaked"


def test_sliding_window_in_a_tree(load_real_model, record_property):
    """Gemma 3 past its 512-token window: tree nodes at different depths drop different keys."""
    model = load_real_model("gemma3-270m")
    window = model.config.sliding_window
    text = " ".join(f"Entry {i}: the value is {i * 37 % 101}." for i in range(120))
    prompt = tuple(model.tokenizer.encode(text))[: window + 3]
    assert len(prompt) == window + 3, f"prompt has only {len(prompt)} tokens"
    kv, sequence, first = _prefilled(model, prompt, num_blocks=96, block_size=8)
    _check_tree(model, kv, sequence, first, PARENTS, "gemma3 past the window", record_property)
    kv.close(sequence)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_accepted_path_is_compacted_not_recomputed(load_real_model, name):
    model = load_real_model(name)
    prompt = tuple(model.tokenizer.encode(TEXT))
    kv, sequence, first = _prefilled(model, prompt)
    tokens = _tree_tokens(model, first)
    path = _path(PARENTS, 8)  # [1, 4, 7, 8]: every node moves down to its depth
    logits = kv.forward([Extend(sequence, tokens, tree_parents=PARENTS, logits="all")])
    table_before = list(sequence.blocks.table)
    kv.accept(sequence, path)
    accepted = [tokens[i] for i in path]
    assert sequence.token_ids == [*prompt, *accepted]
    assert sequence.blocks.table == table_before[: kv.pool.blocks_for(len(prompt) + len(path))]
    continuation = []
    row = logits[path[-1]]
    got = []
    for _ in range(5):
        continuation.append(int(row.argmax()))
        row = kv.forward([Extend(sequence, (continuation[-1],))])[0]
        got.append(row)

    direct_kv, direct, _ = _prefilled(model, prompt)
    for token in accepted:
        direct_kv.forward([Extend(direct, (token,))])
    want = [direct_kv.forward([Extend(direct, (token,))])[0] for token in continuation]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        max_abs = (a - b).abs().max().item()
        assert int(a.argmax()) == int(b.argmax()), f"{name}: step {step} greedy token differs"
        assert max_abs < TOLERANCE, f"{name}: step {step} after compaction, max-abs {max_abs:.2e}"
    kv.close(sequence)
    assert kv.pool.num_free == kv.pool.num_blocks, "blocks leaked"


@pytest.mark.parametrize(
    ("parents", "message"),
    [((0, -1), "parent"), ((1, 0), "parent"), ((-1, 5), "parent"), ((-1,), "parents for")],
)
def test_bad_tree_is_a_clear_error_and_changes_nothing(load_real_model, parents, message):
    model = load_real_model("smollm2-135m-instruct")
    prompt = tuple(model.tokenizer.encode(TEXT))
    kv, sequence, _ = _prefilled(model, prompt, num_blocks=16)
    free, table = kv.pool.num_free, list(sequence.blocks.table)
    with pytest.raises(ValueError, match=message):
        kv.forward([Extend(sequence, (1, 2), tree_parents=parents, logits="all")])
    assert (kv.pool.num_free, sequence.blocks.table, sequence.num_tokens) == (free, table, len(prompt))
    kv.forward([Extend(sequence, (1, 2), tree_parents=(-1, 0), logits="all")])
    with pytest.raises(ValueError, match="chain"):
        kv.accept(sequence, [1])  # node 1 is not a child of the prefix
    kv.accept(sequence, [0, 1])
    kv.close(sequence)
