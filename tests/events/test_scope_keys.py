"""An event's scope keys have one definition (events/authorization.py), which the store's
recipients statement and the rule a copy is published by both read: a copy the store hands
over skips the rule while access is unchanged (docs/decisions/029-judged-as-it-leaves.md),
so a key one knows and the other does not would send a copy the rule refuses, or withhold
one it owes, with nothing failing until a replay."""

from __future__ import annotations

import hashlib
import importlib.util
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from sqlalchemy import insert

from queuekeeper import db
from queuekeeper.config import Settings
from queuekeeper.events import authorization, outbox_postgres
from queuekeeper.models import Base, utcnow

TABLES = Base.metadata.tables
# The columns that link an entity to the entities above it: walking them is the chain.
_CHAIN_COLUMNS = ("customer_uuid", "project_uuid")


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every function of authorization.py made to record (its name, the SQL it gave)."""
    calls: list[tuple[str, str]] = []
    for name, function in list(vars(authorization).items()):
        if not (callable(function) and name.endswith("_sql")):
            continue

        def recorded(*args: Any, _name: str = name, _f: Callable[..., str] = function) -> str:
            sql = _f(*args)
            calls.append((_name, sql))
            return sql

        monkeypatch.setattr(authorization, name, recorded)
    return calls


def _without(sql: str, calls: list[tuple[str, str]]) -> str:
    for _name, fragment in sorted(calls, key=lambda call: -len(call[1])):
        sql = sql.replace(fragment, " ")
    return sql


def test_the_recipients_statement_reads_the_keys_the_rule_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """event_keys_sql is made of key functions alone; the recipients statement, built anew
    with authorization.py's functions recording, calls each of them, and apart from what
    they (and binding_allowed_sql) give it walks no link of the chain itself."""
    calls = _recording(monkeypatch)
    keys = authorization.event_keys_sql("$1::uuid", "$2::uuid", "$3::uuid")
    parts = {name for name, _sql in calls if name != "event_keys_sql"}
    assert parts, "event_keys_sql builds its rows from functions of its module"
    assert "SELECT" not in _without(keys, [c for c in calls if c[0] != "event_keys_sql"])

    calls.clear()
    spec = importlib.util.spec_from_file_location("_recipients_probe", outbox_postgres.__file__)
    assert spec is not None
    assert spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.RECIPIENTS == outbox_postgres.RECIPIENTS  # the same statement, built again
    used = {name for name, _sql in calls}
    assert parts <= used, f"the recipients statement does not read {parts - used}"
    for keyed, statement in probe.RECIPIENTS.items():
        rest = _without(statement, calls)
        for column in _CHAIN_COLUMNS:
            assert column not in rest, f"RECIPIENTS[{keyed}] walks {column} itself"


@pytest.fixture
async def directory(settings: Settings, clean_state: None) -> AsyncIterator[Any]:
    engine = db.create_engine(settings)
    connection = await asyncpg.connect(settings.database_url.replace("+asyncpg", ""))

    async def add(table: str, **values: Any) -> uuid.UUID | None:
        if "uuid" in TABLES[table].c:
            values.setdefault("uuid", uuid.uuid4())
        async with engine.begin() as session:
            await session.execute(insert(TABLES[table]).values(**values))
        found: uuid.UUID | None = values.get("uuid")
        return found

    add.connection = connection  # type: ignore[attr-defined]
    try:
        yield add
    finally:
        await connection.close()
        await engine.dispose()


def _user(staff: bool = False) -> dict[str, Any]:
    token = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    return {"username": "u", "token_hash": token, "is_staff": staff}


@pytest.mark.parametrize("names_project_and_subject", [True, False])
async def test_a_consumer_bound_to_any_key_of_an_event_is_a_recipient_iff_the_rule_says_so(
    directory: Any, names_project_and_subject: bool
) -> None:
    """For each key the rule finds for an event (event_keys_sql, run on the database), a
    consumer bound to it; and consumers bound elsewhere, or by an owner who may not hold
    their binding. The recipients statement's consumers are exactly the rule's."""
    add, connection = directory, directory.connection
    customers = [await add("customers", name="c") for _ in range(4)]
    projects = [await add("projects", name="p", customer_uuid=customers[i + 1]) for i in range(3)]
    offering = await add(
        "offerings", name="o", customer_uuid=customers[0], project_uuid=projects[0]
    )
    subject = await add("users", **_user())
    project = projects[1] if names_project_and_subject else None
    about = subject if names_project_and_subject else None
    now = utcnow()

    keys = await connection.fetch(
        authorization.event_keys_sql("$1::uuid", "$2::uuid", "$3::uuid"), offering, project, about
    )
    # The offering's customer, its project and that project's customer; the event's project
    # and its customer; the subject.
    assert len(keys) == (6 if names_project_and_subject else 3)

    staff = await add("users", **_user(staff=True))
    plain = await add("users", **_user())
    role_holder = await add("users", **_user())
    await add(
        "roles",
        user_uuid=role_holder,
        role_name="r",
        scope_type="customer",
        scope_uuid=customers[1],  # projects[0]'s customer
    )
    consumers: list[uuid.UUID] = []

    async def consumer(owner: uuid.UUID, kind: str, entity: uuid.UUID) -> uuid.UUID:
        made = await add(
            "event_consumers",
            user_uuid=owner,
            queue_name=f"consumer_{uuid.uuid4().hex}",
            vhost="v",
            object_types=[],
        )
        if kind == "offering":
            await add("event_consumer_scopes", consumer_uuid=made, offering_uuid=entity)
        else:
            await add(
                "event_consumer_bindings",
                consumer_uuid=made,
                scope_type=kind,
                scope_uuid=entity,
            )
        consumers.append(made)
        return made

    owed = {await consumer(staff, kind, entity) for kind, entity in keys}
    owed.add(await consumer(staff, "offering", offering))
    owed.add(await consumer(role_holder, "project", projects[0]))  # a role on its customer
    await consumer(plain, "customer", customers[0])  # may not hold it
    await consumer(staff, "customer", customers[3])  # no key of the event
    await consumer(staff, "project", projects[2])
    await consumer(staff, "user", staff)

    rows = await connection.fetch(
        outbox_postgres.RECIPIENTS[names_project_and_subject],
        [offering],
        ["order"],
        now,
        [project] if project else [],
        [about] if about else [],
    )
    kinds = {"consumer", "project", "subject", "global"}
    recipients = {row[2] for row in rows if row[1] in kinds}
    rule = authorization.authorized_sql(
        "NULL::uuid", "$1::uuid", "$2::uuid", "$3::timestamptz", "$4::uuid", "$5::uuid"
    )
    authorized = {
        made
        for made in consumers
        if await connection.fetchval(f"SELECT {rule}", made, offering, now, project, about)
    }
    assert authorized == owed
    assert recipients == authorized
