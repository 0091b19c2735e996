"""What /readyz makes of the supervisor's status (common/processes.py): which processes run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from queuekeeper.common import processes


def test_the_status_the_supervisor_writes_is_what_readers_read(tmp_path: Path) -> None:
    entries = [{"name": "accept-0", "role": "accept", "pid": os.getpid(), "restarts": 2}]
    processes.write_status(tmp_path, 1234, entries)
    assert processes.read_status(str(tmp_path)) == {"supervisor": 1234, "processes": entries}
    processes.remove_status(tmp_path)
    assert processes.read_status(str(tmp_path)) is None
    assert processes.read_status(None) is None  # not supervised


def test_processes_check_is_unready_only_when_no_process_of_a_kind_runs() -> None:
    me, gone = os.getpid(), 2**22 + 12345  # above the default pid_max: never a process
    status = {
        "processes": [
            {"name": "accept-0", "role": "accept", "pid": me},
            {"name": "relay-0", "role": "relay", "pid": gone},
            {"name": "relay-1", "role": "relay", "pid": me},
        ]
    }
    ok, running, error = processes.process_check(status)
    assert (ok, error) == (True, None)
    assert running == {"accept-0": True, "relay-0": False, "relay-1": True}
    status["processes"][2]["pid"] = None  # relay-1 being restarted too
    ok, _, error = processes.process_check(status)
    assert not ok
    assert error == "no relay process running (being restarted)"


def test_a_child_killed_but_not_yet_reaped_is_not_alive() -> None:
    """A killed child stays a zombie until its supervisor reaps it (every 0.2 s): `/readyz`
    must not count it as running in the meantime."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert processes.alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(50):  # the kill is asynchronous
            if not processes.alive(child.pid):
                break
            time.sleep(0.02)
        assert not processes.alive(child.pid)
        assert Path(f"/proc/{child.pid}").exists()  # not reaped: a zombie, yet not alive
    finally:
        child.wait()
    assert not processes.alive(child.pid)
