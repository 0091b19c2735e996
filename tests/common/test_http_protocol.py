"""The HTTP protocol `serve` runs: each answer leaves in one write, and every kind of answer
still arrives whole (a real uvicorn server on loopback, a raw socket client)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from queuekeeper.common.http_protocol import OneWriteHttpToolsProtocol

# Every write that reached the socket's transport, in order, across the server's connections.
WRITES: list[bytes] = []


class _Recorded:
    """The socket's transport, its writes recorded: what the kernel is asked to send."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _RecordedProtocol(OneWriteHttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Recorded(transport))  # type: ignore[arg-type]


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/stream":  # a body in parts sent across turns of the loop
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one,", b"two,", b"three"):
            await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b'{"queued": 1}'
    await send(
        {
            "type": "http.response.start",
            "status": 202,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        _app, http=_RecordedProtocol, lifespan="off", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    WRITES.clear()
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def _exchange(port: int, request: bytes, until: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        received = b""
        while until not in received:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            if not chunk:
                break
            received += chunk
        return received
    finally:
        writer.close()


async def test_an_answer_leaves_in_one_write_head_and_body_together(port: int) -> None:
    request = b"POST /api/internal/events/ HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    answer = await _exchange(port, request, b'{"queued": 1}')
    assert answer.startswith(b"HTTP/1.1 202 Accepted\r\n")
    assert answer.endswith(b'\r\n\r\n{"queued": 1}')
    assert WRITES == [answer]  # one write: the head and the body in it


async def test_keep_alive_answers_each_in_one_write_in_order(port: int) -> None:
    one = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for n in range(3):
            writer.write(one)
            received = b""
            while not received.endswith(b'{"queued": 1}'):
                received += await asyncio.wait_for(reader.read(65536), 5)
            assert received.startswith(b"HTTP/1.1 202")
            assert len(WRITES) == n + 1
    finally:
        writer.close()


async def test_head_and_no_content_answers_are_not_held_back(port: int) -> None:
    """Answers with no body write only a head: it leaves at the end of the turn."""
    head = await _exchange(port, b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 202") and head.endswith(b"\r\n\r\n")
    empty = await _exchange(port, b"GET /empty HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
    assert empty.startswith(b"HTTP/1.1 204")


async def test_a_body_sent_in_parts_arrives_whole_and_in_order(port: int) -> None:
    answer = await _exchange(port, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in answer
    assert answer.split(b"\r\n\r\n", 1)[1] == b"4\r\none,\r\n4\r\ntwo,\r\n5\r\nthree\r\n0\r\n\r\n"
    # The head alone (the app sleeps before its first part), each part in its turn, the
    # last part and the end together: four writes, in the order sent.
    assert len(WRITES) == 4
    assert b"".join(WRITES) == answer


async def test_a_closing_answer_is_flushed_before_the_close(port: int) -> None:
    request = b"GET /a HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    answer = await _exchange(port, request, b"\x00never")  # read until the server closes
    assert answer.startswith(b"HTTP/1.1 202") and answer.endswith(b'{"queued": 1}')
    assert b"connection: close" in answer
