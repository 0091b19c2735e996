"""uvicorn's httptools protocol, with an answer's head and body leaving in one write.

uvicorn writes a response's status line and headers when the app sends
`http.response.start` and its body when it sends `http.response.body`: two `send` system
calls per answer, each of which, on loopback or a LAN, also runs the peer's receive path
and an acknowledgement. A single event's answer is small and sent in one turn of the event
loop, so the writes of one turn are joined and leave together at the end of that turn
(one `call_soon` instead of a system call). Order is kept: a close flushes what is pending
first, and nothing is written around the joined bytes. Everything else is uvicorn's own
(docs/decisions/035-one-write-per-answer.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _JoinedWrites:
    """A transport whose writes within one turn of the event loop are one write."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._pending is None:
            self._pending = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(bytes(data))

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # is_closing, pause_reading, resume_reading, get_extra_info, set_protocol, abort:
        # the transport's own.
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """`uvicorn.Config(http=...)`: the answers of this connection leave in one write each."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # FlowControl keeps the real transport (pausing reads is immediate); the request
        # cycles write through the joining one.
        self.transport = _JoinedWrites(transport, self.loop)  # type: ignore[assignment]
