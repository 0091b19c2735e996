"""Rotating a webhook consumer's signing secret (contract §14): the new secret is shown
once, both secrets sign every delivery while the previous one is valid (the new one first),
only the new one after; and registration and update refuse fields they do not know, the
secret among them. Verified with the `standardwebhooks` package, as a receiver would."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from queuekeeper.config import Settings
from queuekeeper.webhooks import signing
from tests.conftest import ROOT
from tests.consumers.scopes import SERVICE, staff
from tests.events.support import order_event, post_event
from tests.helpers import Backend
from tests.webhooks.support import WEBHOOK_SETTINGS, consumer_row, receiving, webhook_consumer

pytestmark = pytest.mark.settings(**WEBHOOK_SETTINGS)

GUIDE = ROOT / "docs" / "webhooks.md"


def receivers_verify(new: str, old: str) -> Callable[..., Any]:
    """The receiver's `verify` of docs/webhooks.md (the Python block after
    `<!-- webhooks:rotation -->`), run as written with the two secrets."""
    found = re.search(
        r"<!-- webhooks:rotation -->\n```python\n(?P<code>.*?)\n```", GUIDE.read_text(), re.S
    )
    assert found, "docs/webhooks.md has no webhooks:rotation block"
    scope: dict[str, Any] = {"NEW_SECRET": new, "OLD_SECRET": old}
    exec(compile(found["code"], str(GUIDE), "exec"), scope)
    verify: Callable[..., Any] = scope["verify"]
    return verify


async def test_both_secrets_verify_during_the_window_and_only_the_new_one_after(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        old = hook.secret
        rotated = await client.post(
            f"/api/event-consumers/{hook.uuid.hex}/rotate_secret/",
            json={"previous_valid_seconds": 3},
            headers=SERVICE,
        )
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()["webhook_secret"]
        assert new.startswith("whsec_")
        assert new != old
        assert rotated.json()["previous_valid_until"] is not None
        started = time.monotonic()
        await post_event(client, order_event(offering, event_id="during"))
        (during,) = await receiver.wait_for(1)
        assert time.monotonic() - started < 3
        Webhook(new).verify(during.body, during.headers)
        Webhook(old).verify(during.body, during.headers)
        # The guide's receiver, holding either secret or both, accepts it.
        verify = receivers_verify(new, old)
        for secrets in ([new, old], [old], [new]):
            assert verify(during.body, during.headers, secrets)["object_type"] == "order"
        stamp = int(during.headers["webhook-timestamp"])
        assert during.headers["webhook-signature"] == " ".join(
            signing.signature(secret, "during", stamp, during.body) for secret in (new, old)
        )
        await asyncio.sleep(max(0.0, 3.2 - (time.monotonic() - started)))
        await post_event(client, order_event(offering, event_id="after"))
        _, after = await receiver.wait_for(2)
        Webhook(new).verify(after.body, after.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(old).verify(after.body, after.headers)
        assert len(after.headers["webhook-signature"].split()) == 1
        assert verify(after.body, after.headers)["object_type"] == "order"
        with pytest.raises(WebhookVerificationError):
            verify(after.body, after.headers, [old])
    # Stored as the first one was; the answer was the only place it was shown.
    row = await consumer_row(settings, hook.uuid)
    assert row["webhook_secret"] == new
    listed = await client.get(f"/api/event-consumers/{hook.uuid.hex}/", headers=SERVICE)
    assert new not in listed.text
    assert old not in listed.text


async def test_a_zero_window_ends_the_previous_secret_at_once_and_who_may_rotate(
    client: httpx.AsyncClient, backend: Backend, settings: Settings
) -> None:
    agent, offering = await backend.agent_with_offering()
    async with receiving() as receiver:
        hook = await webhook_consumer(settings, agent.uuid, offering, receiver.url)
        path = f"/api/event-consumers/{hook.uuid.hex}/rotate_secret/"
        # The owner is not staff: as for update_webhook, refused.
        assert (await client.post(path, json={}, headers=agent.headers)).status_code == 403
        for bad in ({"previous_valid_seconds": -1}, {"previous_valid_seconds": 604801}):
            refused = await client.post(path, json=bad, headers=SERVICE)
            assert refused.status_code == 400
            assert "previous_valid_seconds" in refused.text
        rotated = await client.post(path, json={"previous_valid_seconds": 0}, headers=SERVICE)
        assert rotated.status_code == 200, rotated.text
        assert rotated.json()["previous_valid_until"] is None
        await post_event(client, order_event(offering, event_id="zero"))
        (got,) = await receiver.wait_for(1)
        Webhook(rotated.json()["webhook_secret"]).verify(got.body, got.headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(hook.secret).verify(got.body, got.headers)
        # A body-less call takes the default window (a day).
        again = await client.post(path, headers=SERVICE)
        assert again.status_code == 200, again.text
        assert again.json()["previous_valid_until"] is not None


@pytest.mark.settings(**{**WEBHOOK_SETTINGS, "webhook_allowed_networks": ["127.0.0.0/8"]})
async def test_registration_and_update_refuse_fields_they_do_not_know(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    admin = await staff(backend)
    url = "http://127.0.0.1:9/hook"
    chosen = {"webhook_url": url, "webhook_secret": "whsec_" + "A" * 32}
    refused = await client.post(
        "/api/event-consumers/register_webhook/", json=chosen, headers=admin.headers
    )
    assert refused.status_code == 400, refused.text
    assert "webhook_secret" in refused.json()["detail"]
    listed = await client.get("/api/event-consumers/", headers=admin.headers)
    assert listed.json() == []  # nothing was made
    made = await client.post(
        "/api/event-consumers/register_webhook/", json={"webhook_url": url}, headers=admin.headers
    )
    assert made.status_code == 201, made.text
    update = f"/api/event-consumers/{made.json()['uuid']}/update_webhook/"
    for body, field in (
        ({"webhook_secret": "whsec_" + "B" * 32}, "webhook_secret"),
        ({"object_types": ["order"], "colour": "blue"}, "colour"),
    ):
        answer = await client.post(update, json=body, headers=admin.headers)
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["detail"]
    unchanged = await client.get(f"/api/event-consumers/{made.json()['uuid']}/", headers=SERVICE)
    assert unchanged.json()["object_types"] == []
