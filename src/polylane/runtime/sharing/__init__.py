"""Cross-model prefill sharing's execution: a shared band's boundary states and KV copied between
resident models (`layer_share`); which layers are shared is `policy/sharing/`."""
