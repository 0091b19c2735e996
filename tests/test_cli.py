"""The `queuekeeper` command against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import typer
from sqlalchemy import func, select
from typer.testing import CliRunner

from queuekeeper.cli import app
from queuekeeper.config import Settings, get_settings
from queuekeeper.db import create_engine, create_sessionmaker
from queuekeeper.models import Offering, OfferingAccess, User
from tests.brokers import BROKER
from tests.conftest import pg_rows
from tests.proxy import closed_port


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def cli_env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The test's settings as the environment a CLI process would have."""
    env = {
        "QUEUEKEEPER_DATABASE_URL": settings.database_url,
        "QUEUEKEEPER_INSTANCE_NAME": settings.instance_name,
        "QUEUEKEEPER_SERVICE_TOKENS": ",".join(settings.service_tokens),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


def invoke(runner: CliRunner, *args: str, **kwargs: Any) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False, **kwargs)


def test_help_lists_every_command_with_a_one_line_description(runner: CliRunner) -> None:
    result = invoke(runner, "--help", env={"COLUMNS": "200"})
    assert result.exit_code == 0
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert {
        "migrate",
        "serve",
        "healthcheck",
        "settings",
        "settings-table",
        "import-directory",
    } <= set(commands)
    for name, command in commands.items():
        summary = command.help.strip().splitlines()[0]
        assert summary.endswith("."), name
        assert re.search(rf"{re.escape(name)}\s+{re.escape(summary)}", result.output), name


def settings_lines(output: str) -> dict[str, tuple[str, str]]:
    """`queuekeeper settings`' lines: (value, note) by variable name."""
    lines: dict[str, tuple[str, str]] = {}
    for line in output.splitlines():
        found = re.fullmatch(r"(?P<name>\w+)=(?P<value>.*?)(?:\s+# (?P<note>.*))?", line)
        assert found, line
        lines[found["name"]] = (found["value"], found["note"] or "")
    return lines


def test_settings_are_printed_with_secrets_masked(
    runner: CliRunner, cli_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUEUEKEEPER_MANAGEMENT_PASSWORD", "mgmt-Secret-4711")
    monkeypatch.setenv(
        "QUEUEKEEPER_SERVICE_TOKENS", "svc-token-aaaaaaaaaaaa,svc-token-bbbbbbbbbbbb"
    )
    monkeypatch.setenv("RABBIT_URL", "amqps://qk:amqp-Secret-0815@rabbit.example.org:5671/")
    monkeypatch.setenv("QUEUEKEEPER_PORT", "9123")
    result = invoke(runner, "settings")
    assert result.exit_code == 0
    lines = {name: value for name, (value, _) in settings_lines(result.output).items()}
    assert lines["QUEUEKEEPER_PORT"] == "9123"
    assert lines["QUEUEKEEPER_AMQP_URL"] == "amqps://qk:***@rabbit.example.org:5671/"
    assert lines["QUEUEKEEPER_MANAGEMENT_PASSWORD"] == "***"
    assert lines["QUEUEKEEPER_SERVICE_TOKENS"] == "***,***"
    # Named like a secret, but a number: shown.
    assert lines["QUEUEKEEPER_TOKEN_EXPIRY_INTERVAL_SECONDS"] == "10"
    assert len(lines) == len(Settings.model_fields)
    for secret in ("mgmt-Secret-4711", "svc-token-aaaaaaaaaaaa", "amqp-Secret-0815"):
        assert secret not in result.output
    as_json = json.loads(invoke(runner, "settings", "--json").output)
    assert as_json["QUEUEKEEPER_PORT"] == 9123
    assert as_json["QUEUEKEEPER_MANAGEMENT_PASSWORD"] == "***"


def test_settings_mark_what_differs_from_the_default_and_what_an_empty_value_means(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Of some hundred lines, the reader finds the ones they set, and an empty database
    URL or process count says what `serve` makes of it."""
    for name in list(os.environ):
        if name.startswith("QUEUEKEEPER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no .env here
    monkeypatch.setenv("QUEUEKEEPER_PORT", "9123")
    monkeypatch.setenv("QUEUEKEEPER_SERVICE_TOKENS", "svc-token-aaaaaaaaaaaa")
    lines = settings_lines(invoke(runner, "settings").output)
    assert lines["QUEUEKEEPER_PORT"] == ("9123", "set; default '8000'")
    assert lines["QUEUEKEEPER_SERVICE_TOKENS"] == ("***", "set; default ''")
    assert lines["QUEUEKEEPER_HOST"] == ("127.0.0.1", "")  # the default: no mark
    url, note = lines["QUEUEKEEPER_DATABASE_URL"]
    assert (url, note) == ("", f"embedded PostgreSQL in {tmp_path / '.queuekeeper' / 'pg'}")
    cores = len(os.sched_getaffinity(0))
    accept, relays = (1, 0) if cores <= 2 else (cores // 2, max(1, cores // 4))
    assert lines["QUEUEKEEPER_ACCEPT_WORKERS"] == (str(accept), f"auto: {cores} cores")
    assert lines["QUEUEKEEPER_RELAY_PROCESSES"][0] == str(relays)
    assert lines["QUEUEKEEPER_RELAY_PROCESSES"][1].startswith(f"auto: {cores} cores")

    changed = settings_lines(invoke(runner, "settings", "--changed").output)
    assert set(changed) == {"QUEUEKEEPER_PORT", "QUEUEKEEPER_SERVICE_TOKENS"}
    as_json = json.loads(invoke(runner, "settings", "--json", "--changed").output)
    assert as_json == {"QUEUEKEEPER_PORT": 9123, "QUEUEKEEPER_SERVICE_TOKENS": ["***"]}

    monkeypatch.setenv("QUEUEKEEPER_ACCEPT_WORKERS", "3")
    monkeypatch.setenv("QUEUEKEEPER_RELAY_ENABLED", "false")
    lines = settings_lines(invoke(runner, "settings").output)
    assert lines["QUEUEKEEPER_ACCEPT_WORKERS"] == ("3", "set; default ''")
    assert lines["QUEUEKEEPER_RELAY_PROCESSES"] == (
        "0",
        "auto: QUEUEKEEPER_RELAY_ENABLED=false, no relay",
    )


def test_settings_warns_of_a_variable_that_is_not_a_setting_as_serve_does(
    runner: CliRunner,
    cli_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("QUEUEKEEPER_SERVICE_TOKEN", "one-token-without-the-s")
    monkeypatch.chdir(tmp_path)  # the .env file is read too
    (tmp_path / ".env").write_text("QUEUEKEEPER_DATABSE_URL=postgresql://x/db\n")
    result = invoke(runner, "settings", "--json")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [
        "warning: QUEUEKEEPER_DATABSE_URL is not a queuekeeper setting and is ignored; did "
        "you mean QUEUEKEEPER_DATABASE_URL?",
        "warning: QUEUEKEEPER_SERVICE_TOKEN is not a queuekeeper setting and is ignored; did "
        "you mean QUEUEKEEPER_SERVICE_TOKENS?",
    ]
    # The settings themselves stay on stdout, readable as ever; the misspelt token is not
    # among them.
    tokens = cli_env["QUEUEKEEPER_SERVICE_TOKENS"].split(",")
    assert json.loads(result.stdout)["QUEUEKEEPER_SERVICE_TOKENS"] == ["***"] * len(tokens)


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("QUEUEKEEPER_PORT", "eighty", "port"),
        ("QUEUEKEEPER_QUEUE_OVERFLOW", "reject-publish-dlxx", "'reject-publish-dlx'"),
    ],
)
def test_invalid_settings_exit_2_naming_the_variable(
    runner: CliRunner,
    cli_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    named: str,
) -> None:
    monkeypatch.setenv(variable, value)
    result = invoke(runner, "settings")
    assert result.exit_code == 2
    assert variable.removeprefix("QUEUEKEEPER_").lower() in result.output
    assert named in result.output


def test_migrate_creates_the_schema_and_fails_cleanly_without_a_database(
    runner: CliRunner, empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUEUEKEEPER_DATABASE_URL", empty_database)
    get_settings.cache_clear()
    result = invoke(runner, "migrate")
    assert result.exit_code == 0, result.output
    assert "database migrated to head" in result.output
    assert pg_rows(empty_database, "SELECT 1 FROM deliveries LIMIT 1") == []  # the tables are there

    password = "pg-Secret-" + secrets.token_hex(4)
    monkeypatch.setenv(
        "QUEUEKEEPER_DATABASE_URL", f"postgresql://qk:{password}@127.0.0.1:{closed_port()}/qk"
    )
    get_settings.cache_clear()
    result = invoke(runner, "migrate")
    get_settings.cache_clear()
    assert result.exit_code == 1
    assert "migration failed" in result.output
    assert password not in result.output


def test_healthcheck_fails_when_nothing_answers(runner: CliRunner) -> None:
    result = invoke(runner, "healthcheck", "--url", f"http://127.0.0.1:{closed_port()}")
    assert result.exit_code == 1
    assert "/healthz" in result.output


# --- import-directory ------------------------------------------------------------------------


async def _counts(settings: Settings) -> tuple[int, int, int]:
    engine = create_engine(settings)
    async with create_sessionmaker(engine)() as session:
        counts = (
            await session.scalar(select(func.count()).select_from(User)) or 0,
            await session.scalar(select(func.count()).select_from(Offering)) or 0,
            await session.scalar(select(func.count()).select_from(OfferingAccess)) or 0,
        )
    await engine.dispose()
    return counts


def _directory(tmp_path: Path, content: dict[str, Any], name: str = "directory.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


def _sample() -> dict[str, Any]:
    offerings = [uuid.uuid4() for _ in range(2)]
    users = [uuid.uuid4() for _ in range(3)]
    return {
        "offerings": [{"uuid": str(o), "name": f"offering {i}"} for i, o in enumerate(offerings)],
        "users": [
            {"uuid": u.hex, "username": f"agent-{i}", "token": secrets.token_hex(20)}
            for i, u in enumerate(users)
        ],
        "grants": [
            {"user_uuid": users[0].hex, "offering_uuid": offerings[0].hex},
            {"user_uuid": users[1].hex, "offering_uuid": offerings[0].hex},
            {"user_uuid": users[2].hex, "offering_uuid": offerings[1].hex},
        ],
    }


def test_import_directory_imports_and_is_idempotent(
    runner: CliRunner,
    cli_env: dict[str, str],
    settings: Settings,
    clean_state: None,
    tmp_path: Path,
) -> None:
    content = _sample()
    path = _directory(tmp_path, content)
    result = invoke(runner, "import-directory", str(path))
    assert result.exit_code == 0, result.output
    assert (
        "offerings: 2 created, 0 updated; users: 3 created, 0 updated; grants: 3 created, "
        "0 updated; 0 failed" in result.output
    )
    # Not a terminal: plain progress lines, ending at the total.
    assert "import-directory: 0/8" in result.output
    assert "import-directory: 8/8 (100%)" in result.output
    assert "━" not in result.output
    assert asyncio.run(_counts(settings)) == (3, 2, 3)
    for user in content["users"]:
        assert user["token"] not in result.output

    again = invoke(runner, "import-directory", str(path))
    assert again.exit_code == 0
    assert (
        "offerings: 0 created, 2 updated; users: 0 created, 3 updated; grants: 0 created, "
        "3 updated; 0 failed" in again.output
    )
    assert asyncio.run(_counts(settings)) == (3, 2, 3)


def test_import_directory_goes_on_past_a_bad_item_and_exits_1(
    runner: CliRunner,
    cli_env: dict[str, str],
    settings: Settings,
    clean_state: None,
    tmp_path: Path,
) -> None:
    content = _sample()
    stranger = uuid.uuid4()
    content["grants"].insert(
        0, {"user_uuid": stranger.hex, "offering_uuid": content["offerings"][0]["uuid"]}
    )
    result = invoke(runner, "import-directory", str(_directory(tmp_path, content)))
    assert result.exit_code == 1
    assert f"failed: grant {stranger.hex}" in result.output
    assert "PUT the user first" in result.output
    assert "grants: 3 created, 0 updated; 1 failed" in result.output
    assert asyncio.run(_counts(settings)) == (3, 2, 3)


def test_import_directory_rejects_an_invalid_file_before_changing_anything(
    runner: CliRunner,
    cli_env: dict[str, str],
    settings: Settings,
    clean_state: None,
    tmp_path: Path,
) -> None:
    content = _sample()
    content["users"][1]["token"] = "short"
    content["grants"][0]["offering_uuid"] = "not-a-uuid"
    result = invoke(runner, "import-directory", str(_directory(tmp_path, content)))
    assert result.exit_code == 2
    assert "users.1.token" in result.output
    assert "grants.0.offering_uuid" in result.output
    assert asyncio.run(_counts(settings)) == (0, 0, 0)

    assert invoke(runner, "import-directory", str(tmp_path / "missing.json")).exit_code == 2
    not_json = tmp_path / "broken.json"
    not_json.write_text("{users: [")
    assert invoke(runner, "import-directory", str(not_json)).exit_code == 2


def test_import_directory_reads_stdin(
    runner: CliRunner, cli_env: dict[str, str], settings: Settings, clean_state: None
) -> None:
    result = invoke(runner, "import-directory", "-", input=json.dumps(_sample()))
    assert result.exit_code == 0, result.output
    assert asyncio.run(_counts(settings)) == (3, 2, 3)


async def _can_login(vhost: str, login: str, password: str) -> bool:
    try:
        connection = await aio_pika.connect(
            BROKER.amqp_url(vhost, user=login, password=password), timeout=5
        )
    except Exception:
        return False
    await connection.close()
    return True


async def test_imported_token_change_reaches_the_broker_users(
    client: Any, backend: Any, runner: CliRunner, cli_env: dict[str, str], tmp_path: Path
) -> None:
    agent, _offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription(description="rotated by import")
    assert await _can_login(agent.vhost, subscription["uuid"], agent.token)
    new_token = secrets.token_hex(20)
    path = _directory(
        tmp_path,
        {"users": [{"uuid": agent.uuid.hex, "username": "rotated", "token": new_token}]},
    )
    result = await asyncio.to_thread(invoke, runner, "import-directory", str(path))
    assert result.exit_code == 0, result.output
    assert await _can_login(agent.vhost, subscription["uuid"], new_token)
    assert not await _can_login(agent.vhost, subscription["uuid"], agent.token)


QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")


def outside_checkout(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it from another directory, with only `env` set."""
    return subprocess.run(
        [QUEUEKEEPER, *args],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Ran:
    """What a command run in this process printed and returned, as a process's would be."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def in_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, **env: str) -> Ran:
    """The command as `outside_checkout` runs it (from `tmp_path`, with only `env` of
    queuekeeper's variables set), through the CLI's own app in this process: a process
    start costs ~1 s of CPU, importing the app. The entry point itself is run as a process
    by the tests that call `outside_checkout`."""
    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("QUEUEKEEPER_"):
                patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setenv("HOME", str(tmp_path))
        patch.chdir(tmp_path)
        get_settings.cache_clear()
        try:
            result = CliRunner().invoke(app, list(args), catch_exceptions=False)
        finally:
            get_settings.cache_clear()
    return Ran(result.exit_code, result.stdout, result.stderr)


def run_as_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str, process: bool, **env: str
) -> Ran | subprocess.CompletedProcess[str]:
    if process:
        return outside_checkout(tmp_path, *args, **env)
    return in_this_process(tmp_path, monkeypatch, *args, **env)


# Each command in this process but the first (`reconcile`), which runs as a user runs it.
EVERY_COMMAND = [
    (["reconcile", "--dry-run"], True),
    (["queues"], False),
    (["serve"], False),
    (["relay"], False),
]


@pytest.mark.parametrize(("command", "process"), EVERY_COMMAND)
def test_an_unmigrated_database_is_one_line_for_every_command(
    tmp_path: Path,
    empty_database: str,
    command: list[str],
    process: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = run_as_user(
        tmp_path, monkeypatch, *command, process=process, QUEUEKEEPER_DATABASE_URL=empty_database
    )
    assert result.returncode == 1, result.stderr
    shown = empty_database.replace("postgresql://", "postgresql+asyncpg://")
    assert result.stderr.splitlines() == [
        f"error: the database {shown} has no queuekeeper tables: run `queuekeeper migrate`, "
        "or set QUEUEKEEPER_DATABASE_URL"
    ]


@pytest.mark.parametrize(("command", "process"), EVERY_COMMAND)
def test_without_a_database_a_command_says_so_in_one_line_and_creates_none(
    tmp_path: Path, command: list[str], process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_as_user(tmp_path, monkeypatch, *command, process=process)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: no embedded database in {tmp_path.resolve() / '.queuekeeper' / 'pg'} "
        f"(QUEUEKEEPER_EMBEDDED_DATA_DIR, working directory {tmp_path.resolve()}): "
        "run `queuekeeper migrate` to create it there, or set QUEUEKEEPER_DATABASE_URL"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "process"), [("sqlite:///./queuekeeper.db", True), ("queuekeeper", False)]
)
def test_a_database_url_that_is_not_postgresql_is_one_line(
    tmp_path: Path, url: str, process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_as_user(
        tmp_path, monkeypatch, "reconcile", process=process, QUEUEKEEPER_DATABASE_URL=url
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "QUEUEKEEPER_DATABASE_URL must be a PostgreSQL URL" in result.stderr
    assert "PostgreSQL is the only database" in result.stderr


def test_a_wrong_or_unmigrated_database_is_one_line(
    tmp_path: Path, settings: Settings, empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    refused = outside_checkout(
        tmp_path,
        "cleanup-stale",
        QUEUEKEEPER_DATABASE_URL=f"postgresql://qk:secret-pw@127.0.0.1:{port}/queuekeeper",
    )
    assert refused.returncode == 1
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith(
        f"error: cannot connect to the database postgresql+asyncpg://qk:***@127.0.0.1:{port}/"
    ), refused.stderr
    assert "secret-pw" not in refused.stderr

    not_a_url = in_this_process(
        tmp_path,
        monkeypatch,
        "reconcile",
        QUEUEKEEPER_DATABASE_URL="postgresql://qk@db:port/queuekeeper",
    )
    assert not_a_url.returncode == 1
    assert len(not_a_url.stderr.splitlines()) == 1, not_a_url.stderr
    assert "is not a database URL" in not_a_url.stderr

    empty = in_this_process(
        tmp_path, monkeypatch, "reconcile", QUEUEKEEPER_DATABASE_URL=empty_database
    )
    assert "has no queuekeeper tables: run `queuekeeper migrate`" in empty.stderr

    # Migrate creates the tables; then the same command runs.
    migrated = in_this_process(
        tmp_path, monkeypatch, "migrate", QUEUEKEEPER_DATABASE_URL=empty_database
    )
    assert migrated.returncode == 0, migrated.stderr
    ran = outside_checkout(
        tmp_path,
        "reconcile",
        "--dry-run",
        QUEUEKEEPER_DATABASE_URL=empty_database,
        QUEUEKEEPER_INSTANCE_NAME=settings.instance_name,
        QUEUEKEEPER_AMQP_URL=settings.amqp_url,
        QUEUEKEEPER_MANAGEMENT_URL=settings.management_url,
    )
    assert ran.returncode == 0, ran.stderr
    assert "reconcile (dry run, trigger cli): succeeded" in ran.stdout


def test_serve_on_a_port_in_use_names_the_setting(tmp_path: Path, database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = outside_checkout(
            tmp_path,
            "serve",
            QUEUEKEEPER_PORT=str(port),
            QUEUEKEEPER_DATABASE_URL=database_url,
        )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: address 127.0.0.1:{port} (QUEUEKEEPER_PORT) is already in use (another "
        "queuekeeper, or `make run` still running?): stop it, or set QUEUEKEEPER_PORT (or pass "
        "--port) to a free port"
    ]


def test_downgrade_to_the_previous_release_and_back(
    tmp_path: Path, empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolling back a release (docs/howto/upgrade.md, Upgrading and rolling back)."""
    url = empty_database

    def run(*args: str) -> Ran:
        return in_this_process(tmp_path, monkeypatch, *args, QUEUEKEEPER_DATABASE_URL=url)

    assert run("migrate").returncode == 0
    [(identity,)] = pg_rows(url, "SELECT uuid FROM installation")
    # The downgrade as a process, as an operator runs it.
    down = outside_checkout(
        tmp_path, "downgrade", "0006_announce_due", QUEUEKEEPER_DATABASE_URL=url
    )
    assert down.returncode == 0, down.stderr
    assert pg_rows(url, "SELECT version_num FROM alembic_version") == [("0006_announce_due",)]
    # The identity survives the rollback: the broker's objects carry it.
    assert pg_rows(url, "SELECT uuid FROM installation") == [(identity,)]
    # The new release refuses the old schema in one line; migrate brings it back.
    refused = run("reconcile")
    assert refused.returncode == 1
    assert "is at migration 0006_announce_due" in refused.stderr
    assert run("migrate").returncode == 0
    # The upgrade again finds the same identity, so the broker's objects stay ours.
    assert pg_rows(url, "SELECT uuid FROM installation") == [(identity,)]
