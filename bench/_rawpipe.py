"""The raw pipeline the single-event benchmark compares queuekeeper with.

Per event, what queuekeeper's guarantees need and nothing else: an asyncpg
INSERT + COMMIT of the event, then an aio-pika publish (persistent, confirmed,
mandatory) to each queue it is given (all at once, one connection per vhost: the
fan-out bench gives it 100), then the answer. It runs as a process of its own (so its
CPU can be read from /proc like the service's), reading `<n>\\n` lines on a TCP socket
and answering `<n>\\n` once that event is committed and every copy confirmed; each line
is handled concurrently, as a server would handle requests.

    python -m bench._rawpipe <port> <postgres dsn> <amqp url> <queue> [<amqp url> <queue> ...]
"""

from __future__ import annotations

import asyncio
import sys

import aio_pika
import asyncpg
import uvloop

BODY = b"x" * 1024


async def serve(port: int, dsn: str, targets: list[tuple[str, str]]) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=16, max_size=16)
    async with pool.acquire() as connection:
        await connection.execute(
            "CREATE TABLE IF NOT EXISTS raw_events "
            "(id bigserial PRIMARY KEY, event_id text UNIQUE, body bytea, accepted timestamptz)"
        )
    channels: dict[str, aio_pika.abc.AbstractChannel] = {}
    for url in dict.fromkeys(url for url, _ in targets):
        amqp = await aio_pika.connect(url)
        channels[url] = await amqp.channel(publisher_confirms=True, on_return_raises=True)

    async def publish(event_id: str, url: str, queue: str) -> None:
        await channels[url].default_exchange.publish(
            aio_pika.Message(
                BODY,
                message_id=event_id,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=queue,
            mandatory=True,
        )

    async def one(event_id: str, writer: asyncio.StreamWriter) -> None:
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute(
                "INSERT INTO raw_events (event_id, body, accepted) VALUES ($1, $2, now())",
                event_id,
                BODY,
            )
        if len(targets) == 1:  # the single-event baseline: no task per copy
            await publish(event_id, *targets[0])
        else:
            await asyncio.gather(*(publish(event_id, url, queue) for url, queue in targets))
        writer.write(f"{event_id}\n".encode())

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.create_task(one(line.decode().strip(), writer))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    # uvloop, as `queuekeeper serve` runs on: the baseline pays no more for its loop.
    pairs = sys.argv[3:]
    uvloop.run(
        serve(int(sys.argv[1]), sys.argv[2], list(zip(pairs[::2], pairs[1::2], strict=True)))
    )
