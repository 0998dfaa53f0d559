"""Which compute path each weight dtype gets on this machine, said in a few lines.

What this module owns: the text `polylane --version` prints and the server logs at start — the
polylane version, the torch build and the CPU capability its kernels run at, the CPU's relevant
instruction sets, and per dtype either the native stack (with its matrix kernel) or torch, with
the reason the native stack does not run where it does not, and the compute thread settings. It
decides nothing: the native stack (`runtime/model/native/stack.py`) and torch make the choice at load;
this asks them the same questions.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

import torch

from polylane.runtime.cpu_load import TORCH_DEFAULT_THREADS, usable_cpus
from polylane.runtime.model import block_weights
from polylane.runtime.model.native import build
from polylane.runtime.model.native import stack as native
from polylane.types import WEIGHT_DTYPES

# CPU flags that decide a path (/proc/cpuinfo spelling)
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile")


def cpu_description() -> str:
    """'MODEL NAME (flags: …; without: …)' from /proc/cpuinfo, or the platform's processor name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    present = [flag for flag in RELEVANT_FLAGS if flag in flags]
    absent = [flag for flag in RELEVANT_FLAGS if flag not in flags]
    described = f"flags {' '.join(present) or 'none of ' + ' '.join(RELEVANT_FLAGS)}"
    if absent and present:
        described += f"; without {' '.join(absent)}"
    return f"{model or platform.machine()} ({described})"


def stack_unavailable_reason() -> str | None:
    """Why the native stack cannot run here at all (GGUF blocks included), or None when it can."""
    if not build.enabled():
        return f"the native stack is turned off ({build.NATIVE_ENV}=0)"
    if native.library() is None:
        return "the native stack has no C compiler, or its build failed (see the log)"
    return None


def native_unavailable_reason() -> str | None:
    """Why the native stack cannot run dense weights (fp32, bf16, int8, int4) here, or None."""
    if (reason := stack_unavailable_reason()) is not None or native.kernel_name() is not None:
        return reason
    if build.portable():
        return f"the native stack's portable C path ({build.PORTABLE_ENV}=1) runs GGUF blocks only"
    march = next(flag for flag in build.compile_flags() if flag.startswith("-march="))
    return f"the native stack's dense kernels need AVX512-BF16 and AVX512-VBMI, which {march} lacks"


def why_not_native() -> str:
    """Why a model runs on torch rather than the native stack here, as far as the machine says."""
    return native_unavailable_reason() or native.int4_packing_problem() or "no native kernel fits its shapes"


def auto_path(torch_path: str, activations: str = "8-bit activations") -> str:
    """What dtype auto (or auto-fp32) computes with here: a GGUF file's blocks in place, or why not."""
    try:
        isa = block_weights.isa_name()
    except block_weights.BlockKernelsUnavailable as error:
        return f"{torch_path} on fp32 weights: {error}"
    kernels = f"{isa} block kernels, {activations}"
    between = torch_path if stack_unavailable_reason() is not None else "the native stack"
    return f"a GGUF file's own blocks in place ({kernels}), {between} between them"


def dtype_paths() -> dict[str, str]:
    """dtype → "native (KERNEL)" or "torch (CAPABILITY)" (+ why not native)."""
    torch_path = f"torch ({torch.backends.cpu.get_cpu_capability()})"
    reason = native_unavailable_reason()
    if reason is not None:
        paths = {dtype: f"{torch_path}: {reason}" for dtype in WEIGHT_DTYPES}
    else:
        kernel = native.kernel_name()
        paths = {dtype: f"native ({kernel})" for dtype in WEIGHT_DTYPES}
        packing = native.int4_packing_problem()
        if packing is not None:
            paths["int4"] = f"{torch_path}: {packing}"
    paths["auto"] = auto_path(torch_path)
    paths["auto-fp32"] = auto_path(torch_path, "float32 activations")
    return paths


OPENMP_SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND")


def thread_settings(threads: int = 0) -> str:
    """The compute thread settings in force: fixed (`threads` > 0) or the adaptive ceiling, the
    usable CPUs, OpenMP's environment."""
    cpus = len(usable_cpus())
    environment = ", ".join(f"{name}={os.environ[name]}" for name in OPENMP_SETTINGS if name in os.environ)
    if threads > 0:
        setting = f"fixed at {threads} ({cpus} usable CPUs)"
    else:
        setting = (
            f"adaptive, {min(TORCH_DEFAULT_THREADS, cpus)} while the machine is idle, one fewer per core "
            f"other processes keep busy ({cpus} usable CPUs; serve --threads N fixes N)"
        )
    return f"threads: {setting}; OpenMP environment: {environment or 'unset'}"


def version_text(threads: int = 0) -> str:
    """The block `polylane --version` prints and the server logs at start (`threads`: the server's
    setting, 0 adaptive)."""
    try:
        version = importlib.metadata.version("polylane")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    cuda = torch.version.cuda or "none"
    lines = [
        f"polylane {version}",
        f"torch {torch.__version__} (CPU kernels: {torch.backends.cpu.get_cpu_capability()}; CUDA {cuda}; "
        f"{torch.get_num_threads()} threads)",
        f"CPU: {cpu_description()}",
        thread_settings(threads),
        "compute paths on this CPU:",
        *(f"  {dtype:5} {path}" for dtype, path in dtype_paths().items()),
    ]
    return "\n".join(lines)


__all__ = [
    "cpu_description",
    "dtype_paths",
    "native_unavailable_reason",
    "stack_unavailable_reason",
    "thread_settings",
    "version_text",
    "why_not_native",
]
