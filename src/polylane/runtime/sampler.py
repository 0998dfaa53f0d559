"""Turning logits rows into tokens.

This module owns one thing: given a row of logits and a request's `SamplingParams`, pick the
next token id (or, for speculative decoding, say what distribution that pick is drawn from).
It holds no policy: which requests run, how many tokens they get, and when they stop are
decided elsewhere.

The distribution for a non-greedy request is built in this order, always in float32 on the CPU:

1. divide the logits by ``temperature`` and take the softmax;
2. top-k: keep the ``top_k`` most likely tokens;
3. top-p: of what is left (renormalised), keep the smallest prefix, by descending probability,
   whose cumulative probability reaches ``top_p``;
4. min-p: of what is left, drop tokens whose probability is below ``min_p`` times the top
   token's probability;
5. renormalise.

The most likely token always survives every filter. Ties in probability are broken towards the
lower token id, as ``torch.argmax`` does for greedy requests.
"""

from __future__ import annotations

import torch

from polylane.types import SamplingParams

__all__ = ["RequestSampler", "sample_rows"]

# Slack for the top-p comparison, so that a cumulative probability that equals top_p in exact
# arithmetic (e.g. 0.5 + 0.3 against top_p = 0.8) is not lost to float32 rounding.
_TOP_P_SLACK = 1e-6

# Sizes of the partial top-k heads a top-p / min-p cut is looked for in (see `_cut_in_partial_heads`).
_PARTIAL_HEADS = (256, 4096)


class RequestSampler:
    """Samples the tokens of one request.

    Each request owns its own CPU ``torch.Generator``, seeded with ``params.seed`` when given
    and with fresh randomness otherwise, so a seeded request that sees the same sequence of
    logits draws the same sequence of tokens no matter what else shares its batch.
    """

    __slots__ = ("generator", "params")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered, normalised distribution (V,) float32 on the CPU that `sample` draws from.

        For a greedy request it is one-hot at the argmax.
        """
        x = _cpu_row(logits)
        ids, probs = self._support(x)
        out = torch.zeros_like(x)
        out[ids] = probs
        return out

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id for a (V,) row of logits."""
        x = _cpu_row(logits)
        if self.params.greedy or self.params.top_k == 1:
            return int(torch.argmax(x))
        ids, probs = self._support(x)
        # Inverse-CDF draw over the kept tokens only (torch.multinomial scans the whole vocabulary).
        cum = torch.cumsum(probs, dim=0, dtype=torch.float64)
        u = float(torch.rand((), generator=self.generator, dtype=torch.float64)) * float(cum[-1])
        index = min(int(torch.searchsorted(cum, u, right=True)), ids.shape[0] - 1)
        return int(ids[index])

    def _support(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept token ids and their renormalised probabilities (float32) for a logits row."""
        p = self.params
        if p.greedy or p.top_k == 1:
            return torch.argmax(x).reshape(1), torch.ones(1)
        if p.temperature != 1.0:
            x = x / p.temperature
        probs = torch.softmax(x, dim=-1)
        vocab = probs.shape[0]
        top_k = p.top_k if 0 < p.top_k < vocab else 0
        if top_k == 0 and p.top_p >= 1.0 and p.min_p <= 0.0:
            return torch.arange(vocab), probs
        if top_k:
            head, order = torch.topk(probs, top_k, sorted=True)
            keep = self._cut(head, float(torch.sum(head, dtype=torch.float64)))
        else:
            head, order, keep = self._cut_in_partial_heads(probs)
        kept = head[:keep]
        return order[:keep], kept / kept.sum()

    def _cut_in_partial_heads(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Top-p / min-p over the whole vocabulary without sorting all of it.

        Most of the mass sits in a few tokens: the cut is looked for in growing partial top-k
        heads, and the whole vocabulary is sorted only when the cut is not provably inside the
        largest (it reaches the head's end, or a tie straddles it).
        """
        total = float(torch.sum(probs, dtype=torch.float64))
        for size in _PARTIAL_HEADS:
            if size >= probs.shape[0]:
                break
            head, order = torch.topk(probs, size, sorted=True)
            keep = self._cut(head, total)
            if keep < size and head[keep - 1] != head[keep]:
                return head, order, keep
        head, order = torch.sort(probs, descending=True, stable=True)
        return head, order, self._cut(head, total)

    def _cut(self, head: torch.Tensor, total: float) -> int:
        """How many of `head` (probabilities sorted descending) survive top-p and min-p, where
        `total` is the mass top-p is measured against."""
        p = self.params
        keep = head.shape[0]
        if p.top_p < 1.0:
            cum = torch.cumsum(head, dim=0, dtype=torch.float64)
            target = p.top_p * total - _TOP_P_SLACK
            keep = min(keep, int(torch.searchsorted(cum, target)) + 1)
        if p.min_p > 0.0:
            threshold = p.min_p * float(head[0])
            keep = min(keep, int((head[:keep] >= threshold).sum()))
        return max(keep, 1)


def sample_rows(logits: torch.Tensor, samplers: list[RequestSampler]) -> list[int]:
    """One token per row of a (R, V) batch of logits; row i is sampled by ``samplers[i]``."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"expected logits of shape ({len(samplers)}, V), got {tuple(logits.shape)}")
    if all(s.params.greedy for s in samplers):
        return logits.argmax(dim=-1).tolist()
    rows = logits.detach().to(device="cpu", dtype=torch.float32)
    return [s.sample(rows[i]) for i, s in enumerate(samplers)]


def _cpu_row(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 1:
        raise ValueError(f"expected a 1-D row of logits, got shape {tuple(logits.shape)}")
    return logits.detach().to(device="cpu", dtype=torch.float32)
