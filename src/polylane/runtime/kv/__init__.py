"""KV bytes: the paged cache's tensors (`kv_cache`) and each model's KV state over the policy's
blocks and prefix tree (`model_kv`: open, extend, fork, close sequences)."""
