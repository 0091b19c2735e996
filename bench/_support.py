"""Shared by the benchmarks: a throw-away PostgreSQL database and a live queuekeeper server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from queuekeeper.app import create_app
from queuekeeper.config import Settings

PG_ADMIN_DSN = os.environ.get("QK_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
ROOT = Path(__file__).resolve().parents[1]
SERVICE_TOKEN = "bench-service-token-0123456789"


async def _admin(sql: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(PG_ADMIN_DSN)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


@contextlib.contextmanager
def bench_database() -> Iterator[str]:
    """A fresh, migrated PostgreSQL database, dropped afterwards."""
    from alembic import command
    from alembic.config import Config

    name = f"qk_bench_{uuid.uuid4().hex[:10]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    url = f"{url}/{name}"
    try:
        config = Config(str(ROOT / "alembic.ini"))
        config.attributes["database_url"] = url
        command.upgrade(config, "head")
        yield url
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def live_server(settings: Settings) -> Iterator[str]:
    """queuekeeper under uvicorn on a loopback port, in a thread of this process."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("queuekeeper did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "n": float(len(ordered))}


def fmt_ms(stats: dict[str, float]) -> str:
    return "  ".join(f"{key} {stats[key] * 1000:6.2f} ms" for key in ("p50", "p90", "p99"))
