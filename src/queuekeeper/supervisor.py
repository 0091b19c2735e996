"""`queuekeeper serve`: accept workers and relay processes, supervised.

One event loop cannot spread an accept's HTTP, its store and the relay's publishing over
several cores (docs/decisions/016-process-model.md). So `serve` binds the port once and
starts `accept_workers` processes that all accept on that one socket (inherited, so the
kernel hands each connection to whichever worker takes it), and `relay_processes`
`queuekeeper relay` processes that take the outbox's work through LISTEN/NOTIFY and
leases (docs/decisions/007-notify-wakeups.md). This process only supervises: it restarts
a child that dies, and on SIGTERM or SIGINT stops them all within `stop_seconds`.

What it knows is written to the status file of the directory the children share
(common/processes.py), which `/readyz` of whichever worker answers reads, so a probe covers
every process; `/metrics` sums the children's metric files there. The children's entry
code is workers.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from queuekeeper.common.processes import MULTIPROC_ENV, remove_status, write_status
from queuekeeper.config import Settings

log = structlog.get_logger(__name__)

# A child that dies sooner than this after its start is restarted after a growing delay
# (1 s doubling up to RESTART_MAX), so one that cannot start does not spin.
STABLE_SECONDS = 10.0
RESTART_MAX = 30.0
PR_SET_PDEATHSIG = 1


def cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's)."""
    return len(os.sched_getaffinity(0)) or 1


# Up to this many cores the default is one process with the relay inside: there a relay
# process apart costs more CPU per event than it frees (1.36 ms per event at 200/s with the
# relay inside, 1.66-1.84 ms with one apart; docs/decisions/016-process-model.md).
RELAY_INSIDE_UP_TO_CORES = 2


def default_counts(available: int) -> tuple[int, int]:
    """(accept workers, relay processes) when the settings name neither, for `available`
    cores: one accept process with the relay inside on `RELAY_INSIDE_UP_TO_CORES` or
    fewer; beyond, half the cores accept workers and a quarter relay processes, at least
    one of each."""
    if available <= RELAY_INSIDE_UP_TO_CORES:
        return 1, 0
    return max(1, available // 2), max(1, available // 4)


def process_counts(settings: Settings, workers: int | None = None) -> tuple[int, int]:
    """(accept workers, relay processes): `--workers` and the settings, else
    `default_counts` of the cores available."""
    accept, relays = default_counts(cores())
    accept = workers or settings.accept_workers or accept
    if settings.relay_processes is not None:
        relays = settings.relay_processes
    elif not settings.relay_enabled:
        relays = 0
    return accept, relays


@dataclass
class Child:
    role: str  # "accept" or "relay"
    index: int
    command: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    delay: float = 0.5  # doubled at each quick death: 1 s, 2 s, ... RESTART_MAX
    restart_at: float | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def start(self) -> None:
        # Our own executable and arguments, never input from outside.
        self.process = subprocess.Popen(  # noqa: S603
            self.command, env=self.env, pass_fds=self.pass_fds, preexec_fn=_die_with_parent
        )
        self.started = time.monotonic()
        self.restart_at = None
        log.info("process_started", process=self.name, pid=self.process.pid)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (even by kill -9), so no
    worker is left holding the port."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class Supervisor:
    host: str
    port: int
    accept_workers: int
    relay_processes: int
    metrics_dir: Path
    stop_seconds: float = 10.0
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    def plan(self, sock: socket.socket) -> None:
        # This interpreter, not a `queuekeeper` script that may live elsewhere on PATH.
        module = [sys.executable, "-m", "queuekeeper.workers"]
        base = {**os.environ, MULTIPROC_ENV: str(self.metrics_dir)}
        for index in range(self.accept_workers):
            env = dict(base)
            if self.relay_processes:
                env["QUEUEKEEPER_RELAY_ENABLED"] = "false"
            if index > 0:
                # The jobs run in one process (the job locks would keep one run at a time
                # anyway; this saves the others the attempt).
                env["QUEUEKEEPER_SCHEDULER_ENABLED"] = "false"
            command = [*module, "accept", str(sock.fileno()), str(os.getpid())]
            self.children.append(Child("accept", index, command, env, (sock.fileno(),)))
        for index in range(self.relay_processes):
            env = {**base, "QUEUEKEEPER_SCHEDULER_ENABLED": "false"}
            self.children.append(Child("relay", index, [*module, "relay"], env))

    def run(self) -> int:
        sock = bind(self.host, self.port)
        self.plan(sock)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        log.info(
            "supervisor_started",
            pid=os.getpid(),
            accept_workers=self.accept_workers,
            relay_processes=self.relay_processes,
            port=sock.getsockname()[1],
        )
        for child in self.children:
            child.start()
        self.write_status()
        while not self.stopping:
            self.watch()
            time.sleep(0.2)
        sock.close()
        self.stop()
        return 0

    def _request_stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def watch(self) -> None:
        """Restart what died (after its delay); write the status when anything changed."""
        changed = False
        now = time.monotonic()
        for child in self.children:
            process = child.process
            if process is not None and process.poll() is not None:
                lived = now - child.started
                child.delay = 0.5 if lived > STABLE_SECONDS else min(child.delay * 2, RESTART_MAX)
                child.restart_at = now + (0.0 if lived > STABLE_SECONDS else child.delay)
                log.warning(
                    "process_died",
                    process=child.name,
                    pid=process.pid,
                    returncode=process.returncode,
                    restart_in=round(child.restart_at - now, 1),
                )
                _mark_dead(process.pid)
                child.process = None
                changed = True
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                child.start()
                changed = True
        if changed:
            self.write_status()

    def stop(self) -> None:
        """SIGTERM to every child; SIGKILL to what is still running after stop_seconds."""
        running = [c.process for c in self.children if c.process is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_seconds
        for process in running:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process_killed", pid=process.pid, after_seconds=self.stop_seconds)
                process.kill()
                process.wait()
            _mark_dead(process.pid)
        remove_status(self.metrics_dir)
        log.info("supervisor_stopped")

    def write_status(self) -> None:
        processes = [
            {
                "name": child.name,
                "role": child.role,
                "pid": child.process.pid if child.process is not None else None,
                "restarts": child.restarts,
            }
            for child in self.children
        ]
        write_status(self.metrics_dir, os.getpid(), processes)


def _mark_dead(pid: int) -> None:
    """Drop a dead child's live gauges from /metrics (its counters stay in the totals)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
