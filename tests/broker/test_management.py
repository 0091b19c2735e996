"""The Management API client: typed errors that keep the broker's reason, encoding, retries."""

from __future__ import annotations

import httpx
import pytest
import respx

from queuekeeper.broker.management import (
    BrokerUnavailable,
    ManagementBadRequest,
    ManagementClient,
    ManagementNotFound,
)
from queuekeeper.config import Settings

BASE = "http://mgmt.test:15672/api"


@pytest.fixture
async def fake() -> ManagementClient:
    return ManagementClient(
        Settings(management_url="http://mgmt.test:15672", management_timeout=0.5)
    )


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
        assert await fake.get_vhost("v") == {"name": "v"}
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
        assert await fake.get_queue("/", "a/b c") == {"name": "a/b c"}
        assert route.called


async def test_real_broker_round_trip(settings: Settings) -> None:
    client = ManagementClient(settings)
    vhost = f"{settings.instance_name}-roundtrip"
    try:
        await client.put_vhost(vhost, description="test", tags=[settings.instance_tag])
        assert await client.put_queue(vhost, "q", arguments={"x-max-length": 5}) is True
        assert await client.put_queue(vhost, "q", arguments={"x-max-length": 5}) is False
        with pytest.raises(ManagementBadRequest) as raised:
            await client.put_queue(vhost, "q", arguments={"x-max-length": 6})
        assert raised.value.inequivalent
        assert await client.delete_queue(vhost, "q", if_empty=True, if_unused=True) is True
        assert await client.delete_queue(vhost, "q") is False
    finally:
        await client.delete_vhost(vhost)
        await client.aclose()
