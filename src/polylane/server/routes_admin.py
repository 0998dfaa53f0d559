"""Admin routes: load, pin, unpin and evict a model, read and set the byte budget, at runtime.

What this module owns: mapping those operations onto the residency manager and its refusals onto
clear statuses: unknown model 404; a refusal that leaves everything unchanged (no room, pinned,
busy with requests, budget below the pinned footprint) 409; a model file that cannot be loaded
503. Loading runs in a worker thread, so the server keeps answering.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from polylane.policy.residency.pool import ResidencyError, UnknownModelError
from polylane.runtime.residency.manager import ModelLoadError
from polylane.server.errors import ApiError
from polylane.server.protocol import BudgetRequest
from polylane.server.routes_openai import list_models, server_state

router = APIRouter(prefix="/admin")


def _run(operation: Any, *args: Any) -> Any:
    try:
        return operation(*args)
    except UnknownModelError as error:
        raise ApiError(404, str(error), param="model", code="model_not_found") from None
    except ResidencyError as error:
        raise ApiError(409, str(error), code="residency_refused") from None
    except ModelLoadError as error:
        raise ApiError(503, str(error), code="model_unavailable") from None


def _load(manager: Any, name: str) -> None:
    with manager.acquire(name):
        pass  # resident now; the lease goes back at once


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    return await list_models(request)


@router.post("/models/{name}/load")
async def load(name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    model = state.resolve(name)
    await run_in_threadpool(_run, _load, state.engine.manager, model)
    return await _model(request, model)


@router.post("/models/{name}/pin")
async def pin(name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    model = state.resolve(name)
    _run(state.engine.manager.pin, model)
    return await _model(request, model)


@router.post("/models/{name}/unpin")
async def unpin(name: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    model = state.resolve(name)
    _run(state.engine.manager.unpin, model)
    return await _model(request, model)


@router.post("/models/{name}/evict")
async def evict(name: str, request: Request, force: bool = False) -> dict[str, Any]:
    state = server_state(request)
    model = state.resolve(name)
    await run_in_threadpool(_run, state.engine.manager.evict, model, force)
    return await _model(request, model)


@router.get("/budget")
async def budget(request: Request) -> dict[str, Any]:
    manager = server_state(request).engine.manager
    return {"budget_bytes": manager.budget_bytes, "eviction": manager.eviction}


@router.post("/budget")
async def set_budget(body: BudgetRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    evicted = await run_in_threadpool(_run, state.engine.manager.set_budget, body.bytes)
    return {"budget_bytes": state.engine.manager.budget_bytes, "evicted": evicted}


async def _model(request: Request, name: str) -> dict[str, Any]:
    listing = await list_models(request)
    return next(m for m in listing["data"] if m["id"] == name)
