"""A server that speaks just enough of PostgreSQL's protocol to refuse a connection the way
PostgreSQL does while it starts up (57P03) or is full (53300): no real server can be made to
do that on demand."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

_SSL_REQUEST = 80877103


def at_port(database_url: str, port: int) -> str:
    """`database_url` pointed at 127.0.0.1:`port`, same database, user and driver."""
    parts = urlsplit(database_url)
    return database_url.replace(f"{parts.hostname}:{parts.port or 5432}", f"127.0.0.1:{port}")


def _error(sqlstate: str, message: str) -> bytes:
    fields = b"".join(
        code + value.encode() + b"\0"
        for code, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack("!I", len(body) + 4) + body


@asynccontextmanager
async def refusing_postgres(sqlstate: str, message: str) -> AsyncIterator[int]:
    """Its port, while it answers every connection's start-up with that error."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length = struct.unpack("!I", await reader.readexactly(4))[0]
                payload = await reader.readexactly(length - 4)
                if length == 8 and struct.unpack("!I", payload)[0] == _SSL_REQUEST:
                    writer.write(b"N")  # no TLS here; the client goes on in the clear
                    continue
                writer.write(_error(sqlstate, message))
                await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
