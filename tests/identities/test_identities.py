"""Agent identities: the first requests waldur-site-agent makes (agent-protocols 1.0.5
§2.1, §3.1)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from queuekeeper.broker.management import ManagementClient
from tests.helpers import Agent, Backend

IDENTITIES = "/api/marketplace-site-agent-identities/"


def agent_body(offering: str, **overrides: Any) -> dict[str, Any]:
    """The body waldur-site-agent 1.0.5 sends, as recorded (naive local last_restarted)."""
    body: dict[str, Any] = {
        "offering": offering,
        "name": f"agent-{offering}",
        "version": "1.0.5",
        "dependencies": [{"package": "waldur-api-client", "version": "8.0.9.dev348"}],
        "config_file_path": "",
        "config_file_content": "",
        "last_restarted": "2026-11-21T22:25:36.755464",
    }
    body.update(overrides)
    return body


async def register(agent: Agent, offering: str, **overrides: Any) -> httpx.Response:
    return await agent.client.post(
        IDENTITIES, json=agent_body(offering, **overrides), headers=agent.headers
    )


def assert_parses_as_agent_identity(item: dict[str, Any]) -> None:
    """What waldur-api-client 8.0.9.dev348's AgentIdentity.from_dict needs (agent-protocols
    1.0.5 §3.1)."""
    for key in ("uuid", "url", "offering", "created_by", "name", "created", "modified"):
        assert key in item, key
    uuid.UUID(item["uuid"])
    uuid.UUID(item["offering"])
    assert item["services"] == []
    assert item["last_restarted"] is not None
    for dependency in item["dependencies"] or []:
        assert set(dependency) >= {"package", "version"}


async def test_first_start_then_restart_as_the_agent_does(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    name = f"agent-{offering.hex}"

    # R1: nothing yet, a bare JSON array.
    response = await client.get(IDENTITIES, params={"name": name}, headers=agent.headers)
    assert response.status_code == 200
    assert response.json() == []

    # R2a: 201, every field the parser needs; naive last_restarted taken as UTC.
    response = await register(agent, offering.hex)
    assert response.status_code == 201, response.text
    identity = response.json()
    assert_parses_as_agent_identity(identity)
    assert identity["offering"] == offering.hex
    assert identity["created_by"] == agent.uuid.hex
    assert identity["name"] == name
    assert identity["version"] == "1.0.5"
    assert identity["last_restarted"] == "2026-11-21T22:25:36.755464Z"
    assert identity["url"] == f"http://testserver{IDENTITIES}{identity['uuid']}/"
    assert identity["dependencies"] == [{"package": "waldur-api-client", "version": "8.0.9.dev348"}]

    # Another identity of the same caller must not be element 0 of the name filter.
    other = await register(agent, offering.hex, name="agent-other")
    assert other.status_code == 201

    # R1 on restart: exactly the one identity with that name.
    response = await client.get(IDENTITIES, params={"name": name}, headers=agent.headers)
    assert response.status_code == 200
    assert [item["uuid"] for item in response.json()] == [identity["uuid"]]

    # R2b: PUT answers 200 with the same identity, the new restart time and version.
    response = await client.put(
        f"{IDENTITIES}{identity['uuid']}/",
        json=agent_body(offering.hex, last_restarted="2026-11-22T08:00:00", version="1.0.6"),
        headers=agent.headers,
    )
    assert response.status_code == 200, response.text
    updated = response.json()
    assert_parses_as_agent_identity(updated)
    assert updated["uuid"] == identity["uuid"]
    assert updated["last_restarted"] == "2026-11-22T08:00:00Z"
    assert updated["version"] == "1.0.6"
    assert updated["created"] == identity["created"]

    response = await client.get(f"{IDENTITIES}{identity['uuid']}/", headers=agent.headers)
    assert response.status_code == 200
    assert response.json()["version"] == "1.0.6"

    response = await client.get(IDENTITIES, headers=agent.headers)
    assert sorted(item["name"] for item in response.json()) == sorted(["agent-other", name])


async def test_last_restarted_is_never_null(client: httpx.AsyncClient, backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    body = agent_body(offering.hex)
    del body["last_restarted"]
    response = await client.post(IDENTITIES, json=body, headers=agent.headers)
    assert response.status_code == 201
    identity = response.json()
    assert identity["last_restarted"] is not None

    # A PUT without it (or with null) keeps the stored value.
    response = await client.put(
        f"{IDENTITIES}{identity['uuid']}/",
        json=agent_body(offering.hex, last_restarted=None),
        headers=agent.headers,
    )
    assert response.status_code == 200
    assert response.json()["last_restarted"] == identity["last_restarted"]


async def test_only_the_callers_identities(client: httpx.AsyncClient, backend: Backend) -> None:
    agent, offering = await backend.agent_with_offering()
    stranger = await backend.put_user()
    await backend.grant(stranger, offering)  # same offering, different user
    identity = (await register(agent, offering.hex)).json()
    path = f"{IDENTITIES}{identity['uuid']}/"

    response = await client.get(
        IDENTITIES, params={"name": identity["name"]}, headers=stranger.headers
    )
    assert response.json() == []
    assert (await client.get(path, headers=stranger.headers)).status_code == 404
    response = await client.put(path, json=agent_body(offering.hex), headers=stranger.headers)
    assert response.status_code == 404
    response = await client.post(
        f"{path}register_event_subscription/",
        json={"observable_object_type": "order"},
        headers=stranger.headers,
    )
    assert response.status_code == 404
    assert (await client.delete(path, headers=stranger.headers)).status_code == 404
    assert (await client.get(path)).status_code == 401
    assert (await client.get(f"{IDENTITIES}not-a-uuid/", headers=agent.headers)).status_code == 404

    # The stranger may register its own identity with the same name: names are per caller.
    response = await register(stranger, offering.hex)
    assert response.status_code == 201
    assert response.json()["uuid"] != identity["uuid"]


async def test_offering_must_be_known_and_granted(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    not_granted = await backend.put_offering()

    response = await register(agent, not_granted.hex)
    assert response.status_code == 403
    assert not_granted.hex in response.json()["detail"]

    response = await register(agent, uuid.uuid4().hex)
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "offering"

    response = await register(agent, "not-a-uuid")
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "offering"

    response = await client.post(IDENTITIES, json={"offering": offering.hex}, headers=agent.headers)
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "name"

    # Moving an identity to an offering without a grant is refused as well.
    identity = (await register(agent, offering.hex)).json()
    path = f"{IDENTITIES}{identity['uuid']}/"
    response = await client.put(path, json=agent_body(not_granted.hex), headers=agent.headers)
    assert response.status_code == 403

    # Once access is revoked, the agent can no longer update or register...
    revoked = await client.delete(
        f"/api/internal/offerings/{offering}/users/{agent.uuid}/", headers=backend.headers
    )
    assert revoked.status_code == 204
    response = await client.put(path, json=agent_body(offering.hex), headers=agent.headers)
    assert response.status_code == 403
    response = await client.post(
        f"{path}register_event_subscription/",
        json={"observable_object_type": "order"},
        headers=agent.headers,
    )
    assert response.status_code == 403
    # ...but may still clean up after itself.
    assert (await client.delete(path, headers=agent.headers)).status_code == 204
    assert (await client.get(path, headers=agent.headers)).status_code == 404


async def test_a_second_identity_with_the_same_name_is_a_conflict(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    first = (await register(agent, offering.hex)).json()
    response = await register(agent, offering.hex)
    assert response.status_code == 409
    assert first["uuid"] in response.json()["detail"]

    # Renaming another identity onto a taken name is refused the same way.
    second = (await register(agent, offering.hex, name="agent-second")).json()
    response = await client.put(
        f"{IDENTITIES}{second['uuid']}/", json=agent_body(offering.hex), headers=agent.headers
    )
    assert response.status_code == 409
    response = await client.get(IDENTITIES, headers=agent.headers)
    assert len(response.json()) == 2


async def test_offering_uuid_in_any_form_is_stored_as_hex_and_odd_forms_are_flagged(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    metric = "queuekeeper_agent_offering_uuid_not_lowercase_total"
    before = REGISTRY.get_sample_value(metric) or 0.0

    response = await register(agent, str(offering))  # dashed lowercase: the agent copes
    assert response.status_code == 201
    assert response.json()["offering"] == offering.hex
    assert REGISTRY.get_sample_value(metric) == before

    upper = str(offering).upper()
    response = await register(agent, upper)
    assert response.status_code == 201
    assert response.json()["offering"] == offering.hex
    assert response.json()["name"] == f"agent-{upper}"  # the name is kept as sent
    assert REGISTRY.get_sample_value(metric) == before + 1

    response = await register(agent, "{" + offering.hex + "}")
    assert response.status_code == 201
    assert REGISTRY.get_sample_value(metric) == before + 2


async def test_queue_names_are_lowercase_hex_whatever_form_the_offering_is_sent_in(
    backend: Backend,
) -> None:
    agent, offering = await backend.agent_with_offering()
    subscription = await agent.create_subscription()
    names = set()
    for form in (
        str(offering).upper(),
        offering.hex.upper(),
        "{" + str(offering) + "}",
        f"urn:uuid:{offering}",
        offering.hex,
    ):
        response = await agent.create_queue(subscription["uuid"], form)
        assert response.status_code in (200, 201), response.text
        assert response.json()["offering_uuid"] == offering.hex
        names.add(response.json()["queue_name"])
    assert names == {f"subscription_{subscription['uuid']}_offering_{offering.hex}_order"}


async def test_deleting_an_identity_removes_what_it_registered(
    client: httpx.AsyncClient, backend: Backend, management: ManagementClient
) -> None:
    agent, offering = await backend.agent_with_offering()
    identity = (await register(agent, offering.hex)).json()
    path = f"{IDENTITIES}{identity['uuid']}/"
    subscriptions = []
    for object_type in ("order", "resource"):
        response = await client.post(
            f"{path}register_event_subscription/",
            json={"observable_object_type": object_type},
            headers=agent.headers,
        )
        assert response.status_code == 201
        subscriptions.append(response.json()["uuid"])
        queue = await agent.create_queue(response.json()["uuid"], offering, object_type)
        assert queue.status_code == 201
    assert await management.get_vhost(agent.vhost) is not None

    assert (await client.delete(path, headers=agent.headers)).status_code == 204
    response = await client.get("/api/event-subscriptions/", headers=agent.headers)
    assert response.json() == []
    for subscription_uuid in subscriptions:
        assert await management.get_user(subscription_uuid) is None
    # They were the user's only subscriptions, so the vhost (and its queues) went too.
    assert await management.get_vhost(agent.vhost) is None


@pytest.mark.parametrize(
    "value",
    ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "0001-01-01T05:00:00+05:01"],
)
async def test_last_restarted_out_of_range_in_utc_is_a_400_naming_the_field(
    backend: Backend, value: str
) -> None:
    """Each is a valid datetime whose UTC form falls outside years 1-9999 (was a 500)."""
    agent, offering = await backend.agent_with_offering()
    created = await register(agent, offering.hex, last_restarted=value)
    assert created.status_code == 400, created.text
    assert created.json()["errors"][0]["field"] == "last_restarted"
    identity = (await register(agent, offering.hex)).json()["uuid"]
    updated = await agent.client.put(
        f"{IDENTITIES}{identity}/",
        json=agent_body(offering.hex, last_restarted=value),
        headers=agent.headers,
    )
    assert updated.status_code == 400, updated.text
    assert updated.json()["errors"][0]["field"] == "last_restarted"
