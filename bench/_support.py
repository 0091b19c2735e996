"""Shared by the benchmarks: a throw-away PostgreSQL database and a live queuekeeper server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import psutil

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings

PG_ADMIN_DSN = os.environ.get("QK_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
ROOT = Path(__file__).resolve().parents[1]
SERVICE_TOKEN = "bench-service-token-0123456789"


def stat_cpu(stat: str) -> tuple[str, float]:
    """(command name, user + system CPU seconds) from the text of a /proc/<pid>/stat."""
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    return head.partition("(")[2], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _times(pid: int) -> tuple[float, float]:
    """(user + system, system) CPU seconds of `pid` (every thread of it) and of its children
    that have exited and been waited for; (0, 0) for a process that is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0, 0.0
    system = times.system + times.children_system
    return times.user + times.children_user + system, system


def process_cpu_seconds(*pids: int) -> float:
    """User + system CPU these processes have used so far (psutil), with what their exited
    children used: give every process of a tree (`process_tree`), so a child counts once,
    alive or gone."""
    return sum(_times(pid)[0] for pid in pids)


def process_system_seconds(*pids: int) -> float:
    """The kernel's part of `process_cpu_seconds` (system calls, wake-ups, page faults)."""
    return sum(_times(pid)[1] for pid in pids)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants now (psutil), parents first."""
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


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


def on_a_bench_database(run: Callable[[Settings], Awaitable[None]]) -> None:
    """`run` with the settings of a fresh bench database and an instance name of its own."""
    with bench_database() as url:
        settings = Settings(database_url=url, instance_name=f"qkb-{uuid.uuid4().hex[:8]}")
        asyncio.run(run(settings))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def live_server(settings: Settings) -> Iterator[str]:
    """`queuekeeper serve` in a process of its own (so it does not share this one's GIL)."""
    with live_process(settings) as (base, _process):
        yield base


@contextlib.contextmanager
def live_process(settings: Settings, **env: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`queuekeeper serve` on a free port, with `QUEUEKEEPER_*` overrides in `env`; its base
    URL and process (for /proc), once `/healthz` answers."""
    port = free_port()
    environment = {
        **os.environ,
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        "QUEUEKEEPER_SERVICE_TOKENS": ",".join(settings.service_tokens),
        "QUEUEKEEPER_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "QUEUEKEEPER_LOG_LEVEL": "WARNING",
        "QUEUEKEEPER_LOG_FORMAT": "json",
        # The benchmarks time registration calls back to back, far above the per-token
        # limit an agent meets (docs/decisions/012-sliding-window-rate-limit.md):
        # throttling is not what they measure.
        "QUEUEKEEPER_REGISTRATION_RATE_LIMIT": "100000/second",
        **env,
    }
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "queuekeeper"), "serve", "--port", str(port)],
        env=environment,
        stdout=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        # A machine busy with other work starts it slower (BENCH_START_SECONDS).
        deadline = time.monotonic() + float(os.environ.get("BENCH_START_SECONDS", "30"))
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("queuekeeper did not start")
            time.sleep(0.1)
        yield base, process
    finally:
        process.terminate()
        process.wait(30)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "n": float(len(ordered))}


def fmt_ms(stats: dict[str, float]) -> str:
    return "  ".join(f"{key} {stats[key] * 1000:6.2f} ms" for key in ("p50", "p90", "p99"))


async def instance_objects(
    management: ManagementClient, settings: Settings
) -> tuple[list[str], list[str]]:
    """The vhosts and broker users tagged with this run's instance name, whichever
    installation (database) made them."""
    tag = settings.instance_tag
    vhosts = [info.name for info in await management.list_vhosts() if tag in info.tags]
    users = [info.name for info in await management.list_users() if tag in info.tags]
    return vhosts, users


async def remove_broker_objects(settings: Settings) -> tuple[int, int]:
    """Delete every vhost and broker user tagged with this run's instance name."""
    from queuekeeper.broker.management import ManagementClient

    management = ManagementClient(settings.model_copy(update={"management_timeout": 60.0}))
    try:
        vhosts, users = await instance_objects(management, settings)
        for vhost in vhosts:
            await management.delete_vhost(vhost)
        for user in users:
            await management.delete_user(user)
        return len(vhosts), len(users)
    finally:
        await management.aclose()


async def alternating_blocks(
    ways: dict[str, Callable[[], Awaitable[object]]], *, block: int, blocks: int
) -> dict[str, list[float]]:
    """CPU ms of this process per call of each way, over `blocks` rounds in which each way
    runs `block` calls in turn (after one block each to warm pools and statement caches): a
    VM whose speed drifts moves every way alike."""

    async def timed(way: Callable[[], Awaitable[object]]) -> float:
        started = time.process_time()
        for _ in range(block):
            await way()
        return 1000 * (time.process_time() - started) / block

    for way in ways.values():
        await timed(way)
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(blocks):
        for name, way in ways.items():
            results[name].append(await timed(way))
    return results


def print_medians(title: str, results: dict[str, list[float]]) -> None:
    print(title)
    width = max(map(len, results))
    for name, figures in results.items():
        print(
            f"  {name:{width}s} median {statistics.median(figures):.3f} ms "
            f"(blocks {min(figures):.3f}-{max(figures):.3f})"
        )
