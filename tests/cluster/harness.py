"""A 3-node RabbitMQ cluster on loopback, beside the machine's main broker, never touching it.

How (each point measured on this machine; docs/scaling.md, section 2, has the figures):

- the real scripts in /usr/lib/rabbitmq/bin (the /usr/sbin wrappers `su` to the rabbitmq
  user, whose HOME holds the *main* node's cookie, and write the main node's startup logs);
- everything in a fresh temp dir: our own cookie (HOME=<dir>/home), config, enabled plugins,
  an empty env file (so /etc/rabbitmq/rabbitmq-env.conf is never read), no advanced config,
  pid files, logs, crash dumps;
- nodes qkc1..3@localhost; every listener on 127.0.0.1 (AMQP 5701-5703, management
  15701-15703, STOMP 61701-61703, web-STOMP 15771-15773, distribution 25701-25703), the CLI's
  distribution ports 35701-35720 (the main node's CLI uses 35672-35682);
- a memory high watermark of its own per node (the default, 0.4 x RAM, is per node);
- teardown by `rabbitmqctl stop` of each of *our* nodes, then `kill -9` by PID of any beam we
  started that is still alive; the temp dir is removed.

Run by hand: `python -m tests.cluster.harness up` (prints the dir; `down <dir>` stops it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from queuekeeper.common.processes import alive

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
NODES = (1, 2, 3)
HOST = "127.0.0.1"


def amqp_port(i: int) -> int:
    return 5700 + i


def management_port(i: int) -> int:
    return 15700 + i


def node_name(i: int) -> str:
    return f"qkc{i}@localhost"


class ClusterError(RuntimeError):
    pass


class Cluster:
    def __init__(self, memory_watermark: str = "600MiB", root: Path | None = None) -> None:
        self.memory_watermark = memory_watermark
        self.dir = root or Path(tempfile.mkdtemp(prefix="qkc."))
        # Every beam PID this harness ever saw, so teardown can prove each one is gone.
        self.pids: set[int] = set()
        self.timings: dict[str, float] = {}

    # --- addresses ---------------------------------------------------------------------------
    def amqp_url(
        self, i: int, user: str = "guest", password: str = "guest", vhost: str = ""
    ) -> str:
        return f"amqp://{user}:{password}@{HOST}:{amqp_port(i)}/{vhost}"

    def management_url(self, i: int) -> str:
        return f"http://{HOST}:{management_port(i)}"

    # --- files and environment --------------------------------------------------------------
    def _write_files(self) -> None:
        home = self.dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16))
        cookie.chmod(0o400)
        for i in NODES:
            node = self.dir / f"n{i}"
            (node / "mnesia").mkdir(parents=True, exist_ok=True)
            (node / "log").mkdir(parents=True, exist_ok=True)
            (node / "rabbitmq-env.conf").write_text("")
            (node / "rabbitmq.conf").write_text(
                f"listeners.tcp.default = {HOST}:{amqp_port(i)}\n"
                f"distribution.listener.interface = {HOST}\n"
                f"management.tcp.ip = {HOST}\n"
                f"management.tcp.port = {management_port(i)}\n"
                f"stomp.listeners.tcp.1 = {HOST}:{61700 + i}\n"
                f"web_stomp.tcp.ip = {HOST}\n"
                f"web_stomp.tcp.port = {15770 + i}\n"
                "loopback_users.guest = true\n"
                f"vm_memory_high_watermark.absolute = {self.memory_watermark}\n"
            )
            (node / "enabled_plugins").write_text(
                "[rabbitmq_management,rabbitmq_stomp,rabbitmq_web_stomp].\n"
            )

    def env(self, i: int) -> dict[str, str]:
        node = self.dir / f"n{i}"
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RABBITMQ_", "ERL_"))
        }
        env.update(
            HOME=str(self.dir / "home"),
            RABBITMQ_NODENAME=node_name(i),
            RABBITMQ_NODE_IP_ADDRESS=HOST,
            RABBITMQ_NODE_PORT=str(amqp_port(i)),
            RABBITMQ_DIST_PORT=str(25700 + i),
            RABBITMQ_MNESIA_BASE=str(node / "mnesia"),
            RABBITMQ_LOG_BASE=str(node / "log"),
            RABBITMQ_CONFIG_FILE=str(node / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(node / "advanced.config"),  # absent: none
            RABBITMQ_ENABLED_PLUGINS_FILE=str(node / "enabled_plugins"),
            RABBITMQ_CONF_ENV_FILE=str(node / "rabbitmq-env.conf"),
            RABBITMQ_PID_FILE=str(node / f"qkc{i}.pid"),
            ERL_CRASH_DUMP=str(node / "erl_crash.dump"),
            ERL_EPMD_ADDRESS=HOST,
            RABBITMQ_CTL_DIST_PORT_MIN="35701",
            RABBITMQ_CTL_DIST_PORT_MAX="35720",
            RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            PATH=f"{RABBIT_BIN}:{os.environ.get('PATH', '')}",
        )
        return env

    def ctl(self, i: int, *args: str, tool: str = "rabbitmqctl", timeout: float = 120) -> str:
        result = subprocess.run(
            [str(RABBIT_BIN / tool), "-n", node_name(i), *args],
            env=self.env(i),
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise ClusterError(
                f"{tool} {' '.join(args)} on {node_name(i)} exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()[:500]}"
            )
        return result.stdout

    def pid(self, i: int) -> int | None:
        try:
            return int((self.dir / f"n{i}" / f"qkc{i}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    # --- preconditions ---------------------------------------------------------------------
    @staticmethod
    def check_free() -> None:
        """Refuse to start over a cluster that is already there (leftovers, or someone's)."""
        names = subprocess.run(
            ["epmd", "-names"], capture_output=True, text=True, check=False
        ).stdout
        taken = [f"qkc{i}" for i in NODES if f"name qkc{i} " in names]
        if taken:
            raise ClusterError(f"nodes {taken} already registered with epmd; not starting")
        import socket

        for i in NODES:
            for port in (amqp_port(i), management_port(i), 25700 + i):
                with socket.socket() as probe:
                    if probe.connect_ex((HOST, port)) == 0:
                        raise ClusterError(f"port {port} is in use; not starting")

    # --- lifecycle ---------------------------------------------------------------------------
    def start_node(self, i: int) -> None:
        """`rabbitmq-server -detached`, then wait (bounded) until the node has booted."""
        out = (self.dir / f"n{i}" / "startup.out").open("ab")
        subprocess.run(
            [str(RABBIT_BIN / "rabbitmq-server"), "-detached"],
            env=self.env(i),
            cwd=self.dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=60,
        )
        out.close()
        # await_startup exits at once until the node has registered with epmd: retry.
        deadline = time.monotonic() + 120
        while True:
            pid = self.pid(i)
            if pid:
                self.pids.add(pid)
            try:
                self.ctl(i, "await_startup", "--timeout", "120")
                break
            except (ClusterError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise ClusterError(f"{node_name(i)} did not start") from None
                time.sleep(1)
        pid = self.pid(i)
        if pid:
            self.pids.add(pid)

    def up(self) -> None:
        self.check_free()
        self._write_files()
        started = time.monotonic()
        try:
            # The seed first, then the two others together (safer than all three at once).
            self.start_node(1)
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(self.start_node, (2, 3)))
            booted = time.monotonic()
            for i in (2, 3):
                self.ctl(i, "stop_app")
                self.ctl(i, "join_cluster", node_name(1))
                self.ctl(i, "start_app")
            self.ctl(1, "await_online_nodes", "3", "--timeout", "60")
        except BaseException:
            self.down()
            raise
        self.timings["boot_s"] = round(booted - started, 1)
        self.timings["formed_s"] = round(time.monotonic() - started, 1)

    def kill(self, i: int) -> int:
        """kill -9 the node's beam (a crash); returns its PID."""
        pid = self.pid(i)
        if pid is None:
            raise ClusterError(f"{node_name(i)} has no pid file")
        os.kill(pid, signal.SIGKILL)
        return pid

    def restart(self, i: int) -> float:
        """Start a killed node again (it rejoins by itself); returns the seconds it took."""
        started = time.monotonic()
        self.start_node(i)
        return round(time.monotonic() - started, 1)

    def down(self) -> list[int]:
        """Stop our nodes, kill any of our beams still alive by PID; returns PIDs left (none)."""
        for i in NODES:
            pid = self.pid(i)
            if pid:
                self.pids.add(pid)

        def stop(i: int) -> None:
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                self.ctl(i, "stop", timeout=60)

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(stop, NODES))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in self.pids):
            time.sleep(0.5)
        for pid in self.pids:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        left = [pid for pid in self.pids if alive(pid)]
        if not left:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left


def main(argv: list[str]) -> int:
    if argv[:1] == ["up"]:
        cluster = Cluster()
        cluster.up()
        print(cluster.dir, cluster.timings, sorted(cluster.pids))
        return 0
    if argv[:1] == ["down"] and len(argv) == 2:
        cluster = Cluster(root=Path(argv[1]))
        left = cluster.down()
        print("left running:", left)
        return 1 if left else 0
    print("usage: python -m tests.cluster.harness up | down <dir>", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
