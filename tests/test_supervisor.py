"""How many processes `serve` starts (supervisor.process_counts); what /readyz makes of the
supervisor's status: tests/common/test_processes.py; the processes themselves:
tests/ops/test_process_model.py."""

from __future__ import annotations

import pytest

from queuekeeper import supervisor
from queuekeeper.config import Settings

PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/x"


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, (1, 1)), (2, (1, 1)), (4, (2, 1)), (16, (8, 4))]
)
def test_defaults_follow_the_cores_available(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: tuple[int, int]
) -> None:
    monkeypatch.setattr(supervisor, "cores", lambda: cores)
    assert supervisor.process_counts(Settings(database_url=PG)) == expected


def test_settings_and_workers_option_override_the_defaults() -> None:
    settings = Settings(database_url=PG, accept_workers=3, relay_processes=0)
    assert supervisor.process_counts(settings) == (3, 0)
    assert supervisor.process_counts(settings, workers=5) == (5, 0)


def test_no_relay_process_by_default_when_the_relay_is_switched_off() -> None:
    assert supervisor.process_counts(Settings(database_url=PG, relay_enabled=False))[1] == 0


def test_sqlite_is_one_process_whatever_the_settings() -> None:
    settings = Settings(
        database_url="sqlite+aiosqlite:///./x.db", accept_workers=4, relay_processes=2
    )
    assert supervisor.process_counts(settings) == (1, 0)
