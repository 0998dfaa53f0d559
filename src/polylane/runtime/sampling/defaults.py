"""A model's own sampling settings, for requests that leave them unset.

What this module owns: reading them from the model's files. A GGUF file may carry them in its header
(`general.sampling.temp`, `.top_k`, `.top_p`, `.min_p`, as llama.cpp's converter writes them from
the model's generation config); a Hugging Face folder in `generation_config.json` (`temperature`,
`top_k`, `top_p`, `min_p`; `do_sample: false` means greedy). Whatever a file leaves out keeps
`SamplingDefaults`' documented value (llama-server's: temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polylane.runtime.loading.loader import open_gguf
from polylane.types import SAMPLING_FIELDS, SamplingDefaults

GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_k": "general.sampling.top_k",
    "top_p": "general.sampling.top_p",
    "min_p": "general.sampling.min_p",
}


def read_sampling_defaults(path: str | Path, format: str) -> SamplingDefaults:
    """The model's sampling settings, each one its file states or the documented default."""
    path = Path(path)
    found: dict[str, Any] = {}
    if format == "gguf":
        metadata = open_gguf(path).metadata
        found = {field: metadata[key] for field, key in GGUF_KEYS.items() if key in metadata}
        where = f"{path.name}'s header"
    else:
        config_file = path / "generation_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, ValueError):
            config = {}  # an unreadable generation config: the documented defaults
        found = {
            field: config[field] for field in SAMPLING_FIELDS if isinstance(config.get(field), int | float)
        }
        if config.get("do_sample") is False:
            found["temperature"] = 0.0
        where = "generation_config.json"
    if not found:
        return SamplingDefaults()
    return SamplingDefaults().override(**found, source=f"{where} ({', '.join(sorted(found))})")
