"""Before a command touches the database: is it there, reachable and migrated?

Each problem is one line naming the URL (password masked) and what to run. Nothing here
creates or changes anything: `queuekeeper migrate` creates the tables.
"""

from __future__ import annotations

import logging
from pathlib import Path

# Importing alembic logs its plugins' set-up at INFO: not worth two lines per command.
logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

from alembic.config import Config  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402
from sqlalchemy import text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.exc import ArgumentError, SQLAlchemyError  # noqa: E402

from queuekeeper.common.redact import redact_url  # noqa: E402
from queuekeeper.config import Settings  # noqa: E402

SET_URL = "set QUEUEKEEPER_DATABASE_URL"
PROJECT_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(__file__).resolve().parent


def migrations_dir() -> Path:
    """`migrations/` of a source checkout, or the copy packaged into the wheel."""
    if PACKAGE_DIR == PROJECT_ROOT / "src" / "queuekeeper":
        return PROJECT_ROOT / "migrations"
    return PACKAGE_DIR / "_migrations"


def alembic_config(database_url: str) -> Config:
    ini = PROJECT_ROOT / "alembic.ini"
    config = Config(str(ini)) if ini.exists() else Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["database_url"] = database_url
    return config


class DatabaseNotReady(Exception):
    """The database cannot serve this release; the message says what to do, in one line."""


class DatabaseUnreachable(DatabaseNotReady):
    """Nothing answered (a server still starting may answer later)."""


def _where(settings: Settings) -> str:
    return redact_url(settings.database_url)


async def check_database(settings: Settings, head: str) -> None:
    """DatabaseNotReady (or DatabaseUnreachable) unless the database exists, answers and
    holds this release's schema (`head`) or a newer one (a replica of the previous release
    next to an upgraded database keeps working)."""
    from queuekeeper.db import create_engine

    try:
        make_url(settings.database_url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        raise DatabaseNotReady(
            f"QUEUEKEEPER_DATABASE_URL is not a database URL ({exc}): {SET_URL}, e.g. "
            "postgresql://user:password@host/queuekeeper"
        ) from None
    engine = create_engine(settings)
    try:
        async with engine.connect() as connection:
            try:
                revision = await connection.scalar(text("SELECT version_num FROM alembic_version"))
            except SQLAlchemyError:
                revision = None
    except (SQLAlchemyError, OSError) as exc:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        reason = f"{type(getattr(exc, 'orig', None) or exc).__name__}: {first[0] if first else ''}"
        raise DatabaseUnreachable(
            f"cannot connect to the database {_where(settings)}: {redact_url(reason)[:300]}; check "
            f"that it runs, or {SET_URL}"
        ) from None
    finally:
        await engine.dispose()
    if revision is None:
        raise DatabaseNotReady(
            f"the database {_where(settings)} has no queuekeeper tables: run `queuekeeper "
            f"migrate`, or {SET_URL}"
        )
    if revision != head and revision in _older_than(head):
        raise DatabaseNotReady(
            f"the database {_where(settings)} is at migration {revision}, this release needs "
            f"{head}: run `queuekeeper migrate`"
        )


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("postgresql://"))


def _older_than(head: str) -> set[str]:
    """The revisions this release knows before `head`."""
    return {revision.revision for revision in _scripts().walk_revisions("base", head)} - {head}


def head_revision() -> str:
    head = _scripts().get_current_head()
    if head is None:  # pragma: no cover - the package always ships its migrations
        raise DatabaseNotReady("this installation has no migrations")
    return head
