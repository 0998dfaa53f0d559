"""Text from a model in this process, no server: `polylane generate` (one prompt) and `polylane
chat` (an interactive conversation, streamed, the earlier turns' KV reused from the prefix cache).

polylane generate [MODEL] PROMPT   stream one completion (the default model when none is named)
polylane chat [MODEL]              talk to a chat model; /clear forgets the conversation, /bye ends

Sampling: greedy by default for `generate` (reproducible); `chat` samples with the model's defaults
(its file's settings, else temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), as the server does
for a request that leaves them unset. Flags override either.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from polylane import catalog
from polylane.types import (
    DEFAULT_DTYPE,
    SAMPLING_FIELDS,
    SAMPLING_OFF,
    WEIGHT_DTYPES,
    SamplingDefaults,
    SamplingParams,
)

DEVICE_HELP = "where models run: auto (default: CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N"
CHAT_KV_TOKENS = 4096  # a conversation's whole history, prompt and replies


def add_parsers(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="generate text from a prompt (no server)")
    generate.add_argument(
        "words",
        nargs="+",
        metavar="[MODEL] PROMPT",
        help=f"a catalogue name, .gguf file or HF folder (default {catalog.DEFAULT_MODEL}), then the prompt "
        "(a user message for chat models)",
    )
    generate.add_argument("--raw", action="store_true", help="do not apply the chat template")
    generate.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    _sampling_and_device(generate, temperature=0.0)
    generate.set_defaults(run=_cmd_generate)

    chat = commands.add_parser("chat", help="talk to a chat model in the terminal, streamed (no server)")
    chat.add_argument(
        "model", nargs="?", default=catalog.DEFAULT_MODEL, help="a chat model (default: %(default)s)"
    )
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    chat.add_argument("--system", help="a system message that starts the conversation")
    _sampling_and_device(chat, temperature=None)
    chat.set_defaults(run=_cmd_chat)


def _sampling_and_device(parser: argparse.ArgumentParser, temperature: float | None) -> None:
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=WEIGHT_DTYPES,
        help="weight dtype (default auto: the file's own quantisation; int8/int4: weight-only "
        "re-quantised projections)",
    )
    unset = "the model's default" if temperature is None else None
    parser.add_argument(
        "--temperature", type=float, default=temperature, help=f"0 = greedy (default {unset or temperature})"
    )
    parser.add_argument("--top-k", type=int, help=f"0 = off (default {unset or 'off'})")
    parser.add_argument("--top-p", type=float, help=f"1.0 = off (default {unset or 'off'})")
    parser.add_argument("--min-p", type=float, help=f"0 = off (default {unset or 'off'})")
    parser.add_argument("--seed", type=int, default=None, help="same seed, same output")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def _load(args: argparse.Namespace, name: str) -> Any:
    import torch

    from polylane.runtime.loading.loaded_model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {name} ({args.dtype}, device {args.device}) …", file=sys.stderr, flush=True)
    return load_model(name, args.dtype, device=args.device)


def _params(args: argparse.Namespace, defaults: SamplingDefaults, max_tokens: int) -> SamplingParams:
    """SamplingParams from the flags, each sampling flag left unset from `defaults`."""
    flags = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    return defaults.params(**flags, seed=args.seed, max_tokens=max_tokens)


def _stream(generator: Any, prompt_ids: list[int], params: Any) -> tuple[Any, str]:
    """Generate one reply, writing its text as it comes; (the output, its whole text)."""
    from polylane.runtime.generate import GenerationRequest
    from polylane.runtime.sampling.detokenizer import IncrementalDetokenizer

    tokenizer = generator.model.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces: list[str] = []

    def on_token(_: int, token_id: int) -> None:
        if token_id not in tokenizer.stop_token_ids:
            pieces.append(detokenizer.push(token_id))
            sys.stdout.write(pieces[-1])
            sys.stdout.flush()

    [output] = generator.generate([GenerationRequest(tuple(prompt_ids), params)], on_token=on_token)
    pieces.append(detokenizer.flush())
    sys.stdout.write(pieces[-1] + "\n")
    return output, "".join(pieces)


def _cmd_generate(args: argparse.Namespace) -> int:
    from polylane.runtime.generate import Generator
    from polylane.runtime.sampling.tokenizer import ChatTemplateError

    if len(args.words) > 2:
        raise ValueError("generate takes [MODEL] PROMPT: quote a prompt of several words")
    name, prompt = args.words if len(args.words) == 2 else (catalog.DEFAULT_MODEL, args.words[0])
    model = _load(args, name)
    tokenizer = model.tokenizer
    if args.raw or not tokenizer.has_chat_template:
        if not args.raw:
            print("(model has no chat template: prompt sent as plain text)", file=sys.stderr)
        prompt_ids = tokenizer.encode(prompt)
    else:
        try:
            prompt_ids = tokenizer.render_chat([{"role": "user", "content": prompt}])
        except ChatTemplateError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    params = _params(args, SAMPLING_OFF, args.max_tokens)
    block_size = 16
    total = len(prompt_ids) + params.max_tokens  # the Generator refuses totals over the context
    generator = Generator(model, num_blocks=-(-total // block_size), block_size=block_size)
    started = time.perf_counter()
    output, _ = _stream(generator, prompt_ids, params)
    print(
        f"[{model.name} {args.dtype}] load {model.load_seconds:.2f} s | prompt "
        f"{output.prompt_tokens} tokens | TTFT {output.ttft_seconds * 1000:.0f} ms | "
        f"{len(output.token_ids)} tokens, decode {output.decode_tokens_per_second:.1f} tokens/s | "
        f"finish: {output.finish_reason} | total {time.perf_counter() - started:.2f} s",
        file=sys.stderr,
    )
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from polylane.runtime.generate import Generator
    from polylane.runtime.sampling.defaults import read_sampling_defaults

    source = catalog.resolve(args.model)
    model = _load(args, args.model)
    if not model.tokenizer.has_chat_template:
        raise ValueError(f"{args.model} has no chat template (a base model): use `polylane generate --raw`")
    params = _params(args, read_sampling_defaults(source.path, source.format), args.max_tokens)
    block_size = 16
    generator = Generator(
        model, num_blocks=CHAT_KV_TOKENS // block_size, block_size=block_size, prefix_cache=True
    )
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    print(
        f"chatting with {args.model}: /clear forgets the conversation, /bye (or Ctrl-D) ends", file=sys.stderr
    )
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            break
        if text == "/clear":
            history.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        turn = [*system, *history, {"role": "user", "content": text}]
        prompt_ids = model.tokenizer.render_chat(turn)
        if len(prompt_ids) + params.max_tokens > CHAT_KV_TOKENS:
            print(
                f"(the conversation is over {CHAT_KV_TOKENS} tokens: /clear to start again)", file=sys.stderr
            )
            continue
        _, reply = _stream(generator, prompt_ids, params)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    return 0
