"""One served model, resolved once when it is registered: the record everything keys off.

What this module owns: `ModelRecord` — a model's name, the source as given and the file it resolved
to, the dtype it is served at, its config, tokenizer and sampling defaults read from that file, its
per-layer digests when an earlier load here saved them, its estimated weight bytes, its KV
reservation, pin and speculation — and `resolve_record`, which builds
one (fetching a catalogue model on first use). The engine keeps one per model, the residency manager
loads from its `file` (never resolving the name again), speculation's setup and the server read it,
and a model's quantised twin is the same record under another name and dtype (`twin`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from polylane import catalog
from polylane.policy.sharing.layer_share import ModelDigest
from polylane.policy.speculation.control import SpeculationConfig
from polylane.runtime.loading.digests import cached_digest
from polylane.runtime.loading.loader import estimate_weight_bytes, read_config
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.sampling.defaults import read_sampling_defaults
from polylane.runtime.sampling.tokenizer import Tokenizer, load_tokenizer
from polylane.types import DEFAULT_DTYPE, SamplingDefaults

DEFAULT_KV_TOKENS = 4096


@dataclass(frozen=True)
class ModelRecord:
    """A registered model: what is known of it before (and without) loading its weights."""

    name: str
    source: str  # as given: a catalogue name or a local path
    file: catalog.ModelSource  # the files it resolved to
    dtype: str
    config: ModelConfig = field(repr=False)
    tokenizer: Tokenizer = field(repr=False)
    kv_tokens: int = DEFAULT_KV_TOKENS  # at most the context length
    pinned: bool = False
    weight_bytes: int = 0  # estimated from the file's header (0: unknown)
    # saved by an earlier load of this file at this dtype (None: never loaded here; the first load
    # computes them, `LoadedModel.digest`)
    digest: ModelDigest | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # for fields a request leaves unset
    speculation: SpeculationConfig | None = None

    @property
    def max_context(self) -> int:
        return self.config.max_context

    @property
    def max_request_tokens(self) -> int:
        return min(self.max_context, self.kv_tokens)

    @property
    def tokenizer_digest(self) -> str:
        return self.tokenizer.digest

    def twin(self, name: str, dtype: str) -> ModelRecord:
        """The same file served under `name` at `dtype` (a quantised twin drafting for this one)."""
        return dataclasses.replace(
            self,
            name=name,
            dtype=dtype,
            pinned=False,
            speculation=None,
            weight_bytes=header_bytes(self.file, dtype),
            digest=cached_digest(self.file, dtype),
        )


def resolve_record(
    name: str,
    source: str | None = None,
    *,
    dtype: str = DEFAULT_DTYPE,
    kv_tokens: int = DEFAULT_KV_TOKENS,
    pinned: bool = False,
    speculation: SpeculationConfig | None = None,
    quiet: bool = True,
) -> ModelRecord:
    """Resolve `source` (default: `name`; fetched now if it is a catalogue model not on disk) and
    read what serving needs from its header and tokenizer. Raises LoadError (an unreadable file)
    or catalog.ModelNotFoundError / FetchError."""
    file = catalog.resolve(source or name, quiet=quiet)
    config = read_config(file.path, file.format)
    return ModelRecord(
        name=name,
        source=source or name,
        file=file,
        dtype=dtype,
        config=config,
        tokenizer=load_tokenizer(file),
        kv_tokens=min(kv_tokens, config.max_context),
        pinned=pinned,
        weight_bytes=header_bytes(file, dtype),
        digest=cached_digest(file, dtype),
        sampling=read_sampling_defaults(file.path, file.format),
        speculation=speculation,
    )


def header_bytes(file: catalog.ModelSource, dtype: str) -> int:
    """Weight bytes from the file's header (what a decode step streams), 0 when unknown."""
    try:
        return estimate_weight_bytes(file.path, file.format, dtype)
    except Exception:
        return 0
