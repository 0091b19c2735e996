"""Bad input is a 400 naming what is wrong, never a 5xx; only a database (or broker) that
is really unreachable is a 503. The cases a fuzz run and a probe found, and their classes."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from queuekeeper.common.pagination import MAX_PAGE
from queuekeeper.config import Settings
from queuekeeper.errors import DatabaseProblem, classify_database_error
from tests.helpers import Backend
from tests.pg_refusing import at_port, refusing_postgres
from tests.proxy import closed_port

HUGE = "11945584113270350860971166138368"
LISTS = [
    "/api/admin/dead-letters/",
    "/api/admin/reconcile-runs/",
    "/api/admin/queues/",
    "/api/admin/agent-identities/",
]


def _fields(response: httpx.Response) -> set[str]:
    return {error["field"] for error in response.json().get("errors", [])}


async def test_redrive_with_an_empty_or_malformed_vhost_is_a_400_naming_it(
    backend: Backend,
) -> None:
    for vhost in ["", "   ", "%00", "%0A", "%09x", "a" * 256]:
        for method, path in [
            ("POST", "/api/admin/dead-letters/redrive/"),
            ("GET", "/api/admin/dead-letters/"),
        ]:
            response = await backend.client.request(
                method, f"{path}?vhost={vhost}", headers=backend.headers
            )
            assert response.status_code == 400, (vhost, path, response.text)
            assert _fields(response) == {"vhost"}
            assert "vhost" in response.json()["detail"]


async def test_redrive_of_a_vhost_not_ours_is_still_a_404(backend: Backend) -> None:
    for vhost in [str(uuid.uuid4()), "not-a-vhost", "%2F", "a" * 255]:
        response = await backend.client.post(
            f"/api/admin/dead-letters/redrive/?vhost={vhost}", headers=backend.headers
        )
        assert response.status_code == 404, (vhost, response.text)
        assert _fields(response) == {"vhost"}


async def test_an_empty_filter_of_the_queue_view_is_a_400_naming_it(backend: Backend) -> None:
    for name in ("vhost", "offering_uuid", "event_subscription_uuid"):
        response = await backend.client.get(f"/api/admin/queues/?{name}=", headers=backend.headers)
        assert response.status_code == 400, (name, response.text)
        assert _fields(response) == {name}


async def test_an_error_quotes_at_most_a_little_of_a_huge_input(backend: Backend) -> None:
    huge = "a" * 60_000
    agent = await backend.put_user()
    for path, headers, status in [
        (f"/api/event-consumers/{huge}/status/", agent.headers, 404),
        (f"/api/event-consumers/{huge}/", agent.headers, 404),
        (f"/api/event-subscriptions/{huge}/", agent.headers, 404),
        (f"/api/admin/reconcile-runs/{huge}/", backend.headers, 404),
        (f"/api/no-such-route/{huge}", backend.headers, 404),
        (f"/api/admin/queues/?offering_uuid={huge}", backend.headers, 400),
        (f"/api/admin/dead-letters/?vhost=%20{huge}", backend.headers, 400),
    ]:
        response = await backend.client.get(path, headers=headers)
        assert response.status_code == status, (path[:80], response.text[:300])
        assert len(response.content) < 1_000, (path[:80], len(response.content))
        detail = response.json()["detail"]
        assert "aaaa" in detail, detail  # still recognisable, and said to be cut
        assert "characters)" in detail, detail


async def test_page_numbers_are_bounded(backend: Backend) -> None:
    cases = [
        (f"page={HUGE}", "page"),
        (f"page={MAX_PAGE + 1}", "page"),
        ("page=0", "page"),
        (f"page_size={HUGE}", "page_size"),
        ("page_size=1001", "page_size"),
    ]
    for path in LISTS:
        for query, field in cases:
            response = await backend.client.get(f"{path}?{query}", headers=backend.headers)
            assert response.status_code == 400, (path, query, response.text)
            assert _fields(response) == {field}


async def test_the_last_allowed_page_is_answered_empty(backend: Backend) -> None:
    response = await backend.client.get(
        f"/api/admin/reconcile-runs/?page={MAX_PAGE}&page_size=1000", headers=backend.headers
    )
    assert response.status_code == 200, response.text
    assert response.json() == []


async def test_nul_in_free_text_is_a_400_naming_the_field(backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.client.post(
        "/api/event-subscriptions/",
        json={"description": "site\x00agent"},
        headers=agent.headers,
    )
    assert subscription.status_code == 400, subscription.text
    assert _fields(subscription) == {"description"}
    identity = await agent.client.post(
        "/api/marketplace-site-agent-identities/",
        json={"offering_uuid": offering.hex, "name": "agent\x00one"},
        headers=agent.headers,
    )
    assert identity.status_code == 400, identity.text
    assert _fields(identity) == {"name"}
    user = await backend.client.put(
        f"/api/internal/users/{uuid.uuid4().hex}/",
        json={"username": "a\x00b"},
        headers=backend.headers,
    )
    assert user.status_code == 400, user.text
    assert _fields(user) == {"username"}
    query = await backend.client.get(
        "/api/admin/agent-identities/?name=a%00b", headers=backend.headers
    )
    assert query.status_code == 400, query.text
    assert _fields(query) == {"name"}


async def test_nan_and_infinity_in_an_event_payload_are_a_400(backend: Backend) -> None:
    _agent, offering = await backend.agent_with_offering()
    envelope = f'"offering_uuid": "{offering.hex}", "object_type": "order"'
    for constant in ["NaN", "Infinity", "-Infinity"]:
        await _refused_payload(backend, envelope, constant)


async def _refused_payload(backend: Backend, envelope: str, constant: str) -> None:
    body = f'{{{envelope}, "payload": {{"price": {constant}}}}}'
    response = await backend.client.post(
        "/api/internal/events/",
        content=body,
        headers={**backend.headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert _fields(response) == {"payload.price"}
    batch = await backend.client.post(
        "/api/internal/events/batch/",
        content=f'{{"events": [{body}]}}',
        headers={**backend.headers, "Content-Type": "application/json"},
    )
    assert batch.status_code == 400, batch.text
    assert _fields(batch) == {"events.0.payload.price"}


def _unreachable_database(settings: Settings) -> str:
    """A URL of the suite's database at a port nothing listens on."""
    return at_port(settings.database_url, closed_port())


async def test_an_unreachable_database_is_a_503_with_retry_after(
    settings: Settings, make_client: Any
) -> None:
    http = await make_client(
        database_url=_unreachable_database(settings),
        relay_enabled=False,
        scheduler_enabled=False,
    )
    response = await http.get(
        "/api/admin/reconcile-runs/",
        headers={"Authorization": "Bearer service-token-primary-0123456789"},
    )
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
    assert "database" in response.json()["detail"]


class _Driver(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _wrapped(orig: BaseException, *, invalidated: bool = False) -> DBAPIError:
    return DBAPIError("select 1", {}, orig, connection_invalidated=invalidated)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_wrapped(_Driver("22003")), DatabaseProblem.BAD_VALUE),  # numeric value out of range
        (_wrapped(_Driver("22021")), DatabaseProblem.BAD_VALUE),  # NUL byte
        (_wrapped(_Driver("22P02")), DatabaseProblem.BAD_VALUE),  # NaN in json
        (_wrapped(_Driver("23505")), DatabaseProblem.CONFLICT),
        (_wrapped(_Driver("40P01")), DatabaseProblem.CONFLICT),  # deadlock: retry
        (_wrapped(_Driver("08006")), DatabaseProblem.UNREACHABLE),
        (_wrapped(_Driver("57P01")), DatabaseProblem.UNREACHABLE),  # admin shutdown
        (_wrapped(_Driver("53300")), DatabaseProblem.UNREACHABLE),  # too many connections
        (_wrapped(_Driver("42601")), DatabaseProblem.OTHER),  # a syntax error is a bug
        (_wrapped(_Driver("42601"), invalidated=True), DatabaseProblem.UNREACHABLE),
        (_wrapped(ConnectionRefusedError()), DatabaseProblem.UNREACHABLE),
        (OperationalError("x", {}, ConnectionResetError()), DatabaseProblem.UNREACHABLE),
        (_wrapped(OverflowError("value out of int64 range")), DatabaseProblem.BAD_VALUE),
        (PoolTimeout("QueuePool limit reached"), DatabaseProblem.UNREACHABLE),
        (ConnectionRefusedError(), DatabaseProblem.UNREACHABLE),
    ],
)
def test_database_errors_are_classified(error: BaseException, expected: DatabaseProblem) -> None:
    assert classify_database_error(error) is expected


@pytest.mark.parametrize(
    ("method", "path"),
    [
        # the request guard looks the token up (a registration call, before the body)
        ("POST", "/api/event-subscriptions/"),
        # the route's dependency looks it up (a GET passes the guard unauthenticated)
        ("GET", "/api/event-subscriptions/"),
    ],
)
async def test_an_agent_call_while_the_database_is_unreachable_is_a_503(
    settings: Settings, make_client: Any, method: str, path: str
) -> None:
    http = await make_client(
        database_url=_unreachable_database(settings),
        relay_enabled=False,
        scheduler_enabled=False,
    )
    body = {"description": "x"} if method == "POST" else None
    response = await http.request(method, path, json=body, headers={"Authorization": "Token abc"})
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
    assert "database" in response.json()["detail"]


async def test_an_agent_call_while_postgres_starts_up_is_a_503(
    settings: Settings, make_client: Any
) -> None:
    """PostgreSQL refuses connections while it starts (57P03): the guard's token lookup
    answers 503 like any unreachable database."""
    async with refusing_postgres("57P03", "the database system is starting up") as port:
        http = await make_client(
            database_url=at_port(settings.database_url, port),
            relay_enabled=False,
            scheduler_enabled=False,
        )
        response = await http.post(
            "/api/event-subscriptions/", json={}, headers={"Authorization": "Token abc"}
        )
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == str(settings.retry_after_seconds)
