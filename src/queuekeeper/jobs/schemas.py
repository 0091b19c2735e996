from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from queuekeeper.common.schemas import HexUUID, Schema, UTCDateTime
from queuekeeper.jobs.runs import Job, RunStatus, Trigger
from queuekeeper.models import JobRun


class FailureOut(Schema):
    item: str = Field(description="What failed: a vhost, `vhost/queue`, a broker user, ….")
    reason: str = Field(description="Why, in the broker's own words where it gave any.")


class ActionOut(Schema):
    action: str
    item: str
    detail: str = ""
    planned: bool = Field(
        default=False, description="True in a dry run: what the run would have done."
    )


class RunOut(Schema):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "uuid": "3f1c9e0a5b2d4c7e8f9a0b1c2d3e4f5a",
                    "job": "reconcile",
                    "trigger": "api",
                    "dry_run": False,
                    "started": "2026-11-22T06:00:00.000000Z",
                    "finished": "2026-11-22T06:00:02.310000Z",
                    "status": "succeeded",
                    "found": {"vhosts": 2, "queues": 31, "orphan_queues": 1},
                    "changed": {"orphans_deleted": 1},
                    "failures": [],
                    "actions": [
                        {
                            "action": "delete_queue",
                            "item": "5e0b…/subscription_…_order",
                            "detail": "orphan: no registration",
                            "planned": False,
                        }
                    ],
                }
            ]
        },
    )

    uuid: HexUUID
    job: Job = Field(
        description="`reconcile`, `cleanup_stale`, `redrive_dead_letters`, `revoke_expired`, "
        "`retention`, `presence` or `sweep_access`."
    )
    trigger: Trigger = Field(
        description="`schedule`, `api`, `cli`, `release` (the redrive a returning agent's "
        "release runs first) or `wake` (a change the job listens for)."
    )
    dry_run: bool
    started: UTCDateTime
    finished: UTCDateTime | None
    status: RunStatus = Field(
        description="`running`, `succeeded`, `partial` (some items failed), `failed` (ended "
        "early) or `skipped` (another run of the job held its lock)."
    )
    found: dict[str, Any] = Field(description="Counts of what the run found.")
    changed: dict[str, Any] = Field(description="Counts of what it changed (empty when dry).")
    failures: list[FailureOut]
    actions: list[ActionOut] = Field(
        description="Each change, or in a dry run each planned change (at most 1000)."
    )

    @classmethod
    def from_row(cls, record: JobRun) -> RunOut:
        return cls.model_validate(record)
