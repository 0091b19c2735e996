"""Readiness: can this process do its work right now?

Each dependency is checked concurrently with a short timeout, so a probe answers within
about `readiness_timeout` seconds even when a dependency hangs rather than refuses. With
several broker nodes configured, every node is checked at once: the broker is up while
one node answers, and the report names each node and whether it answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.nodes import node_label
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.broker.publisher import AmqpPublisher
from queuekeeper.common.processes import process_check, read_status, shared_directory
from queuekeeper.common.redact import default_redactor
from queuekeeper.config import Settings
from queuekeeper.health.schemas import CheckResult, NodeResult, Readiness
from queuekeeper.installation import service as installation

log = structlog.get_logger(__name__)


class Watched(Protocol):
    """What readiness reads (the app's dependencies) and remembers between probes; the
    composition root's `Runtime` is one."""

    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    management: ManagementClient
    provisioner: Provisioner
    publisher: AmqpPublisher
    readiness_down: tuple[str, ...]
    readiness_nodes_down: tuple[str, ...]
    survey: installation.Survey | None
    survey_task: asyncio.Task[None] | None


Check = Callable[[], Awaitable[None]]
NodeCheck = Callable[[str], Awaitable[None]]


async def check_database(state: Watched) -> None:
    async with state.engine.connect() as connection:
        await connection.execute(text("SELECT 1"))


async def check_amqp_node(state: Watched, url: str) -> None:
    await state.publisher.probe(url)


async def check_management_node(state: Watched, url: str) -> None:
    await state.management.node_overview(url)


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


async def _across_nodes(urls: list[str], check: NodeCheck, limit: float) -> CheckResult:
    """Every node at once; the dependency is up when at least one node answered."""
    started = time.perf_counter()
    results = await asyncio.gather(*(_run(partial(check, url), limit) for url in urls))
    nodes = {
        node_label(url): NodeResult(ok=result.ok, seconds=result.seconds, error=result.error)
        for url, result in zip(urls, results, strict=True)
    }
    failed = {label: result.error for label, result in nodes.items() if not result.ok}
    error = None
    if len(failed) == len(nodes) == 1:  # one broker: worded as before there were lists
        error = next(iter(failed.values()))
    elif len(failed) == len(nodes):
        error = "; ".join(f"{label}: {reason}" for label, reason in failed.items())[:1000]
    return CheckResult(
        ok=error is None,
        seconds=round(time.perf_counter() - started, 4),
        error=error,
        nodes=nodes,
    )


# How old a survey of the broker may be before /readyz starts a new one (in the background).
SURVEY_MAX_AGE = 300.0


async def refresh_survey(state: Watched) -> None:
    """Look for objects under our instance name that this database does not know; warn once
    per change. Errors are logged: readiness reports the dependencies themselves."""
    try:
        if state.survey is None:  # the first look of this process
            adopted = await installation.adopt_unclaimed_vhosts(state.provisioner, state.sessions)
            if adopted:
                log.info("vhosts_adopted", count=len(adopted), vhosts=adopted[:5])
        found = await installation.survey(state.provisioner, state.sessions)
    except Exception as exc:  # the broker or the database down: the next probe tries again
        log.info("broker_survey_failed", error=default_redactor.text(repr(exc))[:300])
        return
    previous = state.survey.counts if state.survey is not None else {}
    state.survey = found
    detail = found.detail(state.settings.instance_name)
    if detail and found.counts != previous:
        log.warning(
            "broker_objects_unknown_to_this_database",
            installation=str(state.provisioner.installation),
            counts=found.counts,
            other_installation=found.other_installation,
            unknown=found.unknown,
            detail=detail,
        )
    elif previous and not found.counts:
        log.info("broker_objects_all_known")


def _survey_detail(state: Watched) -> str | None:
    """The last survey's finding; a new survey starts when it is old (never awaited here:
    a probe answers within its timeout)."""
    survey = state.survey
    running = state.survey_task is not None and not state.survey_task.done()
    if not running and (survey is None or time.monotonic() - survey.taken > SURVEY_MAX_AGE):
        state.survey_task = asyncio.create_task(refresh_survey(state), name="survey")
    return survey.detail(state.settings.instance_name) if survey is not None else None


async def readiness(state: Watched) -> Readiness:
    settings = state.settings
    limit = settings.readiness_timeout
    database, amqp, management = await asyncio.gather(
        _run(partial(check_database, state), limit),
        _across_nodes(settings.amqp_urls, partial(check_amqp_node, state), limit),
        _across_nodes(settings.management_urls, partial(check_management_node, state), limit),
    )
    report = {"database": database, "amqp": amqp, "management": management}
    status = read_status(shared_directory())
    if status is not None:  # under `serve`'s supervisor: every process it runs
        ok, running, error = process_check(status)
        report["processes"] = CheckResult(
            ok=ok,
            seconds=0.0,
            error=error,
            nodes={
                name: NodeResult(ok=up, seconds=0.0, error=None if up else "not running")
                for name, up in running.items()
            },
        )
    down = [name for name, result in report.items() if not result.ok]
    nodes_down = [
        f"{name} {label}"
        for name, result in report.items()
        if result.ok
        for label, node in (result.nodes or {}).items()
        if not node.ok
    ]
    _log_change(state, down, nodes_down, report)
    if down:
        return Readiness(
            status="unavailable", detail=f"Not ready: {', '.join(down)} down.", checks=report
        )
    unknown = _survey_detail(state)
    detail = f"Ready; not answering: {', '.join(nodes_down)}." if nodes_down else "Ready."
    if unknown:
        # Still ready: serving is safe, and the guard keeps any run from deleting them.
        detail += f" Warning: {unknown}"
    return Readiness(status="ready", detail=detail, checks=report)


def _log_change(
    state: Watched, down: list[str], nodes_down: list[str], report: dict[str, CheckResult]
) -> None:
    """One line when readiness changes, not one per probe."""
    previous, previous_nodes = list(state.readiness_down), list(state.readiness_nodes_down)
    state.readiness_down = tuple(down)
    # While a check is down its nodes are all down: node changes are told when it is back.
    if nodes_down != previous_nodes and not down:
        state.readiness_nodes_down = tuple(nodes_down)
        if nodes_down:
            log.warning("broker_nodes_not_answering", nodes=nodes_down)
        else:
            log.info("broker_nodes_all_answering", were_down=previous_nodes)
    if down == previous:
        return
    if down:
        log.warning("not_ready", down=down, errors={name: report[name].error for name in down})
    elif previous:
        log.info("ready_again", was_down=previous)
