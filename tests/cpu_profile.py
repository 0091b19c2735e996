"""Where the suite's CPU goes (loaded by tests/conftest.py when QK_CPU_PROFILE names a file).

For each test (setup, call and teardown together) one JSON line: the pytest process's own
CPU and its waited-for children's (`getrusage`), and the CPU the local RabbitMQ (beam.smp)
and the PostgreSQL backends serving this process's databases spent meanwhile, read from
/proc. With several workers the brokers' CPU cannot
be told apart per test: measure those with `-n 0`. `python -m tests.cpu_profile FILE...`
sums the lines per test file.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
# The names of the databases this process made (tests/conftest.py adds them).
DATABASES: set[str] = set()


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command may hold spaces: the fields after it start past the last ')'.
    return text[text.rindex(")") + 2 :].split()


def _ticks(pid: int, *, children: bool) -> int:
    fields = _proc_stat(pid)
    if fields is None:
        return 0
    # Fields 14-17 of proc(5) (utime, stime, cutime, cstime), counted from the state (3).
    used = int(fields[11]) + int(fields[12])
    return used + (int(fields[13]) + int(fields[14]) if children else 0)


def _find(name: str) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process whose command is `name`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if command == name:
            fields = _proc_stat(int(entry.name))
            if fields is not None:
                found.append((int(entry.name), int(fields[1])))
    return found


class _Services:
    """RabbitMQ's CPU (the whole beam.smp: other suites on the broker count too) and that of
    the PostgreSQL backends serving this session's databases (DATABASES), sampled every
    0.25 s in a thread, as a backend's CPU can only be read while it runs."""

    def __init__(self) -> None:
        self.beam = [pid for pid, _ in _find("beam.smp")]
        postgres = _find("postgres")
        pids = {pid for pid, _ in postgres}
        self.postmasters = [pid for pid, parent in postgres if parent not in pids]
        self.backends: dict[int, int] = {}  # pid: CPU ticks when last seen
        self.commands: dict[int, bool] = {}  # pid: serves one of DATABASES
        self.lock = threading.Lock()
        threading.Thread(target=self._poll, name="cpu-profile", daemon=True).start()

    def _poll(self) -> None:
        while True:
            self.sample()
            time.sleep(0.25)

    def sample(self) -> None:
        for postmaster in self.postmasters:
            try:
                children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text()
            except OSError:
                continue
            for pid in map(int, children.split()):
                if not self.commands.get(pid):
                    try:
                        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                    except OSError:
                        continue
                    self.commands[pid] = any(name in command for name in DATABASES)
                if self.commands[pid]:
                    ticks = _ticks(pid, children=False)
                    with self.lock:
                        self.backends[pid] = max(ticks, self.backends.get(pid, 0))

    def seconds(self) -> dict[str, float]:
        self.sample()
        beam = sum(_ticks(pid, children=True) for pid in self.beam)
        with self.lock:
            postgres = sum(self.backends.values())
        return {"rabbitmq": beam / TICKS, "postgres": postgres / TICKS}


def _own() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "self": me.ru_utime + me.ru_stime,
        "children": children.ru_utime + children.ru_stime,
        "wall": time.monotonic(),
    }


class CpuProfile:
    def __init__(self, path: str) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = Path(f"{path}.{worker}")
        self.services = _Services()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        own, services = _own(), self.services.seconds()
        yield
        own_after, services_after = _own(), self.services.seconds()
        row = {"test": item.nodeid}
        row.update({key: round(own_after[key] - own[key], 3) for key in own})
        row.update({key: round(services_after[key] - services[key], 3) for key in services})
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")


def summary(paths: list[str]) -> str:
    columns = ("self", "children", "rabbitmq", "postgres", "wall")
    files: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*columns, "n"), 0.0))
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            totals = files[row["test"].split("::")[0]]
            totals["n"] += 1
            for column in columns:
                totals[column] += row[column]
    lines = ["  total   self  child rabbit     pg   wall    n  file"]
    grand = dict.fromkeys((*columns, "n"), 0.0)
    ranked = sorted(files.items(), key=lambda kv: -sum(kv[1][c] for c in columns[:-1]))
    for name, totals in ranked:
        cpu = sum(totals[c] for c in columns[:-1])
        lines.append(
            f"{cpu:7.1f} "
            + " ".join(f"{totals[c]:6.1f}" for c in columns)
            + f" {int(totals['n']):4d}  {name}"
        )
        for column in (*columns, "n"):
            grand[column] += totals[column]
    cpu = sum(grand[c] for c in columns[:-1])
    figures = " ".join(f"{grand[c]:6.1f}" for c in columns)
    lines.append(f"{cpu:7.1f} {figures} {int(grand['n']):4d}  ALL")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1:]))
