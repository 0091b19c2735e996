"""One owner of a copy's state: no module but `events/outbox_postgres.py` writes `deliveries`
or `events` (docs/architecture.md, "Each in one place"). A service that decides to give up,
make due or prune copies calls the outbox (`events/outbox.py`), which runs that module's
statement; this test keeps the claim true by reading every other module's source."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "queuekeeper"
# The one module whose statements write a copy's state (its SQL text, run on asyncpg or,
# for a request's own transaction, through its session by `events/outbox.py`).
OWNER = PACKAGE / "events" / "outbox_postgres.py"
# The tables the outbox owns: a copy (`deliveries`) and what it keeps of an event.
TABLES = ("deliveries", "events")
_WRITE_SQL = re.compile(
    r"\b(?:UPDATE(?:\s+ONLY)?|INSERT\s+INTO|DELETE\s+FROM(?:\s+ONLY)?|MERGE\s+INTO|TRUNCATE"
    r"(?:\s+TABLE)?(?:\s+ONLY)?)\s+(?:" + "|".join(TABLES) + r")\b",
    re.IGNORECASE,
)
# How the models and the Core tables of those two are named where they are imported.
_MODELS = {"Delivery", "Event"}
_CORE = {"DELIVERIES", "EVENTS"}
_WRITES = {"update", "insert", "delete"}


def _table_names(tree: ast.Module) -> dict[str, bool]:
    """The names a module gives the two tables, each with whether it is a model (else a Core
    table): imported models and Core tables (as they are aliased), and module variables bound
    to `metadata.tables["deliveries"]` or `Model.__table__`."""
    names: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("queuekeeper"):
            for alias in node.names:
                if alias.name in _MODELS | _CORE:
                    names[alias.asname or alias.name] = alias.name in _MODELS
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if value is not None and _names_table(value, names):
                model = isinstance(value, ast.Name) and names[value.id]
                names.update((t.id, model) for t in targets if isinstance(t, ast.Name))
    return names


def _names_table(node: ast.expr, names: dict[str, bool]) -> bool:
    """Whether the expression is one of the tables: a name of them, `X.__table__`, or
    `...tables["deliveries"]`."""
    if isinstance(node, ast.Name):
        return node.id in names
    return _is_core(node, names)


def _is_core(node: ast.expr, names: dict[str, bool]) -> bool:
    """Whether the expression is a Core table of the two (`DELIVERIES`, `Delivery.__table__`,
    `metadata.tables["deliveries"]`), whose `.update()`, `.insert()`, `.delete()` write."""
    if isinstance(node, ast.Name):
        return node.id in names and not names[node.id]
    if isinstance(node, ast.Attribute) and node.attr == "__table__":
        return _names_table(node.value, names)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value in TABLES
    return False


def _write_functions(tree: ast.Module) -> set[str]:
    """`update`, `insert`, `delete` under the names a module imports them by (e.g.
    `from sqlalchemy.dialects.postgresql import insert as pg_insert`)."""
    found = set(_WRITES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found.update(a.asname or a.name for a in node.names if a.name in _WRITES)
    return found


def writes(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) of each write of `deliveries` or `events` in the source: SQL text that
    updates, inserts into, deletes from, merges into or truncates them; `update(X)`,
    `insert(X)`, `delete(X)` of their models or tables (SQLAlchemy's functions, under any
    alias, or a module's `sa.update(X)`); `X.update()`, `.insert()`, `.delete()` of a Core
    table; and a new `Delivery(...)` or `Event(...)` row."""
    tree = ast.parse(source)
    tables = _table_names(tree)
    functions = _write_functions(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _WRITE_SQL.finditer(node.value):
                yield node.lineno, f"SQL text {match.group(0)!r}"
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in functions and node.args and _names_table(node.args[0], tables):
            yield node.lineno, f"{name}({ast.unparse(node.args[0])})"
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in _WRITES
            and _is_core(func.value, tables)
        ):
            yield node.lineno, f"{ast.unparse(func)}()"
        elif isinstance(func, ast.Name) and tables.get(func.id):
            yield node.lineno, f"a new {func.id} row"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != OWNER)


def test_only_the_outbox_writes_copy_state() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in _modules()
        for line, what in writes(path.read_text())
    ]
    assert not found, (
        "a copy's state (`deliveries`, `events`) is written only by events/outbox_postgres.py's "
        "statements, run through events/outbox.py; move these there:\n" + "\n".join(found)
    )


def test_the_owner_is_where_the_claim_says() -> None:
    """The check reads real modules: the owner exists and its writes are seen."""
    assert len(_modules()) > 50
    assert sum(1 for _ in writes(OWNER.read_text())) > 10


@pytest.mark.parametrize(
    "source",
    [
        "S = text(\"UPDATE deliveries d SET state = 'given_up'\")",
        'S = """\nupdate  deliveries\nset next_attempt_at = :now"""',
        'S = "INSERT INTO deliveries (event_id) VALUES (:e)"',
        'S = "DELETE FROM events WHERE accepted < :cutoff"',
        'S = "WITH x AS (SELECT 1) DELETE FROM ONLY deliveries"',
        "from queuekeeper.models import Delivery\nq = update(Delivery).values(state='x')",
        "from queuekeeper.models import Delivery as D\nimport sqlalchemy as sa\nq = sa.delete(D)",
        "from sqlalchemy.dialects.postgresql import insert as pg_insert\n"
        "from queuekeeper.models import Event\nq = pg_insert(Event)",
        "from queuekeeper.events.repository import EVENTS\nq = delete(EVENTS)",
        "from queuekeeper.events.repository import DELIVERIES\nq = DELIVERIES.update()",
        'T = Base.metadata.tables["deliveries"]\nq = update(T)',
        "from queuekeeper.models import Delivery\nq = Delivery.__table__.delete()",
        "from queuekeeper.models import Delivery\nsession.add(Delivery(event_id='e'))",
    ],
)
def test_a_write_is_seen(source: str) -> None:
    assert list(writes(source))


@pytest.mark.parametrize(
    "source",
    [
        "S = \"SELECT count(*) FROM deliveries WHERE state = 'pending'\"",
        'S = "UPDATE event_consumers SET last_error = :e"',
        "from queuekeeper.models import Delivery\nq = select(Delivery.id)",
        "from queuekeeper.models import EventConsumer\nq = update(EventConsumer)",
        "# UPDATE deliveries in a comment is prose\nx = 1",
        "from queuekeeper.models import Delivery\nx = Delivery.state == 'pending'",
    ],
)
def test_a_read_is_not_a_write(source: str) -> None:
    assert not list(writes(source))
