"""`ForwardBatch.select`: the forward of some of a batch's chunks (how a step is split between the
native stack and torch) is the forward those chunks would get built on their own, and its logit
rows map back to the batch's."""

from __future__ import annotations

import torch

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import build_forward_batch
from polylane.types import SequenceChunk
from tests.runtime.test_spec_distribution import tiny_model

BLOCK = 4


def _chunks() -> list[SequenceChunk]:
    return [
        SequenceChunk((1, 2, 3, 4, 5, 0), 0, (0, 1), logits="last"),  # a prompt
        SequenceChunk((3,), 5, (2, 3)),  # a decode token after 5 cached
        SequenceChunk((2, 4, 1), 2, (4, 6), logits="all"),  # a verify chain after 2 cached
        SequenceChunk((5, 5), 0, (5,), logits="none"),  # a prompt chunk without logits
    ]


def test_a_selection_is_the_batch_of_those_chunks() -> None:
    model = tiny_model(7, "tiny").module
    chunks = _chunks()
    batch = build_forward_batch(chunks, BLOCK, model.config)
    part, token_rows, logit_rows = batch.select([2, 0])
    alone = build_forward_batch([chunks[2], chunks[0]], BLOCK, model.config)
    for field in ("token_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(part, field), getattr(alone, field)), field
    # the same logit rows, in the batch's order (the prompt's row came first there)
    assert part.logit_rows.tolist() == [8, 0, 1, 2] and sorted(alone.logit_rows.tolist()) == [0, 1, 2, 8]
    assert part.chunks == alone.chunks and part.host_positions.tolist() == alone.host_positions.tolist()
    assert [row.tolist() for row in part.context_slots] == [row.tolist() for row in alone.context_slots]
    assert token_rows.tolist() == [7, 8, 9, 0, 1, 2, 3, 4, 5]
    # the batch's logit rows: the prompt's last (5), the decode token (6), the verify chain (7, 8, 9);
    # the part's are the batch's rows 0 (prompt), 2, 3, 4 (verify)
    assert batch.logit_rows.tolist() == [5, 6, 7, 8, 9]
    assert logit_rows.tolist() == [0, 2, 3, 4]


def test_split_forwards_give_the_whole_batchs_logits() -> None:
    model = tiny_model(8, "tiny").module
    chunks = _chunks()
    batch = build_forward_batch(chunks, BLOCK, model.config)
    whole_cache = PagedKVCache(model.config, 8, BLOCK, torch.float32)
    split_cache = PagedKVCache(model.config, 8, BLOCK, torch.float32)
    for cache in (whole_cache, split_cache):  # the cached prefixes the decode and verify chunks read
        for layer in range(model.config.num_layers):
            torch.manual_seed(layer)
            cache.keys[layer].copy_(torch.randn_like(cache.keys[layer]))
            cache.values[layer].copy_(torch.randn_like(cache.values[layer]))
    whole = model._torch_forward(batch, whole_cache, 0, None)
    split = torch.empty_like(whole)
    for indexes in ([1, 2], [3, 0]):
        part, _, rows = batch.select(indexes)
        split[rows] = model._torch_forward(part, split_cache, 0, None)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(split_cache.keys[layer], whole_cache.keys[layer], rtol=1e-5, atol=1e-5)
