"""The Management API client: typed errors that keep the broker's reason, encoding, retries."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import respx

from queuekeeper.broker import management
from queuekeeper.broker.management import (
    BrokerOverview,
    BrokerUnavailable,
    ConnectionInfo,
    ManagementBadRequest,
    ManagementClient,
    ManagementNotFound,
    Permission,
    QueueInfo,
    UserInfo,
    VhostInfo,
)
from queuekeeper.config import Settings
from tests.proxy import closed_port

BASE = "http://mgmt.test:15672/api"


@pytest.fixture
async def fake() -> AsyncIterator[ManagementClient]:
    client = ManagementClient(
        Settings(management_url="http://mgmt.test:15672", management_timeout=0.5)
    )
    yield client
    await client.aclose()


async def test_not_found_tells_vhost_from_object(fake: ManagementClient) -> None:
    with respx.mock:
        respx.put(f"{BASE}/queues/v1/q").mock(
            return_value=httpx.Response(
                404, json={"error": "not_found", "reason": "vhost_not_found"}
            )
        )
        with pytest.raises(ManagementNotFound) as raised:
            await fake.put_queue("v1", "q", arguments={})
        assert raised.value.vhost_not_found
        respx.get(f"{BASE}/queues/v1/q").mock(
            return_value=httpx.Response(
                404, json={"error": "Object Not Found", "reason": "Not Found"}
            )
        )
        assert await fake.get_queue("v1", "q") is None


async def test_bad_request_keeps_the_inequivalent_reason(fake: ManagementClient) -> None:
    reason = (
        "inequivalent arg 'x-message-ttl' for queue 'q' in vhost 'v': "
        "received '1' but current is none"
    )
    with respx.mock:
        respx.put(f"{BASE}/queues/v/q").mock(
            return_value=httpx.Response(400, json={"error": "bad_request", "reason": reason})
        )
        with pytest.raises(ManagementBadRequest) as raised:
            await fake.put_queue("v", "q", arguments={"x-message-ttl": 1})
    assert raised.value.inequivalent
    assert raised.value.reason == reason


async def test_credentials_refused_is_unavailable_with_reason(fake: ManagementClient) -> None:
    with respx.mock:
        respx.get(f"{BASE}/vhosts/v").mock(
            return_value=httpx.Response(
                401, json={"error": "not_authorised", "reason": "Login failed"}
            )
        )
        with pytest.raises(BrokerUnavailable, match="credentials"):
            await fake.get_vhost("v")


async def test_one_retry_on_5xx_then_success(fake: ManagementClient) -> None:
    with respx.mock:
        route = respx.get(f"{BASE}/vhosts/v").mock(
            side_effect=[httpx.Response(503, text="busy"), httpx.Response(200, json={"name": "v"})]
        )
        assert await fake.get_vhost("v") == VhostInfo("v")
        assert route.call_count == 2


async def test_timeouts_and_odd_bodies_are_unavailable(fake: ManagementClient) -> None:
    with respx.mock:
        route = respx.get(f"{BASE}/vhosts/v").mock(side_effect=httpx.ReadTimeout("slow"))
        with pytest.raises(BrokerUnavailable, match="unreachable"):
            await fake.get_vhost("v")
        assert route.call_count == 2
        respx.get(f"{BASE}/users/u").mock(return_value=httpx.Response(200, text="<html>"))
        with pytest.raises(BrokerUnavailable, match="not JSON"):
            await fake.get_user("u")
        respx.get(f"{BASE}/users/x").mock(return_value=httpx.Response(200, json=[1, 2]))
        with pytest.raises(BrokerUnavailable, match="unexpected body"):
            await fake.get_user("x")


async def test_names_are_url_encoded(fake: ManagementClient) -> None:
    with respx.mock:
        route = respx.get(f"{BASE}/queues/%2F/a%2Fb%20c").mock(
            return_value=httpx.Response(200, json={"name": "a/b c"})
        )
        assert await fake.get_queue("/", "a/b c") == QueueInfo("a/b c", "/")
        assert route.called


async def test_answers_are_parsed_into_typed_records(fake: ManagementClient) -> None:
    """Tags come as a list (3.10+) or a comma-separated string (older brokers); statistics
    the broker has not computed yet are None, not 0."""
    with respx.mock:
        respx.get(f"{BASE}/vhosts").mock(
            return_value=httpx.Response(
                200, json=[{"name": "a", "tags": ["x", "y"]}, {"name": "b", "tags": "x,z"}, 7]
            )
        )
        respx.get(f"{BASE}/users").mock(
            return_value=httpx.Response(200, json=[{"name": "u", "tags": "", "password_hash": "h"}])
        )
        respx.get(f"{BASE}/permissions").mock(
            return_value=httpx.Response(
                200,
                json=[{"user": "u", "vhost": "a", "configure": "^$", "write": "^$", "read": ".*"}],
            )
        )
        respx.get(f"{BASE}/queues/a").mock(
            return_value=httpx.Response(
                200,
                json={
                    "items": [
                        {"name": "q", "arguments": {"x-max-length": 5}, "messages": 3},
                        {"name": "r", "durable": True, "auto_delete": False, "type": "classic"},
                    ],
                    "page_count": 2,
                },
            )
        )
        assert await fake.list_vhosts() == [VhostInfo("a", ("x", "y")), VhostInfo("b", ("x", "z"))]
        assert await fake.list_users() == [UserInfo("u", (), "h")]
        [permission] = await fake.list_permissions()
        assert permission == Permission("u", "a", "^$", "^$", ".*")
        page = await fake.list_queues_page("a", page=1, page_size=2)
    assert page.page_count == 2
    assert page.items == [
        QueueInfo("q", "a", arguments={"x-max-length": 5}, messages=3),
        QueueInfo("r", "a", durable=True, auto_delete=False, type="classic"),
    ]
    assert page.items[1].messages is None


async def test_statistics_are_skipped_only_when_no_column_needs_them(
    fake: ManagementClient,
) -> None:
    """`disable_stats` makes the broker leave out `messages` and `consumers`: sent with them,
    reconcile's idle check would read every queue as "not computed yet"."""
    with respx.mock:
        route = respx.get(f"{BASE}/queues/v/q").respond(200, json={"name": "q"})
        await fake.get_queue("v", "q")
        await fake.get_queue("v", "q", columns="name,messages,consumers")
    definition, statistics = (call.request.url.params for call in route.calls)
    assert definition["disable_stats"] == "true"
    assert "disable_stats" not in statistics
    assert statistics["columns"] == "name,messages,consumers"
    # A page of them follows the same rule (reconcile's listing, the operator's view).
    with respx.mock:
        pages = respx.get(f"{BASE}/queues/v").respond(200, json={"items": [], "page_count": 0})
        await fake.list_queues_page("v", page=1, page_size=10, columns="name,arguments")
        await fake.list_queues_page("v", page=1, page_size=10)
    definition, statistics = (call.request.url.params for call in pages.calls)
    assert definition["disable_stats"] == "true"
    assert "disable_stats" not in statistics


async def test_real_broker_round_trip(settings: Settings) -> None:
    client = ManagementClient(settings)
    vhost = f"{settings.instance_name}-roundtrip"
    try:
        await client.put_vhost(vhost, description="test", tags=[settings.instance_tag])
        assert await client.put_queue(vhost, "q", arguments={"x-max-length": 5}) is True
        assert await client.put_queue(vhost, "q", arguments={"x-max-length": 5}) is False
        info = await client.get_queue(vhost, "q")
        assert info is not None
        assert (info.name, info.vhost, info.arguments) == ("q", vhost, {"x-max-length": 5})
        assert (info.durable, info.auto_delete) == (True, False)
        assert VhostInfo(vhost, (settings.instance_tag,)) in await client.list_vhosts()
        with pytest.raises(ManagementBadRequest) as raised:
            await client.put_queue(vhost, "q", arguments={"x-max-length": 6})
        assert raised.value.inequivalent
        assert await client.delete_queue(vhost, "q", if_empty=True, if_unused=True) is True
        assert await client.delete_queue(vhost, "q") is False
    finally:
        await client.delete_vhost(vhost)
        await client.aclose()


async def test_overview_names_the_running_rabbitmq_version(settings: Settings) -> None:
    client = ManagementClient(settings)
    try:
        overview = await client.overview()
    finally:
        await client.aclose()
    async with httpx.AsyncClient(
        auth=(settings.management_user, settings.management_password), timeout=5
    ) as raw:
        answer = await raw.get(f"{settings.management_urls[0]}/api/overview")
    assert overview == BrokerOverview(rabbitmq_version=answer.json()["rabbitmq_version"])
    assert overview.rabbitmq_version.split(".")[0].isdigit()


async def test_queues_now_counts_exactly_the_named_queues(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names are matched whole and literally (a `.` is no wildcard), in as many calls as
    QUEUES_PER_CALL needs; a vhost that is not there has none of them."""
    monkeypatch.setattr(management, "QUEUES_PER_CALL", 2)
    client = ManagementClient(settings)
    vhost = f"{settings.instance_name}-totals"
    try:
        await client.put_vhost(vhost, description="test", tags=[settings.instance_tag])
        for name in ("a.b", "aXb", "a.b.c", "c", "d"):
            await client.put_queue(vhost, name, arguments={"x-max-length": 5})
        found = await client.queues_now(vhost, ["a.b", "c", "d", "missing"])
        assert sorted(found) == ["a.b", "c", "d"]
        info = found["a.b"]
        assert (info.messages_ready, info.messages_unacknowledged) == (0, 0)
        assert (info.arguments, info.durable, info.auto_delete) == (
            {"x-max-length": 5},
            True,
            False,
        )
        assert await client.queues_now(f"{vhost}-absent", ["a.b"]) == {}
    finally:
        await client.delete_vhost(vhost)
        await client.aclose()


@pytest.mark.parametrize(
    ("name", "peer"),
    [
        ("127.0.0.1:51962 -> 127.0.0.1:15674", ("127.0.0.1", 51962)),
        ("[::1]:40000 -> [::1]:61613", ("::1", 40000)),
        ("a name a plugin chose", (None, None)),
    ],
)
def test_a_tracked_connection_is_named_after_its_peer(
    name: str, peer: tuple[str | None, int | None]
) -> None:
    tracked = ConnectionInfo.tracked({"name": name, "vhost": "v", "user": "u", "node": "n"})
    assert (tracked.peer_host, tracked.peer_port, tracked.vhost) == (*peer, "v")
    assert (tracked.connected_at, tracked.client) == (None, None)


async def test_a_refused_connection_is_named_as_such(settings: Settings) -> None:
    """The transport maps aiohttp's errors onto httpx's coarsely (a refused connection
    arrives as `ConnectTimeout`); the 503 and the logs must name what really happened."""
    closed = settings.model_copy(update={"management_url": f"http://127.0.0.1:{closed_port()}"})
    client = ManagementClient(closed)
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            await client.list_vhosts()
    finally:
        await client.aclose()
    assert "unreachable (ClientConnectorError: Cannot connect to host" in str(raised.value)
    assert "Timeout" not in str(raised.value)


async def test_a_node_answering_what_is_not_http_is_unavailable(settings: Settings) -> None:
    """A peer that is not the Management API (a wrong port, a broken proxy) must be a 503 and
    the next node, like any transport error, not an exception the caller does not expect."""

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = ManagementClient(
        settings.model_copy(update={"management_url": f"http://127.0.0.1:{port}"})
    )
    try:
        with pytest.raises(BrokerUnavailable, match=r"unreachable \(ClientResponseError: "):
            await client.list_vhosts()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_real_broker_refusing_our_credentials_is_unavailable(settings: Settings) -> None:
    """The Authorization header is built once by the client: a wrong password must reach
    the broker as such and come back as the 503-mapped error that names the credentials."""
    client = ManagementClient(settings.model_copy(update={"management_password": "not-it"}))
    try:
        with pytest.raises(BrokerUnavailable, match=r"refused queuekeeper's credentials \(401\)"):
            await client.get_vhost("/")
    finally:
        await client.aclose()


def test_plain_http_builds_no_trust_store_and_would_refuse_any_certificate() -> None:
    """Loading the system's CA store cost ~25 ms of CPU for every client made; over plain
    HTTP nothing is verified, so none is loaded, and the context given trusts no CA."""
    plain = Settings(management_url="http://127.0.0.1:15672")
    context = management._ssl_context(plain)
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0
    # Over HTTPS the system's store is loaded, and switching checks off is explicit.
    secure = Settings(management_url="https://127.0.0.1:15671")
    verified = management._ssl_context(secure)
    assert isinstance(verified, ssl.SSLContext)
    assert verified.verify_mode is ssl.CERT_REQUIRED
    assert verified.cert_store_stats()["x509_ca"] > 0
    assert management._ssl_context(secure.model_copy(update={"tls_verify": False})) is False
