"""The operator's replay names a queue by vhost the way `GET /api/admin/queues/?vhost=` does:
the dashed or upper-case form of the owner's uuid is the same vhost."""

from __future__ import annotations

import uuid

import httpx

from queuekeeper.models import utcnow
from tests.events.support import SERVICE, register
from tests.helpers import Backend


async def test_an_operator_replay_takes_the_vhost_in_any_form_the_listing_takes(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    registered = await register(backend)
    owner = uuid.UUID(hex=registered.vhost)
    for form in (str(owner), registered.vhost.upper(), str(owner).upper()):
        listed = await client.get("/api/admin/queues/", params={"vhost": form}, headers=SERVICE)
        assert listed.status_code == 200, listed.text
        assert registered.queue_name in {row["queue_name"] for row in listed.json()}
        body = {
            "since": utcnow().isoformat(),
            "queue_name": registered.queue_name,
            "vhost": form,
        }
        response = await client.post("/api/admin/queues/replay/", json=body, headers=SERVICE)
        assert response.status_code == 202, (form, response.text)
    # Not a vhost name at all: a 400 naming it, as the listing's.
    body = {"since": utcnow().isoformat(), "queue_name": registered.queue_name, "vhost": " x"}
    response = await client.post("/api/admin/queues/replay/", json=body, headers=SERVICE)
    assert response.status_code == 400, response.text
    assert response.json()["errors"][0]["field"] == "vhost"
