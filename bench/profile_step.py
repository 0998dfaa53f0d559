"""Profile one decode step of polylane's decoder: where the time goes, by category and by op.

Run:  python bench/profile_step.py [--model smollm2-135m-instruct] [--dtype fp32|bf16|int8|int4]
      [--context 32] [--batch 1] [--steps 10] [--threads 2] [--pieces]

Prints the median wall time of a decode step (--batch sequences, one new token each, after
prompts of --context tokens; median of 40 steps), then a torch.profiler run of --steps steps:
- by category: self CPU time of the ops in each category per step —
  weights (mm/addmm/linear: streaming the weight matrices), attention (the score and value
  matmuls, softmax, masking, KV gathers and writes), elementwise and norms (RMSNorm, RoPE,
  activation, residual adds, casts), and "Python and dispatch": profiled wall time per step minus
  all op time (the interpreter, module calls, building the batch layout);
- sampling: the time to pick the next token from the step's logits, greedy (argmax) and with
  temperature 0.8 / top-p 0.9 (`RequestSampler`), measured outside the profiler;
- the per-op table (grouped by input shape), sorted by self CPU time.
The profiler adds overhead of its own, so its wall time per step is reported next to the plain
one. With --pieces, the parts of one layer (norm, attention and its projections, MLP and its
projections) and the output projection are also timed alone, outside the profiler (microseconds
per call, batch rows of one new token each). The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.loading.loaded_model import load_model
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.layers import ForwardContext
from polylane.runtime.sampling.sampler import RequestSampler, sample_rows
from polylane.types import WEIGHT_DTYPES, SamplingParams, SequenceChunk

WEIGHT_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "aten::matmul",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
}
ATTENTION_OPS = {
    "aten::bmm",
    "aten::_softmax",
    "aten::softmax",
    "aten::masked_fill",
    "aten::index_select",
    "aten::index_copy_",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::scaled_dot_product_attention",
    "aten::baddbmm",
}


def category(name: str, shapes: list) -> str:
    if name in ATTENTION_OPS:
        return "attention"
    if name in WEIGHT_OPS:
        # the attention's own matmuls are batched 3-D; weight matmuls take a 2-D weight
        return "weights" if len(shapes) > 1 and len(shapes[1]) == 2 else "attention"
    return "elementwise and norms"


def _microseconds(call, repeats: int = 200) -> float:
    for _ in range(10):
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e6


@torch.inference_mode()
def time_pieces(model, cache, tables, length: int, block_size: int) -> dict[str, float]:
    """Microseconds per call of one middle layer's parts and of the output projection."""
    module = model.module
    chunks = [SequenceChunk((5,), length, t) for t in tables]
    batch = build_forward_batch(chunks, block_size, model.config)
    rotary = {kind: table.lookup(batch.positions) for kind, table in module._rotary.items()}
    context = ForwardContext(batch, cache, rotary)
    rows = len(tables)
    activations = torch.float32 if model.dtype == torch.float32 else model.dtype
    hidden = torch.randn(rows, model.config.hidden_size, dtype=activations)
    inner = torch.randn(rows, model.config.intermediate_size, dtype=activations)
    layer = module.layers[len(module.layers) // 2]
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "whole forward": _microseconds(lambda: module(batch, cache), 50),
        "build batch layout": _microseconds(lambda: build_forward_batch(chunks, block_size, model.config)),
        "one layer": _microseconds(lambda: layer(hidden, context)),
        "  input norm": _microseconds(lambda: layer.input_layernorm(hidden)),
        "  attention": _microseconds(lambda: attention(hidden, context)),
        "    qkv projection": _microseconds(lambda: attention.qkv_proj(hidden)),
        "    output projection": _microseconds(lambda: attention.o_proj(hidden)),
        "  mlp": _microseconds(lambda: mlp(hidden)),
        "    gate/up projection": _microseconds(lambda: mlp.gate_up_proj(hidden)),
        "    down projection": _microseconds(lambda: mlp.down_proj(inner)),
        "output logits": _microseconds(lambda: module.output_logits(hidden), 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=WEIGHT_DTYPES)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pieces", action="store_true", help="also time one layer's parts alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, quiet=True, device="cpu")  # the CPU stacks compared
    block_size, timed = 16, 40
    per_sequence = -(-(args.context + timed + args.steps + 16) // block_size)
    cache = PagedKVCache(model.config, per_sequence * args.batch, block_size, model.kv_dtype)
    tables = [tuple(range(b * per_sequence, (b + 1) * per_sequence)) for b in range(args.batch)]
    prompts = [tuple(100 + (i * 37 + b) % 1000 for i in range(args.context)) for b in range(args.batch)]
    first = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    model.module(build_forward_batch(first, block_size, model.config), cache)
    length = args.context
    logits = torch.empty(0)

    def step() -> None:
        nonlocal length, logits
        chunks = [SequenceChunk((5,), length, t) for t in tables]
        logits = model.module(build_forward_batch(chunks, block_size, model.config), cache)
        length += 1

    for _ in range(5):
        step()
    times = []
    for _ in range(timed):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    step_ms = statistics.median(times) * 1000
    tokens_per_s = 1000 * args.batch / step_ms
    print(
        f"{args.model} {args.dtype} batch {args.batch}: "
        f"decode step {step_ms:.1f} ms ({tokens_per_s:.1f} tokens/s)"
    )

    rows = logits.reshape(-1, logits.shape[-1])[: args.batch].float()
    sampling = {}
    for label, params in (
        ("greedy", SamplingParams()),
        ("top_p", SamplingParams(temperature=0.8, top_p=0.9)),
    ):
        samplers = [RequestSampler(params) for _ in range(args.batch)]
        started = time.perf_counter()
        for _ in range(20):
            sample_rows(rows, samplers)
        sampling[label] = (time.perf_counter() - started) / 20 * 1000

    with torch.profiler.profile(record_shapes=True) as profile:
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        profiled_ms = (time.perf_counter() - started) / args.steps * 1000
    averages = profile.key_averages(group_by_input_shape=True)
    categories: dict[str, float] = {"weights": 0.0, "attention": 0.0, "elementwise and norms": 0.0}
    for event in averages:
        if event.key.startswith("aten::") or event.key.startswith("mkldnn"):
            categories[category(event.key, event.input_shapes)] += (
                event.self_cpu_time_total / 1000 / args.steps
            )
    categories["Python and dispatch"] = max(0.0, profiled_ms - sum(categories.values()))

    print(f"\nunder the profiler: {profiled_ms:.1f} ms per step; by category (ms per step, share):")
    for name, ms in categories.items():
        print(f"  {name:24s} {ms:7.2f} ms  {ms / profiled_ms:6.1%}")
    print(
        f"sampling ({args.batch} rows, outside the profiler): greedy {sampling['greedy']:.2f} ms, "
        f"temperature 0.8 / top-p 0.9 {sampling['top_p']:.2f} ms\n"
    )
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    pieces = time_pieces(model, cache, tables, length, block_size) if args.pieces else {}
    for name, us in pieces.items():
        print(f"  {name:28s} {us:8.1f} us")
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "context": args.context,
                "batch": args.batch,
                "step_ms": step_ms,
                "tokens_per_s": tokens_per_s,
                "profiled_step_ms": profiled_ms,
                "categories_ms": categories,
                "sampling_ms": sampling,
                "threads": args.threads,
                "pieces_us": pieces,
            }
        )
    )


if __name__ == "__main__":
    main()
