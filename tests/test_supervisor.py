"""How many processes `serve` starts (supervisor.process_counts) and what /readyz makes of
the supervisor's status; the processes themselves: tests/ops/test_process_model.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from queuekeeper import supervisor
from queuekeeper.config import Settings

PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/x"


@pytest.mark.parametrize(
    ("cores", "expected"),
    [(1, (1, 0)), (2, (1, 0)), (3, (1, 1)), (4, (2, 1)), (8, (4, 2)), (16, (8, 4))],
)
def test_default_counts_follow_the_cores(cores: int, expected: tuple[int, int]) -> None:
    """On 2 cores or fewer one process with the relay inside (the least CPU per event
    there); beyond, half the cores accept and a quarter relay, at least one of each."""
    assert supervisor.default_counts(cores) == expected


@pytest.mark.parametrize(("cores", "expected"), [(2, (1, 0)), (16, (8, 4))])
def test_serve_takes_the_defaults_from_the_cores_it_may_use(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: tuple[int, int]
) -> None:
    monkeypatch.setattr(supervisor, "cores", lambda: cores)
    assert supervisor.process_counts(Settings(database_url=PG)) == expected


def test_the_cores_are_those_this_process_may_run_on() -> None:
    assert supervisor.cores() == len(os.sched_getaffinity(0))


def test_settings_and_workers_option_override_the_defaults() -> None:
    settings = Settings(database_url=PG, accept_workers=3, relay_processes=0)
    assert supervisor.process_counts(settings) == (3, 0)
    assert supervisor.process_counts(settings, workers=5) == (5, 0)


def test_no_relay_process_by_default_when_the_relay_is_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervisor, "cores", lambda: 16)
    assert supervisor.process_counts(Settings(database_url=PG, relay_enabled=False)) == (8, 0)


def test_the_settings_override_the_defaults_on_two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "cores", lambda: 2)
    settings = Settings(database_url=PG, accept_workers=2, relay_processes=1)
    assert supervisor.process_counts(settings) == (2, 1)


def test_processes_check_is_unready_only_when_no_process_of_a_kind_runs() -> None:
    me, gone = os.getpid(), 2**22 + 12345  # above the default pid_max: never a process
    status = {
        "processes": [
            {"name": "accept-0", "role": "accept", "pid": me},
            {"name": "relay-0", "role": "relay", "pid": gone},
            {"name": "relay-1", "role": "relay", "pid": me},
        ]
    }
    ok, running, error = supervisor.process_check(status)
    assert (ok, error) == (True, None)
    assert running == {"accept-0": True, "relay-0": False, "relay-1": True}
    status["processes"][2]["pid"] = None  # relay-1 being restarted too
    ok, _, error = supervisor.process_check(status)
    assert not ok
    assert error == "no relay process running (being restarted)"


def test_a_child_killed_but_not_yet_reaped_is_not_alive() -> None:
    """A killed child stays a zombie until its supervisor reaps it (every 0.2 s): `/readyz`
    must not count it as running in the meantime."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert supervisor.alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(50):  # the kill is asynchronous
            if not supervisor.alive(child.pid):
                break
            time.sleep(0.02)
        assert not supervisor.alive(child.pid)
        assert Path(f"/proc/{child.pid}").exists()  # not reaped: a zombie, yet not alive
    finally:
        child.wait()
    assert not supervisor.alive(child.pid)
