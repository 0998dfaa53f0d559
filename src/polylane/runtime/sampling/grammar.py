"""Structured outputs, per request: the matcher that masks each step's logits.

What this module owns: `Constraint`, one request's grammar state compiled for its model's
tokenizer: the mask applied to a row of logits before sampling and the token consumed after.
The grammars themselves are built (and refused) in `polylane.grammar_spec`.
"""

from __future__ import annotations

import threading
from typing import Any

import llguidance
import numpy as np
import torch

from polylane.grammar_spec import GrammarError
from polylane.types import GrammarSpec

__all__ = ["Constraint"]


class _Tokenizers:
    """One llguidance tokenizer per (model tokenizer, logits width): building one walks the whole
    vocabulary (a few hundred ms for 150k tokens), so it is done once and shared by requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[tuple[str, int], Any] = {}

    def get(self, tokenizer: Any, width: int) -> Any:
        key = (tokenizer.digest, width)
        with self._lock:
            if key not in self._built:
                import llguidance.hf

                self._built[key] = llguidance.hf.from_tokenizer(
                    tokenizer.backend, n_vocab=width, eos_token=sorted(tokenizer.stop_token_ids)
                )
            return self._built[key]


_TOKENIZERS = _Tokenizers()


class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each token it takes.

    `mask` sets every forbidden token's logit to -inf in place (a row wider than the tokenizer's
    vocabulary has its extra ids forbidden); `accept` consumes the sampled token. Once the grammar
    is complete only the end-of-turn tokens are allowed, so the request stops there.
    """

    def __init__(self, spec: GrammarSpec, tokenizer: Any) -> None:
        self.width = width = tokenizer.vocab_size
        lltok = _TOKENIZERS.get(tokenizer, width)
        self._matcher = llguidance.LLMatcher(lltok, spec.grammar)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def allowed(self) -> torch.Tensor:
        """(width,) bool: the tokens the grammar allows next."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.width]
        return torch.from_numpy(bits.astype(np.bool_))

    def mask(self, row: torch.Tensor) -> None:
        """Forbidden tokens of a (V,) float row of logits to -inf, in place."""
        allowed = self.allowed()
        if row.shape[-1] > allowed.shape[0]:
            row[allowed.shape[0] :] = float("-inf")
        row[: allowed.shape[0]].masked_fill_(~allowed[: row.shape[-1]], float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self._matcher.get_error()}")

    def accept_all(self, tokens: list[int]) -> None:
        for token in tokens:
            self.accept(token)

    def rollback(self, count: int) -> None:
        """Forget the last `count` tokens taken."""
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"cannot roll back {count} tokens: {self._matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say (a JSON key and its
        quotes and colon, say): the only continuation it allows. Empty when it allows a choice."""
        return list(self._matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, taken in order from here, the grammar allows (nothing is taken)."""
        return self._matcher.validate_tokens(tokens)
