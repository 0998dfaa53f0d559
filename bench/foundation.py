"""Foundation benchmark: polylane's single-model decoder against Hugging Face transformers.

Both systems run the same GGUF file, at the same dtype, on the same token ids (made with
polylane's tokenizer), in the same run, batch 1, greedy. This file owns the measurement and the
report; it does not tune either system (transformers runs with its defaults: its own attention
implementation, `DynamicCache`).

Run:  python bench/foundation.py [--model smollm2-135m-instruct] [--dtypes fp32,bf16]
      [--threads 2] [--repeats 3] [--decode-tokens 64] [--out bench/out/foundation]

Metrics (all wall-clock, `time.perf_counter`, batch 1; the report gives the BEST of the repeats,
i.e. the highest tokens/s, because on a shared machine other processes only ever slow a run down;
every sample and the median are in results.json):

prefill tokens/s (512 tokens)
    512 / the time of one forward over the whole 512-token prompt into an empty KV cache, with
    logits for the last position only. polylane: `build_forward_batch` + `DecoderModel.forward`
    (the paged KV cache is allocated beforehand, as a server would). transformers: one
    `model(ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)` call, the
    cache created inside the timed region (it grows on demand); `logits_to_keep=1` is what
    `generate` passes, and matches polylane computing logits for the last row only.
decode tokens/s, short context
    The first 16 tokens of the prompt, then N greedy tokens (N = --decode-tokens), one forward
    per token, end-of-sequence ignored. tokens/s = (N - 1) / (time of the last token - time of the
    first token): the prefill and the first token are excluded; each of the N - 1 steps counts
    a forward over one token, the argmax and the driver's per-step bookkeeping. polylane: its
    `Generator` (the driver behind `polylane generate`), whose `decode_seconds` is exactly this
    interval. transformers: a hand-written loop with `past_key_values` and `argmax`, timed the
    same way (not `generate`, so the definition matches exactly).
decode tokens/s, 512-token context
    The same after the full 512-token prompt: the steps attend over 512 to 512 + N - 1 tokens.
load seconds
    Time to turn the GGUF file into a model ready to run (polylane's `load_model`, including its
    tokenizer; transformers' `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`).
RSS after load, peak RSS (MiB)
    Each system runs in its OWN worker process (this script re-invoked with `--worker polylane`
    or `--worker transformers`), so the numbers never mix. "RSS after load" is psutil's resident
    set size right after loading; "peak RSS" is `resource.getrusage(RUSAGE_SELF).ru_maxrss`,
    the high-water mark over the whole worker's life (imports, loading, warm-up, every timed
    run). A fresh pair of workers is started for each dtype.
greedy agreement (short context)
    How many of the first decode tokens polylane and transformers agree on, counted up to the
    first difference (out of N), at the short context; the same at 512 tokens is in the JSON. A
    sanity number, not a gate: in bf16 a near-tie may flip (see shared/PERF.md).
ratio
    polylane / transformers for each metric: above 1 is better for polylane on tokens/s, below
    1 is better for polylane on seconds and memory.

Procedure. For each dtype: start the polylane worker and wait until it has loaded and done one
warm-up (a 512-token prefill and a short decode at both contexts), then the same for
transformers; then for each repeat run polylane then transformers (A, B, A, B, ...) so that
drift of the machine cancels. Only one worker computes at a time; the other waits on its stdin.
`torch.set_num_threads(--threads)` in every worker.

Output: a Markdown table per dtype on stdout and in OUT/foundation.md, everything (samples,
versions, load average) in OUT/results.json, the prompt in OUT/prompt.json, progress on stderr;
the LAST line of stdout is one JSON document with every reported number and ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

SYSTEMS = ("polylane", "transformers")
LONG_PROMPT_TOKENS = 512
SHORT_PROMPT_TOKENS = 16
WARMUP_DECODE_TOKENS = 8
BLOCK_SIZE = 16
MIB = 1024 * 1024

# (key, label, unit, better): the rows of the report, in order. "higher" or "lower" is better.
METRICS = (
    ("prefill_tokens_per_second", "prefill, 512 tokens", "tok/s", "higher"),
    ("decode_short_tokens_per_second", "decode, short context", "tok/s", "higher"),
    ("decode_long_tokens_per_second", "decode, 512-token context", "tok/s", "higher"),
    ("load_seconds", "load", "s", "lower"),
    ("rss_after_load_mib", "RSS after load", "MiB", "lower"),
    ("peak_rss_mib", "peak RSS", "MiB", "lower"),
)
TIMED_METRICS = METRICS[:3]

_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[foundation {time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Prompt


_SUBJECTS = (
    "The old lighthouse keeper",
    "A young engineer from the valley",
    "The committee of river merchants",
    "Our neighbour's patient grey cat",
    "The travelling orchestra",
    "A careful botanist",
    "The night-shift baker",
)
_VERBS = (
    "wrote a long letter about",
    "spent the whole winter studying",
    "argued loudly in the market over",
    "quietly kept a record of",
    "drew a detailed map showing",
    "told the children a story about",
)
_OBJECTS = (
    "the tides that came twice a day",
    "seventeen kinds of moss on the northern wall",
    "the price of salt in three neighbouring towns",
    "a bridge that had been rebuilt four times",
    "the migration of swallows in early spring",
    "an unfinished clock found in the attic",
    "the rules of a card game nobody remembered",
    "why the well water tasted of iron",
)
_ENDINGS = (
    "and nobody was surprised.",
    "before the first snow fell.",
    "although the evidence was thin.",
    "which later appeared in the town archive.",
    "while the rain kept falling.",
)


def prompt_text(sentences: int = 120) -> str:
    """A deterministic, varied English paragraph (no randomness, so every run sees the same)."""
    parts = []
    for i in range(sentences):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        verb = _VERBS[(i * 5 + 1) % len(_VERBS)]
        obj = _OBJECTS[(i * 3 + 2) % len(_OBJECTS)]
        ending = _ENDINGS[(i * 7 + 3) % len(_ENDINGS)]
        parts.append(f"In year {1700 + 13 * i}, {subject.lower()} {verb} {obj}, {ending}")
    return " ".join(parts)


def make_prompt(model_name: str) -> dict[str, Any]:
    """Token ids of the long (512) and short (16) prompts, made with polylane's tokenizer."""
    from polylane import catalog
    from polylane.runtime.sampling.tokenizer import load_tokenizer

    source = catalog.resolve(model_name)
    tokenizer = load_tokenizer(source)
    text = prompt_text()
    ids = tokenizer.encode(text)
    if len(ids) < LONG_PROMPT_TOKENS:
        raise RuntimeError(f"prompt text gives only {len(ids)} tokens; need {LONG_PROMPT_TOKENS}")
    long_ids = ids[:LONG_PROMPT_TOKENS]
    return {
        "model": source.name,
        "path": str(source.path),
        "format": source.format,
        "long_ids": long_ids,
        "short_ids": long_ids[:SHORT_PROMPT_TOKENS],
        "long_text": tokenizer.decode(long_ids, skip_special_tokens=False),
        "short_text": tokenizer.decode(long_ids[:SHORT_PROMPT_TOKENS], skip_special_tokens=False),
    }


# --------------------------------------------------------------------------------------------
# Workers: one process per system and dtype, driven over stdin/stdout, one JSON line per command


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / MIB


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB  # ru_maxrss is KiB


class PolylaneRunner:
    """Times polylane: a direct forward for prefill, the `Generator` for decode."""

    def __init__(self, model_name: str, dtype: str, max_decode_tokens: int) -> None:
        from polylane.runtime.generate import Generator
        from polylane.runtime.loading.loaded_model import load_model

        started = time.perf_counter()
        self.model = load_model(model_name, dtype, quiet=True)
        self.load_seconds = time.perf_counter() - started
        # Just enough blocks for the longest sequence, as DynamicCache holds just what it needs.
        num_blocks = math.ceil((LONG_PROMPT_TOKENS + max_decode_tokens) / BLOCK_SIZE) + 1
        self.generator = Generator(
            self.model, num_blocks=num_blocks, block_size=BLOCK_SIZE, prefill_chunk=LONG_PROMPT_TOKENS
        )

    def prefill_seconds(self, ids: list[int]) -> float:
        from polylane.runtime.model.batch import build_forward_batch
        from polylane.types import SequenceChunk

        # The generator's pool is all free between `generate` calls, so its cache's first blocks
        # can be borrowed.
        chunk = SequenceChunk(
            token_ids=tuple(ids),
            num_cached=0,
            block_table=tuple(range(math.ceil(len(ids) / BLOCK_SIZE))),
            logits="last",
        )
        started = time.perf_counter()
        batch = build_forward_batch([chunk], BLOCK_SIZE, self.model.config)
        logits = self.model.module(batch, self.generator.kv.cache)  # (1, V)
        elapsed = time.perf_counter() - started
        assert logits.shape[0] == 1
        return elapsed

    def decode(self, ids: list[int], tokens: int) -> tuple[list[int], float]:
        from polylane.runtime.generate import GenerationRequest
        from polylane.types import SamplingParams

        request = GenerationRequest(
            tuple(ids), SamplingParams(temperature=0.0, max_tokens=tokens), stop_at_eos=False
        )
        (output,) = self.generator.generate([request])
        return output.token_ids, output.decode_seconds

    def describe(self) -> dict[str, Any]:
        return {"dtype": str(self.model.dtype), "weight_bytes": self.model.weight_bytes}


class TransformersRunner:
    """Times Hugging Face transformers on the same file: one forward for prefill, a manual loop."""

    def __init__(self, path: str, file_format: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        file = Path(path)
        started = time.perf_counter()
        if file_format == "gguf":
            self.model = AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch_dtype
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(file, dtype=torch_dtype)
        self.model.eval()
        self.load_seconds = time.perf_counter() - started

    def _forward(self, ids: Any, cache: Any) -> Any:
        output = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1]  # (V,)

    def prefill_seconds(self, ids: list[int]) -> float:
        from transformers import DynamicCache

        torch = self.torch
        input_ids = torch.tensor([ids], dtype=torch.long)  # (1, T)
        with torch.inference_mode():
            started = time.perf_counter()
            self._forward(input_ids, DynamicCache(config=self.model.config))
            return time.perf_counter() - started

    def decode(self, ids: list[int], tokens: int) -> tuple[list[int], float]:
        from transformers import DynamicCache

        torch = self.torch
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            logits = self._forward(torch.tensor([ids], dtype=torch.long), cache)
            first_token_at = time.perf_counter()
            token = int(logits.argmax())
            generated = [token]
            last_token_at = first_token_at
            for _ in range(tokens - 1):
                logits = self._forward(torch.tensor([[token]], dtype=torch.long), cache)  # (V,)
                last_token_at = time.perf_counter()
                token = int(logits.argmax())
                generated.append(token)
        return generated, last_token_at - first_token_at

    def describe(self) -> dict[str, Any]:
        return {
            "dtype": str(self.model.dtype),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
        }


def run_worker(args: argparse.Namespace) -> None:
    """Serve `run` and `finish` commands on stdin; answer each with one JSON line."""
    # Keep the real stdout for the protocol; anything else printed to stdout goes to stderr.
    protocol: TextIO = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def answer(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    import torch

    torch.set_num_threads(args.threads)
    prompt = json.loads(Path(args.prompt_file).read_text())
    long_ids, short_ids = prompt["long_ids"], prompt["short_ids"]
    rss_after_imports = _rss_mib()
    if args.worker == "polylane":
        runner: PolylaneRunner | TransformersRunner = PolylaneRunner(
            prompt["path"], args.dtype, args.decode_tokens
        )
    else:
        runner = TransformersRunner(prompt["path"], prompt["format"], args.dtype)
    rss_after_load = _rss_mib()

    # Warm-up: the same shapes as the timed runs, fewer decode steps.
    runner.prefill_seconds(long_ids)
    runner.decode(short_ids, WARMUP_DECODE_TOKENS)
    runner.decode(long_ids, WARMUP_DECODE_TOKENS)
    answer(
        {
            "ready": True,
            "system": args.worker,
            "requested_dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "load_seconds": runner.load_seconds,
            "rss_after_imports_mib": rss_after_imports,
            "rss_after_load_mib": rss_after_load,
            **runner.describe(),
        }
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            prefill = runner.prefill_seconds(long_ids)
            short_tokens, short_seconds = runner.decode(short_ids, args.decode_tokens)
            long_tokens, long_seconds = runner.decode(long_ids, args.decode_tokens)
            steps = args.decode_tokens - 1
            answer(
                {
                    "prefill_seconds": prefill,
                    "prefill_tokens_per_second": len(long_ids) / prefill,
                    "decode_short_seconds": short_seconds,
                    "decode_short_tokens_per_second": steps / short_seconds,
                    "decode_long_seconds": long_seconds,
                    "decode_long_tokens_per_second": steps / long_seconds,
                    "short_tokens": short_tokens,
                    "long_tokens": long_tokens,
                }
            )
        elif command == "finish":
            answer({"rss_end_mib": _rss_mib(), "peak_rss_mib": _peak_rss_mib()})
            return
        else:
            answer({"error": f"unknown command {command!r}"})


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, system: str, dtype: str, args: argparse.Namespace, prompt_file: Path) -> None:
        self.system = system
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            system,
            "--dtype",
            dtype,
            "--threads",
            str(args.threads),
            "--decode-tokens",
            str(args.decode_tokens),
            "--prompt-file",
            str(prompt_file),
        ]
        env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"{self.system} worker exited (status {code}) without answering")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.system} worker: {message['error']}")
        return message

    def send(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.receive()

    def finish(self) -> dict[str, Any]:
        message = self.send("finish")
        self.process.wait(timeout=60)
        return message

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# --------------------------------------------------------------------------------------------
# Parent: drive the workers, summarise, report


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy sequences share before their first difference."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def bench_dtype(dtype: str, args: argparse.Namespace, prompt_file: Path) -> dict[str, Any]:
    workers: dict[str, Worker] = {}
    info: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    try:
        for system in SYSTEMS:  # one at a time, so loads do not compete for the cores
            progress(f"{dtype}: starting {system} worker (load + warm-up)")
            workers[system] = Worker(system, dtype, args, prompt_file)
            info[system] = workers[system].receive()
            progress(
                f"{dtype}: {system} ready: loaded in {info[system]['load_seconds']:.1f}s, "
                f"RSS {info[system]['rss_after_load_mib']:.0f} MiB"
            )
        for repeat in range(args.repeats):
            for system in SYSTEMS:
                sample = workers[system].send("run")
                samples[system].append(sample)
                progress(
                    f"{dtype} repeat {repeat + 1}/{args.repeats} {system:>12}: "
                    f"prefill {sample['prefill_tokens_per_second']:7.1f} tok/s, "
                    f"decode short {sample['decode_short_tokens_per_second']:5.1f} tok/s, "
                    f"decode 512 {sample['decode_long_tokens_per_second']:5.1f} tok/s"
                )
        for system in SYSTEMS:
            info[system].update(workers[system].finish())
    finally:
        for worker in workers.values():
            worker.kill()

    summary: dict[str, Any] = {}
    for system in SYSTEMS:
        row: dict[str, Any] = {
            "load_seconds": info[system]["load_seconds"],
            "rss_after_load_mib": info[system]["rss_after_load_mib"],
            "peak_rss_mib": info[system]["peak_rss_mib"],
        }
        for key, _, _, _ in TIMED_METRICS:
            values = [s[key] for s in samples[system]]
            row[key] = max(values)  # best: the highest tokens/s
            row[f"{key}_median"] = statistics.median(values)
        summary[system] = row
    ratio = {
        key: summary["polylane"][key] / summary["transformers"][key]
        for key, _, _, _ in METRICS
        if summary["transformers"][key]
    }
    ours, theirs = samples["polylane"][-1], samples["transformers"][-1]
    agreement = {
        "short": leading_agreement(ours["short_tokens"], theirs["short_tokens"]),
        "long": leading_agreement(ours["long_tokens"], theirs["long_tokens"]),
        "out_of": args.decode_tokens,
        # Greedy output must not change between repeats of one system; False would mean noise
        # in the numerics (e.g. threads summing in a different order), worth a look.
        "polylane_repeatable": all(s["short_tokens"] == ours["short_tokens"] for s in samples["polylane"]),
        "transformers_repeatable": all(
            s["short_tokens"] == theirs["short_tokens"] for s in samples["transformers"]
        ),
    }
    return {
        "summary": summary,
        "ratio": ratio,
        "greedy_agreement": agreement,
        "workers": info,
        "samples": samples,
    }


def markdown(
    results: dict[str, Any],
    args: argparse.Namespace,
    prompt: dict[str, Any],
    load_average: tuple[float, float],
) -> str:
    lines = [
        f"# Foundation benchmark: {prompt['model']}",
        "",
        f"threads {args.threads}, repeats {args.repeats} (best of them shown), "
        f"decode {args.decode_tokens} tokens, batch 1, greedy. "
        "Ratio = polylane / transformers (tok/s: higher is better; s and MiB: lower is better). "
        f"1-minute load average {load_average[0]:.1f} before, {load_average[1]:.1f} after "
        f"({os.cpu_count()} cores): well above the thread count means other work shared the machine.",
    ]
    for dtype, result in results.items():
        summary, ratio = result["summary"], result["ratio"]
        agreement = result["greedy_agreement"]
        lines += [
            "",
            f"## {dtype}",
            "",
            "| metric | polylane | transformers | ratio |",
            "|---|---:|---:|---:|",
        ]
        for key, label, unit, _ in METRICS:
            ours, theirs = summary["polylane"][key], summary["transformers"][key]
            digits = 2 if unit == "s" else 1 if unit == "tok/s" else 0
            lines.append(
                f"| {label} ({unit}) | {ours:,.{digits}f} | {theirs:,.{digits}f} | "
                f"{ratio.get(key, float('nan')):.2f} |"
            )
        lines += [
            "",
            f"Greedy agreement (leading tokens equal): short context {agreement['short']}/"
            f"{agreement['out_of']}, 512-token context {agreement['long']}/{agreement['out_of']}.",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or path")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every worker")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system and dtype")
    parser.add_argument("--decode-tokens", type=int, default=64, help="N greedy tokens per decode")
    parser.add_argument("--out", default="bench/out/foundation", help="output folder")
    # Internal: the parent re-invokes this script as a worker.
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2 (decode speed is timed between tokens)")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
        return

    import torch
    import transformers

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress(f"preparing the {LONG_PROMPT_TOKENS}-token prompt with polylane's tokenizer")
    prompt = make_prompt(args.model)
    prompt_file = out / "prompt.json"
    prompt_file.write_text(json.dumps(prompt, indent=1) + "\n")

    load_before = os.getloadavg()
    results = {dtype: bench_dtype(dtype, args, prompt_file.resolve()) for dtype in dtypes}
    load_after = os.getloadavg()

    table = markdown(results, args, prompt, (load_before[0], load_after[0]))
    (out / "foundation.md").write_text(table)
    environment = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    settings = {
        "model": prompt["model"],
        "path": prompt["path"],
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "long_prompt_tokens": LONG_PROMPT_TOKENS,
        "short_prompt_tokens": SHORT_PROMPT_TOKENS,
        "statistic": "best of repeats (highest tokens/s); medians under *_median",
    }
    (out / "results.json").write_text(
        json.dumps({**settings, "environment": environment, "results": results}, indent=1) + "\n"
    )
    print(table)
    print(f"Full results: {out / 'results.json'}")
    final = {
        **settings,
        "load_average": [load_before[0], load_after[0]],
        "results": {
            dtype: {
                "polylane": r["summary"]["polylane"],
                "transformers": r["summary"]["transformers"],
                "ratio": r["ratio"],
                "greedy_agreement": r["greedy_agreement"],
            }
            for dtype, r in results.items()
        },
    }
    print(json.dumps(final))


if __name__ == "__main__":
    main()
