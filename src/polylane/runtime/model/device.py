"""Which torch device the engine runs its models on, and putting a loaded model there.

What this module owns: reading a `--device` value ("auto", "cpu", "cuda", "cuda:N") into a
`torch.device`, with a clear error when the device is not there; moving a model loaded on the
host to that device (`place_model`: weights, quantised kernels' packed weights, RoPE tables); and
the free memory a budget of "auto" takes half of.

One device per engine: every model it serves, their KV caches and their forward passes live there;
logits come back to the host once per forward (`ModelKV.forward`), where sampling runs. On CPU the
host is the device and nothing moves.
"""

from __future__ import annotations

import psutil
import torch

from polylane.runtime.model.quantize import QuantizedProjection
from polylane.runtime.models.base import DecoderModel

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """A device that cannot be used: not a device name, or not present on this machine."""


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The device `name` means here: "auto" is the first CUDA device when torch sees one, else CPU."""
    if isinstance(name, torch.device):
        name = str(name)
    text = (name or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r} (choose {DEVICE_CHOICES})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceError(f"device {name!r} is not supported (choose {DEVICE_CHOICES})")
    if not torch.cuda.is_available():
        built = "with" if torch.backends.cuda.is_built() else "without"
        raise DeviceError(
            f"device {name!r}: torch {torch.__version__} (built {built} CUDA) sees no CUDA device "
            "on this machine; use --device cpu"
        )
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def place_model(model: DecoderModel, device: torch.device) -> DecoderModel:
    """Move a model loaded on the host to `device`, in place (nothing moves on CPU)."""
    if device.type == "cpu":
        return model
    for module in model.modules():
        if isinstance(module, QuantizedProjection):
            module.place(device)  # its packed weight takes the device's kernel layout
    model.to(device)
    model.prepare()  # the RoPE tables, on the device
    return model


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for models on `device` now: available RAM on CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def model_device(model: DecoderModel) -> torch.device:
    """The device a model's weights are on."""
    return model.norm.weight.device
