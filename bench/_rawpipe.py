"""The raw pipeline the single-event benchmark compares queuekeeper with.

Per event, what queuekeeper's guarantees need and nothing else: an asyncpg
INSERT + COMMIT of the event, then an aio-pika publish (persistent, confirmed,
mandatory) to each queue it is given (all at once, one connection per vhost: the
fan-out bench gives it 100), then the answer. It runs as a process of its own (so its
CPU can be read from /proc like the service's), reading `<n>\\n` lines on a TCP socket
and answering `<n>\\n` once that event is committed and every copy confirmed; each line
is handled concurrently, as a server would handle requests.

With `--http` first, the same work sits behind the HTTP server `queuekeeper serve` runs on
(uvicorn, httptools, uvloop, no access log) and a bare ASGI app: the request's JSON body is
parsed, its `event_id` stored with the body and published as above, and the answer is a
202 with `{"event_id": ...}`. No authentication, validation, routing or middleware: what
an HTTP service doing the raw pipeline's work cannot do without, so the service's CPU above
it is what its own layers and guarantees cost (docs/benchmarks.md).

    python -m bench._rawpipe [--http] <port> <dsn> <amqp url> <queue> [<amqp url> <queue> ...]
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aio_pika
import asyncpg
import uvicorn
import uvloop

BODY = b"x" * 1024


async def serve(port: int, dsn: str, targets: list[tuple[str, str]], http: bool = False) -> None:
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

    async def publish(event_id: str, url: str, queue: str, body: bytes = BODY) -> None:
        await channels[url].default_exchange.publish(
            aio_pika.Message(
                body,
                message_id=event_id,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=queue,
            mandatory=True,
        )

    async def stored_and_published(event_id: str, body: bytes = BODY) -> None:
        async with pool.acquire() as connection, connection.transaction():
            await connection.execute(
                "INSERT INTO raw_events (event_id, body, accepted) VALUES ($1, $2, now())",
                event_id,
                body,
            )
        if len(targets) == 1:  # the single-event baseline: no task per copy
            await publish(event_id, *targets[0], body)
        else:
            await asyncio.gather(*(publish(event_id, url, queue, body) for url, queue in targets))

    async def one(event_id: str, writer: asyncio.StreamWriter) -> None:
        await stored_and_published(event_id)
        writer.write(f"{event_id}\n".encode())

    if http:
        await _serve_http(port, stored_and_published)
        return

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


async def _serve_http(port: int, work: Any) -> None:
    async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        event_id = json.loads(body)["event_id"]
        await work(event_id, body)
        answer = json.dumps({"event_id": event_id}).encode()
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    config = uvicorn.Config(
        bare_app,
        host="127.0.0.1",
        port=port,
        loop="none",  # already on uvloop (below)
        http="httptools",
        lifespan="off",
        access_log=False,
        proxy_headers=False,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            await serving
            raise RuntimeError("the raw HTTP pipeline did not start")
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    await serving


if __name__ == "__main__":
    # uvloop, as `queuekeeper serve` runs on: the baseline pays no more for its loop.
    args = sys.argv[1:]
    http = args[:1] == ["--http"]
    args = args[1:] if http else args
    pairs = args[2:]
    uvloop.run(serve(int(args[0]), args[1], list(zip(pairs[::2], pairs[1::2], strict=True)), http))
