"""Our decoder against Hugging Face `transformers` loading the same GGUF file.

For each real model and several prompts: last-position logits agree (max-abs difference and
top-1 / top-5 agreement in the message) and 32 greedy tokens are identical. transformers is the
reference: it dequantises the same file to float32 and runs its own implementation.

Loading the file into transformers takes up to a minute per model (its GGUF reader parses every
metadata field in Python and dequantises every tensor), so transformers' outputs are kept on disk
under `<cache dir>/transformers-reference/`, keyed by the file's content hash, the transformers,
torch and gguf versions, the prompt token ids, GREEDY_TOKENS and the source of the reference
procedure: transformers runs once per machine, file and version, and the reference stays its own
output. POLYLANE_PARITY_FRESH=1 ignores (and rewrites) the saved reference.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from polylane import catalog
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.loading.file_identity import content_digest, write_atomically
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
    name = request.param
    source = fetch_or_skip(name)
    ours = load_real_model(name)
    prompt_ids = _prompt_ids(ours.tokenizer, name)
    yield ours, _reference(source.path, prompt_ids)
    unload_real_model(name)
    gc.collect()


def _reference(path: Path, prompt_ids: dict[str, list[int]]) -> Reference:
    """transformers' outputs for these prompts of this file: read from the reference cache, else
    computed by transformers and saved there."""
    saved = _reference_path(path, prompt_ids)
    if os.environ.get("POLYLANE_PARITY_FRESH") != "1":
        try:
            return _reference_from_json(json.loads(saved.read_text()), prompt_ids)
        except (OSError, KeyError, TypeError, ValueError):
            pass  # never computed here, or unreadable: compute it again
    reference = _transformers_reference(path, prompt_ids)
    write_atomically(saved, json.dumps(_reference_to_json(reference)), "a transformers reference")
    return reference


def _reference_path(path: Path, prompt_ids: dict[str, list[int]]) -> Path:
    import transformers

    key = {
        "file_sha256": content_digest(path),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": version("gguf"),
        "prompt_ids": prompt_ids,
        "greedy_tokens": GREEDY_TOKENS,
        "procedure": inspect.getsource(_transformers_reference) + inspect.getsource(_hf_greedy),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return catalog.cache_dir() / "transformers-reference" / f"{path.stem}-{digest[:32]}.json"


def _reference_to_json(reference: Reference) -> dict:
    return {
        "prompt_ids": reference.prompt_ids,
        "greedy": reference.greedy,
        "last_logits": {
            key: base64.b64encode(logits.contiguous().numpy().tobytes()).decode()
            for key, logits in reference.last_logits.items()
        },
    }


def _reference_from_json(saved: dict, prompt_ids: dict[str, list[int]]) -> Reference:
    if saved["prompt_ids"] != prompt_ids or set(saved["greedy"]) != set(prompt_ids):
        raise ValueError("the saved reference is for other prompts")
    last_logits = {
        key: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.float32)
        for key, text in saved["last_logits"].items()
    }
    greedy = {key: [int(token) for token in tokens] for key, tokens in saved["greedy"].items()}
    if set(last_logits) != set(prompt_ids) or any(len(t) != GREEDY_TOKENS for t in greedy.values()):
        raise ValueError("the saved reference is incomplete")
    return Reference(prompt_ids, last_logits, greedy)


def _transformers_reference(path: Path, prompt_ids: dict[str, list[int]]) -> Reference:
    """Load the GGUF file into transformers at float32 and run every prompt through it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _one_gguf_reader_per_file():
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    last_logits, greedy = {}, {}
    for key, ids in prompt_ids.items():
        last_logits[key], greedy[key] = _hf_greedy(hf, ids)
    del hf
    gc.collect()
    return Reference(prompt_ids, last_logits, greedy)


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
