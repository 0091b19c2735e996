"""The `queuekeeper` command.

Exit codes: 0 success; 1 the operation failed (a dependency down, items refused);
2 bad usage or an invalid input file.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import typer

from queuekeeper.config import Settings, get_settings

app = typer.Typer(
    help="queuekeeper: owns the RabbitMQ queues through which a backend sends events to site "
    "agents. Configuration comes from QUEUEKEEPER_* environment variables (see "
    "`queuekeeper settings`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals would print settings, tokens included
)


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _settings() -> Settings:
    """The settings; invalid ones stop the command in one line naming each problem."""
    from pydantic import ValidationError

    try:
        return get_settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg'].removeprefix('Value error, ')}"
            for error in exc.errors(include_input=False, include_url=False)
        )
        raise fail(f"invalid settings: {problems}", 2) from None


def _port_free(host: str, port: int, *, from_option: bool) -> None:
    """One line naming the setting when the port is taken, instead of uvicorn's bind error."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # uvicorn says what else is wrong (an address this host lacks)
            given = "--port" if from_option else "QUEUEKEEPER_PORT"
            raise fail(
                f"address {host}:{port} ({given}) is already in use (another queuekeeper, or "
                "`make run` still running?): stop it, or set QUEUEKEEPER_PORT (or pass --port) "
                "to a free port"
            ) from None


def database_settings(*, create: bool = False) -> Settings:
    """The settings of a command that uses the database: with no QUEUEKEEPER_DATABASE_URL,
    the embedded server's URL, the server started when not running (one line when it
    cannot be; only `migrate` creates it). The URL goes into the environment, for `serve`'s
    processes and every later `get_settings()` of this one."""
    from queuekeeper.embedded import EmbeddedPostgresError, with_database

    settings = get_settings()
    if settings.database_url:
        return settings
    try:
        settings = with_database(settings, create=create)
    except EmbeddedPostgresError as exc:
        raise fail(str(exc)) from None
    os.environ["QUEUEKEEPER_DATABASE_URL"] = settings.database_url
    get_settings.cache_clear()
    return get_settings()


def _ready_database(settings: Settings, *, serving: bool = False) -> None:
    """Stop with one line when the database is missing, unmigrated or unreachable (a server
    starts anyway when it is only unreachable: it answers 503 until the database is up)."""
    import structlog

    from queuekeeper.preflight import (
        DatabaseNotReady,
        DatabaseUnreachable,
        check_database,
        head_revision,
    )

    try:
        asyncio.run(check_database(settings, head_revision()))
    except DatabaseUnreachable as exc:
        if not serving:
            raise fail(str(exc)) from None
        structlog.get_logger("queuekeeper.cli").warning("database_unreachable", detail=str(exc))
    except DatabaseNotReady as exc:
        raise fail(str(exc)) from None


def _alembic(step: str, revision: str, *, check_first: bool, done: str, failed: str) -> None:
    """`alembic upgrade|downgrade revision` on the configured database, failing in one line."""
    from alembic import command
    from sqlalchemy.exc import SQLAlchemyError

    from queuekeeper.common.redact import redact_url
    from queuekeeper.logging import configure_logging
    from queuekeeper.preflight import alembic_config

    settings = database_settings(create=not check_first)
    configure_logging(settings)
    if check_first:
        _ready_database(settings)
    try:
        getattr(command, step)(alembic_config(settings.database_url), revision)
    except (SQLAlchemyError, OSError) as exc:
        raise fail(
            f"{failed} failed on {redact_url(settings.database_url)}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    typer.echo(f"database {done} to {revision}")


@app.command()
def migrate(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Apply database migrations (run before `serve`, and after every upgrade)."""
    # The one command that runs on a database without queuekeeper's tables: no check first.
    _alembic("upgrade", revision, check_first=False, done="migrated", failed="migration")


@app.command()
def downgrade(
    revision: str = typer.Argument(
        ..., help="Revision to go back to, e.g. the previous release's head (see migrations/)."
    ),
) -> None:
    """Undo migrations down to REVISION (rolling back a release; back up first)."""
    _alembic("downgrade", revision, check_first=True, done="downgraded", failed="downgrade")


def _prepare_multiprocess_dir() -> str:
    """Several workers share their metrics through files in one directory.

    It must start empty (stale files would add a previous run's counts), so queuekeeper
    empties the one it is given or makes a fresh one.
    """
    from queuekeeper.common.processes import MULTIPROC_ENV, remove_status, shared_directory

    directory = shared_directory()
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink(missing_ok=True)
        remove_status(path)
    else:
        directory = tempfile.mkdtemp(prefix="queuekeeper-metrics-")
        os.environ[MULTIPROC_ENV] = directory  # inherited by the worker processes
    return directory


@app.command()
def serve(
    host: str | None = typer.Option(None, help="Default: QUEUEKEEPER_HOST."),
    port: int | None = typer.Option(None, help="Default: QUEUEKEEPER_PORT."),
    workers: int | None = typer.Option(
        None,
        min=1,
        help="Accept worker processes; overrides QUEUEKEEPER_ACCEPT_WORKERS.",
    ),
) -> None:
    """Run the service (HTTP, relay, scheduled jobs).

    Accept workers and relay processes under one supervisor (QUEUEKEEPER_ACCEPT_WORKERS,
    QUEUEKEEPER_RELAY_PROCESSES); with one worker and no relay process (the default on 2
    cores or fewer): one process (uvicorn) with the relay in it.
    """
    import structlog
    import uvicorn

    from queuekeeper.common.processes import shared_directory
    from queuekeeper.logging import configure_logging
    from queuekeeper.supervisor import Supervisor, process_counts
    from queuekeeper.workers import freeze_startup_objects, server_options

    settings = _settings()
    configure_logging(settings)
    bind_host, bind_port = host or settings.host, port or settings.port
    _port_free(bind_host, bind_port, from_option=port is not None)
    settings = database_settings()
    _ready_database(settings, serving=True)
    accept_workers, relay_processes = process_counts(settings, workers)
    logger = structlog.get_logger("queuekeeper.cli")
    if accept_workers > 1 or relay_processes or shared_directory():
        directory = _prepare_multiprocess_dir()
        logger.info(
            "metrics_multiprocess_mode",
            directory=directory,
            accept_workers=accept_workers,
            relay_processes=relay_processes,
        )
    if accept_workers > 1 or relay_processes:
        supervisor = Supervisor(
            bind_host,
            bind_port,
            accept_workers,
            relay_processes,
            Path(directory),
        )
        raise typer.Exit(supervisor.run())
    freeze_startup_objects()
    uvicorn.run(
        "queuekeeper.app:serve_app", host=bind_host, port=bind_port, **server_options(settings)
    )


@app.command()
def healthcheck(
    url: str | None = typer.Option(
        None, help="Base URL of the service. Default: http://QUEUEKEEPER_HOST:QUEUEKEEPER_PORT."
    ),
    ready: bool = typer.Option(False, "--ready", help="Probe /readyz instead of /healthz."),
    timeout: float = typer.Option(3.0, help="Seconds to wait for the answer."),
) -> None:
    """Probe a running service's /healthz (or /readyz); exit 1 when it does not answer 200."""
    import httpx

    if url is None:
        settings = _settings()
        url = f"http://{settings.local_host}:{settings.port}"
    target = url.rstrip("/") + ("/readyz" if ready else "/healthz")
    try:
        response = httpx.get(target, timeout=timeout)
    except httpx.HTTPError as exc:
        raise fail(f"{target}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise fail(f"{target} answered {response.status_code}: {response.text[:500]}")
    typer.echo(f"{target}: {response.status_code} {response.text[:500]}")


@app.command("waldur-standin")
def waldur_standin(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(
        8080, help="Port to listen on: the site proxy's `waldur` upstream (8080 as shipped)."
    ),
) -> None:
    """Answer as an empty Waldur, for trying an agent behind the site proxy without one."""
    import uvicorn

    from queuekeeper.logging import configure_logging
    from queuekeeper.waldur_standin import WaldurStandIn

    configure_logging(level="INFO")
    uvicorn.run(WaldurStandIn(), host=host, port=port, lifespan="off", log_config=None)


def masked_settings(settings: Settings) -> dict[str, Any]:
    """Effective settings by environment variable name, secrets masked."""
    from queuekeeper.common.redact import MASK, is_secret_key, redact_url
    from queuekeeper.config_reference import env_names

    values: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        # A number or a switch is never a secret (`token_expiry_interval_seconds`).
        if is_secret_key(name) and value and not isinstance(value, int | float | bool):
            value = [MASK] * len(value) if isinstance(value, list) else MASK
        elif isinstance(value, str) and "://" in value:
            value = redact_url(value)
        values[env_names(name, field)[0]] = value
    return values


def changed_settings(settings: Settings) -> dict[str, str]:
    """The default, as `queuekeeper settings` shows a value, of each setting that differs
    from it, by variable name."""
    from queuekeeper.config_reference import env_names

    changed: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if getattr(settings, name) != default and not _derived(settings, name):
            shown = masked_settings(Settings.model_construct(**{name: default}))
            changed[env_names(name, field)[0]] = _line_value(shown, name)
    return changed


def _derived(settings: Settings, name: str) -> bool:
    """The public URL left empty is made from the listen address (`Settings`)."""
    derived = f"http://{settings.local_host}:{settings.port}{settings.root_path}"
    return name == "public_url" and settings.public_url == derived


def settings_notes(settings: Settings) -> dict[str, str]:
    """What a line of `queuekeeper settings` says beside its value, by variable name: the
    default it replaces, or what an empty value means (the embedded database, the process
    counts `serve` derives from the cores)."""
    from queuekeeper.supervisor import cores, process_counts

    notes = {
        env: f"set; default {default!r}" for env, default in changed_settings(settings).items()
    }
    if _derived(settings, "public_url"):
        notes["QUEUEKEEPER_PUBLIC_URL"] = "auto: from QUEUEKEEPER_HOST, _PORT and _ROOT_PATH"
    if not settings.database_url:
        data_dir = Path(settings.embedded_data_dir).expanduser().absolute()
        notes["QUEUEKEEPER_DATABASE_URL"] = f"embedded PostgreSQL in {data_dir}"
    _, relays = process_counts(settings)
    if settings.accept_workers is None:
        notes["QUEUEKEEPER_ACCEPT_WORKERS"] = f"auto: {cores()} cores"
    if settings.relay_processes is None:
        notes["QUEUEKEEPER_RELAY_PROCESSES"] = (
            "auto: QUEUEKEEPER_RELAY_ENABLED=false, no relay"
            if not settings.relay_enabled
            else f"auto: {cores()} cores"
            + ("; 0: the relay runs in the accept process" if relays == 0 else "")
        )
    return notes


def effective_values(settings: Settings) -> dict[str, Any]:
    """`masked_settings`, with the process counts `serve` uses when they are left empty."""
    from queuekeeper.supervisor import process_counts

    values = masked_settings(settings)
    accept, relays = process_counts(settings)
    values["QUEUEKEEPER_ACCEPT_WORKERS"] = accept
    values["QUEUEKEEPER_RELAY_PROCESSES"] = relays
    return values


def _line_value(values: dict[str, Any], name: str) -> str:
    from queuekeeper.config_reference import env_names

    value = values[env_names(name, Settings.model_fields[name])[0]]
    shown = ",".join(map(str, value)) if isinstance(value, list) else value
    if isinstance(shown, bool):
        shown = str(shown).lower()
    return "" if shown is None else str(shown)


@app.command("settings")
def show_settings(
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of lines."),
    changed: bool = typer.Option(
        False, "--changed", help="Only the settings that differ from their default."
    ),
) -> None:
    """Print the effective settings (environment and .env applied), secrets masked.

    A line is `NAME=value`, then `# set; default ...` when the value is not the default, or
    what an empty value stands for (the embedded database, the process counts from the
    cores). `--json` gives the settings as set (null where `serve` decides)."""
    from pydantic import ValidationError

    from queuekeeper.config_reference import env_names, unknown_in_environment

    for unknown in unknown_in_environment():  # what `serve` logs, on stderr
        typer.echo(f"warning: {unknown.detail}", err=True)
    try:
        settings = Settings()
    except ValidationError as exc:
        raise fail(f"invalid settings:\n{exc}", 2) from exc
    differ = changed_settings(settings)
    if as_json:
        values = masked_settings(settings)
        if changed:
            values = {env: value for env, value in values.items() if env in differ}
        typer.echo(json.dumps(values, indent=2, default=str))
        return
    values = effective_values(settings)
    notes = settings_notes(settings)
    for name, field in Settings.model_fields.items():
        env = env_names(name, field)[0]
        if changed and env not in differ:
            continue
        note = notes.get(env, "")
        line = f"{env}={_line_value(values, name)}"
        typer.echo(f"{line:<48} # {note}" if note else line)


@app.command("settings-table")
def settings_table(
    write: list[Path] = typer.Option(
        [], help="Rewrite the table between the settings-table markers of this file."
    ),
    check: bool = typer.Option(False, help="Exit 1 when a --write file is out of date."),
) -> None:
    """Print the configuration reference table (Markdown), or write it into the docs."""
    from queuekeeper.config_reference import (
        embedded_table,
        render_table,
        undocumented_settings,
        write_table,
    )

    missing = undocumented_settings()
    if missing:
        raise fail(f"settings without a description: {', '.join(missing)}")
    if not write:
        typer.echo(render_table(), nl=False)
        return
    stale = []
    for path in write:
        if not path.exists():
            raise fail(f"{path}: no such file", 2)
        if check:
            if embedded_table(path.read_text(encoding="utf-8")) != render_table():
                stale.append(str(path))
            continue
        try:
            changed = write_table(path)
        except ValueError as exc:
            raise fail(f"{path}: {exc}") from exc
        typer.echo(f"{path}: {'updated' if changed else 'up to date'}")
    if stale:
        raise fail(f"out of date: {', '.join(stale)}; run `queuekeeper settings-table --write`")


def _read_directory_file(file: str) -> Any:
    from pydantic import ValidationError

    from queuekeeper.directory.schemas import DirectoryFile

    try:
        raw = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot read {file}: {exc.strerror or exc}", 2) from exc
    try:
        return DirectoryFile.model_validate_json(raw)
    except ValidationError as exc:
        problems = [
            f"  {'.'.join(map(str, error['loc'])) or '(file)'}: {error['msg']}"
            for error in exc.errors(include_input=False, include_url=False)
        ]
        raise fail(f"{file} is not a valid directory file:\n" + "\n".join(problems), 2) from exc


@app.command("import-directory")
def import_directory(
    file: str = typer.Argument(
        ..., help='JSON file {"offerings": [...], "users": [...], "grants": [...]}, or - for stdin.'
    ),
) -> None:
    """Import users, offerings and access grants from a JSON file (idempotent)."""
    from sqlalchemy.exc import SQLAlchemyError

    from queuekeeper.app import running
    from queuekeeper.common.progress import Progress
    from queuekeeper.directory.importer import ImportReport
    from queuekeeper.directory.importer import import_directory as run_import
    from queuekeeper.logging import configure_logging

    settings = _settings()
    configure_logging(settings, level="WARNING")
    data = _read_directory_file(file)
    settings = database_settings()
    _ready_database(settings)

    async def run() -> ImportReport:
        async with running(settings) as state:
            with Progress("import-directory", total=data.size) as progress:
                return await run_import(state.sessions, state.provisioner, data, progress.advance)

    try:
        report = asyncio.run(run())
    except (SQLAlchemyError, OSError) as exc:
        raise fail(f"database unavailable: {type(exc).__name__}") from exc
    for label, reason in report.failures:
        typer.echo(f"failed: {label}: {reason}", err=True)
    typer.echo(report.summary())
    if report.failures:
        raise typer.Exit(1)


# --- reconcile, stale cleanup, dead-letter redrive ----------------------------------------
# Exit codes: 0 the run succeeded; 1 it failed or some items failed (see the output);
# 3 another run of the same job was in progress, so this one did nothing.
EXIT_SKIPPED = 3


def _run_command(start: Callable[[Any, Any], Awaitable[Any]]) -> None:
    import asyncio

    from queuekeeper.app import running
    from queuekeeper.common.progress import Phases
    from queuekeeper.logging import configure_logging

    configure_logging(_settings(), level="WARNING")  # each change is in the run record below
    _ready_database(database_settings())

    async def main(on_progress: Phases) -> Any:
        async with running(_settings()) as state:
            return await start(state.jobs, on_progress)

    with Phases() as on_progress:
        record = asyncio.run(main(on_progress))
    raise typer.Exit(_print_run(record))


def _print_run(record: Any) -> int:
    typer.echo(
        f"{record.job} ({'dry run, ' if record.dry_run else ''}trigger {record.trigger}): "
        f"{record.status}"
    )
    for title, counts in (("found", record.found), ("changed", record.changed)):
        if counts:
            typer.echo(f"  {title}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for action in record.actions:
        prefix = "would " if action.get("planned") else ""
        detail = f" ({action['detail']})" if action.get("detail") else ""
        typer.echo(f"  {prefix}{action['action']} {action['item']}{detail}")
    for failure in record.failures:
        typer.echo(f"  FAILED {failure['item']}: {failure['reason']}", err=True)
    if record.status == "skipped":
        return EXIT_SKIPPED
    return 0 if record.status == "succeeded" else 1


@app.command()
def reconcile(
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Report what would change; change nothing."
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Delete even when the run would delete more than the deletion guard allows "
        "(QUEUEKEEPER_RECONCILE_MAX_DELETIONS, QUEUEKEEPER_RECONCILE_MAX_DELETE_SHARE).",
    ),
) -> None:
    """Bring the broker in line with the database now (what the scheduled job does)."""
    from queuekeeper.jobs.runs import Job, Trigger

    _run_command(
        lambda jobs, progress: jobs.run(
            Job.RECONCILE, Trigger.CLI, dry_run=dry_run, force=force, progress=progress
        )
    )


@app.command("cleanup-stale")
def cleanup_stale(
    dry_run: bool = typer.Option(False, "--dry-run", help="Report what would go; remove nothing."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Delete even when the run would delete more than the deletion guard allows "
        "(QUEUEKEEPER_RECONCILE_MAX_DELETIONS, QUEUEKEEPER_RECONCILE_MAX_DELETE_SHARE).",
    ),
) -> None:
    """Remove subscriptions of inactive users and expired tokens, with their broker objects."""
    from queuekeeper.jobs.runs import Job, Trigger

    _run_command(
        lambda jobs, progress: jobs.run(
            Job.CLEANUP_STALE, Trigger.CLI, dry_run=dry_run, force=force, progress=progress
        )
    )


@app.command("redrive-dead-letters")
def redrive_dead_letters(
    vhost: str | None = typer.Option(None, help="Only this vhost (an owner's uuid hex)."),
) -> None:
    """Move dead letters back to their queues; give up (and record) those too old or orphaned."""
    from queuekeeper.deadletters.service import redrive_body
    from queuekeeper.jobs.runs import Job, Trigger

    _run_command(
        lambda jobs, progress: jobs.run(
            Job.REDRIVE, Trigger.CLI, progress=progress, body=redrive_body(vhost)
        )
    )


@app.command()
def queues(
    vhost: str | None = typer.Option(None, help="Only this vhost (an owner's uuid hex)."),
    state_filter: str | None = typer.Option(
        None, "--state", help="ok, missing, drifted, unregistered or foreign_vhost."
    ),
) -> None:
    """Every queue: registered, present on the broker, arguments right, depth, consumers."""
    import asyncio

    from rich.console import Console
    from rich.table import Table

    from queuekeeper.app import running
    from queuekeeper.logging import configure_logging
    from queuekeeper.reconcile.schemas import QueueState
    from queuekeeper.reconcile.view import QueueFilter, queue_states

    configure_logging(_settings(), level="WARNING")
    _ready_database(database_settings())
    try:
        wanted = QueueFilter(vhost=vhost, state=QueueState(state_filter) if state_filter else None)
    except ValueError as exc:
        raise typer.BadParameter(f"unknown state {state_filter!r}", param_hint="--state") from exc
    table = Table(
        "vhost", "queue", "state", "registered", "present", "arguments", "messages", "consumers"
    )

    def cell(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return str(value)

    async def main() -> int:
        count = 0
        async with running(_settings()) as state:
            async for entry in queue_states(state.jobs.context, wanted):
                count += 1
                arguments = cell(entry.arguments_ok)
                if entry.differences:
                    arguments = "; ".join(entry.differences)
                table.add_row(
                    entry.vhost,
                    entry.queue_name,
                    entry.state,
                    cell(entry.registered),
                    cell(entry.present),
                    arguments,
                    cell(entry.messages),
                    cell(entry.consumers),
                )
        return count

    from queuekeeper.broker.management import ManagementError

    try:
        count = asyncio.run(main())
    except ManagementError as exc:
        typer.echo(f"RabbitMQ Management API: {exc}", err=True)
        raise typer.Exit(1) from exc
    Console(width=None if _is_terminal() else 250).print(table)
    typer.echo(f"queues: {count}")


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty()


@app.command()
def relay() -> None:
    """Run the outbox relay alone (no HTTP) until interrupted.

    It shares the work with the relays of running services and other
    `queuekeeper relay` processes. It is woken by a NOTIFY when copies are committed
    unclaimed (run `serve` with QUEUEKEEPER_RELAY_ENABLED=false beside it), and looks
    every QUEUEKEEPER_RELAY_POLL_INTERVAL besides.
    """
    from queuekeeper.logging import configure_logging
    from queuekeeper.workers import run_relay

    settings = database_settings()
    configure_logging(settings)
    _ready_database(settings)
    run_relay(settings)
