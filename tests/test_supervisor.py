"""How many processes `serve` starts (supervisor.process_counts); what /readyz makes of the
supervisor's status: tests/common/test_processes.py; the processes themselves:
tests/ops/test_process_model.py."""

from __future__ import annotations

import os

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
