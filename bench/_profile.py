"""Where the CPU went, from a py-spy raw (collapsed stacks) file: share of samples by layer.

By library (the default): each sample is charged to the innermost frame that belongs to a
known layer, so time inside asyncpg called by SQLAlchemy counts as asyncpg, and
SQLAlchemy's own work as SQLAlchemy.

By stage of a single event's way through the service (`--stages`, optionally with the CPU
per event the run measured, `--ms 1.4`, to print each stage's share of it in ms): each
sample is charged to the innermost frame that marks a stage (`STAGES`), so the store's
statement called from the intake counts as the store, and the intake's own work as the
intake. A sample with no frame below the event loop's own is the loop: its polling,
its callbacks and timers, and (py-spy cannot see into C) the socket system calls uvloop
makes for the protocols it serves. Recorded with `--native` (BENCH_PROFILE_NATIVE=1) the
system calls show by name.

    python -m bench._profile /tmp/prof/single.txt
    python -m bench._profile --stages --ms 1.4 /tmp/prof/single-1x0.txt
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# (layer, substrings of a frame's file path), first match from the innermost frame wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("logging (structlog, stdlib)", ("structlog/", "/logging/", "queuekeeper/logging")),
    ("JSON", ("/json/",)),
    ("asyncpg", ("asyncpg/",)),
    ("SQLAlchemy", ("sqlalchemy/",)),
    ("aio-pika / aiormq / pamqp", ("aio_pika/", "aiormq/", "pamqp/")),
    ("pydantic", ("pydantic",)),
    ("uvicorn / h11 / httptools", ("uvicorn/", "h11/", "httptools/")),
    ("FastAPI / Starlette", ("fastapi/", "starlette/")),
    ("prometheus", ("prometheus_client/",)),
    ("queuekeeper relay", ("queuekeeper/events/relay", "queuekeeper/events/outbox")),
    ("queuekeeper accept", ("queuekeeper/events/",)),
    ("queuekeeper other", ("queuekeeper/",)),
    ("event loop, greenlet", ("asyncio/", "greenlet", "selectors")),
]


# (stage, substrings of a frame), the innermost frame matching any wins; the order only
# breaks a tie within one frame.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("HTTP: parse and answer (uvicorn, httptools)", ("httptools_impl", "h11_impl")),
    (
        "HTTP: middleware (request id, access line, metrics, guard, telemetry)",
        (
            "ObservabilityMiddleware",
            "RequestGuard",
            "ProxyHeadersMiddleware",
            "AppBodyLimitMiddleware",
            "NativeTelemetry",
            "PathPrefixMiddleware",
            "prometheus_client/",
            "structlog/",
            "request_id_from",
        ),
    ),
    # `bare_app`: the raw HTTP pipeline's whole app (bench/_rawpipe.py).
    (
        "HTTP: routing (Starlette, FastAPI, lean path)",
        ("starlette/", "fastapi/", "lean.py", "bare_app"),
    ),
    (
        "validation (JSON, pydantic, payload rules)",
        ("lean.parsed", "model_validate", "/json/", "validate_payloads", "unstorable_body"),
    ),
    ("answer encoding", ("_answer (", "model_dump_json")),
    ("events service (plan, bodies)", ("queuekeeper/events/service.py",)),
    ("intake: batching, futures, task", ("Intake.",)),
    # `stored_and_published`: the raw pipelines' insert (their publish is aio-pika's, below).
    (
        "store: recipients + one insert",
        ("Outbox.store", "StoreUnit", "_Store.", "stored_and_published"),
    ),
    ("hand-off to the relay", ("Relay.hand_over",)),
    ("gate: judged as it leaves", ("Relay.judged_now", "Outbox.access", "ParkingGate")),
    ("publish (aio-pika, framing)", ("AmqpPublisher", "Relay._publish_vhost", "aio_pika/")),
    ("settle: published_at", ("Relay._write_confirmed", "Relay._settle", "Outbox.settle")),
    ("relay: dispatch, claim loop, batch task", ("Relay.",)),
    (
        "timers and background jobs (scheduler, releaser, webhooks, presence, gauges)",
        (
            "JobScheduler",
            "run_coroutine_job",
            "Releaser",
            "WebhookDispatcher",
            "Presence",
            "refresh_",
            "apscheduler/",
            "_housekeeping",
        ),
    ),
    ("logging", ("/logging/", "queuekeeper/logging")),
]
# Libraries whose work is charged to the stage that called them; only a sample no stage
# frame calls (a task of their own) is charged to them.
LIBRARIES: list[tuple[str, tuple[str, ...]]] = [
    ("broker I/O: frames in and out, confirms (aiormq's reader and writer)", ("aiormq/", "pamqp/")),
    ("database driver (asyncpg), no caller seen", ("asyncpg/",)),
    (
        "pool checkout and return (SQLAlchemy, in its greenlets: no caller seen)",
        ("sqlalchemy/", "checked_out", "greenlet"),
    ),
]
LOOP = "event loop: polling, callbacks, socket system calls (uvloop)"


def stage_of(frames: list[str]) -> str:
    for table in (STAGES, LIBRARIES):
        for frame in reversed(frames):
            for name, keys in table:
                if any(key in frame for key in keys):
                    return name
    if any(frame.startswith(("Runner.run", "run_forever", "Loop__run")) for frame in frames):
        return LOOP
    return "other"


def samples(path: Path) -> Iterator[tuple[list[str], int, bool]]:
    """Each folded stack of a py-spy recording: its frames, its sample count, and whether
    it was idle (waiting in select)."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        yield frames, int(count), "idle" in frames[-1] or "select (selectors" in frames[-1]


def stages(path: Path) -> Counter[str]:
    shares: Counter[str] = Counter()
    for frames, count, idle in samples(path):
        if not idle:
            shares[stage_of(frames)] += count
    return shares


def summarize(path: Path) -> Counter[str]:
    shares: Counter[str] = Counter()
    for frames, count, idle in samples(path):
        layer = "other"
        for frame in reversed(frames):
            found = next((name for name, keys in LAYERS if any(k in frame for k in keys)), None)
            if found:
                layer = found
                break
        if idle:
            layer = "idle (waiting in select)"
        shares[layer] += count
    return shares


def main() -> None:
    args = sys.argv[1:]
    by_stage = "--stages" in args
    ms = float(args[args.index("--ms") + 1]) if "--ms" in args else None
    names = [a for i, a in enumerate(args) if not a.startswith("--") and args[i - 1] != "--ms"]
    if by_stage:
        for name in names:
            shares = stages(Path(name))
            busy = sum(shares.values())
            print(f"{name}: {busy} busy samples")
            for stage, n in shares.most_common():
                cost = f" {n / busy * ms:5.3f} ms/event" if ms is not None else ""
                print(f"  {stage:78s} {n / busy:6.1%}{cost}")
        return
    for name in names:
        shares = summarize(Path(name))
        busy = sum(n for layer, n in shares.items() if not layer.startswith("idle"))
        print(f"{name}: {busy} busy samples")
        for layer, n in shares.most_common():
            if not layer.startswith("idle"):
                print(f"  {layer:30s} {n / busy:6.1%}")


if __name__ == "__main__":
    main()
