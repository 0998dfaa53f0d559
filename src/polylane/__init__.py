"""polylane: many models in one process, one decode lane, shared prefill, lossless speculation.

Where each part is (every package's `__init__` says what it owns, and every module's first
paragraph what it does):

- `policy/` — pure decisions, no torch: KV blocks and the prefix tree (`kv/`), residency under a
  byte budget (`residency/`), the step plan and the decode lane (`scheduling/`), speculation's
  rules (`speculation/`), which layers two models share (`sharing/`).
- `runtime/` — tensors: loading files (`loading/`), the model's arithmetic and the C kernels
  (`model/`, `model/native/`, the architectures in `models/`), KV bytes (`kv/`), speculation's
  execution (`speculation/`), residency's loading and unloading (`residency/`), cross-model KV
  import (`sharing/`), logits to text (`sampling/`); `runner` executes one step's plan.
- `engine` — the engine thread and its loop (`engine_stats`: its statistics); `types` — the plain
  data that crosses between policy, runtime and front ends; `catalog` — the model catalogue.
- `server/` — the OpenAI-compatible HTTP server; `cli*` — the command line; `bench/` — `polylane
  bench`.
"""
