"""Readiness: can this process do its work right now?

Each dependency is checked concurrently with a short timeout, so a probe answers within
about `readiness_timeout` seconds even when a dependency hangs rather than refuses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy import text

from queuekeeper.common.redact import default_redactor
from queuekeeper.health.schemas import CheckResult, Readiness
from queuekeeper.state import AppState

log = structlog.get_logger(__name__)

Check = Callable[[], Awaitable[None]]


async def check_database(state: AppState) -> None:
    async with state.engine.connect() as connection:
        await connection.execute(text("SELECT 1"))


async def check_amqp(state: AppState) -> None:
    await state.publisher.probe()


async def check_management(state: AppState) -> None:
    await state.management.overview()


def checks(state: AppState) -> dict[str, Check]:
    return {
        "database": lambda: check_database(state),
        "amqp": lambda: check_amqp(state),
        "management": lambda: check_management(state),
    }


async def _run(check: Check, limit: float) -> CheckResult:
    started = time.perf_counter()
    error: str | None = None
    try:
        await asyncio.wait_for(check(), limit)
    except TimeoutError:
        error = f"no answer within {limit:g} s"
    except Exception as exc:  # any failure means "not ready"; the reason is reported
        error = default_redactor.text(f"{type(exc).__name__}: {exc}")[:500]
    return CheckResult(
        ok=error is None, seconds=round(time.perf_counter() - started, 4), error=error
    )


async def readiness(state: AppState) -> Readiness:
    named = checks(state)
    timeout = state.settings.readiness_timeout
    results = await asyncio.gather(*(_run(check, timeout) for check in named.values()))
    report = dict(zip(named, results, strict=True))
    down = [name for name, result in report.items() if not result.ok]
    _log_change(state, down, report)
    if down:
        return Readiness(
            status="unavailable", detail=f"Not ready: {', '.join(down)} down.", checks=report
        )
    return Readiness(status="ready", detail="Ready.", checks=report)


def _log_change(state: AppState, down: list[str], report: dict[str, CheckResult]) -> None:
    """One line when readiness changes, not one per probe."""
    previous = list(state.readiness_down)
    state.readiness_down = tuple(down)
    if down == previous:
        return
    if down:
        log.warning("not_ready", down=down, errors={name: report[name].error for name in down})
    elif previous:
        log.info("ready_again", was_down=previous)
