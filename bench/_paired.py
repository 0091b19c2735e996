"""This checkout's service against another's, at one rate, in interleaved steps.

`bench single` runs each pipeline's steps one after another, so a machine whose speed
drifts over the minutes of a run (a shared VM) moves one pipeline's figures and not the
other's: on such a machine two runs of the same code differ by more than a change of a few
per cent. Here the raw pipeline, the other checkout's `queuekeeper serve` and this one's run
side by side (each service with a database and an instance name of its own), and the load
goes to one at a time in short steps, round after round, the services' order swapped each
round; each round's ratio of this service's CPU per event to the other's is a paired
figure, and their median is the comparison.

    python -m bench._paired <checkout with its .venv>    (say, a `git worktree` of main)

BENCH_RATES (200), BENCH_ROUNDS (8), BENCH_STEP_SECONDS (5); each service in its default
process model for this machine. Both checkouts must take the same load (the single-event
route) and migrate their own database (`queuekeeper migrate`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import uvloop

from bench._support import _admin, bench_database, free_port, remove_broker_objects
from bench.publish import TOKEN, Service
from bench.single import (
    Consumer,
    Pipeline,
    Step,
    _sessions,
    event_pipeline,
    run_step,
    start_rawpipe,
)
from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings

RATES = [int(r) for r in os.environ.get("BENCH_RATES", "200").split(",")]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "8"))
STEP_SECONDS = float(os.environ.get("BENCH_STEP_SECONDS", "5"))


def _migrated(checkout: Path, url: str) -> None:
    """`url`'s database migrated by `checkout`'s own code (its schema may differ)."""
    subprocess.run(
        [str(checkout / ".venv" / "bin" / "queuekeeper"), "migrate"],
        env={**os.environ, "QUEUEKEEPER_DATABASE_URL": url},
        check=True,
        stdout=subprocess.DEVNULL,
    )


async def _service(settings: Settings, dsn: str, executable: Path | None, name: str) -> Pipeline:
    service = Service(settings, port=free_port(), executable=executable)
    await service.start()
    database = dsn.rsplit("/", 1)[1]
    pipeline = await event_pipeline(service, name, dsn, lambda: _sessions(dsn, database))
    pipeline.service = service  # type: ignore[attr-defined]
    await run_step(pipeline, 100, 2)  # warm-up: connections, prepared statements
    return pipeline


def _summary(name: str, steps: list[Step]) -> str:
    cpu = [s.cpu_ms for s in steps]
    p50 = statistics.median(s.p50 for s in steps) * 1e3
    p99 = statistics.median(s.p99 for s in steps) * 1e3
    return (
        f"  {name:9s} CPU {statistics.median(cpu):.2f} ms/event (rounds {min(cpu):.2f}-"
        f"{max(cpu):.2f}), p50 {p50:.1f} ms, p99 {p99:.1f} ms (medians of the rounds), "
        f"{sum(1 for s in steps if s.held)}/{len(steps)} steps held"
    )


async def run(this: Settings, other: Settings, checkout: Path) -> None:
    this_dsn = this.database_url.replace("postgresql+asyncpg://", "postgresql://")
    other_dsn = other.database_url.replace("postgresql+asyncpg://", "postgresql://")
    management = ManagementClient(this)
    raw_vhost, raw_queue = f"{this.instance_name}-raw", "subscription_raw_single"
    provisioner = Provisioner(management, this, uuid.uuid4())
    await provisioner.ensure_vhost(raw_vhost)
    await provisioner.ensure_queue(raw_vhost, raw_queue)
    raw_process, raw_port = await start_rawpipe(this_dsn, [(raw_vhost, raw_queue)])
    raw_consumer = Consumer()
    pipelines: list[Pipeline] = []
    try:
        await raw_consumer.start(raw_vhost, raw_queue)
        raw = Pipeline(
            "raw",
            lambda: [raw_process.pid],
            {"kind": "raw", "port": raw_port},
            raw_consumer,
            lambda: _sessions(this_dsn, this_dsn.rsplit("/", 1)[1]),
        )
        before = await _service(
            other, other_dsn, checkout / ".venv" / "bin" / "queuekeeper", "other"
        )
        pipelines.append(before)
        after = await _service(this, this_dsn, None, "this")
        pipelines.append(after)
        print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
        for rate in RATES:
            steps: dict[str, list[Step]] = {"raw": [], "other": [], "this": []}
            for round_ in range(ROUNDS):
                services = [before, after] if round_ % 2 == 0 else [after, before]
                for pipeline in [raw, *services]:
                    steps[pipeline.name].append(await run_step(pipeline, rate, STEP_SECONDS))
                print(
                    f"  {rate}/s round {round_ + 1}: "
                    + ", ".join(f"{n} {s[-1].cpu_ms:.2f}" for n, s in steps.items())
                    + " ms/event",
                    flush=True,
                )
            ratios = [
                a.cpu_ms / b.cpu_ms for a, b in zip(steps["this"], steps["other"], strict=True)
            ]
            to_raw = [a.cpu_ms / r.cpu_ms for a, r in zip(steps["this"], steps["raw"], strict=True)]
            print(f"{rate}/s, {ROUNDS} rounds of {STEP_SECONDS:g} s:")
            for name, taken in steps.items():
                print(_summary(name, taken))
            print(
                f"  this / other, paired by round: median x{statistics.median(ratios):.3f} "
                f"(rounds x{min(ratios):.3f}-x{max(ratios):.3f}; below 1 in "
                f"{sum(1 for r in ratios if r < 1)} of {len(ratios)}); this / raw median "
                f"x{statistics.median(to_raw):.2f}",
                flush=True,
            )
        print(f"uptime: {os.popen('uptime').read().strip()}")
    finally:
        for pipeline in pipelines:
            await pipeline.consumer.close()
            await pipeline.service.stop()  # type: ignore[attr-defined]
        await raw_consumer.close()
        raw_process.terminate()
        await remove_broker_objects(this)
        await remove_broker_objects(other)
        await management.aclose()


def main() -> None:
    if len(sys.argv) < 2 or not (Path(sys.argv[1]) / ".venv" / "bin" / "queuekeeper").exists():
        sys.exit("usage: python -m bench._paired <a checkout with its .venv (make install)>")
    checkout = Path(sys.argv[1]).resolve()
    name = f"qk_bench_{uuid.uuid4().hex[:10]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        with bench_database() as url:
            other_url = f"{url.rsplit('/', 1)[0]}/{name}"
            _migrated(checkout, other_url)
            tag = secrets.token_hex(4)
            this = Settings(database_url=url, instance_name=f"qkb-{tag}", service_tokens=[TOKEN])
            other = Settings(
                database_url=other_url, instance_name=f"qkb-{tag}-o", service_tokens=[TOKEN]
            )
            print(f"this checkout against {checkout}: rates {RATES}/s, interleaved", flush=True)
            uvloop.run(run(this, other, checkout))
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


if __name__ == "__main__":
    main()
