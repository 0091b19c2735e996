"""Bodies are authenticated and bounded before they are read.

The ASGI transport reads a request body from the test's generator only when the app asks
for it, so counting the chunks the generator gave shows how much the service read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

CHUNK = 64 * 1024
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


class Body:
    """A body of `chunks` x 64 KiB that counts how many chunks were pulled from it."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.pulled += 1
            yield b" " * CHUNK


async def test_no_credentials_is_401_before_any_of_the_body_is_read(
    client: httpx.AsyncClient,
) -> None:
    for path in ("/api/event-subscriptions/", "/api/internal/events/batch/"):
        body = Body(1000)  # 62.5 MiB
        response = await client.post(path, content=body)
        assert response.status_code == 401, response.text
        assert body.pulled == 0
        # Sized bodies too: refused on the headers alone.
        response = await client.post(
            path, content=b"x" * 2_000_000, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 401, response.text


async def test_bad_or_wrong_kind_of_token_is_refused_before_the_body(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    cases = [
        ("/api/event-subscriptions/", {"Authorization": "Token not-a-token"}, 401),
        ("/api/event-subscriptions/", {"Authorization": "Basic abc"}, 401),
        ("/api/event-subscriptions/", SERVICE, 403),
        ("/api/internal/events/", agent.headers, 403),
        ("/api/internal/events/", {"Authorization": "Bearer wrong"}, 401),
    ]
    for path, headers, status in cases:
        body = Body(100)
        response = await client.post(path, content=body, headers=headers)
        assert response.status_code == status, (path, headers, response.text)
        assert body.pulled == 0, (path, headers)


async def test_oversized_agent_body_is_413_by_content_length_unread(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    oversized = json.dumps({"description": "x" * 70_000}).encode()
    response = await client.post(
        "/api/event-subscriptions/",
        content=oversized,
        headers={**agent.headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text
    answer = response.json()
    assert answer["setting"] == "body_max_bytes"
    assert answer["limit"] == 64 * 1024
    assert "body_max_bytes" in answer["detail"]


async def test_streamed_body_without_length_is_counted_and_refused_at_the_limit(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    body = Body(1000)
    response = await client.post(
        "/api/event-subscriptions/",
        content=body,
        headers={**agent.headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 413, response.text
    assert response.json()["setting"] == "body_max_bytes"
    # The limit is 64 KiB: the service stopped reading at the second chunk of 1000.
    assert body.pulled <= 3


async def test_event_payload_over_its_limit_is_413_naming_the_setting(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    event = {
        "offering_uuid": offering.hex,
        "object_type": "order",
        "payload": {"blob": "x" * (80 * 1024)},
    }
    response = await client.post("/api/internal/events/", json=event, headers=SERVICE)
    assert response.status_code == 413, response.text
    assert "event_payload_max_bytes" in response.json()["detail"]
    # A normal event still passes the guard.
    event["payload"] = {"order_uuid": uuid.uuid4().hex}
    response = await client.post("/api/internal/events/", json=event, headers=SERVICE)
    assert response.status_code == 202, response.text


@pytest.mark.settings(events_batch_max=10, event_payload_max_bytes=1024)
async def test_batch_body_is_bounded_by_batch_maximum_times_event_maximum(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    offering = await backend.put_offering()
    # 10 x (1 KiB + 4 KiB) = 50 KiB: 11 small events fit the bytes but not the count.
    small = [
        {"offering_uuid": offering.hex, "object_type": "order", "payload": {"n": i}}
        for i in range(11)
    ]
    response = await client.post(
        "/api/internal/events/batch/", json={"events": small}, headers=SERVICE
    )
    assert response.status_code == 400, response.text
    assert "10" in response.json()["detail"]
    huge = {"events": [{**small[0], "payload": {"blob": "x" * 60_000}}]}
    response = await client.post("/api/internal/events/batch/", json=huge, headers=SERVICE)
    assert response.status_code == 413, response.text
    assert "events_batch_max" in response.json()["detail"]
    # Within the batch's bytes, one event over its own limit is refused, named.
    one_big = {"events": [small[0], {**small[0], "payload": {"blob": "x" * 2000}}]}
    response = await client.post("/api/internal/events/batch/", json=one_big, headers=SERVICE)
    assert response.status_code == 413, response.text
    answer = response.json()
    assert answer["errors"][0]["field"] == "events.1.payload"
    assert answer["setting"] == "event_payload_max_bytes"


async def test_a_validation_error_never_echoes_a_huge_input(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent = await backend.put_user()
    big = "y" * 60_000
    response = await client.post(
        "/api/event-subscriptions/",
        json={"observable_objects": [{"object_type": big}]},
        headers=agent.headers,
    )
    assert response.status_code == 400, response.text
    assert len(response.content) < 4_000
    assert response.json()["errors"][0]["field"].startswith("observable_objects")
    assert "truncated" in response.json()["errors"][0]["message"]
    # Thousands of bad items: the first ones are listed, the rest counted.
    response = await client.post(
        "/api/event-subscriptions/",
        json={"observable_objects": [{"object_type": "nope"}] * 90},
        headers=agent.headers,
    )
    assert response.status_code == 400, response.text
    assert len(response.json()["errors"]) == 20
    assert response.json()["detail"].endswith("and 70 more errors")
