"""The long-lived processes' entry code: an accept worker and a relay process.

`serve`'s supervisor (supervisor.py) starts each child as
`python -m queuekeeper.workers accept <fd> <supervisor pid>` or `... relay`; the CLI's
`serve` (one process) and `relay` commands use the same pieces. Beside the composition
root (app.py), which it loads; nothing but the CLI imports it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any

from queuekeeper.config import Settings, get_settings
from queuekeeper.logging import configure_logging


def freeze_startup_objects() -> None:
    """Modules, classes and schemas live as long as the process: keep them out of the
    garbage collector's way (a full collection took 130 ms under load, 7 ms frozen)."""
    import gc

    import queuekeeper.app  # noqa: F401 - load everything the service will use

    gc.collect()
    gc.freeze()


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options, the same in `serve`'s one process and in each accept worker."""
    return {
        "factory": True,
        "log_config": None,
        # queuekeeper logs each request itself, with its request id.
        "access_log": False,
        # The app itself believes X-Forwarded-For only from QUEUEKEEPER_FORWARDED_ALLOW_IPS
        # (uvicorn's own default would trust any loopback peer).
        "proxy_headers": False,
        # uvicorn's 5 s is httpx's own idle limit: the two raced (decision 037).
        "timeout_keep_alive": settings.http_keep_alive_seconds,
    }


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a long-lived process's loop on uvloop, as uvicorn runs the accept workers' (the
    relay's CPU per event is a third lower than on asyncio's loop), or asyncio's where
    uvloop is not installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        asyncio.run(main)
        return
    uvloop.run(main)


def run_relay(settings: Settings) -> None:
    """The outbox relay alone (no HTTP) until SIGINT or SIGTERM."""
    from queuekeeper.app import running

    freeze_startup_objects()

    async def run() -> None:
        async with running(settings, relay=True) as state:
            relay = state.relay
            assert relay is not None  # started by running(relay=True)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, relay.request_stop)
            print(f"relay {relay.id} running; Ctrl-C stops it", file=sys.stderr)
            await relay.wait_stopped()

    run_loop(run())


def relay_process() -> None:
    """A relay process of the supervisor's: as `queuekeeper relay`."""
    from queuekeeper.preflight import DatabaseNotReady, check_database, head_revision

    settings = get_settings()
    configure_logging(settings)
    try:
        asyncio.run(check_database(settings, head_revision()))
    except DatabaseNotReady as exc:  # unreachable too: the supervisor starts it again later
        sys.exit(f"error: {exc}")
    run_relay(settings)


def accept_worker(fd: int, supervisor: int) -> None:
    """An accept worker: uvicorn on the socket the supervisor bound."""
    import uvicorn

    settings = get_settings()
    configure_logging(settings)
    # The supervisor died before prctl took effect. Compared with its pid, not with 1: in
    # a container the supervisor may be pid 1 itself.
    if os.getppid() != supervisor:
        sys.exit(1)
    sock = socket.socket(fileno=fd)
    freeze_startup_objects()
    config = uvicorn.Config(
        "queuekeeper.app:serve_app", **server_options(settings), timeout_graceful_shutdown=5
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    if sys.argv[1:2] == ["accept"] and len(sys.argv) == 4:
        accept_worker(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1:] == ["relay"]:
        relay_process()
    else:
        sys.exit("usage: python -m queuekeeper.workers accept <fd> <supervisor pid> | relay")
