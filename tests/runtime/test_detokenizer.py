"""The incremental detokenizer on a real byte-level BPE tokenizer (SmolLM2's): pieces add up to
the whole decode, nothing is emitted inside a UTF-8 character, and a character cut by the last
token comes out as U+FFFD at the end rather than vanishing."""

from __future__ import annotations

import pytest

from polylane import catalog
from polylane.runtime.sampling.detokenizer import IncrementalDetokenizer
from polylane.runtime.sampling.tokenizer import load_tokenizer

TEXT = "Crabs 🦀 and snakes 🐍 say héllo — 你好!"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(catalog.resolve("smollm2-135m-instruct", quiet=True))


def test_pieces_add_up_to_the_decode_and_never_end_inside_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in ids]
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces), "an emoji spans several tokens here"


def test_a_character_cut_by_the_last_token_ends_as_a_replacement_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "no token boundary inside a character"
    for n in cuts:
        detokenizer = IncrementalDetokenizer(tokenizer)
        text = "".join(detokenizer.push(token) for token in ids[:n])
        assert not text.endswith("\ufffd")
        assert text + detokenizer.flush() == tokenizer.decode(ids[:n])  # the cut character shown, not dropped
        assert detokenizer.flush() == ""  # nothing twice
