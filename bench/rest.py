"""What the service costs at rest: CPU per second of `queuekeeper serve` with no traffic.

At Waldur's pace (events a few times a second, well below 200/s) a service's CPU is mostly
what it spends between events: its polls, its scheduled jobs, its timers. This measures it.

- queuekeeper: `queuekeeper serve` (its default process model) on a fresh database, left
  alone for BENCH_REST_SECONDS (30) after BENCH_REST_SETTLE (10) seconds; the CPU of every
  process of its tree over that time, in ms per second, and what it adds to each event at
  200 events/s and at 5/s;
- the same with one kind of periodic work slowed to every 600 s, each in a run of its own
  (BENCH_REST_PARTS=1, the default; 0 leaves them out), so each kind's share shows: the
  relay's and the webhook dispatcher's polls (`relay_poll_interval`), the parking check
  (`park_check_interval`), the access sweep job, the token expiry job; after each, the
  transactions committed and rows written in its database a minute;
- raw: uvicorn serving an empty ASGI app on uvloop, as `serve` runs (its own 0.1 s tick is
  the floor of any uvicorn service), in a process of its own.

    .venv/bin/python -m bench rest
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench._support import (
    PG_ADMIN_DSN,
    bench_database,
    free_port,
    live_process,
    process_cpu_seconds,
    process_tree,
)
from queuekeeper.config import Settings

SECONDS = float(os.environ.get("BENCH_REST_SECONDS", "30"))
SETTLE = float(os.environ.get("BENCH_REST_SETTLE", "10"))
PARTS = os.environ.get("BENCH_REST_PARTS", "1") != "0"
SLOW = "600"
# Each kind of periodic work, and the settings that slow it to every SLOW seconds.
KINDS: dict[str, dict[str, str]] = {
    "relay and dispatcher polls": {"QUEUEKEEPER_RELAY_POLL_INTERVAL": SLOW},
    "parking check": {"QUEUEKEEPER_PARK_CHECK_INTERVAL": SLOW},
    "access sweep job": {"QUEUEKEEPER_ACCESS_SWEEP_INTERVAL_SECONDS": SLOW},
    "token expiry job": {"QUEUEKEEPER_TOKEN_EXPIRY_INTERVAL_SECONDS": SLOW},
}
EMPTY_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
"""


def _rest_cpu(pids: list[int], database: str | None = None) -> float:
    """ms of CPU per second over SECONDS, after SETTLE; with `database`, also prints the
    transactions it committed and the rows written in it over that time."""
    time.sleep(SETTLE)
    writes = _database_writes(database) if database else None
    before, started = process_cpu_seconds(*pids), time.monotonic()
    time.sleep(SECONDS)
    cpu = (process_cpu_seconds(*pids) - before) * 1e3 / (time.monotonic() - started)
    if database and writes is not None:
        time.sleep(1.5)  # PostgreSQL flushes a backend's counts at most once a second
        commits, rows = (a - b for a, b in zip(_database_writes(database), writes, strict=True))
        minutes = SECONDS / 60
        print(
            f"    its database: {commits / minutes:.0f} commits and {rows / minutes:.0f} rows "
            "written a minute (pg_stat_database; readings included)",
            flush=True,
        )
    return cpu


def _database_writes(database: str) -> tuple[int, int]:
    """Transactions committed in `database`, and rows inserted, updated and deleted."""

    async def read() -> tuple[int, int]:
        import asyncpg

        connection = await asyncpg.connect(PG_ADMIN_DSN)
        try:
            row = await connection.fetchrow(
                "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS rows "
                "FROM pg_stat_database WHERE datname = $1",
                database,
            )
        finally:
            await connection.close()
        return int(row["xact_commit"]), int(row["rows"])

    return asyncio.run(read())


def queuekeeper(settings: Settings, **env: str) -> float:
    with live_process(settings, **env) as (_base, process):
        return _rest_cpu(process_tree(process.pid), settings.database_url.rsplit("/", 1)[1])


def raw(directory: Path) -> float:
    (directory / "rest_empty_app.py").write_text(EMPTY_APP)
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "rest_empty_app:app", "--port", str(port)]
    command += ["--loop", "uvloop", "--http", "httptools", "--no-access-log"]
    process = subprocess.Popen(command, cwd=directory, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the empty uvicorn app did not start") from None
                time.sleep(0.1)
        return _rest_cpu([process.pid])
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    print(f"uptime before: {os.popen('uptime').read().strip()}", flush=True)
    with bench_database() as url:
        settings = Settings(
            database_url=url,
            instance_name=f"qkb-{uuid.uuid4().hex[:8]}",
            service_tokens=[secrets.token_urlsafe(32)],
        )
        whole = queuekeeper(settings)
        print(
            f"queuekeeper at rest: {whole:.1f} ms of CPU a second ({whole / 10:.2f} % of a "
            f"core): {whole / 200:.3f} ms per event at 200/s, {whole / 5:.2f} ms at 5/s",
            flush=True,
        )
        if PARTS:
            for kind, env in KINDS.items():
                without = queuekeeper(settings, **env)
                print(
                    f"  with the {kind} every {SLOW} s: {without:.1f} ms/s "
                    f"(theirs: {whole - without:.1f} ms/s)",
                    flush=True,
                )
    with tempfile.TemporaryDirectory() as directory:
        floor = raw(Path(directory))
    print(f"raw: uvicorn serving an empty app at rest: {floor:.1f} ms/s")
    print(f"RATIO rest CPU queuekeeper / raw: {whole / floor if floor else float('inf'):.1f}x")
    print(f"uptime after: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
