"""A loaded model's arithmetic in torch and its weights' forms: the flat batch (`batch`), the shared
layers (`layers`), the config (`model_config`), a GGUF file's blocks as projections
(`block_weights`), int4/int8 re-quantisation (`quantize`, `int4_layout`), where a model runs
(`device`), what computes each dtype here (`compute_paths`), and the C layer stack and block
kernels (`native/`). The architectures are in `runtime/models/`."""
