"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`: OpenAI's routes over the engine.

What this module owns: turning a validated request into engine submissions (one per choice, `n`),
the checks that need the model (context length with both counts, chat template present), the
admission reservation (429 when full), the per-request deadline, streaming as OpenAI's SSE chunks
ending with `data: [DONE]`, and aborting at the next engine step when the client goes away
(streaming or not), so its KV is freed and never cached.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from polylane.engine import (
    Completion,
    EngineDeadError,
    RequestHandle,
    RequestTooLongError,
    StreamEvent,
    UnknownModelError,
)
from polylane.runtime.sampling.tokenizer import ChatTemplateError
from polylane.server import protocol
from polylane.server.admission import QueueFullError
from polylane.server.errors import ApiError, error_body
from polylane.server.state import ServerState
from polylane.server.tools import ToolCallStream, parse_calls, supports_tools
from polylane.types import TokenLogprob

router = APIRouter()
STARTED = int(time.time())


def server_state(request: Request) -> ServerState:
    return request.app.state.polylane


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {"object": "list", "data": _model_objects(state)}


@router.get("/v1/models/{name}")
async def retrieve_model(name: str, request: Request) -> dict[str, Any]:
    """One model's object (`client.models.retrieve`); an alias answers with its model's."""
    state = server_state(request)
    canonical = state.resolve(name)
    return next(m for m in _model_objects(state) if m["id"] == canonical)


def _model_objects(state: ServerState) -> list[dict[str, Any]]:
    served = state.engine.models
    data = []
    in_flight, idle = state.engine.requests_in_flight(), state.engine.idle_seconds()
    for info in state.engine.manager.snapshot():
        model = served.get(info.name)
        if model is None:
            continue
        data.append(
            {
                "id": info.name,
                "object": "model",
                "created": STARTED,
                "owned_by": "polylane",
                "state": info.state,
                "bytes": info.bytes,  # weights and KV reservation: measured once resident
                "bytes_estimated": info.state != "resident",  # before: from the file's header
                "pinned": info.pinned,
                "in_flight": in_flight.get(info.name, 0),  # requests, not residency leases
                "idle_seconds": round(idle[info.name], 1) if info.name in idle else None,  # None: never used
                "dtype": info.dtype,
                "max_context": model.max_request_tokens,  # what one request (prompt + output) may use
                "model_context": model.max_context,  # what the model was trained for
                "vocab_size": model.tokenizer.vocab_size,  # token ids of a prompt lie below it
                "chat": model.tokenizer.has_chat_template,
                "aliases": state.aliases_of(info.name),
            }
        )
    return data


@router.post("/v1/completions", response_model=None)
async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
    return await _serve(request, body, chat=False)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Any:
    return await _serve(request, body, chat=True)


async def _serve(
    request: Request, body: protocol.CompletionRequest | protocol.ChatCompletionRequest, chat: bool
) -> Any:
    state = server_state(request)
    limits = state.limits
    model = state.resolve(body.model)
    if body.n > limits.max_n:
        raise ApiError(400, f"n: at most {limits.max_n} choices per request", param="n")
    prompts = await run_in_threadpool(_prompt_ids, state, model, body, chat)
    longest = len(max(prompts, key=len))  # the longest prompt bounds max_tokens
    served = state.engine.models[model]
    requested = body.requested_max_tokens if chat else body.max_tokens  # type: ignore[union-attr]
    limit = served.max_request_tokens
    room = limit - longest
    where = "messages" if chat else "prompt"
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your {where} resulted in "
            f"{longest} tokens, with none left for the completion. Please reduce the length of "
            f"the {where}.",
            param=where,
            code="context_length_exceeded",
        )
    max_tokens = requested if requested is not None else min(limits.max_tokens_default, room)
    if max_tokens > room:  # refused here, before admission: retrying (a 429) would never help
        name = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or {name}.",
            param=name,
            code="context_length_exceeded",
        )
    reserved = body.n * sum(len(prompt) + max_tokens for prompt in prompts)
    if reserved > state.admission.max_tokens:  # could never be admitted, however long one waits
        raise ApiError(
            400,
            f"this request needs {reserved} tokens (n x (prompt + max_tokens)); the server queues at "
            f"most {state.admission.max_tokens}",
            param="max_tokens",
            code="request_too_large",
        )
    try:
        state.admission.reserve(reserved)
    except QueueFullError as error:
        raise ApiError(429, str(error), code="queue_full", headers={"Retry-After": "1"}) from None
    try:
        handles = await run_in_threadpool(_submit, state, model, prompts, body, max_tokens)
    except BaseException:
        state.admission.release(reserved)
        raise
    loop = asyncio.get_running_loop()
    deadline_s = min(limits.request_timeout_s, body.timeout or math.inf)
    timers = (
        loop.call_later(deadline_s, lambda: [h.abort("deadline") for h in handles if not h.done]),
        loop.call_later(
            limits.max_queue_s, lambda: [h.abort_if_waiting("queue_timeout") for h in handles if not h.done]
        ),
    )
    state.open_handles.update(handles)
    request_id = protocol.new_id("chatcmpl" if chat else "cmpl")

    finished = False

    def finish() -> None:  # idempotent: the stream's end and the response's end both call it
        nonlocal finished
        if finished:
            return
        finished = True
        for timer in timers:
            timer.cancel()
        state.open_handles.difference_update(handles)
        for handle in handles:
            if not handle.done:
                handle.abort()
        state.admission.release(reserved)
        request.state.polylane_access = _access_fields(model, sum(map(len, prompts)), handles)

    if body.stream:
        events = _events(handles)
        try:
            first = await _first_event(request, events)
        except BaseException:
            finish()
            raise
        if first is None:  # the client went away; nobody reads a response
            finish()
            return JSONResponse(protocol.error_body_gone(), status_code=499)
        index, event = first
        if event.finish_reason is not None and event.finish_reason not in protocol.FINISH_REASONS:
            finish()  # failed before a token: an error status, not a 200 and an error event
            state.metrics.served([handles[index].result(timeout=0)])
            raise _failure_error(event.finish_reason, event.error, state, deadline_s)
        return _EventStream(
            _stream(state, request_id, body, handles, chat, finish, first, events, deadline_s),
            finish,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        completions = await _wait(request, handles)
    finally:
        finish()
    if completions is None:  # the client went away; nobody reads a response
        return JSONResponse(protocol.error_body_gone(), status_code=499)
    usage = _account(state, completions, body.n)
    for completion in completions:
        if completion.finish_reason not in protocol.FINISH_REASONS:
            raise _failure_error(completion.finish_reason, completion.error, state, deadline_s)
    shown = _LogprobsShown(state, model, body, chat)
    calling = chat and body.template_tools is not None
    choices = []
    for i, c in enumerate(completions):
        logprobs = shown.body(c.logprobs, c.finish_reason)
        content, calls = parse_calls(c.text, set(body.tool_names())) if calling else (c.text, [])
        if calls:
            reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            choices.append(protocol.tool_calls_choice(i, content, calls, reason, logprobs))
        else:
            choices.append(protocol.choice(i, c.text, c.finish_reason, chat, logprobs))
    return protocol.completion_body(request_id, body.model, choices, usage, chat)


class _LogprobsShown:
    """A request's logprobs as the client sees them (None when it did not ask): each token's text
    in full (special tokens too), the end-of-turn token that stopped a choice left out."""

    def __init__(self, state: ServerState, model: str, body: Any, chat: bool) -> None:
        self.asked = body.logprobs_count is not None
        tokenizer = state.engine.models[model].tokenizer
        self.stop_ids = tokenizer.stop_token_ids
        self.chat = chat
        self.text = functools.lru_cache(maxsize=4096)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False)
        )

    def body(
        self, entries: Sequence[TokenLogprob], finish_reason: str | None, offset: int = 0
    ) -> dict[str, Any] | None:
        if not self.asked:
            return None
        if finish_reason == "stop" and entries and entries[-1].token in self.stop_ids:
            entries = entries[:-1]
        return protocol.logprobs_body(entries, self.text, self.chat, offset)


def _account(state: ServerState, completions: list[Completion], n: int) -> dict[str, Any]:
    """A request's `usage` over its prompts (`n` choices each: a prompt counted once), and the
    same counted in /metrics."""
    groups = [completions[i : i + n] for i in range(0, len(completions), n)]
    for group in groups:
        state.metrics.served(group)
    return protocol.usage(
        sum(group[0].prompt_tokens for group in groups),
        sum(len(c.token_ids) for c in completions),
        sum(group[0].cached_tokens for group in groups),
    )


def _access_fields(model: str, prompt_tokens: int, handles: list[RequestHandle]) -> dict[str, Any]:
    """The access log's part of a completion request (logs.AccessLog): its model and tokens, and
    the first token's time of its first choice to have one."""
    done = [h.result(timeout=0) for h in handles if h.done]
    ttfts = [c.ttft_seconds for c in done if c.ttft_seconds is not None]
    return {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(len(c.token_ids) for c in done),
        "ttft_ms": round(min(ttfts) * 1000, 1) if ttfts else None,
    }


class _EventStream(StreamingResponse):
    """An SSE response that ends its request however the response ends: a client that goes away
    before the first chunk (so the stream's own `finally` never runs) still aborts the request and
    gives its admission back."""

    def __init__(self, content: AsyncIterator[str], finish: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._finish()


def _failure(
    reason: str | None, error: str | None, state: ServerState, deadline_s: float
) -> tuple[str, str, int]:
    """The message, code and Retry-After seconds of a request the server ended without an answer
    (finish reasons that are not OpenAI's: "error", "deadline", "queue_timeout", "shutdown",
    "abort"): its status is 503, or a final SSE error event once the stream has begun. A request
    that timed out in the queue is told when the requests queued now will have drained, at the
    rate they have been ending."""
    limits = state.limits
    if reason == "deadline":
        own = deadline_s < limits.request_timeout_s
        where = "the request's timeout" if own else "limits.request_timeout_s"
        return (
            f"the request ran past its deadline of {deadline_s:g} s ({where}); it may succeed when "
            "the server is less busy",
            "request_timeout",
            1,
        )
    if reason == "queue_timeout":
        retry = state.admission.retry_after_s(limits.max_queue_s)
        return (
            f"the request waited {limits.max_queue_s:g} s in the queue without starting "
            f"(limits.max_queue_s): the server is saturated; retry in about {retry} s",
            "queue_timeout",
            retry,
        )
    if reason == "shutdown":
        return "the server is shutting down and its drain timeout has passed", "server_shutting_down", 1
    if reason == "abort":
        return "the server ended the request (its model was evicted or the server is stopping)", "aborted", 1
    return error or "the model failed", "model_unavailable", 1


def _failure_error(reason: str | None, error: str | None, state: ServerState, deadline_s: float) -> ApiError:
    message, code, retry = _failure(reason, error, state, deadline_s)
    return ApiError(503, message, code=code, headers={"Retry-After": str(retry)})


def _prompt_ids(state: ServerState, model: str, body: Any, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids: a chat's one, a completion's one or several (a batch)."""
    try:
        if chat:
            tools = body.template_tools
            if tools is not None and not supports_tools(
                state.engine.models[model].tokenizer.backend.chat_template
            ):
                raise ApiError(
                    400,
                    f"the chat template of {model!r} does not call tools (polylane calls tools through "
                    "templates that write <tool_call> blocks, as Qwen2.5's do)",
                    param="tools",
                    code="tools_not_supported",
                )
            return [state.engine.prompt_ids(model, messages=body.plain_messages(), tools=tools)]
        return [state.engine.prompt_ids(model, prompt) for prompt in body.prompt_inputs]
    except ChatTemplateError as error:
        if state.engine.models[model].tokenizer.has_chat_template:  # the template refused these messages
            raise ApiError(
                400,
                f"the chat template of {model!r} cannot render these messages: {str(error)[:200]}",
                param="messages",
                code="chat_template_error",
            ) from None
        raise ApiError(
            400,
            f"model {model!r} has no chat template (a base model), so it is completion-only: "
            "send a prompt to /v1/completions",
            param="messages",
            code="no_chat_template",
        ) from None
    except UnknownModelError as error:
        raise ApiError(404, str(error), param="model", code="model_not_found") from None
    except ValueError as error:
        raise ApiError(400, str(error), param="messages" if chat else "prompt") from None


def _submit(
    state: ServerState, model: str, prompts: list[list[int]], body: Any, max_tokens: int
) -> list[RequestHandle]:
    """`body.n` choices of each prompt, in that order (choice index = prompt × n + choice)."""
    handles: list[RequestHandle] = []
    try:
        defaults = state.sampling_defaults(model)
        for prompt_ids in prompts:
            for index in range(body.n):
                seed = None if body.seed is None else body.seed + index
                params = body.sampling_params(max_tokens, defaults, seed)
                handles.append(state.engine.submit(model, prompt_ids, params=params, priority=body.priority))
    except RequestTooLongError as error:
        raise ApiError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
    except EngineDeadError as error:
        raise ApiError(503, str(error), code="engine_dead") from None
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    finally:
        if len(handles) < body.n * len(prompts):
            for handle in handles:
                handle.abort()
    return handles


async def _collect(handle: RequestHandle) -> Completion:
    async for _ in handle:
        pass
    return handle.result(timeout=0)  # the last event was seen, so the handle is done


async def _wait(request: Request, handles: list[RequestHandle]) -> list[Completion] | None:
    """All choices' completions, or None if the client disconnected first (then they are aborted)."""
    completions = await _unless_gone(request, asyncio.gather(*(_collect(h) for h in handles)))
    if completions is None:
        for handle in handles:
            handle.abort()
    return completions


async def _unless_gone(request: Request, awaitable: Any) -> Any:
    """What `awaitable` gives, or None if the client disconnects first (then it is cancelled, its
    outcome marked seen)."""
    future = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.25)
            if done:
                return future.result()
            if await request.is_disconnected():
                return None
    finally:
        if not future.done():
            future.cancel()
        future.add_done_callback(_retrieved)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a cancelled gather's outcome as seen: asyncio logs an unseen one as an error with a
    traceback ("exception was never retrieved") on every client that disconnects."""
    if not future.cancelled():
        future.exception()


async def _events(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamEvent]]:
    if len(handles) == 1:
        async for event in handles[0]:
            yield 0, event
        return
    merged: asyncio.Queue[tuple[int, StreamEvent]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for event in handle:
            await merged.put((index, event))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, event = await merged.get()
            if event.finish_reason is not None:
                remaining -= 1
            yield index, event
    finally:
        for task in tasks:
            task.cancel()


async def _first_event(
    request: Request, events: AsyncIterator[tuple[int, StreamEvent]]
) -> tuple[int, StreamEvent] | None:
    """The stream's first event, awaited before the response starts (so a request that fails before
    its first token, its model unable to load or its deadline passed in the queue, gets an error
    status); None if the client disconnected first."""
    return await _unless_gone(request, anext(events))


async def _then(
    first: tuple[int, StreamEvent], rest: AsyncIterator[tuple[int, StreamEvent]]
) -> AsyncIterator[tuple[int, StreamEvent]]:
    yield first
    async for item in rest:
        yield item


async def _stream(
    state: ServerState,
    request_id: str,
    body: Any,
    handles: list[RequestHandle],
    chat: bool,
    finish: Any,
    first: tuple[int, StreamEvent],
    rest: AsyncIterator[tuple[int, StreamEvent]],
    deadline_s: float,
) -> AsyncIterator[str]:
    try:
        started = [False] * len(handles)
        error: tuple[str, str, int] | None = None
        shown = _LogprobsShown(state, handles[0].model, body, chat)
        # per choice: logprobs of tokens whose text is not out yet, and the text offset so far
        pending: list[list[TokenLogprob]] = [[] for _ in handles]
        offsets = [0] * len(handles)
        # with tools: per choice, text held from a <tool_call> on, parsed into calls at its end
        calling = None
        if chat and body.template_tools is not None:
            calling = [ToolCallStream(set(body.tool_names())) for _ in handles]
        async for index, event in _then(first, rest):
            finish_reason = event.finish_reason
            if finish_reason is not None and finish_reason not in protocol.FINISH_REASONS:
                error = error or _failure(finish_reason, event.error, state, deadline_s)
                finish_reason = None  # the error event below ends the stream
            pending[index].extend(event.logprobs)
            text, calls = event.text, []
            if calling is not None:
                text = calling[index].push(text)
                if event.finish_reason is not None:
                    rest_text, calls = calling[index].finish()
                    text += rest_text
                    if calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
            if not text and not calls and finish_reason is None:
                continue
            if chat and not started[index]:  # OpenAI's first chunk of a choice: the role alone
                yield f"data: {json.dumps(protocol.role_chunk(request_id, body.model, index))}\n\n"
            started[index] = True
            logprobs = shown.body(pending[index], finish_reason, offsets[index])
            pending[index] = []
            if text:
                chunk = protocol.chunk_body(
                    request_id, body.model, index, text, None if chat else finish_reason, chat, logprobs
                )
                offsets[index] += len(text)
                logprobs = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if calls:  # each call whole in one delta, in order
                chunk = protocol.tool_calls_chunk(request_id, body.model, index, calls)
                yield f"data: {json.dumps(chunk)}\n\n"
            if finish_reason is not None and (chat or not text):  # chat: an empty delta carries it
                chunk = protocol.chunk_body(request_id, body.model, index, "", finish_reason, chat, logprobs)
                yield f"data: {json.dumps(chunk)}\n\n"
        usage = _account(state, [h.result(timeout=0) for h in handles], body.n)
        if error is not None:
            yield f"data: {json.dumps(error_body(503, error[0], None, error[1]))}\n\n"
        if body.include_usage:
            yield f"data: {json.dumps(protocol.usage_chunk(request_id, body.model, usage, chat))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        finish()  # the client may be gone: abort what still runs, give the reservation back
