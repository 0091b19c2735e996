"""`GET /metrics`: the Prometheus exposition, summed over the worker processes if several."""

from __future__ import annotations

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from queuekeeper.common.access import Caller
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.processes import shared_directory

router = caller_router(Caller.PUBLIC, tags=["health"])

_EXAMPLE = (
    "# HELP queuekeeper_create_queue_total create_queue calls by outcome.\n"
    "# TYPE queuekeeper_create_queue_total counter\n"
    'queuekeeper_create_queue_total{outcome="created"} 42.0\n'
)


def exposition_registry() -> CollectorRegistry:
    """The registry to expose: this process's, or every worker's in multiprocess mode.

    In multiprocess mode each worker writes its samples to files in the directory the
    processes share (common/processes.py); a fresh registry per scrape reads them all, so
    whichever worker answers the scrape reports the totals.
    """
    if shared_directory():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    description="Every queuekeeper metric in the Prometheus text format (see "
    "docs/reference/monitoring.md for what each means). Not counted as HTTP traffic itself. "
    "No authentication: expose it to your Prometheus, not to the internet.",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}, "example": _EXAMPLE}},
        }
    },
)
def metrics() -> Response:
    # A plain `def`: FastAPI runs it in a thread, so reading the multiprocess files
    # never blocks the event loop.
    return Response(generate_latest(exposition_registry()), media_type=CONTENT_TYPE_LATEST)
