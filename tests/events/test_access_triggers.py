"""Every table and column the authorization rule reads is watched by an access trigger
(migration 0016_access_changes): an unchanged access epoch proves nothing the rule reads
changed, which lets a copy skip the rule (docs/decisions/029-judged-as-it-leaves.md) and
wakes the sweep of queued copies (docs/decisions/030-queued-copies-on-every-access-loss.md).

The tables come from PostgreSQL's own plans of the rule's statements (authorization.py), so a
table the rule starts reading is checked without this file changing; the columns from the
rule's text (`alias.column` of each `FROM`/`JOIN table alias`)."""

from __future__ import annotations

import json
import re
from typing import Any

import asyncpg
import pytest

from queuekeeper.config import Settings
from queuekeeper.events import authorization

# The rule's statements, each with its parameters' types, planned generically (no value
# folds a branch away).
_STATEMENTS = (
    ("SELECT " + authorization.access_sql("$1"), ("timestamptz",)),
    (
        "SELECT " + authorization.authorized_sql("$1", "$2", "$3", "$4", "$5", "$6"),
        ("uuid", "uuid", "uuid", "timestamptz", "uuid", "uuid"),
    ),
    (
        "SELECT " + authorization.binding_allowed_sql("$1", "$2", "$3", "$4"),
        ("uuid", "varchar", "uuid", "timestamptz"),
    ),
    (authorization.event_keys_sql("$1", "$2", "$3"), ("uuid", "uuid", "uuid")),
)
# Read by the rule, watched by no trigger, as decision 029 records: the epoch itself, and the
# legacy subscriptions, of which the rule reads only keys that are never updated (deleting a
# queue sets its copies' `queue_uuid` null, which every judging statement checks first).
_UNWATCHED = {"access_epoch", "event_subscriptions", "event_subscription_queues"}
# pg_trigger.tgtype's bits (PostgreSQL's trigger.h).
_ROW, _BEFORE, _INSERT, _DELETE, _UPDATE = 1, 2, 4, 8, 16


def _relations(plan: Any) -> set[str]:
    if isinstance(plan, dict):
        found = {plan["Relation Name"]} if "Relation Name" in plan else set()
        return found.union(*(_relations(value) for value in plan.values()))
    if isinstance(plan, list):
        return set().union(*(_relations(value) for value in plan))
    return set()


async def tables_read(connection: asyncpg.Connection) -> set[str]:
    """The tables the plans of the rule's statements scan."""
    found: set[str] = set()
    await connection.execute("SET plan_cache_mode = force_generic_plan")
    for sql, types in _STATEMENTS:
        await connection.execute(f"PREPARE rule_statement ({', '.join(types)}) AS {sql}")
        nulls = ", ".join("NULL" for _ in types)
        plan = await connection.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE rule_statement ({nulls})")
        await connection.execute("DEALLOCATE rule_statement")
        found |= _relations(json.loads(plan))
    await connection.execute("RESET plan_cache_mode")
    return found


def columns_read() -> dict[str, set[str]]:
    """(table: its columns) the rule's text reads, through the aliases it gives tables."""
    text = " ".join(sql for sql, _types in _STATEMENTS)
    aliases: dict[str, str] = {}
    for table, alias in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)\s+(\w+)", text):
        if alias.isupper():  # no alias: the next keyword (`FROM access_epoch WHERE`)
            continue
        assert aliases.setdefault(alias, table) == table, f"alias {alias}: two tables"
    found: dict[str, set[str]] = {}
    for alias, column in re.findall(r"\b(\w+)\.(\w+)\b", text):
        if alias in aliases:
            found.setdefault(aliases[alias], set()).add(column)
    return found


async def missing_watches(connection: asyncpg.Connection) -> list[str]:
    """What the access triggers fail to watch of what the rule reads: a table with no
    enabled row trigger firing after both UPDATE and DELETE, or a column (not of its primary
    key: the service never updates one) whose UPDATE the trigger ignores."""
    triggers = {
        row["table"]: row
        for row in await connection.fetch(
            """
            SELECT c.relname AS table, t.tgtype, t.tgenabled <> 'D' AS enabled, p.prosrc
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
            JOIN pg_proc p ON p.oid = t.tgfoid
            WHERE t.tgname = 'access_changed' AND NOT t.tgisinternal
            """
        )
    }
    keys: dict[str, set[str]] = {}
    for row in await connection.fetch(
        """
        SELECT c.relname AS table, a.attname AS column
        FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey)
        WHERE i.indisprimary
        """
    ):
        keys.setdefault(row["table"], set()).add(row["column"])
    columns = columns_read()
    missing = []
    for table in sorted(await tables_read(connection) - _UNWATCHED):
        trigger = triggers.get(table)
        fires = _ROW | _UPDATE | _DELETE
        if (
            trigger is None
            or not trigger["enabled"]
            or trigger["tgtype"] & (fires | _BEFORE) != fires
        ):
            missing.append(f"{table}: no row trigger after UPDATE and DELETE")
            continue
        if "NOT (true)" in trigger["prosrc"]:  # every UPDATE counts
            continue
        for column in sorted(columns.get(table, set()) - keys.get(table, set())):
            if f"OLD.{column}" not in trigger["prosrc"]:
                missing.append(f"{table}.{column}: an UPDATE of it bumps nothing")
    return missing


@pytest.fixture
async def connection(settings: Settings) -> Any:
    found = await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))
    yield found
    await found.close()


async def test_every_table_and_column_the_rule_reads_is_watched(
    connection: asyncpg.Connection,
) -> None:
    read = await tables_read(connection)
    # The directory, the grants and the consumers (a plan that lost some would prove little).
    assert read >= {"users", "roles", "offering_access", "offerings", "projects"}
    assert read >= {"event_consumers", "event_consumer_bindings", "event_consumer_scopes"}
    # Every table's columns found through its alias (the epoch's own table has none).
    assert read - set(columns_read()) == {"access_epoch"}
    assert columns_read()["users"] >= {"is_active", "token_hash", "token_expires_at"}
    assert await missing_watches(connection) == []


@pytest.mark.parametrize(
    ("change", "reported"),
    [
        ("DROP TRIGGER access_changed ON roles", "roles: no row trigger"),
        ("ALTER TABLE projects DISABLE TRIGGER access_changed", "projects: no row trigger"),
        (
            # The users' trigger as if written before `is_support` counted.
            """CREATE OR REPLACE FUNCTION queuekeeper_access_changed_users() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN
                IF TG_OP = 'UPDATE' AND NOT (ROW(OLD.is_active, OLD.is_staff, OLD.token_hash,
                    OLD.token_expires_at) IS DISTINCT FROM ROW(NEW.is_active, NEW.is_staff,
                    NEW.token_hash, NEW.token_expires_at)) THEN RETURN NULL; END IF;
                RETURN NULL;
            END $$""",
            "users.is_support: an UPDATE of it bumps nothing",
        ),
    ],
)
async def test_a_table_or_column_left_unwatched_is_reported(
    connection: asyncpg.Connection, change: str, reported: str
) -> None:
    """The check itself, against the test's own database changed in a transaction that is
    rolled back."""
    transaction = connection.transaction()
    await transaction.start()
    try:
        await connection.execute(change)
        missing = await missing_watches(connection)
    finally:
        await transaction.rollback()
    assert [line for line in missing if line.startswith(reported)] == missing
    assert missing
    assert await missing_watches(connection) == []
