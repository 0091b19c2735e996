"""Where the CPU went, from a py-spy raw (collapsed stacks) file: share of samples by layer.

Each sample is charged to the innermost frame that belongs to a known layer, so
time inside asyncpg called by SQLAlchemy counts as asyncpg, and SQLAlchemy's own
work as SQLAlchemy.

    python -m bench._profile /tmp/prof/single.txt
"""

from __future__ import annotations

import sys
from collections import Counter
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


def summarize(path: Path) -> Counter[str]:
    shares: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        layer = "other"
        for frame in reversed(frames):
            found = next((name for name, keys in LAYERS if any(k in frame for k in keys)), None)
            if found:
                layer = found
                break
        if "idle" in frames[-1] or "select (selectors" in frames[-1]:
            layer = "idle (waiting in select)"
        shares[layer] += int(count)
    return shares


def main() -> None:
    for name in sys.argv[1:]:
        shares = summarize(Path(name))
        busy = sum(n for layer, n in shares.items() if not layer.startswith("idle"))
        print(f"{name}: {busy} busy samples")
        for layer, n in shares.most_common():
            if not layer.startswith("idle"):
                print(f"  {layer:30s} {n / busy:6.1%}")


if __name__ == "__main__":
    main()
