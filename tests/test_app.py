"""The app's routes are built once per process and shared by every app made in it
(docs/decisions/036-routes-built-once.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts

from queuekeeper.app import _routes, create_app
from queuekeeper.common.openapi import operation_id
from queuekeeper.config import Settings


def _settings(name: str) -> Settings:
    return Settings(
        database_url="postgresql+asyncpg://postgres@127.0.0.1:5432/unused",
        instance_name=name,
        service_tokens=["t" * 40],
    )


def _shape(app: FastAPI) -> list[tuple[Any, ...]]:
    """What each route does with a request: its path, methods, the dependencies it runs,
    its body limit, content-type strictness and answer class."""
    shape = []
    for context in iter_route_contexts(app.routes):
        dependant = getattr(context, "dependant", None)
        shape.append(
            (
                context.path,
                sorted(context.methods or ()),
                [d.call for d in dependant.dependencies] if dependant is not None else None,
                getattr(context, "max_body_size", None),
                bool(getattr(getattr(context, "strict_content_type", None), "value", True)),
                getattr(context, "response_class", None),
            )
        )
    return shape


def test_two_apps_of_one_process_share_the_route_contexts_built_for_the_first() -> None:
    first, second = create_app(_settings("qkt-first")), create_app(_settings("qkt-second"))
    routes = _routes()
    tail = len(routes)
    # Only the documentation's few routes, before these, are an app's own.
    assert first.routes[-tail:] == second.routes[-tail:] == list(routes)
    pairs = zip(
        iter_route_contexts(first.routes[-tail:]),
        iter_route_contexts(second.routes[-tail:]),
        strict=True,
    )
    resolved = [
        (a.dependant, getattr(b, "dependant", None))
        for a, b in pairs
        if getattr(a, "dependant", None) is not None
    ]
    assert len(resolved) > 40
    # The same objects: the second app resolved no route's dependencies again.
    assert all(a is b for a, b in resolved)


@pytest.mark.parametrize("root_path", ["", "/queuekeeper"])
def test_the_shared_routes_are_what_including_each_router_in_the_app_makes(
    root_path: str,
) -> None:
    """The app's own inclusion of each router (what `_routes` stands in for): the same
    OpenAPI document, and every route with the same path, methods, dependencies, limits."""
    shared = create_app(_settings("qkt-shared").model_copy(update={"root_path": root_path}))
    included = create_app(_settings("qkt-shared").model_copy(update={"root_path": root_path}))
    routes = _routes()
    included.router.routes[-len(routes) :] = []
    for route in routes:
        # FastAPI's record of an inclusion: the router and the dependencies it was given.
        context: Any = route.include_context  # type: ignore[attr-defined]
        included.include_router(route.original_router, dependencies=context.dependencies)  # type: ignore[attr-defined]
    assert included.router.generate_unique_id_function is operation_id
    assert shared.openapi() == included.openapi()
    assert _shape(shared) == _shape(included)


async def test_the_suite_runs_on_the_loop_serve_runs_on() -> None:
    """uvicorn runs `serve` on uvloop; the suite's tests and apps run on it too
    (tests/conftest.py, `pytest_asyncio_loop_factories`)."""
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
