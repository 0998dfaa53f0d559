"""The tensor side: everything that imports torch. Feature folders — `loading/` (model files to
loaded models), `model/` (a model's arithmetic, weight forms and the native C stack), `models/`
(architectures), `kv/` (KV bytes), `speculation/`, `residency/`, `sharing/`, `sampling/` — and at
the top the runner (one step's plan executed), the offline generate loop and the CPU load sampler."""
