"""Cross-model prefill sharing: which lower layers two models provably share, from their per-layer
digests (`layer_share`)."""
