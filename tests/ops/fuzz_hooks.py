"""Schemathesis hooks for tests/ops/test_fuzz.py (loaded by the schemathesis process through
SCHEMATHESIS_HOOKS): bad input generated beside the schema's own, and a check that an
answer refusing a request changed nothing (contract §14).

* Bodies and queries: besides what schemathesis generates, a variant with one value
  changed: a string (or a key) holding a lone UTF-16 surrogate, a datetime without an
  offset or out of range in UTC, or a value nested thousands of levels deep.
* `nothing_changed`: an answer of 400, 403, 404, 409, 413, 422 or 5xx leaves the database
  (the row count of every table) and the broker (this instance's vhosts, their queues and
  its users) as they were just before the request.

The test hands the database, the broker and the instance over in QK_FUZZ_* variables.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from typing import Any

import asyncpg
import httpx
import schemathesis
from hypothesis import strategies as st

# A nested value deeper than the server's JSON parser goes (Python's default recursion
# limit, 1000); schemathesis hashes, copies and encodes it recursively, a few frames per
# level, so this process allows more.
DEPTH = 1100
sys.setrecursionlimit(max(sys.getrecursionlimit(), DEPTH * 20))

SURROGATES = ("\ud800", "\udfff", "x\udbff")
NAIVE = "2030-01-02T03:04:05"
OUT_OF_RANGE = ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00")
DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
UNCHANGED_ON = frozenset({400, 403, 404, 409, 413, 422})
READS = frozenset({"GET", "HEAD", "OPTIONS"})


def _deep(value: Any) -> Any:
    nested: Any = value
    for _ in range(DEPTH):
        nested = [nested]
    return nested


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every value inside `value` with its path (the root's path is empty)."""
    found = [(path, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(_places(item, (*path, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(_places(item, (*path, index)))
    return found


def _replaced(value: Any, path: tuple[Any, ...], new: Any, *, key: bool = False) -> Any:
    """A copy of `value` with the value at `path` replaced (or, with `key`, its key)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        copy = dict(value)
        if key and not rest:
            copy[new] = copy.pop(head)
        else:
            copy[head] = _replaced(value[head], rest, new, key=key)
        return copy
    copy_list = list(value)
    copy_list[head] = _replaced(value[head], rest, new, key=key)
    return copy_list


def _bad_value(value: Any, kind: int) -> Any:
    """What a value becomes: a lone surrogate (alone or appended), a datetime without an
    offset or out of range in UTC (for a datetime, else a surrogate), or nested deep."""
    if kind == 0:
        return SURROGATES[0] if not isinstance(value, str) else value + SURROGATES[0]
    if kind == 1:
        return SURROGATES[2]
    if kind in (2, 3, 4):
        if isinstance(value, str) and DATETIME.match(value):
            return (NAIVE, *OUT_OF_RANGE)[kind - 2]
        return SURROGATES[1]
    return _deep(value)


KINDS = 7  # 0-5 a value (5: nested deep), 6 the value's key


def _variant(body: Any, places: list[tuple[tuple[Any, ...], Any]], chosen: tuple[int, int]) -> Any:
    place, kind = chosen
    path, value = places[place]
    if kind == KINDS - 1 and path and isinstance(path[-1], str):
        return _replaced(body, path, path[-1] + SURROGATES[1], key=True)
    return _replaced(body, path, _bad_value(value, min(kind, KINDS - 2)))


def _with_bad_input(body: Any) -> st.SearchStrategy[Any]:
    """The body as generated, or one value (or key) of it made bad; for an object, also a
    naive datetime in a field of that name it may lack."""
    places = [place for place in _places(body) if place[0]]
    options: list[st.SearchStrategy[Any]] = [st.just(body)]
    if places:
        chosen = st.tuples(st.integers(0, len(places) - 1), st.integers(0, KINDS - 1))
        bad = chosen.map(lambda picked: _variant(body, places, picked))
        options.extend([bad, bad, bad])  # most examples carry bad input
    if isinstance(body, dict):
        options.append(
            st.sampled_from(["expires_at", "token_expires_at", "since", "until"]).map(
                lambda name: {**body, name: NAIVE}
            )
        )
    return st.one_of(options)


def _reachable(body: Any) -> list[Any]:
    """The body, and one whose `scopes` bind the seeded offering (QK_FUZZ_OFFERING), which
    the fuzzing agent may bind: without it a registration is refused before anything it
    stores is read, and what a stored value breaks is never reached."""
    offering = os.environ.get("QK_FUZZ_OFFERING")
    if not offering or not isinstance(body, dict) or "scopes" not in body:
        return [body]
    return [body, {**body, "scopes": [{"type": "offering", "uuid": offering}]}]


@schemathesis.hook
def flatmap_body(_ctx: Any, body: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(_reachable(body)).flatmap(_with_bad_input)


@schemathesis.hook
def flatmap_query(_ctx: Any, query: dict[str, Any]) -> st.SearchStrategy[Any]:
    if not isinstance(query, dict):
        return st.just(query)
    dated = [
        {**query, name: bad}
        for name, value in query.items()
        if isinstance(value, str) and DATETIME.match(value)
        for bad in (NAIVE, *OUT_OF_RANGE)
    ]
    return st.one_of(st.just(query), st.sampled_from(dated)) if dated else st.just(query)


class _State:
    """The database's row counts and the broker's objects of this instance, read from the
    schemathesis process (its own event loop for asyncpg)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.connection: asyncpg.Connection | None = None
        self.count_sql: str | None = None
        self.tag = os.environ["QK_FUZZ_INSTANCE_TAG"]
        self.http = httpx.Client(
            base_url=os.environ["QK_FUZZ_MANAGEMENT_URL"],
            auth=(os.environ["QK_FUZZ_MANAGEMENT_USER"], os.environ["QK_FUZZ_MANAGEMENT_PASSWORD"]),
            timeout=30,
        )
        self.state_before: dict[str, Any] | None = None
        # The broker's objects as read after the last call, while no call may have changed
        # them since (None: read them again before the next write).
        self.broker: dict[str, Any] | None = None
        self.pending = False  # a call was made and its check has not run yet

    async def _rows(self) -> dict[str, int]:
        if self.connection is None:
            self.connection = await asyncpg.connect(os.environ["QK_FUZZ_DATABASE_URL"])
            tables = [
                row["tablename"]
                for row in await self.connection.fetch(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                    "AND tablename <> 'alembic_version' ORDER BY tablename"
                )
            ]
            self.count_sql = "SELECT " + ", ".join(
                f'(SELECT count(*) FROM "{table}") AS "{table}"' for table in tables
            )
        assert self.count_sql is not None
        row = await self.connection.fetchrow(self.count_sql)
        return dict(row) if row is not None else {}

    def _get(self, path: str, columns: str, **query: str) -> list[dict[str, Any]]:
        """A Management API listing; retried, as the broker answers slowly under load."""
        for attempt in range(5):
            # Once in 13,000 calls under load the column filter answered rows of another
            # shape: the last attempts ask for whole rows.
            params = {"columns": columns, **query} if attempt < 2 else query
            response = self.http.get(path, params=params)
            if response.status_code == 200:
                found = response.json()
                if isinstance(found, list) and all(isinstance(row, dict) for row in found):
                    return found
            time.sleep(0.2 * (attempt + 1))
        raise AssertionError(f"the Management API answered {path} with {response.text[:300]}")

    def _broker(self) -> dict[str, Any]:
        """Three listings whatever the instance holds: asking the broker (once per vhost and
        with message statistics) took most of the run's time, the broker's CPU included."""
        vhosts = sorted(
            vhost["name"]
            for vhost in self._get("/api/vhosts", "name,tags", disable_stats="true")
            if self.tag in (vhost.get("tags") or [])
        )
        users = sorted(
            user["name"]
            for user in self._get("/api/users", "name,tags")
            if self.tag in (user.get("tags") or [])
        )
        ours = set(vhosts)
        queues = sorted(
            (queue["vhost"], queue["name"])
            for queue in self._get("/api/queues", "vhost,name", disable_stats="true")
            if queue.get("vhost") in ours
        )
        return {"vhosts": vhosts, "users": users, "queues": queues}

    def rows(self) -> dict[str, int]:
        return self.loop.run_until_complete(self._rows())

    def before(self, method: str) -> None:
        """The state before a call; for a read (GET, HEAD), the database's rows only: the
        broker is read around the calls that may write, which keeps the run within its
        time. A write right after a write refused with nothing changed starts from the
        broker as read after that one: nothing but the fuzzer's calls (one at a time) may
        change it, and reading it again doubled the run's calls to the broker."""
        if self.pending:  # the last call's check never ran: it may have changed anything
            self.broker = None
        self.pending = True
        if method.upper() in READS:
            self.state_before = {"rows": self.rows()}
            return
        if self.broker is None:
            self.broker = self._broker()
        self.state_before = {"rows": self.rows(), **self.broker}

    def after(self, method: str) -> dict[str, Any]:
        if method.upper() in READS:
            return {"rows": self.rows()}
        return {"rows": self.rows(), **self._broker()}


_state: _State | None = None


def _current() -> _State:
    global _state
    if _state is None:
        _state = _State()
    return _state


@schemathesis.hook
def before_call(_ctx: Any, case: Any, _kwargs: Any) -> None:
    _current().before(case.method)


@schemathesis.check
def nothing_changed(_ctx: Any, response: Any, case: Any) -> None:
    """An answer refusing the request left the database and the broker as they were."""
    status = response.status_code
    state = _current()
    state.pending = False
    before, state.broker = state.state_before, None
    if os.environ.get("QK_FUZZ_LOG"):  # what was sent and answered, to see what a run tried
        with open(os.environ["QK_FUZZ_LOG"], "a", encoding="utf-8") as log:
            log.write(f"{status} {case.method} {case.formatted_path} {ascii(case.body)[:300]}\n")
    if before is None or not (status in UNCHANGED_ON or status >= 500):
        return
    after = state.after(case.method)
    if after == before:
        if "vhosts" in after:
            state.broker = {kind: after[kind] for kind in ("vhosts", "users", "queues")}
        return
    changes = []
    for name, rows in after["rows"].items():
        if rows != before["rows"].get(name):
            changes.append(f"table {name}: {before['rows'].get(name)} -> {rows} rows")
    for kind in ("vhosts", "users", "queues") if "vhosts" in after else ():
        made = sorted(set(map(str, after[kind])) - set(map(str, before[kind])))
        gone = sorted(set(map(str, before[kind])) - set(map(str, after[kind])))
        if made or gone:
            changes.append(f"broker {kind}: made {made}, gone {gone}")
    raise AssertionError(
        f"{case.method} {case.formatted_path} answered {status} but changed: " + "; ".join(changes)
    )
