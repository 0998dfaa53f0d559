"""The OpenAI wire format: request bodies (validated by pydantic) and response builders.

What this module owns: every field polylane accepts on `/v1/completions` and
`/v1/chat/completions`, its type and range (a bad value is a 400 naming the field, raised by
pydantic before anything reaches the engine), the conversion to `SamplingParams`, and the JSON
shapes of responses and streamed chunks. Structured outputs: OpenAI's `response_format` (`json_object`,
`json_schema`), llama.cpp's `json_schema` and vLLM's `guided_json`, `guided_regex` and
`guided_choice` become one `GrammarSpec` (at most one of them per request; a schema the grammar
engine cannot enforce is a 400 naming the field and the reason). Fields OpenAI defines that
polylane does not implement (logprobs, echo, penalties, tools, a required or named tool_choice, …)
and llama.cpp's GBNF `grammar` are refused with a 400 naming them rather than ignored.
Unknown extra fields are ignored, as OpenAI's own clients send some. Every model is strict: a value
is taken only in its own JSON type (an integer where a float is asked excepted), so `"1"`, `true`
or `1.0` is never read as the integer 1, nor `"false"` or `0` as a boolean, nor `["12", "34"]` as
token ids; each is a 400 naming the field.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from polylane.grammar_spec import GrammarError, grammar_for
from polylane.server.tools import call_grammar
from polylane.sizes import parse_bytes
from polylane.types import MAX_TOP_LOGPROBS, GrammarSpec, SamplingDefaults, SamplingParams, TokenLogprob

# The finish reasons a client sees; the engine's others ("error", "deadline", "abort") are errors.
FINISH_REASONS = ("stop", "length")
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
# Upper bounds that no model reaches, so a huge number is refused by type, never echoed back.
MAX_COUNT = 2**31 - 1


def _valid_unicode(text: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"); no tokenizer can encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (it holds a lone surrogate)") from None


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
_UNSUPPORTED = (
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "suffix",
    # llama.cpp's GBNF and vLLM's grammar (structured outputs take JSON schemas, regexes, choices)
    "grammar",
    "guided_grammar",
)
# The fields that ask for structured outputs, and the kind of grammar each gives.
_GRAMMAR_FIELDS = ("response_format", "json_schema", "guided_json", "guided_regex", "guided_choice")


# What served the response, as OpenAI's `system_fingerprint`: the engine's version (responses from
# one version of polylane with the same request and seed are the same).
SYSTEM_FINGERPRINT = f"fp_polylane_{importlib.metadata.version('polylane')}"


class _Strict(BaseModel):
    """No coercion across JSON types (pydantic's strict mode; subclasses inherit it)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1000)]


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is always honoured here: the
    output matches the schema whatever it says; the name is optional, as llama.cpp takes it)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama.cpp's, with json_object

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return (
                grammar_for("json_object")
                if self.schema_ is None
                else grammar_for("json_schema", self.schema_)
            )
        if self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({name, schema, strict})")
        schema = self.json_schema.schema_
        return grammar_for("json_object") if schema is None else grammar_for("json_schema", schema)


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    # Unset (None): the model's defaults (`SamplingDefaults`: its file's settings, serve's flags,
    # else llama-server's values).
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] | None = None  # 0 or -1: off (vLLM's convention)
    min_p: Probability | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: Annotated[int, Field(ge=-100, le=100)] = 0
    user: Annotated[str, Field(max_length=256)] | None = None
    speculation: bool | None = None  # polylane: False turns speculative decoding off for this request
    # polylane: seconds this request may run (queue included) before it ends as an error; the
    # server's limits.request_timeout_s bounds it
    timeout: Annotated[float, Field(gt=0.0, le=1e9)] | None = None
    # Defined by OpenAI, not implemented here: a request that sets them is refused, not ignored.
    echo: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    # OpenAI's: token id (a string of digits) → bias in [-100, 100], added to the logits
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | None
    ) = None
    best_of: Any = None
    suffix: Any = None
    grammar: Any = None
    guided_grammar: Any = None
    # Structured outputs (at most one): each is read into a GrammarSpec as it is validated.
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's
    guided_json: dict[str, Any] | str | None = None  # vLLM's (a schema, or one as a JSON string)
    guided_regex: Annotated[str, Field(min_length=1, max_length=10_000)] | None = None
    guided_choice: Choices | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        for stop in stops:
            _valid_unicode(stop)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
        return stops

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value in (None, False, 0, "", [], {}, {"type": "text"}):
            return value
        raise ValueError("is not supported by polylane (leave it unset)")

    @field_validator(*_GRAMMAR_FIELDS, mode="after")
    @classmethod
    def _grammar(cls, value: Any, info: Any) -> Any:
        if value is None:
            return None
        try:
            if info.field_name == "response_format":
                return value.grammar()
            if info.field_name == "guided_regex":
                return grammar_for("regex", value)
            if info.field_name == "guided_choice":
                return grammar_for("choice", value)
            if isinstance(value, str):  # guided_json as a JSON string
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ValueError("is a string that is not JSON (give the schema as an object)") from None
            return grammar_for("json_schema", value)
        except GrammarError as error:
            raise ValueError(f"cannot be enforced: {error}") from None

    @model_validator(mode="after")
    def _one_grammar(self) -> _Sampling:
        if len([f for f in _GRAMMAR_FIELDS if getattr(self, f) is not None]) > 1:
            raise ValueError(f"at most one of {', '.join(_GRAMMAR_FIELDS)} may be set")
        return self

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The request's structured-output grammar (None: free text)."""
        return next((getattr(self, f) for f in _GRAMMAR_FIELDS if getattr(self, f) is not None), None)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys must be token ids (strings of digits), got {key[:24]!r}")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: Any) -> Any:
        if value in (None, 1):
            return value
        raise ValueError("is not supported by polylane (only 1)")

    def sampling_params(
        self, max_tokens: int, defaults: SamplingDefaults, seed: int | None = None
    ) -> SamplingParams:
        """The request's sampling, each field it leaves unset taken from `defaults`."""
        return defaults.params(
            temperature=self.temperature,
            top_k=None if self.top_k is None else max(0, self.top_k),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed if seed is None else seed,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            speculation=self.speculation,
            grammar=self.grammar_spec,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())),
            logprobs=self.logprobs_count,
        )

    @property
    def logprobs_count(self) -> int | None:
        """How many top alternatives each token's logprobs entry lists (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_COUNT)]], Field(min_length=1)]
MAX_PROMPTS = 32  # prompts in one completions request (a batch)


class CompletionRequest(_Sampling):
    # each token's logprob and the N most likely alternatives' (OpenAI allows 5; polylane 20)
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Any:
        # One clear reason instead of pydantic's per-branch errors of the union.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "must be a non-empty string, a non-empty list of token ids (integers >= 0), or a list of "
                f"1 to {MAX_PROMPTS} of either (a batch: each prompt gets its n choices)"
            ) from None

    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None

    @field_validator("top_logprobs", "tools", "tool_choice")
    @classmethod
    def _chat_only(cls, value: Any, info: Any) -> Any:
        if value in (None, [], "none", "auto"):
            return value
        if info.field_name == "top_logprobs":
            raise ValueError("is a chat completions field; completions take logprobs: N (the alternatives)")
        raise ValueError("is a chat completions field (tools are called from /v1/chat/completions)")

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts of the request, one or a batch."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Strict):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # JSON, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("must be a JSON object (as a string)") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object (as a string)")
        return value


class AssistantToolCall(_Strict):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for text in [value] if isinstance(value, str) else [part.text for part in value or []]:
            _valid_unicode(text)
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """This message as chat templates take it (a call's arguments as an object)."""
        message: dict[str, Any] = {
            "role": {"developer": "system"}.get(self.role, self.role),
            "content": self.text(),
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    _tool_grammar: GrammarSpec | None = PrivateAttr(default=None)
    # "none": the tools are not shown to the model; "auto": it may call them; "required" or a named
    # function: its output is calls (one, or several with parallel_tool_calls), by the grammar
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _content(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text() or m.tool_calls for m in messages):
            raise ValueError("every message is empty")
        return messages

    @field_validator("tools")
    @classmethod
    def _names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("two functions have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: Any, info: Any) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"names {choice.function.name!r}, which is not among the tools")
        if choice == "required" and not names:
            raise ValueError("'required' needs tools")
        return choice

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        if self.tool_grammar_wanted:
            if super().grammar_spec is not None:
                raise ValueError("a required or named tool_choice and a response format cannot both be set")
            try:
                tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
                self._tool_grammar = call_grammar(tools, self.tool_names(), self.parallel_tool_calls)
            except GrammarError as error:
                raise ValueError(f"tools cannot be enforced: {error}") from None
        return self

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        return self._tool_grammar or super().grammar_spec

    def plain_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (None: no tools shown)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def tool_grammar_wanted(self) -> bool:
        return self.tools is not None and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        )

    def tool_names(self) -> list[str]:
        """The functions a required or named choice allows."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [self.tool_choice.function.name]
        return [t.function.name for t in self.tools or []]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class BudgetRequest(_Strict):
    model_config = ConfigDict(extra="forbid")

    # an integer, or a size as the command line takes it ("6G", "6GiB", "6000MB")
    bytes: Annotated[int, Field(ge=0, le=2**50)] | Annotated[str, Field(min_length=1, max_length=32)]

    @field_validator("bytes")
    @classmethod
    def _size(cls, value: int | str) -> int:
        size = parse_bytes(value)
        if size > 2**50:
            raise ValueError(f"{size} bytes is over the largest budget, 2**50")
        return size


# ---------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any], chat: bool
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
        "usage": usage_,
    }


def choice(
    index: int, text: str, finish_reason: str | None, chat: bool, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def tool_calls_choice(
    index: int,
    content: str | None,
    calls: list[dict[str, Any]],
    finish_reason: str,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    """A chat choice whose output was tool calls (`server/tools.py`)."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": content, "tool_calls": calls},
        "finish_reason": finish_reason,
        "logprobs": logprobs,
    }


def tool_calls_chunk(request_id: str, model: str, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat choice's tool calls: one delta listing each call (its index among the
    choice's calls, id, name and whole arguments), as OpenAI's clients assemble them."""
    delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
    piece = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
    return _envelope(request_id, model, True, choices=[piece])


def chunk_body(
    request_id: str,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    chat: bool,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed piece of one choice: its text (a chat delta's `content`; an empty delta where
    `text` is empty), its tokens' logprobs when asked, and the finish reason on the last."""
    if chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        piece = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        piece = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    return _envelope(request_id, model, chat, choices=[piece])


def logprobs_body(
    entries: Sequence[TokenLogprob], token_text: Callable[[int], str], chat: bool, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice (or a chunk of one): chat's `content` list of {token,
    logprob, bytes, top_logprobs}; completions' parallel lists (tokens, token_logprobs,
    top_logprobs, text_offset from `offset`)."""
    if chat:
        content = [
            {
                "token": token_text(e.token),
                "logprob": e.logprob,
                "bytes": list(token_text(e.token).encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())}
                    for t, lp in e.top
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}
    tokens = [token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def role_chunk(request_id: str, model: str, index: int) -> dict[str, Any]:
    """A chat choice's first chunk, as OpenAI sends it: the role and empty content."""
    piece = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "finish_reason": None,
        "logprobs": None,
    }
    return _envelope(request_id, model, True, choices=[piece])


def usage_chunk(request_id: str, model: str, usage_: dict[str, Any], chat: bool) -> dict[str, Any]:
    return _envelope(request_id, model, chat, choices=[], usage=usage_)


def _envelope(request_id: str, model: str, chat: bool, **fields: Any) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        **fields,
    }


def error_body_gone() -> dict[str, Any]:
    """The body of a response nobody reads: the client disconnected before the request ended."""
    return {
        "error": {
            "message": "client closed the request",
            "type": "client_closed",
            "param": None,
            "code": "client_closed",
        }
    }
