"""What `serve`'s supervisor and the processes it runs share: one directory, and in it the
supervisor's status file (docs/decisions/016-process-model.md).

The directory is named by the environment variable `MULTIPROC_ENV`: prometheus_client's
multiprocess mode keeps every process's metric files there, and the supervisor writes
`STATUS_FILE` beside them, which `/readyz` of whichever worker answers reads
(health/service.py), so a probe covers every process. Only the standard library here:
the CLI's quick commands import it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STATUS_FILE = "processes.json"


def shared_directory() -> str | None:
    """The directory this process shares with the others; None when it runs alone."""
    return os.environ.get(MULTIPROC_ENV) or None


def write_status(directory: Path, supervisor: int, processes: list[dict[str, Any]]) -> None:
    """The supervisor's status: its pid and each process it runs, as
    {"name", "role" ("accept" or "relay"), "pid" (None while restarting), "restarts"}."""
    target = directory / STATUS_FILE
    temporary = target.with_suffix(".tmp")
    temporary.write_text(json.dumps({"supervisor": supervisor, "processes": processes}))
    temporary.replace(target)  # a reader sees the old file or the new, never half


def remove_status(directory: Path) -> None:
    (directory / STATUS_FILE).unlink(missing_ok=True)


def read_status(directory: str | None) -> dict[str, Any] | None:
    """What the supervisor last wrote; None when this process is not supervised."""
    if not directory:
        return None
    try:
        status: dict[str, Any] = json.loads((Path(directory) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return status


def process_check(status: dict[str, Any]) -> tuple[bool, dict[str, bool], str | None]:
    """(ok, each process and whether it runs, why not ok) from the supervisor's status: ok
    while at least one process of each role runs (one being restarted is named, not
    fatal: the others take its connections, or its outbox work once its leases end)."""
    running = {entry["name"]: alive(entry["pid"]) for entry in status["processes"]}
    roles = {entry["role"] for entry in status["processes"]}
    missing = sorted(
        role
        for role in roles
        if not any(running[e["name"]] for e in status["processes"] if e["role"] == role)
    )
    error = f"no {' or '.join(missing)} process running (being restarted)" if missing else None
    return not missing, running, error


def alive(pid: int | None) -> bool:
    """Whether `pid` runs: a killed child that its supervisor has not reaped yet (a zombie)
    does not, though a signal to it still succeeds."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: the signal said it is there
    return state not in ("Z", "X")
