from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Liveness(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"] = "ok"


class CheckResult(BaseModel):
    ok: bool
    seconds: float = Field(description="How long the check took.")
    error: str | None = Field(default=None, description="Why it failed (secrets masked).")


class Readiness(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "status": "unavailable",
                    "detail": "Not ready: amqp is down.",
                    "checks": {
                        "database": {"ok": True, "seconds": 0.002, "error": None},
                        "amqp": {
                            "ok": False,
                            "seconds": 0.001,
                            "error": "AMQPConnectionError: [Errno 111] Connect call failed",
                        },
                        "management": {"ok": True, "seconds": 0.004, "error": None},
                    },
                }
            ]
        }
    )

    status: Literal["ready", "unavailable"]
    detail: str = Field(description="`Ready.`, or which dependencies are down.")
    checks: dict[str, CheckResult] = Field(
        description="One entry per dependency: `database`, `amqp`, `management`."
    )
