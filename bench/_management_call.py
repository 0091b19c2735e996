"""One Management API call: queuekeeper's client against plain `httpx.AsyncClient`, in one run.

All GET the same queue from the local broker, in alternating blocks of 200, and the CPU of
this process is read per block (`time.process_time`), so they are compared under the same
machine speed: plain `httpx.AsyncClient`, `ManagementClient` on httpx's own transport
(httpcore, as before docs/decisions/010-management-api-client.md) and `ManagementClient` as
it is (aiohttp underneath). Not part of `make bench`:

    python -m bench._management_call
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx

from queuekeeper.broker.management import ManagementClient
from queuekeeper.config import Settings

BLOCK = 200
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "10"))
COLUMNS = "name,durable,auto_delete,arguments"


async def _block(call: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """(CPU ms per call, wall ms per call) over one block."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(BLOCK):
        await call()
    return 1000 * (time.process_time() - cpu) / BLOCK, 1000 * (time.perf_counter() - wall) / BLOCK


async def main() -> None:
    settings = Settings()
    queue = f"qk-bench-call-{uuid.uuid4().hex[:8]}"
    ours = ManagementClient(settings)
    on_httpcore = ManagementClient(settings, transport=httpx.AsyncHTTPTransport(retries=1))
    plain = httpx.AsyncClient(
        auth=(settings.management_user, settings.management_password),
        timeout=httpx.Timeout(settings.management_timeout),
        transport=httpx.AsyncHTTPTransport(retries=1),
        headers={"content-type": "application/json"},
    )
    url = f"{settings.management_urls[0]}/api/queues/%2F/{queue}"

    async def through_ours() -> object:
        return await ours.get_queue("/", queue)

    async def through_httpcore() -> object:
        return await on_httpcore.get_queue("/", queue)

    async def through_plain() -> object:
        response = await plain.get(url, params={"columns": COLUMNS})
        response.raise_for_status()
        return response.json()

    try:
        await ours.put_queue("/", queue, arguments={})
        calls = {"ours": through_ours, "httpcore": through_httpcore, "plain": through_plain}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
        for call in calls.values():  # warm every connection up
            await _block(call)
        for _ in range(BLOCKS):
            for name, call in calls.items():
                results[name].append(await _block(call))
    finally:
        await ours.delete_queue("/", queue)
        await ours.aclose()
        await on_httpcore.aclose()
        await plain.aclose()
    print(f"GET one queue, {BLOCKS} blocks of {BLOCK} calls each, medians of the blocks:")
    labels = {
        "plain": "httpx.AsyncClient",
        "httpcore": "ManagementClient, httpcore",
        "ours": "ManagementClient",
    }
    for name, label in labels.items():
        cpu = statistics.median(block[0] for block in results[name])
        wall = statistics.median(block[1] for block in results[name])
        print(f"  {label:26s} CPU {cpu:.3f} ms/call, wall {wall:.3f} ms/call")


if __name__ == "__main__":
    asyncio.run(main())
