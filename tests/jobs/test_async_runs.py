"""`Prefer: respond-async` on the run-now routes: 202 at once, a record to poll, a skipped second
start, and a clean record when the service stops under a background run."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from queuekeeper.app import Runtime, create_app
from queuekeeper.broker import topology
from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings
from queuekeeper.jobs.runs import Job, JobContext, JobRunner, JobSpec, Run
from queuekeeper.models import JobRun
from tests.helpers import Backend, Operator
from tests.reconcile.test_reconcile import SPEC_ARGUMENTS

ASYNC = {"Prefer": "respond-async"}


async def poll(operator: Operator, location: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        record: dict[str, Any] = await operator.get(location)
        if record["finished"] is not None:
            return record
        assert time.monotonic() < deadline, f"the run never finished: {record}"
        await asyncio.sleep(0.1)


class Gate:
    """A job body that waits until the test lets it finish."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, context: JobContext, run: Run) -> None:
        self.entered.set()
        await self.release.wait()
        run.find("gated")


def gated(state: Runtime, gate: Gate) -> None:
    state.jobs = JobRunner(state.jobs.context, {Job.RECONCILE: JobSpec(Job.RECONCILE, gate)})


async def test_async_reconcile_answers_202_with_a_record_to_poll(
    operator: Operator, backend: Backend, management: ManagementClient
) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    orphan = topology.queue_name(uuid.UUID(subscription["uuid"]), uuid.uuid4(), "order")
    await management.put_queue(agent.vhost, orphan, arguments=SPEC_ARGUMENTS)

    response = await operator.client.post(
        "/api/admin/reconcile/", headers={**operator.headers, **ASYNC}
    )

    assert response.status_code == 202, response.text
    assert response.headers["Preference-Applied"] == "respond-async"
    started = response.json()
    assert started["job"] == "reconcile"
    assert started["trigger"] == "api"
    assert response.headers["Location"] == f"/api/admin/reconcile-runs/{started['uuid']}/"
    finished = await poll(operator, response.headers["Location"])
    assert finished["status"] == "succeeded", finished["failures"]
    assert finished["changed"] == {"orphans_deleted": 1}
    assert await management.get_queue(agent.vhost, orphan) is None


async def test_second_async_start_is_skipped_like_the_sync_form(
    app: FastAPI, operator: Operator
) -> None:
    gate = Gate()
    gated(app.state.queuekeeper, gate)
    first = await operator.client.post(
        "/api/admin/reconcile/", headers={**operator.headers, **ASYNC}
    )
    assert first.status_code == 202, first.text
    assert first.json()["status"] == "running"
    await asyncio.wait_for(gate.entered.wait(), 10)

    second = await operator.client.post(
        "/api/admin/reconcile/", headers={**operator.headers, **ASYNC}
    )
    sync = await operator.client.post("/api/admin/reconcile/", headers=operator.headers)

    for answer in (second, sync):
        assert answer.status_code == 409, answer.text
        assert answer.json()["run"]["status"] == "skipped"
        assert "Location" not in answer.headers
    gate.release.set()
    finished = await poll(operator, first.headers["Location"])
    assert finished["status"] == "succeeded"
    assert finished["found"] == {"gated": 1}


async def test_redrive_async_checks_the_vhost_first(operator: Operator) -> None:
    response = await operator.client.post(
        "/api/admin/dead-letters/redrive/",
        params={"vhost": uuid.uuid4().hex},
        headers={**operator.headers, **ASYNC},
    )
    assert response.status_code == 404
    assert response.json()["errors"][0]["field"] == "vhost"


async def test_shutdown_interrupts_a_background_run_and_records_it(
    settings: Settings, clean_state: None
) -> None:
    app = create_app(settings.model_copy(update={"scheduler_enabled": False}))
    gate = Gate()
    async with LifespanManager(app):
        state: Runtime = app.state.queuekeeper
        gated(state, gate)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            operator = Operator(http, settings.service_tokens[0])
            response = await http.post(
                "/api/admin/reconcile/", headers={**operator.headers, **ASYNC}
            )
            assert response.status_code == 202, response.text
        await asyncio.wait_for(gate.entered.wait(), 10)
    # The lifespan is over: the run was cancelled, and said so in its record.
    async with state.sessions() as session:
        record = await session.get(JobRun, uuid.UUID(response.json()["uuid"]))
    assert record is not None
    assert record.status == "failed"
    assert record.finished is not None
    assert "interrupted" in record.failures[-1]["reason"]
