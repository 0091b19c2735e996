"""The open-loop load generator of `bench single`: a process of its own.

It shares neither an event loop nor a GIL with what it measures, nor with the consumer
(in the bench's main process), so its own cost cannot hold the pipeline back or be read
as the pipeline's latency. Send times are fixed before the run: event n is due at
`start + n / rate` (wall clock, so the consumer in another process can compare), and a
late wake-up sends every event already due at once instead of pushing the rest of the
schedule back (no sleep-paced drift).

Two targets, each with the cheapest client that does the work:

  raw   the line protocol of `bench/_rawpipe.py`: one connection, ids written as they
        fall due, the answers read as they come (the pipeline handles lines concurrently);
  http  `POST <path>` over `connections` kept-alive HTTP/1.1 connections written on raw
        asyncio streams (no HTTP library: httpx costs more per request than the accept
        itself); a due event waits for a free connection, as a backend's would.

With several generator processes (`index` of `of`), each sends the events n with
n % of == index, so together they keep the one schedule.

    python -m bench._loadgen '<json spec>'   ->  one JSON line on stdout

Spec: kind, port, rate, seconds, start (epoch seconds), prefix, index, of; http also
connections, path, token, body (a JSON text with "__ID__" where the event id goes).
Answer: {"sent": n, "results": [[n, status, answered - due, served], ...]} where served
is the time from the request written to its answer read (the pipeline's own part).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvloop


async def _raw(spec: dict[str, Any], due: list[int], results: list[list[float]]) -> None:
    prefix, rate, start = spec["prefix"], spec["rate"], spec["start"]
    reader, writer = await asyncio.open_connection("127.0.0.1", spec["port"])
    written: dict[int, float] = {}
    pending = len(due)

    async def answers() -> None:
        nonlocal pending
        while pending and (line := await reader.readline()):
            now = time.time()
            n = int(line.rsplit(b"-", 1)[1])
            results.append([n, 202, now - (start + n / rate), now - written.pop(n, now)])
            pending -= 1

    reading = asyncio.create_task(answers())
    async for n in _schedule(spec, due):
        written[n] = time.time()
        writer.write(f"{prefix}{n}\n".encode())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reading, timeout=spec.get("drain", 15))
    writer.close()


async def _http(spec: dict[str, Any], due: list[int], results: list[list[float]]) -> None:
    prefix, rate, start = spec["prefix"], spec["rate"], spec["start"]
    head_template = (
        f"POST {spec['path']} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {spec['token']}\r\nContent-Type: application/json\r\n"
    )
    before, _, after = spec["body"].partition("__ID__")
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", spec["port"])
        try:
            while True:
                n = await queue.get()
                body = f"{before}{prefix}{n}{after}".encode()
                written = time.time()
                try:
                    writer.write(
                        f"{head_template}Content-Length: {len(body)}\r\n\r\n".encode() + body
                    )
                    head = await reader.readuntil(b"\r\n\r\n")
                    status = int(head.split(b" ", 2)[1])
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    await reader.readexactly(length)
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    status = 0  # a dropped connection counts as refused; open another
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", spec["port"])
                now = time.time()
                results.append([n, status, now - (start + n / rate), now - written])
                queue.task_done()
        finally:
            writer.close()

    workers = [asyncio.create_task(connection()) for _ in range(spec["connections"])]
    async for n in _schedule(spec, due):
        queue.put_nowait(n)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(queue.join(), timeout=spec.get("drain", 15))
    for worker in workers:
        worker.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


async def _schedule(spec: dict[str, Any], due: list[int]) -> AsyncIterator[int]:
    """The event numbers in `due`, each once its send time has come; after a late wake-up,
    every one already due at once."""
    rate, start = spec["rate"], spec["start"]
    index = 0
    while index < len(due):
        now = time.time()
        while index < len(due) and start + due[index] / rate <= now:
            yield due[index]
            index += 1
        if index < len(due):
            await asyncio.sleep(max(0.0, start + due[index] / rate - time.time()))


async def main(spec: dict[str, Any]) -> None:
    count = int(spec["rate"] * spec["seconds"])
    due = list(range(spec.get("index", 0), count, spec.get("of", 1)))
    results: list[list[float]] = []
    await (_raw if spec["kind"] == "raw" else _http)(spec, due, results)
    sys.stdout.write(json.dumps({"sent": len(due), "results": results}) + "\n")


if __name__ == "__main__":
    uvloop.run(main(json.loads(sys.argv[1])))
