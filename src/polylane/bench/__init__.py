"""`polylane bench`: one harness that measures polylane against its baselines, side by side.

Modules, one job each: `workloads` (seeded request lists, prompts shipped in `prompts/`),
`metrics` (every metric's definition and arithmetic; pure), `replay` (arrivals and the
concurrency cap over a client), `engine_client` / `http_client` / `hf_client` (the in-process
engine, a running server, Hugging Face transformers), `worker` (a system in its own process),
`systems` (what each system name means, the parent's side), `harness` (alternating repeats →
results), `report` (results.json, results.md, PNG plots, the final JSON line), `command` (the
CLI) and `schema.json` (the results format). Importing this package does not import torch.
"""
