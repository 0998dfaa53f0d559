"""Our decoder against Hugging Face `transformers` loading the same GGUF file.

For each real model and several prompts: last-position logits agree (max-abs difference and
top-1 / top-5 agreement in the message) and 32 greedy tokens are identical. transformers is the
reference: it dequantises the same file to float32 and runs its own implementation.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from dataclasses import dataclass

import pytest
import torch

from polylane.runtime.generate import GenerationRequest, Generator
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip, unload_real_model

GREEDY_TOKENS = 32
MAX_ABS_TOLERANCE = 1e-3  # logits are O(10); observed differences are O(1e-5)

PROMPTS = {
    "chat": None,  # filled with the chat template where the model has one
    "text": "The history of the printing press begins in the fifteenth century, when",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
}
# Longer than Gemma 3's 512-token sliding window, so local layers really slide.
LONG_PROMPT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} box holds {i * 7 % 23} stones."
    for i in range(60)
)

MODELS = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    "qwen2.5-coder-0.5b-instruct",
    pytest.param("qwen2.5-coder-1.5b-instruct", marks=pytest.mark.slow),
]


@dataclass
class Reference:
    prompt_ids: dict[str, list[int]]
    last_logits: dict[str, torch.Tensor]
    greedy: dict[str, list[int]]


def _prompt_ids(tokenizer, name: str) -> dict[str, list[int]]:
    prompts = {}
    for key, text in PROMPTS.items():
        if key == "chat":
            if not tokenizer.has_chat_template:
                continue
            prompts[key] = tokenizer.render_chat(
                [{"role": "user", "content": "Name three uses of a paperclip."}]
            )
        else:
            prompts[key] = tokenizer.encode(text)
    if name.startswith("gemma3"):
        prompts["long"] = tokenizer.encode(LONG_PROMPT)
    return prompts


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Last-position logits of the prompt and GREEDY_TOKENS greedy tokens (no EOS stop)."""
    # transformers renamed `past_key_values` to `cache` (5.2x); the pin allows both sides
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    first_logits = out.logits[0, -1].float().clone()
    past, token = getattr(out, name), int(out.logits[0, -1].argmax())
    tokens = [token]
    for _ in range(GREEDY_TOKENS - 1):
        out = model(torch.tensor([[token]]), use_cache=True, **{name: past})
        past, token = getattr(out, name), int(out.logits[0, -1].argmax())
        tokens.append(token)
    return first_logits, tokens


@pytest.fixture(scope="module", params=MODELS)
def model_pair(request, load_real_model):
    """(our LoadedModel, transformers reference outputs) for one real model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    name = request.param
    source = fetch_or_skip(name)
    ours = load_real_model(name)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _one_gguf_reader_per_file():
        hf = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32
        ).eval()
    prompt_ids = _prompt_ids(ours.tokenizer, name)
    last_logits, greedy = {}, {}
    for key, ids in prompt_ids.items():
        last_logits[key], greedy[key] = _hf_greedy(hf, ids)
    del hf
    gc.collect()
    yield ours, Reference(prompt_ids, last_logits, greedy)
    unload_real_model(name)
    gc.collect()


@contextlib.contextmanager
def _one_gguf_reader_per_file():
    """transformers opens the GGUF twice (config, then weights), and `gguf.GGUFReader` parses every
    metadata field in Python each time — half a minute for a 150k–262k-token vocabulary. The
    reader is read-only (a memory map), so both opens may share one."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


_OURS: dict[tuple[str, tuple[int, ...]], object] = {}


def _our_greedy(model, prompt_ids: list[int]):
    """Our logits and GREEDY_TOKENS greedy tokens for a prompt (computed once per session)."""
    key = (model.name, tuple(prompt_ids))
    if key not in _OURS:
        _OURS[key] = _run_ours(model, prompt_ids)
    return _OURS[key]


def _run_ours(model, prompt_ids: list[int]):
    generator = Generator(model, num_blocks=-(-(len(prompt_ids) + GREEDY_TOKENS) // 16), block_size=16)
    request = GenerationRequest(
        tuple(prompt_ids), SamplingParams(max_tokens=GREEDY_TOKENS), stop_at_eos=False
    )
    [output] = generator.generate([request], record_logits=True)
    return output


def test_last_position_logits_match(model_pair):
    ours, reference = model_pair
    for key, ids in reference.prompt_ids.items():
        output = _our_greedy(ours, ids)
        mine, theirs = output.logits[0], reference.last_logits[key]
        max_abs = (mine - theirs).abs().max().item()
        top5_mine = set(mine.topk(5).indices.tolist())
        top5_theirs = set(theirs.topk(5).indices.tolist())
        message = (
            f"{ours.name} prompt {key!r} ({len(ids)} tokens): max-abs {max_abs:.2e}, "
            f"top-1 {int(mine.argmax())} vs {int(theirs.argmax())}, "
            f"top-5 overlap {len(top5_mine & top5_theirs)}/5"
        )
        print(message)  # shown with `pytest -rP`: the numbers behind a pass
        assert max_abs < MAX_ABS_TOLERANCE, message
        assert int(mine.argmax()) == int(theirs.argmax()), message
        assert top5_mine == top5_theirs, message


def test_greedy_tokens_identical(model_pair):
    ours, reference = model_pair
    for key, ids in reference.prompt_ids.items():
        output = _our_greedy(ours, ids)
        expected = reference.greedy[key]
        first_difference = next(
            (i for i, (a, b) in enumerate(zip(output.token_ids, expected, strict=True)) if a != b),
            None,
        )
        assert output.token_ids == expected, (
            f"{ours.name} prompt {key!r}: greedy tokens differ first at step {first_difference}:"
            f"\nours   {output.token_ids}\ntheirs {expected}"
        )
