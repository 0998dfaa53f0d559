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

from polylane.runtime.sampling.grammar import Constraint
from polylane.types import SamplingParams, TokenLogprob

__all__ = ["RequestSampler", "sample_rows"]

# Slack for the top-p comparison, so that a cumulative probability that equals top_p in exact
# arithmetic (e.g. 0.5 + 0.3 against top_p = 0.8) is not lost to float32 rounding.
_TOP_P_SLACK = 1e-6

# The partial top-k head a top-p / min-p cut is looked for in first (see `_support_without_sort`).
_PARTIAL_HEAD = 256
# Past that head (see `_support_by_buckets`): buckets per split, splits at most, and how few tokens
# are sorted rather than split again.
_NUM_BUCKETS = 256
_BUCKET_LEVELS = 4
_SORT_AT_MOST = 1024


class RequestSampler:
    """Samples the tokens of one request.

    A request's `logit_bias` is added to its logits first; with a grammar (`constraint`) every
    token the grammar forbids is then masked out, and its grammar takes each token it samples
    (`sample_rows`). Both happen before any filter, so logprobs and speculation see them too.

    Each request owns its own CPU ``torch.Generator``, seeded with ``params.seed`` when given
    and with fresh randomness otherwise, so a seeded request that sees the same sequence of
    logits draws the same sequence of tokens no matter what else shares its batch.
    """

    __slots__ = ("constraint", "generator", "logprobs", "params")

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        self.params = params
        self.constraint = constraint  # structured outputs: the grammar masks the logits first
        self.logprobs: list[TokenLogprob] = []  # with params.logprobs: its tokens' since last taken
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def shapes_logits(self) -> bool:
        """Whether its logits are changed before sampling (a logit bias, a grammar)."""
        return bool(self.params.logit_bias) or self.constraint is not None

    def record_logprob(self, row: torch.Tensor, token: int) -> None:
        """With params.logprobs: note `token`'s log-probability under the distribution it was drawn
        from out of `row` (its shaped logits: bias and grammar applied)."""
        top = self.params.logprobs
        if top is None:
            return
        x = _cpu_row(row)
        if self.params.greedy or self.params.top_k == 1:
            logp = torch.log_softmax(x, dim=0)
        else:
            logp = torch.log(self.probabilities(x))
        best: list[tuple[int, float]] = []
        if top:
            values, ids = torch.topk(logp, min(top, logp.shape[0]))
            best = [(int(i), float(v)) for v, i in zip(values, ids, strict=True) if v > float("-inf")]
        self.logprobs.append(TokenLogprob(token, max(float(logp[token]), -9999.0), tuple(best)))

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        taken, self.logprobs = tuple(self.logprobs), []
        return taken

    def bias(self, rows: torch.Tensor) -> None:
        """Its logit bias added to (…, V) float rows, in place (ids past V are ignored)."""
        width = rows.shape[-1]
        for token, value in self.params.logit_bias:
            if token < width:
                rows[..., token] += value

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
            return greedy_tokens(x.view(1, -1))[0]
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
            return self._support_without_sort(probs)
        kept = head[:keep]
        return order[:keep], kept / kept.sum()

    def _support_without_sort(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-p / min-p over the whole vocabulary without sorting all of it (exact).

        Most of the mass usually sits in a few tokens: the cut is looked for in a partial top-k
        head first. Past it (flat distributions), `_support_by_buckets` narrows the cut down.
        """
        total = float(torch.sum(probs, dtype=torch.float64))
        if probs.shape[0] > _PARTIAL_HEAD:
            head, order = torch.topk(probs, _PARTIAL_HEAD, sorted=True)
            keep = self._cut(head, total)
            if keep < _PARTIAL_HEAD and head[keep - 1] != head[keep]:
                kept = head[:keep]
                return order[:keep], kept / kept.sum()
        return self._support_by_buckets(probs, total)

    def _support_by_buckets(self, probs: torch.Tensor, total: float) -> tuple[torch.Tensor, torch.Tensor]:
        """min-p alone is a threshold. For top-p, the tokens still in question are split into
        equal-width probability buckets; those above the bucket where the cumulative mass reaches
        top-p are kept whole, those below dropped, and the crossing bucket is split again until
        few enough are left to sort. That finds the smallest kept probability; the kept set is
        every token above it and the lowest-id tokens equal to it. Bucketing by
        `floor((p - lo) * c)` is monotone in p and equal probabilities share a bucket, so the set
        is exactly the full stable sort's prefix (kept ids come out in id order, not by rank).
        """
        p = self.params
        floor = p.min_p * float(probs.max()) if p.min_p > 0.0 else 0.0
        if p.top_p >= 1.0:
            ids = torch.nonzero(probs >= floor).squeeze(1)
            kept = probs[ids]
            return ids, kept / kept.sum()
        target = p.top_p * total - _TOP_P_SLACK
        values, mass_above = probs, 0.0
        for _ in range(_BUCKET_LEVELS):
            low, high = values.min(), values.max()
            if values.shape[0] <= _SORT_AT_MOST or low == high:
                break
            scaled = (values - low) * (_NUM_BUCKETS / (high - low))
            bucket = (_NUM_BUCKETS - 1) - scaled.floor_().clamp_(max=_NUM_BUCKETS - 1).long()  # 0: largest
            mass = torch.zeros(_NUM_BUCKETS, dtype=torch.float64).scatter_add_(0, bucket, values.double())
            cumulative = mass_above + torch.cumsum(mass, dim=0)
            crossing = min(int(torch.searchsorted(cumulative, target)), _NUM_BUCKETS - 1)
            if crossing > 0:
                mass_above = float(cumulative[crossing - 1])
            values = values[bucket == crossing]
        values = torch.sort(values, descending=True).values
        within = mass_above + torch.cumsum(values, dim=0, dtype=torch.float64)
        keep = min(int(torch.searchsorted(within, target)) + 1, values.shape[0])
        last = values[keep - 1]  # the smallest kept probability; ties at it: lower ids first
        ties = int((values[:keep] == last).sum())
        ids = torch.cat(
            [torch.nonzero(probs > last).squeeze(1), torch.nonzero(probs == last).squeeze(1)[:ties]]
        )
        kept = probs[ids]
        if floor > 0.0:  # min-p after top-p (the most likely token always survives)
            survive = kept >= floor
            ids, kept = ids[survive], kept[survive]
        return ids, kept / kept.sum()

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


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of (R, V) logits (the lower id on ties, NaN counting as largest, as
    ``torch.argmax``). A CPU float32 batch goes through numpy, whose argmax is an order of
    magnitude faster than torch's on the CPU (docs/profile.md, "Prompt attention on tiles")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_rows(logits: torch.Tensor, samplers: list[RequestSampler]) -> list[int]:
    """One token per row of a (R, V) batch of logits; row i is sampled by ``samplers[i]``."""
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"expected logits of shape ({len(samplers)}, V), got {tuple(logits.shape)}")
    constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
    if any(s.shapes_logits for s in samplers):  # in a copy (the forward's may be an inference tensor)
        logits = logits.detach().to(device="cpu", dtype=torch.float32, copy=True)
        for i, sampler in enumerate(samplers):
            sampler.bias(logits[i])
        for i in constrained:
            samplers[i].constraint.mask(logits[i])  # type: ignore[union-attr]
    if all(s.params.greedy for s in samplers):
        tokens = greedy_tokens(logits)
    else:
        rows = logits.detach().to(device="cpu", dtype=torch.float32)
        tokens = [s.sample(rows[i]) for i, s in enumerate(samplers)]
    # every row checked before any grammar takes its token, so a failure changes no state
    for i in constrained:
        if logits[i, tokens[i]] == float("-inf"):
            raise GrammarDeadEnd(f"the grammar allows no token here (request row {i})")
    for i in constrained:
        samplers[i].constraint.accept(tokens[i])  # type: ignore[union-attr]
    for i, sampler in enumerate(samplers):
        sampler.record_logprob(logits[i], tokens[i])
    return tokens


class GrammarDeadEnd(RuntimeError):
    """A constrained row had every token masked: the grammar allows nothing next."""


def _cpu_row(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 1:
        raise ValueError(f"expected a 1-D row of logits, got shape {tuple(logits.shape)}")
    return logits.detach().to(device="cpu", dtype=torch.float32)
