"""Cross-model prefill share: a model reuses another model's cached prefix through a shared band.

What this module owns: the registry of the models one engine serves (their digests, and a weak
reference to the KV of each resident one), the boundary layers each resident model records, and
extending a just-admitted sequence from a peer's cached prefix. Which layers two models share and
which peer to read from are pure decisions (`policy.sharing.layer_share`); the bytes move in
`PagedKVCache.import_band` and `ModelKV.extend_from_band`.

How a consumer reuses a provider's prefix, when both share layers `[0, L)`:

1. The provider records, for every token it prefills, the hidden state entering layer `L` (its
   cache's boundary state, registered here as soon as both digests are known). Its prefix tree
   holds the blocks; the same slots hold that state, and a flag per slot says the state belongs to
   the K/V now there.
2. The scheduler admitted the consumer's request at its own prefix-cache hit, with slots for the
   whole prompt reserved; `extend(consumer, kv, sequence, prompt)` then, for every
   resident peer with a band, it reads (no prefix lock; the engine thread owns every tree) the peer's
   cached whole blocks of the prompt, trims them to the leading tokens whose boundary state is
   valid, and lets `choose_source` pick the peer saving the most layer-tokens.
3. The consumer copies the K/V of layers `< L` for those tokens, runs only layers `>= L` from the
   boundary state, and the caller prefills the rest as usual (the last prompt token at least).
   Identical models (`L` = every layer) copy all K/V and compute nothing for the prefix.

The result is exact: layers `< L` compute bit-identical K/V and hidden states in both models, so
the continuation matches the consumer's own cold prefill to float tolerance (tests/runtime/
test_layer_share.py). The import runs inside the step that admits the sequence, outside the
scheduler's token budget (it costs at most the upper layers of the reused prefix).

A model's digests are known once it has been loaded on this machine (`runtime.loading.digests` caches them
by file identity); `declare` feeds cached ones in before a model loads, so that its peers record
boundary states from their first prefill. A resident model that is not leased by the runner stays
readable through a weak reference until the residency manager evicts it; boundary-state memory
is allocated when a peer appears and is not counted in the residency budget (small: one hidden
vector per KV slot and boundary, e.g. 9 MiB for SmolLM2's 4,096 slots).

`declare` may be called from any thread; everything else runs on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence

from polylane.policy.sharing.layer_share import (
    CrossCandidate,
    CrossModelCounters,
    CrossModelStats,
    ModelDigest,
    SharedBand,
    boundary_layers,
    choose_source,
    shared_band,
)
from polylane.runtime.kv.model_kv import KVSequence, ModelKV

log = logging.getLogger(__name__)


class LayerShare:
    """The cross-model prefill share among the models of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, ModelDigest] = {}
        self._live: dict[str, weakref.ReferenceType[ModelKV]] = {}
        self._changed = False  # digests declared since the boundaries were last synced
        self._counters: dict[str, CrossModelCounters] = {}

    # ------------------------------------------------------------------ registry

    def declare(self, name: str, digest: ModelDigest | None) -> None:
        """A served model's digests known before it loads (cached from an earlier load); None
        when unknown. Any thread."""
        if digest is None:
            return
        with self._lock:
            if self._digests.get(name) != digest:
                self._digests[name] = digest
                self._changed = True

    def attach(self, name: str, kv: ModelKV) -> None:
        """A model is resident with this KV (engine thread): record the boundary states its peers
        need, in its cache and in theirs. A model loaded without digests shares nothing."""
        digest = kv.model.digest
        if digest is None:
            return
        with self._lock:
            self._digests[name] = digest
            self._live[name] = weakref.ref(kv)
            self._changed = True
        self._sync_boundaries()

    def band(self, a: str, b: str) -> SharedBand:
        """The band two served models share (no band if either digest is unknown)."""
        with self._lock:
            first, second = self._digests.get(a), self._digests.get(b)
        if first is None or second is None:
            return SharedBand(0, False, "digests not known yet (model never loaded here)")
        return shared_band(first, second)

    def stats(self) -> dict[str, CrossModelStats]:
        """Cross-model hit statistics per consumer model. Any thread."""
        with self._lock:
            return {name: counters.snapshot() for name, counters in self._counters.items()}

    # ------------------------------------------------------------------ open

    def extend(self, name: str, kv: ModelKV, sequence: KVSequence, prompt_ids: Sequence[int]) -> None:
        """Extend a just-admitted `sequence` (its own prefix-cache hit written, slots for the rest
        of `prompt_ids` reserved) from the best peer's cached prefix, if any beats the model's
        own. Never fails for want of a peer: without one the sequence is left as it was."""
        if kv.tree is None or kv.model.digest is None:
            return
        self._sync_boundaries()
        lookup = prompt_ids[:-1]  # the last prompt token is always computed (its logits are needed)
        peers = self._peers(name, kv)
        if not peers:
            return
        with self._lock:
            counters = self._counters.setdefault(name, CrossModelCounters())
            counters.lookup()
        start = sequence.num_tokens
        candidates, sources = [], {}
        for peer, (peer_kv, band) in peers.items():
            slots = self._valid_slots(peer_kv, band, lookup, start, kv.model.config.num_layers)
            if slots:
                candidates.append(CrossCandidate(peer, band.layers, start + len(slots)))
                sources[peer] = (peer_kv, slots)
        choice = choose_source(candidates, start, kv.model.config.num_layers)
        if choice is None:
            return
        peer_kv, slots = sources[choice.provider]
        try:
            kv.extend_from_band(
                sequence, lookup[start : choice.num_tokens], peer_kv.cache, slots, choice.band
            )
        except Exception:  # a failed import costs its speed-up, never the request: the tokens
            # it did not commit are prefilled (and their slots rewritten) the usual way
            log.exception("importing %d tokens of %s into %s failed", len(slots), choice.provider, name)
            return
        with self._lock:
            counters.hit(choice.provider, len(slots), choice.band)

    def open(self, name: str, kv: ModelKV, prompt_ids: Sequence[int]) -> KVSequence:
        """A scratch sequence (`kv.open`, blocks taken as it goes) extended as `extend` does."""
        sequence = kv.open(prompt_ids)
        self.extend(name, kv, sequence, prompt_ids)
        return sequence

    # ------------------------------------------------------------------ internals

    def _peers(self, name: str, kv: ModelKV) -> dict[str, tuple[ModelKV, SharedBand]]:
        """Resident models other than `name` sharing a band with it, and that band."""
        with self._lock:
            live = list(self._live.items())
        own = kv.model.digest
        assert own is not None
        peers = {}
        for peer, reference in live:
            peer_kv = reference()
            if peer_kv is None:  # evicted since
                with self._lock:
                    if self._live.get(peer) is reference:
                        del self._live[peer]
                continue
            if peer == name or peer_kv is kv or peer_kv.tree is None or peer_kv.model.digest is None:
                continue
            band = shared_band(own, peer_kv.model.digest)
            if band.layers > 0:
                peers[peer] = (peer_kv, band)
        return peers

    @staticmethod
    def _valid_slots(
        peer_kv: ModelKV, band: SharedBand, lookup: Sequence[int], start: int, num_layers: int
    ) -> list[int]:
        """Slots in the peer's cache of prompt tokens `[start, n)`: its cached whole blocks, cut at
        the first token without a valid boundary state at the band (when the consumer has layers
        above it). Empty when the peer holds nothing past `start`."""
        assert peer_kv.tree is not None
        blocks = peer_kv.tree.peek_blocks(lookup)
        size = peer_kv.block_size
        slots = [blocks[i // size] * size + i % size for i in range(start, len(blocks) * size)]
        if not slots or band.layers >= num_layers:
            return slots
        valid = peer_kv.cache.boundary_valid.get(band.layers)
        if valid is None:
            return []
        flags = valid[slots].tolist()
        return slots[: flags.index(False)] if False in flags else slots

    def _sync_boundaries(self) -> None:
        """Register, in every resident model's cache, the boundaries its known peers need."""
        with self._lock:
            if not self._changed:
                return
            self._changed = False
            digests = dict(self._digests)
            live = [(name, reference()) for name, reference in self._live.items()]
        for name, kv in live:
            if kv is None:
                continue
            own = digests[name]
            others = [digest for peer, digest in digests.items() if peer != name]
            for layer in sorted(boundary_layers(own, others)):
                kv.cache.add_boundary(layer)
