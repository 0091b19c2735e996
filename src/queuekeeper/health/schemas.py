from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Liveness(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"] = "ok"


class NodeResult(BaseModel):
    ok: bool
    seconds: float = Field(description="How long the check took.")
    error: str | None = Field(default=None, description="Why it failed (secrets masked).")


class CheckResult(NodeResult):
    nodes: dict[str, NodeResult] | None = Field(
        default=None,
        description="`amqp` and `management`: each configured node (`host:port`) and whether "
        "it answered. The check is ok while at least one node answers. `processes`: each "
        "process `serve` supervises (`accept-0`, `relay-0`, ...) and whether it runs; ok "
        "while at least one of each kind runs.",
    )


class Readiness(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "status": "ready",
                    "detail": "Ready; not answering: amqp 10.0.0.2:5672.",
                    "checks": {
                        "database": {"ok": True, "seconds": 0.002, "error": None},
                        "amqp": {
                            "ok": True,
                            "seconds": 0.011,
                            "error": None,
                            "nodes": {
                                "10.0.0.1:5672": {"ok": True, "seconds": 0.01, "error": None},
                                "10.0.0.2:5672": {
                                    "ok": False,
                                    "seconds": 0.001,
                                    "error": "AMQPConnectionError: [Errno 111] Connection refused",
                                },
                            },
                        },
                        "management": {
                            "ok": True,
                            "seconds": 0.004,
                            "error": None,
                            "nodes": {
                                "10.0.0.1:15672": {"ok": True, "seconds": 0.004, "error": None}
                            },
                        },
                    },
                }
            ]
        }
    )

    status: Literal["ready", "unavailable"]
    detail: str = Field(
        description="`Ready.`, which dependencies are down, or which broker nodes did not "
        "answer while others did (still ready); followed by `Warning: …` when the broker holds "
        "objects under this instance name that this database does not know (another "
        "installation with the same name, or a database restored from an older backup; still "
        "ready, docs/howto/backup-and-restore.md)."
    )
    checks: dict[str, CheckResult] = Field(
        description="One entry per dependency: `database`, `amqp`, `management`; and "
        "`processes` when `serve` runs several processes (docs/scaling.md)."
    )
