"""Each process of the service held to its own share of a core (CFS bandwidth control of the
cgroup v1 `cpu` controller), for `bench single`'s sliced sweep.

On this 2-core machine PostgreSQL, RabbitMQ, the load generator and the service share two
cores, so a second process of the service adds work, not capacity. With every process of
the service held to the same slice, a process model's capacity is what its processes can do
with a core each on a host with cores to spare, scaled down: capacity grows with processes
exactly when the work spreads over them. No library does this; it is three files of
/sys/fs/cgroup.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
# A short period keeps a throttled process's wait (at most the period less its quota) well
# under the 20 ms p99 goal.
PERIOD_US = 5000


def _group(pid: int) -> Path:
    """The cgroup this bench run makes for `pid`."""
    return ROOT / f"qkbench-{os.getpid()}-{pid}"


def why_unavailable() -> str | None:
    """None when slices can be made here, else why not."""
    if not (ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller with CFS bandwidth control at {ROOT}"
    if not os.access(ROOT, os.W_OK):
        return f"{ROOT} is not writable (run as root)"
    return None


@contextlib.contextmanager
def cpu_slices(pids: list[int], share: float) -> Iterator[None]:
    """Hold each of `pids` (with its threads) to `share` of one core while inside."""
    made: list[Path] = []
    try:
        for pid in pids:
            group = _group(pid)
            group.mkdir()
            made.append(group)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for group in made:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # the process may have ended
                    (ROOT / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()


def throttled_seconds(pids: list[int]) -> float:
    """Time the slices held the processes back so far (cpu.stat's throttled_time)."""
    total = 0
    for pid in pids:
        stat = _group(pid) / "cpu.stat"
        with contextlib.suppress(OSError):
            for line in stat.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "throttled_time":
                    total += int(value)
    return total / 1e9
