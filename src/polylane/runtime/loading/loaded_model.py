"""A model ready to run: weights at a dtype, tokenizer, and how long loading took."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from polylane import catalog
from polylane.policy.sharing.layer_share import ModelDigest
from polylane.runtime.loading.converted import converted_path, load_converted, save_converted
from polylane.runtime.loading.digests import cached_digest, model_digest
from polylane.runtime.loading.gguf_in_place import load_gguf_in_place
from polylane.runtime.loading.loader import (
    IN_PLACE_ACTIVATION_BITS,
    LoadedWeights,
    load_weights,
    parse_dtype,
    stored_16_bit,
)
from polylane.runtime.model.block_weights import BlockKernelsUnavailable, formats_summary
from polylane.runtime.model.block_weights import isa_name as block_isa_name
from polylane.runtime.model.device import model_device, place_model, resolve_device
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.model.native.stack import NativeStack, runs_natively
from polylane.runtime.model.native.stack import kernel_name as native_kernel_name
from polylane.runtime.model.quantize import QUANTISED_FORMATS, module_bytes, quantize_model
from polylane.runtime.models.base import DecoderModel
from polylane.runtime.sampling.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


def block_kernels_problem() -> str | None:
    """Why the GGUF block kernels cannot run here (no C compiler, native code off), or None."""
    try:
        block_isa_name()
    except BlockKernelsUnavailable as error:
        return str(error)
    return None


@dataclass(frozen=True)
class LoadPlan:
    """How `load_model` builds a model of `source` at a dtype, decided from the file and the
    machine alone (so the KV cache's size is known before the load: `kv_cache_bytes`)."""

    in_place: bool  # the GGUF file's blocks computed in place
    activation_bits: int | None  # in place: 8 or 32
    dtype: str | torch.dtype  # the dtype asked, "auto" resolved where the file is not used in place
    quantised: str | None  # "int4" or "int8": the quantised twin
    run_dtype: torch.dtype  # the activations' dtype
    kernels_problem: str | None  # why "auto" could not use the file in place here

    @classmethod
    def of(cls, source: catalog.ModelSource, dtype: str | torch.dtype, target: torch.device) -> LoadPlan:
        activation_bits = IN_PLACE_ACTIVATION_BITS.get(dtype) if isinstance(dtype, str) else None
        in_place = activation_bits is not None and source.format == "gguf" and target.type == "cpu"
        problem = block_kernels_problem() if in_place else None
        if problem is not None:
            in_place = False
        if activation_bits is not None and not in_place:
            dtype = auto_dtype(source, target)
        quantised = dtype if isinstance(dtype, str) and dtype in QUANTISED_FORMATS else None
        run_dtype = torch.float32 if quantised or in_place else parse_dtype(dtype)
        return cls(in_place, activation_bits if in_place else None, dtype, quantised, run_dtype, problem)

    def half_kv(self, native: bool) -> bool:
        """bf16 K/V: int4 and int8 models, and a file's blocks with 8-bit activations, on the
        native stack (see LoadedModel.kv_cache_dtype)."""
        return native and (self.quantised is not None or (self.in_place and self.activation_bits == 8))


def kv_cache_bytes(
    source: catalog.ModelSource,
    dtype: str | torch.dtype,
    config: ModelConfig,
    slots: int,
    device: str | torch.device = "auto",
) -> int:
    """The bytes of a KV cache of `slots` token slots that `load_model(source, dtype)` would give,
    known before loading (residency admits a model by its weights and this)."""
    target = resolve_device(device)
    plan = LoadPlan.of(source, dtype, target)
    native = target.type == "cpu" and runs_natively(config)
    element = torch.bfloat16 if plan.half_kv(native) else plan.run_dtype
    return 2 * config.num_layers * slots * config.num_kv_heads * config.head_dim * element.itemsize


@dataclass
class LoadedModel:
    name: str
    source: catalog.ModelSource
    config: ModelConfig
    module: DecoderModel
    tokenizer: Tokenizer
    dtype: torch.dtype
    weight_bytes: int
    load_seconds: float
    digest: ModelDigest | None = None  # per-layer digests (`runtime.loading.digests`); None: not computed
    # The KV cache's element type (None: the activations' dtype). int4 and int8 models on the native
    # stack, and a GGUF file's blocks with 8-bit activations (dtype auto) there, keep bf16 K/V: a
    # decode step streams the cache, and bf16 halves it, as llama.cpp's f16 does (SmolLM2, 8 streams
    # at 512 tokens of context read 377 MB of float32 K/V per step).
    kv_cache_dtype: torch.dtype | None = None
    # what computes it, said for the load log: the formats and kernels ("Q4_K ×169, Q6_K ×29 read
    # in place by the avx2 block kernels, torch between", "native stack (amx)", "torch (AVX2)")
    compute_path: str = ""

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def device(self) -> torch.device:
        return model_device(self.module)


def load_model(
    name_or_path: str | catalog.ModelSource,
    dtype: str | torch.dtype = "fp32",
    quiet: bool = False,
    convert_cache: bool = True,
    device: str | torch.device = "auto",
) -> LoadedModel:
    """Resolve (fetching a catalogue model on first use; a `ModelSource` is resolved already), read
    weights and tokenizer, and put the model on `device` ("auto": CUDA when torch sees a GPU, else
    CPU; see `runtime.model.device`).

    dtype "auto" (the default of `serve`): a GGUF file computes from its own quantised blocks in
    place (`runtime.loading.gguf_in_place`) on the CPU, nothing converted, activations rounded to 8 bits per
    group of 16 for integer dot products ("auto-fp32": float32 activations); elsewhere see
    `auto_dtype`.
    Otherwise a GGUF file is dequantised once per dtype; with `convert_cache` the result is kept as
    safetensors (`runtime.loading.converted`) and later loads read that instead. dtype "int4" or "int8"
    gives the quantised twin (`runtime.model.quantize`): the float32 model with weight-only quantised
    projections (bf16 inside those kernels); its activations and KV are float32.
    """
    target = resolve_device(device)  # a missing device fails before anything is read
    if isinstance(name_or_path, catalog.ModelSource):
        source = name_or_path
    else:
        source = catalog.resolve(name_or_path, quiet=quiet)
    started = time.perf_counter()
    plan = LoadPlan.of(source, dtype, target)
    if (problem := plan.kernels_problem) is not None:
        log.warning("%s: %s; dtype %s dequantises it to fp32 instead", source.name, problem, dtype)
    in_place, run_dtype = plan.in_place, plan.run_dtype
    if in_place:
        bits = plan.activation_bits or 8
        weights = load_gguf_in_place(source.path, progress=not quiet, activation_bits=bits)
    else:
        weights = _load_weights(source, run_dtype, quiet, convert_cache)
    weight_bytes = weights.weight_bytes
    if plan.quantised:
        quantize_model(weights.model, plan.quantised)
        weight_bytes = module_bytes(weights.model)
    tokenizer = load_tokenizer(source)
    # Per-layer digests for the cross-model prefill share: hashed once per file, then cached
    # (from the host's tensors, so that they are the same whatever device the model then runs on).
    digest = model_digest(source, plan.dtype, weights.model, weights.config, tokenizer, run_dtype)
    place_model(weights.model, target)
    weights.model.native_stack = NativeStack.build(weights.model)
    native = weights.model.native_stack is not None
    half_kv = plan.half_kv(native)
    if in_place:
        arithmetic = "8-bit activations" if plan.activation_bits == 8 else "float32 activations"
        kernels = f"the {block_isa_name()} block kernels ({arithmetic})"
        between = "the native stack" if native else "torch"
        path = f"{formats_summary(weights.model)} read in place by {kernels}, {between} between"
    elif native:
        path = f"native stack ({native_kernel_name()})"
    else:
        path = (
            f"torch ({torch.backends.cpu.get_cpu_capability()})"
            if target.type == "cpu"
            else f"torch ({target})"
        )
    loaded = LoadedModel(
        name=source.name,
        source=source,
        config=weights.config,
        module=weights.model,
        tokenizer=tokenizer,
        dtype=run_dtype,
        weight_bytes=weight_bytes,
        load_seconds=0.0,
        digest=digest,
        kv_cache_dtype=torch.bfloat16 if half_kv else None,
        compute_path=path,
    )
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def auto_dtype(source: catalog.ModelSource, target: torch.device) -> str:
    """What dtype "auto" means where the file cannot be used in place: a GGUF file off the CPU
    (the block kernels are CPU code) runs bf16 on CUDA; a Hugging Face folder keeps its own
    dtype (bf16 when its tensors are 16-bit, else fp32)."""
    if source.format == "gguf":
        return "bf16" if target.type == "cuda" else "fp32"
    return "bf16" if stored_16_bit(source.path) else "fp32"


def _load_weights(
    source: catalog.ModelSource, dtype: torch.dtype, quiet: bool, convert_cache: bool
) -> LoadedWeights:
    if source.format != "gguf" or not convert_cache:
        return load_weights(source.path, source.format, dtype, progress=not quiet)
    target = converted_path(source.path, dtype)
    weights = load_converted(target, dtype)
    if weights is None:
        weights = load_weights(source.path, source.format, dtype, progress=not quiet)
        save_converted(weights, target)
    return weights


def digest_of(name_or_path: str, dtype: str = "fp32", *, quiet: bool = True) -> ModelDigest:
    """A model's digests: from the cache when this file was digested before, else by loading it
    (which caches them)."""
    source = catalog.resolve(name_or_path, quiet=quiet)
    digest = cached_digest(source, dtype)
    if digest is None:
        digest = load_model(name_or_path, dtype, quiet=quiet, device="cpu").digest  # (hashed on the host)
        assert digest is not None
    return digest
