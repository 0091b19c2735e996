"""Settings a newcomer gets wrong: the public URL, the database URL, and variables that are
not settings."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from queuekeeper.config import Settings
from queuekeeper.config_reference import unknown_settings


def test_public_url_follows_host_and_port_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUEUEKEEPER_PUBLIC_URL", raising=False)
    assert Settings(host="10.0.0.5", port=9001).public_url == "http://10.0.0.5:9001"
    assert Settings(host="0.0.0.0", port=9002).public_url == "http://127.0.0.1:9002"
    assert Settings(port=9003, root_path="qk").public_url == "http://127.0.0.1:9003/qk"
    assert Settings(port=9004, public_url="https://q.example.org").public_url == (
        "https://q.example.org"
    )


@pytest.mark.parametrize(
    "given",
    [
        "postgresql://u:p@db.example:5433/qk",
        "postgres://u:p@db.example:5433/qk",
        "postgresql+asyncpg://u:p@db.example:5433/qk",
    ],
)
def test_a_postgresql_url_is_run_on_asyncpg(given: str) -> None:
    assert (
        Settings(database_url=given).database_url == "postgresql+asyncpg://u:p@db.example:5433/qk"
    )


@pytest.mark.parametrize(
    "given", ["sqlite:///./queuekeeper.db", "sqlite+aiosqlite:///x.db", "mysql://u@h/db", "qk.db"]
)
def test_any_other_database_url_is_refused_naming_the_variable(given: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Settings(database_url=given)
    (error,) = raised.value.errors()
    assert error["loc"] == ("database_url",)
    assert "QUEUEKEEPER_DATABASE_URL must be a PostgreSQL URL" in error["msg"]
    assert "PostgreSQL is the only database" in error["msg"]


def test_no_database_url_means_the_embedded_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty by default: the commands then use the embedded PostgreSQL (embedded.py) in
    `embedded_data_dir`; what they do with it is tests/test_embedded.py's."""
    monkeypatch.delenv("QUEUEKEEPER_DATABASE_URL", raising=False)
    settings = Settings(_env_file=None)
    assert settings.database_url == ""
    assert settings.embedded_data_dir == ".queuekeeper/pg"
    assert Settings(_env_file=None, database_url="postgres://u@h/d").database_url == (
        "postgresql+asyncpg://u@h/d"
    )


def test_a_variable_that_is_not_a_setting_is_named_with_the_closest_one() -> None:
    assert unknown_settings(
        {
            "QUEUEKEEPER_INSTANCE": "prod",
            "QUEUEKEEPER_DATABSE_URL": "postgresql://x",
            "QUEUEKEEPER_SOMETHING_ELSE": "1",
            "QUEUEKEEPER_PORT": "8000",
            "RABBIT_URL": "amqp://",
            "HOME": "/root",
        }
    ) == [
        ("QUEUEKEEPER_DATABSE_URL", "QUEUEKEEPER_DATABASE_URL"),
        ("QUEUEKEEPER_INSTANCE", "QUEUEKEEPER_INSTANCE_NAME"),
        ("QUEUEKEEPER_SOMETHING_ELSE", None),
    ]


async def test_start_up_warns_of_a_mistyped_setting(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUEUEKEEPER_INSTANCE", "prod")
    with capture_logs() as logs:
        client: httpx.AsyncClient = await make_client()
    (warning,) = [entry for entry in logs if entry["event"] == "unknown_setting"]
    assert warning["variable"] == "QUEUEKEEPER_INSTANCE"
    assert warning["detail"] == (
        "QUEUEKEEPER_INSTANCE is not a queuekeeper setting and is ignored; did you mean "
        "QUEUEKEEPER_INSTANCE_NAME?"
    )
    assert (await client.get("/healthz")).status_code == 200


async def test_the_root_points_at_the_docs(client: httpx.AsyncClient) -> None:
    response = await client.get("/")
    assert response.status_code == 200
    assert response.json()["docs"] == "/docs"
    assert "/docs" in response.json()["detail"]
