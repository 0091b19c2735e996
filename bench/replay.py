"""Another tenant's live latency while replays run (contract §11, decision 021).

`queuekeeper serve` on a fresh database. Tenant A: BENCH_REPLAY_QUEUES (20) order queues of
one offering, each holding BENCH_REPLAY_WINDOW (2,000) published events in a window (then
purged, as an agent would have read them). Tenant B: one order queue of another offering,
read by an aio-pika consumer, and events posted to it one at a time at BENCH_REPLAY_RATE
(50/s); each event's publish-to-receive latency is measured from just before its POST to
its arrival at B's consumer.

Phases of BENCH_REPLAY_SECONDS (10) each, B's traffic throughout:
- baseline: no replay;
- one queue: BENCH_REPLAYS (20) concurrent replays of A's first queue, the whole window
  (the probe's case: one token replaying again and again);
- every queue: one replay of each of A's queues at once (the ceiling of replays together).

Printed per phase: B's p50/p90/p99 latency and its ratio to the baseline's, the replays
accepted (202) and refused (409), the replayed copies written. What the service is run
from is whatever `queuekeeper` imports (PYTHONPATH selects another tree's `src` to
measure the code before a change the same way).

    .venv/bin/python -m bench replay
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import aio_pika

from bench._support import fmt_ms, free_port, on_a_bench_database, percentiles
from bench.publish import Service
from queuekeeper.config import Settings

QUEUES = int(os.environ.get("BENCH_REPLAY_QUEUES", "20"))
WINDOW = int(os.environ.get("BENCH_REPLAY_WINDOW", "2000"))
REPLAYS = int(os.environ.get("BENCH_REPLAYS", "20"))
RATE = float(os.environ.get("BENCH_REPLAY_RATE", "50"))
SECONDS = float(os.environ.get("BENCH_REPLAY_SECONDS", "10"))
AMQP = "amqp://guest:guest@127.0.0.1:5672/"


def _event(offering: uuid.UUID, event_id: str) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "offering_uuid": offering.hex,
        "object_type": "order",
        "payload": {"order_uuid": uuid.uuid4().hex},
    }


async def _fill_window(service: Service, offering: uuid.UUID) -> str:
    """WINDOW events to A's offering, published; returns the window's start."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 1))
    for start in range(0, WINDOW, 500):
        batch = [_event(offering, f"a-{n}") for n in range(start, min(start + 500, WINDOW))]
        await service.call("POST", "/api/internal/events/batch/", json={"events": batch})
    await service.drained()
    return since


async def _purge(vhost: str, queue: str) -> None:
    connection = await aio_pika.connect(AMQP.rstrip("/") + "/" + vhost)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        await declared.purge()


async def _replay(service: Service, vhost: str, queue: str, since: str) -> int:
    response = await service.http.post(
        "/api/admin/queues/replay/", json={"since": since, "vhost": vhost, "queue_name": queue}
    )
    return response.status_code


async def _phase(
    service: Service,
    b_offering: uuid.UUID,
    b_queue: tuple[str, str],
    label: str,
    replays: list[tuple[str, str]],
    since: str,
) -> list[float]:
    vhost, queue = b_queue
    sent: dict[str, float] = {}
    latencies: list[float] = []
    connection = await aio_pika.connect(AMQP.rstrip("/") + "/" + vhost)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        declared = await channel.declare_queue(queue, passive=True)

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            at = time.perf_counter()
            started = sent.get(str(message.message_id))
            if started is not None:
                latencies.append(at - started)
            await message.ack()

        await declared.consume(take)
        replaying = asyncio.gather(*(_replay(service, v, q, since) for v, q in replays))
        began = time.perf_counter()
        n = 0
        while time.perf_counter() - began < SECONDS:
            event_id = f"b-{label.replace(' ', '-')}-{n}"
            sent[event_id] = time.perf_counter()
            answer = await service.http.post(
                "/api/internal/events/", json=_event(b_offering, event_id)
            )
            if answer.status_code >= 400:
                raise RuntimeError(f"B's event refused: {answer.status_code} {answer.text[:300]}")
            n += 1
            await asyncio.sleep(max(0.0, began + n / RATE - time.perf_counter()))
        codes = await replaying
        deadline = time.perf_counter() + 30
        while len(latencies) < n and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
    accepted, refused = codes.count(202), codes.count(409)
    pending = (await service.call("GET", "/api/admin/outbox/")).json().get("pending")
    waited = time.perf_counter()
    await service.drained()
    print(
        f"{label:>11}: B received {len(latencies)}/{n}, latency {fmt_ms(percentiles(latencies))}"
        f"; replays 202 x{accepted}, 409 x{refused}, other x{len(codes) - accepted - refused}"
        f"; outbox pending {pending} at the phase's end, drained "
        f"{time.perf_counter() - waited:.1f} s later",
        flush=True,
    )
    return latencies


async def run(settings: Settings) -> None:
    service = Service(settings, free_port())
    await service.start()
    try:
        a_offering, b_offering = uuid.uuid4(), uuid.uuid4()
        for offering in (a_offering, b_offering):
            await service.call("PUT", f"/api/internal/offerings/{offering}/", json={"name": "b"})
        a_queues = await service.queues(a_offering, QUEUES)
        [b_queue] = await service.queues(b_offering, 1)
        since = await _fill_window(service, a_offering)
        for vhost, queue in a_queues:
            await _purge(vhost, queue)
        print(f"tenant A: {QUEUES} queues x {WINDOW} events in the window; B at {RATE:g}/s")
        base = await _phase(service, b_offering, b_queue, "baseline", [], since)
        one = await _phase(
            service, b_offering, b_queue, "one queue", [a_queues[0]] * REPLAYS, since
        )
        await service.drained()
        every = await _phase(service, b_offering, b_queue, "every queue", a_queues, since)
        reference = percentiles(base)
        for label, samples in (("one queue", one), ("every queue", every)):
            found = percentiles(samples)
            ratios = ", ".join(
                f"{key} x{found[key] / reference[key]:.1f}" for key in ("p50", "p90", "p99")
            )
            print(f"{label} against the baseline: {ratios}")
    finally:
        await service.stop()


def main() -> None:
    on_a_bench_database(run)


if __name__ == "__main__":
    main()
