"""The one TCP fault proxy of the suite: put it between queuekeeper and a real service to
make outages without touching the shared PostgreSQL or RabbitMQ.

`stop()` refuses new connections and cuts the open ones (the port looks down);
`start()` listens again on the same port; `sever()` cuts the open connections but
keeps listening. With `blackhole=True` it accepts connections and never forwards a
byte (a service that hangs); with `delay` every chunk from the service arrives that
much later (a distant one). `accepted` counts connections made through it.

It runs its own event loop in a thread, so it serves async tests and synchronous ones
(CLI commands, subprocesses) alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from tests.brokers import BROKER


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


closed_port = free_port


class TcpProxy:
    def __init__(
        self,
        target_host: str = BROKER.host,
        target_port: int = BROKER.amqp_port,
        *,
        port: int = 0,
        blackhole: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self.blackhole = blackhole
        self.delay = delay
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def amqp_url(self, vhost: str = "/") -> str:
        """An administrator's AMQP URL through this proxy."""
        return BROKER.amqp_url(vhost).replace(f":{BROKER.amqp_port}/", f":{self.port}/", 1)

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> int:
        """Listen (again, on the same port after a stop); returns the port."""
        self._call(self._start())
        return self.port

    def stop(self) -> None:
        """Refuse new connections and cut the open ones."""
        self._call(self._stop())

    def sever(self) -> None:
        """Cut every open connection; keep listening."""
        self._call(self._sever())

    def close(self) -> None:
        """Stop, and end the proxy's thread."""
        if self._loop.is_closed():
            return
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _start(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        await self._sever()

    async def _sever(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        if self.blackhole:
            with contextlib.suppress(Exception):
                await reader.read()  # hold the connection, answer nothing
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(upstream_writer)
        await asyncio.gather(
            self._pipe(reader, upstream_writer, 0.0),
            self._pipe(upstream_reader, writer, self.delay),
        )
        self._writers.difference_update((writer, upstream_writer))

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


@contextlib.contextmanager
def tcp_proxy(
    target_host: str = BROKER.host, target_port: int = BROKER.amqp_port, **options: Any
) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port, **options)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()
