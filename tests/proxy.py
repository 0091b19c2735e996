"""A TCP proxy the test controls, to cut queuekeeper off from RabbitMQ without touching it.

`close()` stops listening and severs every open connection (the AMQP port looks
down to queuekeeper); `open()` listens again on the same port. With
`blackhole=True` it accepts connections and never forwards a byte (a broker
that hangs); with `delay` every chunk from the broker arrives that much later
(a distant broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TcpProxy:
    def __init__(
        self,
        target_port: int = 5672,
        *,
        port: int | None = None,
        blackhole: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = port or free_port()
        self.blackhole = blackhole
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def amqp_url(self, user: str = "guest", password: str = "guest") -> str:
        return f"amqp://{user}:{password}@127.0.0.1:{self.port}/"

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )

    async def close(self) -> None:
        """Refuse new connections and cut the open ones."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.sever()

    def sever(self) -> None:
        """Cut every open connection (keeps listening if open)."""
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        if self.blackhole:
            with contextlib.suppress(Exception):
                await reader.read()  # hold the connection, answer nothing
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        for source, sink, delay in ((reader, up_writer, 0.0), (up_reader, writer, self.delay)):
            task = asyncio.create_task(self._pipe(source, sink, delay))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await source.read(65536):
                if delay:
                    await asyncio.sleep(delay)
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()
