"""The `queuekeeper` command."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import typer

from queuekeeper.config import get_settings

app = typer.Typer(
    help="queuekeeper: owns the RabbitMQ queues of site agents.", no_args_is_help=True
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _alembic_config(database_url: str | None = None) -> object:
    from alembic.config import Config

    ini = PROJECT_ROOT / "alembic.ini"
    config = Config(str(ini)) if ini.exists() else Config()
    config.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    config.attributes["database_url"] = database_url or get_settings().database_url
    return config


@app.command()
def migrate(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Apply database migrations (run before `serve`, and after every upgrade)."""
    from alembic import command

    from queuekeeper.logging import configure_logging

    configure_logging()
    command.upgrade(_alembic_config(), revision)  # type: ignore[arg-type]
    typer.echo(f"database migrated to {revision}")


@app.command()
def serve(
    host: str | None = typer.Option(None, help="Default: QUEUEKEEPER_HOST."),
    port: int | None = typer.Option(None, help="Default: QUEUEKEEPER_PORT."),
    workers: int = typer.Option(1, help="Worker processes (see docs/operations.md)."),
) -> None:
    """Run the HTTP service (uvicorn)."""
    import uvicorn

    from queuekeeper.logging import configure_logging

    settings = get_settings()
    configure_logging()
    uvicorn.run(
        "queuekeeper.app:create_app",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers,
        log_config=None,
        proxy_headers=True,
    )


# --- reconcile, stale cleanup, dead-letter redrive ----------------------------------------
# Exit codes: 0 the run succeeded; 1 it failed or some items failed (see the output);
# 3 another run of the same job was in progress, so this one did nothing.
EXIT_SKIPPED = 3


def _progress_printer() -> tuple[Any, Any]:
    """A rich progress bar in a terminal, a plain line per step (at most ~20) otherwise."""
    import sys

    if sys.stdout.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        tasks: dict[str, Any] = {}

        def on_progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done, total=total)

        return bar, on_progress

    def plain(what: str, done: int, total: int) -> None:
        step = max(1, total // 20)
        if done == total or done % step == 0:
            typer.echo(f"{what}: {done}/{total}")

    return None, plain


def _run_command(start: Callable[[Any, Any], Awaitable[Any]]) -> None:
    import asyncio

    from queuekeeper.app import build_state
    from queuekeeper.logging import configure_logging

    configure_logging("WARNING")  # each change is in the run record printed below
    bar, on_progress = _progress_printer()

    async def main() -> Any:
        state = build_state(get_settings())
        try:
            return await start(state, on_progress)
        finally:
            await state.management.aclose()
            await state.engine.dispose()

    if bar is not None:
        with bar:
            record = asyncio.run(main())
    else:
        record = asyncio.run(main())
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
) -> None:
    """Bring the broker in line with the database now (what the scheduled job does)."""
    from queuekeeper.jobs.runs import Trigger
    from queuekeeper.reconcile.service import run_reconcile

    _run_command(
        lambda state, progress: run_reconcile(
            state, Trigger.CLI, dry_run=dry_run, progress=progress
        )
    )


@app.command("cleanup-stale")
def cleanup_stale(
    dry_run: bool = typer.Option(False, "--dry-run", help="Report what would go; remove nothing."),
) -> None:
    """Remove subscriptions of inactive users and expired tokens, with their broker objects."""
    from queuekeeper.jobs.runs import Trigger
    from queuekeeper.reconcile.stale import run_cleanup_stale

    _run_command(
        lambda state, progress: run_cleanup_stale(
            state, Trigger.CLI, dry_run=dry_run, progress=progress
        )
    )


@app.command("redrive-dead-letters")
def redrive_dead_letters(
    vhost: str | None = typer.Option(None, help="Only this vhost (an owner's uuid hex)."),
) -> None:
    """Move dead letters back to their queues; give up (and record) those too old or orphaned."""
    from queuekeeper.deadletters.service import run_redrive
    from queuekeeper.jobs.runs import Trigger

    _run_command(
        lambda state, progress: run_redrive(state, Trigger.CLI, vhost=vhost, progress=progress)
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

    from queuekeeper.app import build_state
    from queuekeeper.logging import configure_logging
    from queuekeeper.reconcile.view import QueueFilter, QueueState, queue_states

    configure_logging("WARNING")
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
        state = build_state(get_settings())
        count = 0
        try:
            async for entry in queue_states(state, wanted):
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
        finally:
            await state.management.aclose()
            await state.engine.dispose()
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
