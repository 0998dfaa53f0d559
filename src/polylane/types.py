"""Plain data that crosses between policy, runtime and front ends. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from polylane.policy.kv.sequence_blocks import BlockCopy, validate_tree

# Weight dtypes a model can be served at: float32, bfloat16, or weight-only int8 / int4 projections
# (`runtime.model.quantize`: torch's CPU kernels, float32 activations and KV around them).
# "auto": the file's own — a GGUF file's quantised blocks computed in place (runtime.loading.gguf_in_place),
# activations rounded to 8 bits for integer dot products as llama.cpp does; "auto-fp32": the same
# blocks multiplied with float32 activations (the fp32 product of the file's values; slower).
WEIGHT_DTYPES = ("auto", "auto-fp32", "fp32", "bf16", "int8", "int4")
DEFAULT_DTYPE = "auto"

# Below this a temperature samples as greedy does: dividing logits by, say, 1e-300 overflows the
# sampler's floats to inf and NaN.
GREEDY_BELOW_TEMPERATURE = 1e-4


class LoadError(RuntimeError):
    """A model file could not be loaded; the message names the file and the reason. (Here, not in
    `runtime.loading.loader`, so that the command line catches it without importing torch.)"""


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")  # what SamplingDefaults fills in


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves temperature, top-k, top-p or min-p unset gets: the model's own
    settings where its file states them (`runtime.sampling.defaults`), `serve`'s flags over them,
    else these documented values (llama-server's defaults). A request's explicit value always wins
    (`temperature: 0` stays greedy)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    source: str = "llama-server's defaults"

    def override(self, source: str | None = None, **values: float | int | None) -> SamplingDefaults:
        """These settings with `values` (None: unchanged) in their place, checked as a request's."""
        changed = {name: value for name, value in values.items() if value is not None}
        if not changed:
            return self
        merged = SamplingDefaults(**{**self.__dict__, **changed, "source": source or self.source})
        merged.params()  # checked as a request's
        return merged

    def params(self, **fields: object) -> SamplingParams:
        """SamplingParams from `fields` (SamplingParams' own), each of SAMPLING_FIELDS that is None or
        missing taken from these defaults."""
        for name in SAMPLING_FIELDS:
            if fields.get(name) is None:
                fields[name] = getattr(self, name)
        return SamplingParams(**fields)  # type: ignore[arg-type]


# Every sampling filter off: greedy (`polylane generate`'s default).
SAMPLING_OFF = SamplingDefaults(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, source="off")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured outputs): llguidance's serialised grammar (a
    JSON string), and the kind of request it came from ("json_object", "json_schema", "regex",
    "choice"). Built by `polylane.grammar_spec.grammar_for`."""

    kind: str
    grammar: str


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was drawn from, and the
    `top` most likely tokens of that distribution with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token.

    temperature: 0 (or below 1e-4) means greedy (argmax); otherwise logits are divided by it
        before softmax.
    top_k: keep only the k most likely tokens (0 = off).
    top_p: keep the smallest set of tokens whose probability sums to at least top_p (1.0 = off).
    min_p: drop tokens whose probability is below min_p × the top token's probability (0 = off).
    seed: a request with the same seed and the same inputs produces the same tokens.
    max_tokens: the most tokens to generate.
    stop: strings that end generation; they are never part of the output.
    ignore_eos: keep generating past the model's end-of-sequence tokens (for benchmarks).
    speculation: None follows the model's setting (speculative decoding when it was added with
        one); False never speculates for this request. Output (greedy tokens, or the sampled
        distribution) is the same either way. A sampled request with a seed decodes plainly, so
        that its seed reproduces its tokens.
    grammar: structured outputs: every token is one the grammar allows (None: free text).
    logit_bias: (token id, bias) pairs added to the logits before anything else (OpenAI's; -100
        bans a token, +100 all but forces it).
    logprobs: None: none; N (0 to 20): each token's log-probability and the N most likely tokens'
        (`TokenLogprob`), from the distribution the token was drawn from: after the bias, the
        grammar, temperature, top-k/top-p/min-p (a greedy request's: the softmax of its logits).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    speculation: bool | None = None
    grammar: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if any(token < 0 or not -100.0 <= bias <= 100.0 for token, bias in self.logit_bias):
            raise ValueError("logit_bias takes token ids >= 0 and biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class SequenceChunk:
    """The part of one sequence that a forward pass computes.

    The sequence already has `num_cached` tokens of KV in the blocks of `block_table`; this chunk
    appends `len(token_ids)` more at logical indexes num_cached, num_cached + 1, …

    tree_parents: None for a causal chain (a prefill chunk or decode tokens). For a token tree, the
    parent of each new token as an index into this chunk, or -1 for a child of the committed
    prefix; parents come before children. A tree token sees the committed prefix and its own
    ancestors, never its siblings, and sits at position num_cached + depth - 1 (depth 1 for a
    child of the prefix).
    logits: which rows of this chunk need logits: "none", "last" or "all".
    """

    token_ids: tuple[int, ...]
    num_cached: int
    block_table: tuple[int, ...]
    tree_parents: tuple[int, ...] | None = None
    logits: str = "last"

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a chunk needs at least one token")
        if self.logits not in ("none", "last", "all"):
            raise ValueError(f"logits must be 'none', 'last' or 'all', got {self.logits!r}")
        if self.tree_parents is not None:
            if len(self.tree_parents) != len(self.token_ids):
                raise ValueError(
                    f"tree has {len(self.tree_parents)} parents for {len(self.token_ids)} tokens"
                )
            validate_tree(self.tree_parents)

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens of KV the sequence holds once this chunk is written."""
        return self.num_cached + len(self.token_ids)


# ---------------------------------------------------------------------- the engine's step

FINISH_REASONS = ("stop", "length", "abort", "deadline", "error")


@dataclass(frozen=True)
class PrefillWork:
    """Compute up to `max_tokens` more prompt tokens of one request (a chunk of its prefill).

    The runner starts where the request's KV ends (a prefix-cache hit may skip ahead); the chunk
    that reaches the end of the prompt also samples the request's first token.
    """

    request_id: int
    model: str
    max_tokens: int


@dataclass(frozen=True)
class BlockTable:
    """Where one request of the step keeps its KV (the scheduler's `KVManager` chose it).

    blocks: its block ids, in order (logical slot i lives in block blocks[i // block_size]).
    num_tokens: tokens of KV already written; this step writes from there, into any slot up to the
    table's end (a prefill chunk, a decode token, a verify pass's draft tokens), no further.
    copies: blocks to copy before the step writes (copy-on-write of a block it shares).
    cached: when the request was admitted this step, the prompt tokens its prefix-cache hit served
    (its `num_tokens`); else None.
    """

    request_id: int
    blocks: tuple[int, ...]
    num_tokens: int
    copies: tuple[BlockCopy, ...] = ()
    cached: int | None = None


@dataclass(frozen=True)
class StepPlan:
    """What one engine step does: the scheduler's whole decision, handed to the runner.

    prefill: prompt chunks, for any models that hold a lease (several models may prefill).
    decode_model / decode: the one model that owns the decode lane this step and every one of its
    requests that decodes a token (continuous batching). Never more than one model.
    tables: the block table of every request in `prefill` and `decode`.
    preempted: requests whose KV the scheduler let go for want of blocks (cached as far as it was
    written); they wait and prefill again (recompute). The runner forgets their step state.
    close: requests whose KV (if any) was let go without caching, with why: "abort" (the client
    gave up) or "error" (e.g. its model failed to load), and a message.
    acquire / release: models whose lease the engine should take (load if needed) / give back.
    """

    step: int
    prefill: tuple[PrefillWork, ...] = ()
    decode_model: str | None = None
    decode: tuple[int, ...] = ()
    tables: tuple[BlockTable, ...] = ()
    preempted: tuple[int, ...] = ()
    close: tuple[tuple[int, str, str], ...] = ()
    acquire: tuple[str, ...] = ()
    release: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.decode and self.decode_model is None:
            raise ValueError("decode requests need a decode_model")
        ids = [w.request_id for w in self.prefill] + list(self.decode)
        if len(set(ids)) != len(ids):
            raise ValueError("a request appears twice in one step")
        if self.tables and {t.request_id for t in self.tables} != set(ids):
            raise ValueError("every request of the step needs one block table, and only those")

    @property
    def is_idle(self) -> bool:
        return not (self.prefill or self.decode or self.close or self.acquire or self.release)


@dataclass
class StepResult:
    """What the runner did with a `StepPlan`.

    computed: request → tokens of KV it holds after the step (prefix-cache hits and a cross-model
    import included; after a verify pass, the accepted ones).
    tokens: request → the token sampled this step (first token after prefill, or a decode token).
    extra_tokens: request → the tokens a speculative round produced after `tokens`' one, in order.
    failed: request → error message.
    forced_tokens: tokens a grammar forced this step, verified with the decode batch (jump-forward).
    logprobs: request → its tokens' log-probabilities this step, in order (requests that ask).
    """

    step: int
    computed: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    extra_tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    forced_tokens: int = 0
    logprobs: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)
