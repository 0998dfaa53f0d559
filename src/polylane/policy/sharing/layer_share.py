"""Which layers two models provably share, and which cached prefix a consumer should reuse.

Pure policy (no torch). The runtime computes a `ModelDigest` per loaded model (sha256 over the
bytes of its embedding and of each layer's tensors, plus its tokenizer, RoPE configuration, KV
layout and layer hyper-parameters; see `runtime.loading.digests`) and hands the digests here:

- `shared_band(a, b)`: two models share the band of layers `[0, L)` when their tokenizer, RoPE,
  KV layout, layer hyper-parameters and embedding agree and so do layers `0 .. L-1`; for the same
  token ids at the same positions their K/V in those layers, and the hidden state entering layer
  `L`, are then bit-identical. Identical models (aliases, or one file under two names) share every
  layer. Anything that differs before layer 0 (tokenizer, RoPE base, embedding …) means `L = 0`.
- `boundary_layers(own, peers)`: the band boundaries at which a model must record the hidden
  state of the tokens it prefills, so that a peer can later resume from there.
- `choose_source(candidates, own_tokens, num_layers)`: among the peers' cached prefixes of a
  prompt, the one that saves the most layer-tokens over what the consumer's own prefix tree holds.
- `CrossModelCounters`: hit statistics of the cross-model share, per consumer model.

What this module does not own: the digests' computation, the KV and boundary-state bytes (the
runtime's `PagedKVCache`), the prefix trees (`policy.kv.radix`), or when a model is resident.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The parts that must agree before any layer can be shared, in the order they are checked.
_PREREQUISITES = (
    ("tokenizer", "tokenizer"),
    ("rope", "RoPE configuration"),
    ("kv_layout", "KV layout"),
    ("compute", "layer hyper-parameters"),
    ("embedding", "embedding"),
)


@dataclass(frozen=True)
class ModelDigest:
    """sha256 hex digests of what a model computes, from the bytes it actually loaded.

    embedding: the token embedding (bytes, shape, dtype). layers: one per decoder layer, over its
    tensors (names, shapes, dtypes, bytes) and its attention kind (global or sliding). head: the
    final norm and output projection (in no band; two models are `identical` only if it agrees).
    tokenizer: vocabulary, merges, normaliser and special tokens. rope: RoPE bases and row layout.
    kv_layout: KV heads, head size and dtype. compute: the hyper-parameters every layer's arithmetic
    depends on (architecture, hidden size, heads, norm epsilon, activation, scales, weight dtype).
    """

    embedding: str
    layers: tuple[str, ...]
    head: str
    tokenizer: str
    rope: str
    kv_layout: str
    compute: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "embedding": self.embedding,
            "layers": list(self.layers),
            "head": self.head,
            "tokenizer": self.tokenizer,
            "rope": self.rope,
            "kv_layout": self.kv_layout,
            "compute": self.compute,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelDigest:
        """The digest `to_json` wrote; KeyError/TypeError/ValueError for anything else."""
        fields = {name: str(data[name]) for name in ("embedding", "head", "tokenizer", "rope", "kv_layout")}
        layers = data["layers"]
        if not isinstance(layers, list) or not all(isinstance(layer, str) for layer in layers):
            raise ValueError("layers must be a list of digests")
        return cls(layers=tuple(layers), compute=str(data["compute"]), **fields)


@dataclass(frozen=True)
class SharedBand:
    """Layers `[0, layers)` of two models compute the same K/V and hidden states.

    identical: every layer, the head and every prerequisite agree (aliases). reason: why the band
    ends where it does, for `polylane models inspect`.
    """

    layers: int
    identical: bool
    reason: str


def shared_band(a: ModelDigest, b: ModelDigest) -> SharedBand:
    """The band of layers `a` and `b` share (symmetric)."""
    for name, label in _PREREQUISITES:
        if getattr(a, name) != getattr(b, name):
            return SharedBand(0, False, f"{label} differs")
    shallower = min(a.num_layers, b.num_layers)
    band = 0
    while band < shallower and a.layers[band] == b.layers[band]:
        band += 1
    if band < shallower:
        return SharedBand(band, False, f"layer {band} differs")
    if a.num_layers != b.num_layers:
        return SharedBand(band, False, f"all {band} layers of the shallower model agree")
    if a.head != b.head:
        return SharedBand(band, False, "every layer agrees; the final norm or output head differs")
    return SharedBand(band, True, "identical")


def boundary_layers(own: ModelDigest, peers: Iterable[ModelDigest]) -> frozenset[int]:
    """Layers `L` at whose input a model must record hidden states for its peers.

    One per peer band `[0, L)` with `L > 0`, except a band covering both whole models (nothing
    above it to resume). `L` may equal `own.num_layers` when a deeper peer extends this model.
    """
    boundaries = set()
    for peer in peers:
        band = shared_band(own, peer).layers
        if 0 < band < max(own.num_layers, peer.num_layers):
            boundaries.add(band)
    return frozenset(boundaries)


@dataclass(frozen=True)
class CrossCandidate:
    """A peer's cached prefix of a prompt usable by the consumer through a shared band.

    num_tokens: prompt tokens whose K/V (layers `< band`) and boundary state the peer holds.
    """

    provider: str
    band: int
    num_tokens: int


def choose_source(
    candidates: Sequence[CrossCandidate], own_tokens: int, num_layers: int
) -> CrossCandidate | None:
    """The candidate saving the most layer-tokens over the consumer's own `own_tokens`, or None.

    Without a candidate the tokens `[own_tokens, n)` cost `num_layers` layers each; reusing a band
    `[0, L)` costs `num_layers - L`, so a candidate saves `(n - own_tokens) * L`. A band covering
    the consumer's every layer saves whole tokens. Ties go to the provider name first in order,
    so the choice is deterministic.
    """
    best, best_saving = None, 0
    for candidate in sorted(candidates, key=lambda c: c.provider):
        saving = max(0, candidate.num_tokens - own_tokens) * min(candidate.band, num_layers)
        if saving > best_saving:
            best, best_saving = candidate, saving
    return best


@dataclass(frozen=True)
class CrossModelStats:
    """One consumer model's cross-model prefill share since the counters were made.

    lookups: sequences opened while at least one resident peer shared a band with it. hits: of
    those, sequences that reused a peer's cached prefix. imported_tokens: prompt tokens whose
    lower-band K/V came from a peer. skipped_layer_tokens: tokens × layers not computed thanks to
    that. by_provider: imported tokens per providing model.
    """

    lookups: int = 0
    hits: int = 0
    imported_tokens: int = 0
    skipped_layer_tokens: int = 0
    by_provider: Mapping[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class CrossModelCounters:
    """Mutable counters behind `CrossModelStats`; one owner thread (the engine's)."""

    def __init__(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.imported_tokens = 0
        self.skipped_layer_tokens = 0
        self.by_provider: dict[str, int] = {}

    def lookup(self) -> None:
        self.lookups += 1

    def hit(self, provider: str, num_tokens: int, band: int) -> None:
        self.hits += 1
        self.imported_tokens += num_tokens
        self.skipped_layer_tokens += num_tokens * band
        self.by_provider[provider] = self.by_provider.get(provider, 0) + num_tokens

    def snapshot(self) -> CrossModelStats:
        return CrossModelStats(
            self.lookups, self.hits, self.imported_tokens, self.skipped_layer_tokens, dict(self.by_provider)
        )
