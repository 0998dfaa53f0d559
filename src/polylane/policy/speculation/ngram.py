"""N-gram prompt lookup: draft tokens copied from earlier in the request's own context.

What this module owns: an incremental index of one request's tokens (prompt, then everything it
generates) and the proposal rule. To propose, the last n tokens (n from `max_ngram` down to
`min_ngram`) are looked up among earlier positions; the tokens that followed an earlier
occurrence are the draft (prompt lookup decoding, Saxena 2023; transformers' `prompt_lookup`).
The earliest occurrences are tried first, as transformers does: text that is being copied usually
comes from the prompt, while a recent match is often the model's own last few tokens. With
`max_branches` > 1, the continuations of up to that many occurrences that start differently
(shorter n-grams' after the longest one's) are merged into a token trie (a draft tree); with 1,
the draft is a chain. No model runs: the cost
is a dictionary lookup per round.

Pure policy: token ids only.
"""

from __future__ import annotations

from collections.abc import Sequence

from polylane.policy.speculation.tree import DraftTree


class NgramIndex:
    """Where each n-gram (min_ngram ≤ n ≤ max_ngram) of a growing token list ends."""

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram → end positions (exclusive)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index hold `tokens`, which extend what it holds (a request's context only
        grows); anything else (shorter, or a different last token) rebuilds it."""
        common = len(self.tokens)
        if common > len(tokens) or (common and self.tokens[-1] != tokens[common - 1]):
            self.__init__(self.min_ngram, self.max_ngram)  # type: ignore[misc]
            common = 0
        self.extend(tokens[common:])

    def continuations(self, max_tokens: int, max_branches: int = 1) -> list[list[int]]:
        """Up to `max_branches` continuations (each up to `max_tokens` tokens) with different first
        tokens: those of the longest n-gram that matches earlier first, then shorter n-grams'
        (for a tree's other branches); [] when nothing matches."""
        if max_tokens < 1 or max_branches < 1:
            return []
        end = len(self.tokens)
        found: list[list[int]] = []
        starts: set[int] = set()
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            for match_end in self._ends.get(tuple(self.tokens[end - n :]), []):
                if match_end >= end:
                    continue  # the suffix itself
                follow = self.tokens[match_end : match_end + max_tokens]
                if not follow or follow[0] in starts:
                    continue
                starts.add(follow[0])
                found.append(follow)
                if len(found) == max_branches:
                    return found
        return found

    def propose(self, max_nodes: int, max_branches: int = 1, depth: int | None = None) -> DraftTree:
        """A draft of at most `max_nodes` tokens, each branch at most `depth` deep (default: as
        many as the nodes): a chain, or a trie of continuations."""
        continuations = self.continuations(min(max_nodes, depth or max_nodes), max_branches)
        return trie(continuations, max_nodes)


def trie(continuations: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """Merge token sequences into one draft tree (shared prefixes once), at most `max_nodes`
    nodes, the earlier sequences first. Every node gets probability 1 (a deterministic draft)."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    child_of: dict[tuple[int, int], int] = {}
    children_count: dict[int, int] = {}
    for sequence in continuations:
        node = -1
        for token in sequence:
            existing = child_of.get((node, token))
            if existing is not None:
                node = existing
                continue
            if len(tokens) >= max_nodes:
                break
            tokens.append(token)
            parents.append(node)
            depths.append(1 if node < 0 else depths[node] + 1)
            ranks.append(children_count.get(node, 0))
            children_count[node] = children_count.get(node, 0) + 1
            child_of[(node, token)] = len(tokens) - 1
            node = len(tokens) - 1
    n = len(tokens)
    return DraftTree(tuple(tokens), tuple(parents), (1.0,) * n, (1.0,) * n, tuple(ranks), tuple(depths))


__all__ = ["NgramIndex", "trie"]
