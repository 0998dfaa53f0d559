"""KV bytes: the paged cache's tensors (`kv_cache`) and each model's KV state over the policy's
`KVManager` (`model_kv`: forwards over the block tables a plan gives, and the runtime's own
scratch sequences: open, extend, fork, close)."""
