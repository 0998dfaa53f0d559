"""Read GGUF files and Hugging Face safetensors folders into our decoder at a chosen dtype.

GGUF tensors are memory-mapped by the `gguf` package and dequantised tensor by tensor; safetensors
are memory-mapped by `safetensors`. Both are renamed to the Hugging Face layout first (undoing
llama.cpp's own conventions), then copied into the fused parameters of our modules.

Every failure names the file and the problem: a bad magic, a truncated file, an unknown
architecture, a missing tensor or a tensor of the wrong shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from polylane.runtime.loading.gguf_file import FLOAT_TYPES, GGUFFile, GGUFFormatError
from polylane.runtime.model.layers import interleave_rotary_rows
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.models import ARCHITECTURES, HF_MODEL_TYPES
from polylane.runtime.models.base import DecoderModel
from polylane.types import LoadError

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

# The dtypes that mean "the file's own": a GGUF file's quantised blocks used in place
# (`runtime.loading.gguf_in_place`), with activations rounded to 8 bits ("auto") or float32 ("auto-fp32");
# a Hugging Face folder's stored dtype.
AUTO, AUTO_FP32 = "auto", "auto-fp32"
IN_PLACE_ACTIVATION_BITS = {AUTO: 8, AUTO_FP32: 32}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class LoadedWeights:
    config: ModelConfig
    model: DecoderModel
    weight_bytes: int


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported weight dtype {name}; use fp32 or bf16")
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported weight dtype {name!r}; use fp32 or bf16") from None


# ---------------------------------------------------------------- GGUF


def open_gguf(path: Path) -> GGUFFile:
    try:
        file = GGUFFile(path)
    except FileNotFoundError:
        raise LoadError(f"{path}: file not found") from None
    except GGUFFormatError as error:
        raise LoadError(f"{path}: not a valid GGUF file: {error}") from None
    except OSError as error:
        raise LoadError(f"{path}: cannot read ({error})") from None
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    file.metadata["__vocab_size"] = getattr(tokens, "length", None) or (len(tokens) if tokens else None)
    file.metadata["__has_output"] = "output.weight" in file.tensors
    if "general.architecture" not in file.metadata:
        raise LoadError(f"{path}: GGUF header has no general.architecture")
    return file


def _read_tensor(file: GGUFFile, name: str) -> np.ndarray:
    try:
        return file.read(name)
    except NotImplementedError as error:
        raise LoadError(
            f"{file.path}: tensor {name!r} has type {file.type_name(name)}, which cannot be "
            f"dequantised ({error})"
        ) from None


def check_finite(file: GGUFFile, name: str) -> bool:
    """A tensor whose floats (values, or its blocks' scales) include NaN or Inf fails the load: a
    corrupt file would otherwise be served, answering with garbage. False where the format's
    scales are not known here (then the dequantised values are to be checked)."""
    count = file.nonfinite_count(name)
    if count:
        kind = "values" if file.tensors[name].type_id in FLOAT_TYPES else "block scales"
        raise _nonfinite(file.path, name, count, kind)
    return count is not None


def _nonfinite(path: Path, name: str, count: int, kind: str) -> LoadError:
    return LoadError(f"{path}: tensor {name!r} has {count:,} NaN or infinite {kind}: the file is corrupt")


GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, module: Any) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for a tensor our decoder does not use (e.g.
    precomputed rope tables)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[stem]}.{suffix}"
    if (match := re.match(r"^blk\.(\d+)\.(\w+)$", stem)) and match[2] in module.GGUF_LAYER_NAMES:
        return f"model.layers.{match[1]}.{module.GGUF_LAYER_NAMES[match[2]]}.{suffix}"
    return None


def gguf_tensors(
    file: GGUFFile, module: Any, config: ModelConfig, progress: bool, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every tensor the decoder needs, but those
    named in `skip` (GGUF names)."""
    names = tqdm(
        [name for name in file.tensors if name not in skip],
        desc=f"loading {file.path.name}",
        unit="tensor",
        disable=None if progress else True,  # None: shown only on a terminal
        leave=False,
    )
    for gguf_name in names:
        name = hf_name(gguf_name, module)
        if name is None:
            continue
        checked = check_finite(file, gguf_name)
        values = _read_tensor(file, gguf_name)
        if not checked and not np.isfinite(values).all():
            raise _nonfinite(file.path, gguf_name, int(np.count_nonzero(~np.isfinite(values))), "values")
        array = module.transform_gguf_tensor(name, values, config)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # memory-mapped F32 tensors are read-only
        yield name, torch.from_numpy(array)


def gguf_config(file: GGUFFile) -> tuple[type, Any, ModelConfig]:
    arch = str(file.metadata["general.architecture"])
    if arch not in ARCHITECTURES:
        raise LoadError(
            f"{file.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    model_class, module = ARCHITECTURES[arch]
    try:
        return model_class, module, module.config_from_gguf(file.metadata)
    except (KeyError, ValueError, TypeError) as error:
        raise LoadError(f"{file.path}: incomplete {arch} header ({error})") from None


def load_gguf(path: str | Path, dtype: str | torch.dtype = "fp32", progress: bool = False) -> LoadedWeights:
    """Dequantise a GGUF file into our decoder; `progress` shows a bar on stderr."""
    path = Path(path)
    file = open_gguf(path)
    model_class, module, config = gguf_config(file)
    tensors = gguf_tensors(file, module, config, progress)
    model = build(model_class, config, parse_dtype(dtype), tensors, path)
    return LoadedWeights(config, model, _parameter_bytes(model))


# ---------------------------------------------------------------- Hugging Face folders


def _hf_config(path: Path) -> tuple[type, ModelConfig]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LoadError(f"{path}: cannot read config.json ({error})") from None
    model_type = cfg.get("model_type")
    arch = HF_MODEL_TYPES.get(str(model_type))
    if arch is None:
        raise LoadError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})"
        )
    model_class, module = ARCHITECTURES[arch]
    try:
        return model_class, module.config_from_hf(cfg)
    except (KeyError, ValueError, TypeError) as error:
        raise LoadError(f"{path}: config.json is incomplete or unsupported ({error})") from None


def load_hf_folder(path: str | Path, dtype: str | torch.dtype = "fp32") -> LoadedWeights:
    from safetensors import safe_open

    path = Path(path)
    model_class, config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path}: no *.safetensors files")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:
                raise LoadError(f"{file}: not a readable safetensors file ({error})") from None
            with handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    hf_name = name.removeprefix("language_model.")
                    if hf_name.startswith("model.language_model."):
                        hf_name = "model." + hf_name.removeprefix("model.language_model.")
                    try:
                        tensor = handle.get_tensor(name).float()
                    except Exception as error:
                        raise LoadError(f"{file}: cannot read tensor {name!r} ({error})") from None
                    if not torch.isfinite(tensor).all():
                        raise _nonfinite(file, name, int((~torch.isfinite(tensor)).sum()), "values")
                    yield hf_name, tensor

    model = build(model_class, config, parse_dtype(dtype), tensors(), path)
    return LoadedWeights(config, model, _parameter_bytes(model))


def load_weights(
    path: str | Path, format: str, dtype: str | torch.dtype = "fp32", progress: bool = False
) -> LoadedWeights:
    if format == "gguf":
        return load_gguf(path, dtype, progress)
    if format == "hf":
        return load_hf_folder(path, dtype)
    raise ValueError(f"unknown model format {format!r}")


def read_config(path: str | Path, format: str) -> ModelConfig:
    """The model's shape from its header or config.json alone (no tensor is read)."""
    path = Path(path)
    if format == "gguf":
        return gguf_config(open_gguf(path))[2]
    if format == "hf":
        return _hf_config(path)[1]
    raise ValueError(f"unknown model format {format!r}")


def stored_16_bit(path: str | Path) -> bool:
    """Whether a Hugging Face folder stores its weights in 16 bits (bf16 or f16)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    return handle.get_slice(name).get_dtype() in ("BF16", "F16")
        except Exception as error:
            raise LoadError(f"{file}: not a readable safetensors file ({error})") from None
    return False


def estimate_weight_bytes(path: str | Path, format: str, dtype: str | torch.dtype = "fp32") -> int:
    """Bytes the weights will take at `dtype`, from the file's header alone (no tensor is read).
    At "auto" (or "auto-fp32") a GGUF file costs its own tensors' bytes (they are used in place).

    Also the cheap validity check before anything is evicted for this model: a missing, truncated
    or corrupt file raises LoadError here.
    """
    path = Path(path)
    if dtype in IN_PLACE_ACTIVATION_BITS:
        if format == "gguf":
            return sum(info.num_bytes for info in open_gguf(path).tensors.values())
        dtype = "bf16" if format == "hf" and stored_16_bit(path) else "fp32"
    element_size = torch.empty(0, dtype=parse_dtype(dtype)).element_size()
    if format == "gguf":
        file = open_gguf(path)
        return sum(math.prod(info.shape) for info in file.tensors.values()) * element_size
    if format == "hf":
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise LoadError(f"{path}: no *.safetensors files")
        elements = 0
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        elements += math.prod(handle.get_slice(name).get_shape())
            except Exception as error:
                raise LoadError(f"{file}: not a readable safetensors file ({error})") from None
        return elements * element_size
    raise ValueError(f"unknown model format {format!r}")


# ---------------------------------------------------------------- filling the modules


def _destination(hf_name: str, config: ModelConfig) -> tuple[str, int] | None:
    """Our parameter name and the row offset inside it, for a Hugging Face tensor name."""
    if hf_name == "lm_head.weight":
        return None if config.tie_embeddings else ("lm_head.weight", 0)
    if not hf_name.startswith("model."):
        return None
    name = hf_name.removeprefix("model.")
    match = _LAYER.match(hf_name)
    if match is None:
        return name, 0
    index, rest = match[1], match[2]
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", config.intermediate_size),
    }
    module_name, _, suffix = rest.rpartition(".")
    if module_name in fused:
        target, offset = fused[module_name]
        return f"layers.{index}.{target}.{suffix}", offset
    return f"layers.{index}.{rest}", 0


def build(
    model_class: type[DecoderModel],
    config: ModelConfig,
    dtype: torch.dtype,
    tensors: Iterator[tuple[str, torch.Tensor]],
    path: Path,
    in_place: Callable[[DecoderModel], None] | None = None,
) -> DecoderModel:
    """Our decoder with its parameters filled from `tensors`; `in_place` first swaps in the
    modules that compute from the file as it lies (`runtime.loading.gguf_in_place`), whose weights are
    then not expected from `tensors`."""
    with torch.device("meta"):
        model = model_class(config)
        transposed = set() if in_place else model.choose_layouts(dtype)  # filled column-wise: (in, out)
    if in_place is not None:
        in_place(model)
    # Gemma-style norms keep float32 weights (they multiply in float32); the rest takes `dtype`.
    float32_names: set[str] = set()
    for module_name, module in model.named_modules():
        keep_float32 = getattr(module, "cast_before_weight", True) is False
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            if keep_float32:
                float32_names.add(full_name)
            empty = torch.empty(parameter.shape, dtype=torch.float32 if keep_float32 else dtype)
            module._parameters[name] = torch.nn.Parameter(empty, requires_grad=False)
    parameters = dict(model.named_parameters())

    def logical_rows(name: str) -> int:
        parameter = parameters[name]
        return parameter.shape[1] if name in transposed else parameter.shape[0]

    filled: dict[str, int] = {}  # parameter → logical (out) rows written
    for hf_name, tensor in tensors:
        destination = _destination(hf_name, config)
        if destination is None:
            continue
        name, offset = destination
        if name == "embed_tokens.weight" and "vocab_columns" in transposed:
            name = "vocab_columns"
        parameter = parameters.get(name)
        if parameter is None:
            continue
        tensor = to_runtime_order(hf_name, tensor, config)
        if name in float32_names:
            tensor = tensor + 1  # Gemma's 1 + w, folded once here
        rows = tensor.shape[0]
        expected = (parameter.shape[0],) if name in transposed else tuple(parameter.shape[1:])
        if offset + rows > logical_rows(name) or tuple(tensor.shape[1:]) != expected:
            raise LoadError(
                f"{path}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, which does not fit "
                f"{name} {tuple(parameter.shape)} at row {offset}"
            )
        if name in transposed:
            parameter.data[:, offset : offset + rows] = tensor.t().to(parameter.dtype)
        else:
            parameter.data[offset : offset + rows] = tensor.to(parameter.dtype)
        filled[name] = filled.get(name, 0) + rows
    missing = sorted(n for n in parameters if filled.get(n, 0) != logical_rows(n))
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise LoadError(f"{path}: missing tensors for {shown}")
    model.prepare()
    return model.eval()


def to_runtime_order(hf_name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Q/K rows (and QK-norm weights) into interleaved rotary pairs (see `RotaryTable`)."""
    module_name = hf_name.rpartition(".")[0]
    if module_name.endswith("self_attn.q_proj"):
        return interleave_rotary_rows(tensor, config.num_heads)
    if module_name.endswith("self_attn.k_proj"):
        return interleave_rotary_rows(tensor, config.num_kv_heads)
    if module_name.endswith(("self_attn.q_norm", "self_attn.k_norm")):
        return interleave_rotary_rows(tensor, 1)
    return tensor


def _parameter_bytes(model: DecoderModel) -> int:
    return sum(p.nbytes for p in model.parameters())
