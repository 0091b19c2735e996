"""Every answer an agent or client reads, parsed by the models of every waldur-api-client
line a published agent pins (8.0.9.dev348 for 1.0.5, 8.1.2 for 1.0.7, 8.1.3rc23 for
1.0.8rc12), of 8.1.3 final (contract §10) and of the newest build on the package index,
pre-releases included (8.1.4rc3 and later, contract §12). Each client runs in its own virtualenv
(tests/agents/site_agent_venv.py); a missing required field fails naming the field.

Two tests: the answers, captured from queuekeeper, fed to each client's `from_dict`; and
the client's own endpoint functions (register_queue, event consumers, and the webhook
consumers' from 8.1.4) against a live queuekeeper, for each client that has them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from packaging.version import Version

from tests.agents.harness import AGENT_107_TYPES, Server
from tests.agents.releases import CLIENTS, NEWEST_CLIENT, ClientSource
from tests.agents.site_agent_venv import (
    ensure_api_client_venv,
    ensure_site_agent_venv,
    newest_api_client,
)
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Agent, Backend

IDENTITIES = "/api/marketplace-site-agent-identities/"
CONSUMERS = "/api/event-consumers/"
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# Nothing listens there and nothing is sent in these tests; the settings allow loopback.
WEBHOOK_URL = "http://127.0.0.1:9/hooks?key=credential"
LOOPBACK_WEBHOOKS = pytest.mark.settings(webhook_allowed_networks=["127.0.0.0/8"])

# Opens every script run_in runs in a client's virtualenv: `waldur_api_client.models` as a bare
# package, without its __init__, which imports all ~5,600 generated model modules only to
# re-export them (~7 s of CPU a run, most of this file's time, 13 runs). Each model module
# imports the models it refers to, and the endpoint functions theirs, from their own
# modules, so what parses and what is called is the client's own code either way; the
# agents' end-to-end tests import the whole package as the agents do.
BARE_MODELS = """
import sys, types, waldur_api_client
_models = types.ModuleType("waldur_api_client.models")
_models.__path__ = [waldur_api_client.__path__[0] + "/models"]
sys.modules["waldur_api_client.models"] = _models
"""
# Runs in the client's virtualenv: parses each captured answer with the named model.
PARSE_SCRIPT = r"""
import importlib, json, re, sys
from importlib.metadata import version

cases = json.load(open(sys.argv[1]))
results = []
for case in cases:
    module_name = re.sub(r"(?<!^)(?=[A-Z])", "_", case["model"]).lower()
    try:
        module = importlib.import_module("waldur_api_client.models." + module_name)
    except ModuleNotFoundError:
        results.append({**case, "outcome": "absent"})  # this client has no such model
        continue
    model = getattr(module, case["model"])
    items = case["answer"] if case["many"] else [case["answer"]]
    try:
        for item in items:
            model.from_dict(item)
    except KeyError as exc:
        results.append({**case, "outcome": f"missing required field {exc.args[0]!r}"})
    except Exception as exc:
        results.append({**case, "outcome": f"{type(exc).__name__}: {exc}"})
    else:
        results.append({**case, "outcome": "ok"})
print(json.dumps({"version": version("waldur-api-client"), "results": results}))
"""
# What a client cannot parse whatever the server does, as Waldur's own answers show:
# 8.1.2 declares EventConsumer.object_types an object, so a consumer with a filter (a
# list, as Waldur and 8.1.3 have it) fails there: (client version prefix, model).
FILTER_DEFECTS = {("8.1.2", "EventConsumer")}


def client_python(source: ClientSource) -> Path:
    if source.agent is not None:
        return ensure_site_agent_venv(source.agent)
    assert source.client is not None
    if source.client == NEWEST_CLIENT:
        return ensure_api_client_venv(newest_api_client())
    return ensure_api_client_venv(source.client)


async def run_in(python: Path, script: str, *args: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        str(python),
        "-c",
        BARE_MODELS + script,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-4000:]
    found: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return found


async def capture_answers(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    """Every answer an agent (1.0.5, 1.0.7, 1.0.8) or a client integration reads, from a
    live queuekeeper: (label, model, answer, many)."""
    backend = Backend(http, SERVICE_TOKEN)
    agent, offering = await backend.agent_with_offering()
    cases: list[dict[str, Any]] = []

    def case(label: str, model: str, response: httpx.Response, ok: tuple[int, ...]) -> Any:
        assert response.status_code in ok, (label, response.text)
        answer = response.json()
        cases.append(
            {"label": label, "model": model, "answer": answer, "many": isinstance(answer, list)}
        )
        return answer

    body = {
        "offering": offering.hex,
        "name": f"agent-{offering.hex}",
        "version": "1.0.8rc12",
        "dependencies": [{"package": "waldur-api-client", "version": "8.1.3rc23"}],
        "last_restarted": "2026-11-26T08:00:00.000000+00:00",
    }
    created = case(
        "identities create", "AgentIdentity", await post(agent, IDENTITIES, body), (201,)
    )
    identity = created["uuid"]
    case(
        "identities list",
        "AgentIdentity",
        await agent.client.get(IDENTITIES, params={"name": body["name"]}, headers=agent.headers),
        (200,),
    )
    case(
        "identities update",
        "AgentIdentity",
        await agent.client.put(f"{IDENTITIES}{identity}/", json=body, headers=agent.headers),
        (200,),
    )
    case(
        "identities retrieve",
        "AgentIdentity",
        await agent.client.get(f"{IDENTITIES}{identity}/", headers=agent.headers),
        (200,),
    )
    subscription = case(
        "register_event_subscription",
        "EventSubscription",
        await post(
            agent,
            f"{IDENTITIES}{identity}/register_event_subscription/",
            {"observable_object_type": "order", "description": "e2e"},
        ),
        (200, 201),
    )
    case(
        "create_queue",
        "EventSubscriptionQueue",
        await post(
            agent,
            f"/api/event-subscriptions/{subscription['uuid']}/create_queue/",
            {"offering_uuid": offering.hex, "object_type": "order"},
        ),
        (200, 201),
    )
    case(
        "register_queue",
        "AgentQueueRegistrationResponse",
        await post(
            agent, f"{IDENTITIES}{identity}/register_queue/", {"object_types": AGENT_107_TYPES}
        ),
        (201,),
    )
    unfiltered = case(
        "event-consumers register",
        "EventConsumerRegistrationResponse",
        await post(
            agent,
            f"{CONSUMERS}register/",
            {"object_types": [], "scopes": [{"type": "offering", "uuid": offering.hex}]},
        ),
        (201,),
    )
    own = await agent.client.get(CONSUMERS, headers=agent.headers)
    filtered = [c for c in own.json() if c["object_types"]]
    plain = [c for c in own.json() if not c["object_types"]]
    assert filtered, own.json()
    assert plain, own.json()
    cases.append(
        {
            "label": "event-consumers list, filtered",
            "model": "EventConsumer",
            "answer": filtered,
            "many": True,
        }
    )
    cases.append(
        {"label": "event-consumers list", "model": "EventConsumer", "answer": plain, "many": True}
    )
    case(
        "event-consumers list, service token",
        "EventConsumer",
        await agent.client.get(CONSUMERS, params={"o": "-created"}, headers=SERVICE),
        (200,),
    )
    consumer_uuid = unfiltered["rmq_username"]
    case(
        "event-consumers retrieve",
        "EventConsumer",
        await agent.client.get(f"{CONSUMERS}{consumer_uuid}/", headers=agent.headers),
        (200,),
    )
    # Webhook consumers (contract §13; the test's settings allow loopback): a staff user's.
    admin = await backend.put_user(is_staff=True)
    hook = case(
        "register_webhook",
        "EventConsumer",
        await post(admin, f"{CONSUMERS}register_webhook/", {"webhook_url": WEBHOOK_URL}),
        (201,),
    )
    case(
        "update_webhook",
        "EventConsumer",
        await post(
            admin, f"{CONSUMERS}{hook['uuid']}/update_webhook/", {"object_types": ["user_role"]}
        ),
        (200,),
    )
    case(
        "event-consumers list, webhook",
        "EventConsumer",
        await agent.client.get(CONSUMERS, params={"delivery": "webhook"}, headers=SERVICE),
        (200,),
    )
    case(
        "resync",
        "EventConsumerResyncResponse",
        await post(admin, f"{CONSUMERS}{hook['uuid']}/resync/", {}),
        (202,),
    )
    return cases


async def post(agent: Agent, path: str, body: dict[str, Any]) -> httpx.Response:
    return await agent.client.post(path, json=body, headers=agent.headers)


def without(cases: list[dict[str, Any]], label: str, field: str) -> dict[str, Any]:
    """The answer of `label` with `field` left out: what a regression would serve."""
    (item,) = [item for item in cases if item["label"] == label]
    answers = item["answer"] if item["many"] else [item["answer"]]
    stripped = [{k: v for k, v in answer.items() if k != field} for answer in answers]
    return {**item, "answer": stripped if item["many"] else stripped[0], "label": f"no {field}"}


def has_filter(item: dict[str, Any]) -> bool:
    answers = item["answer"] if item["many"] else [item["answer"]]
    return item["model"] == "EventConsumer" and any(a["object_types"] for a in answers)


@pytest.mark.timeout(600)
@LOOPBACK_WEBHOOKS
@pytest.mark.parametrize("source", CLIENTS, ids=[source.label for source in CLIENTS])
async def test_every_answer_parses_with_the_clients_models(
    server: Server, source: ClientSource, tmp_path: Path
) -> None:
    python = await asyncio.to_thread(client_python, source)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        cases = await capture_answers(http)
    # Proof that the check can fail, and names the field: 8.1.3 requires these.
    cases.append(without(cases, "identities retrieve", "compatibility"))
    cases.append(without(cases, "event-consumers retrieve", "user_username"))
    # ... and 8.1.4 these.
    for field in ("delivery", "payload_filters", "last_delivered_at"):
        cases.append(without(cases, "event-consumers retrieve", field))
    filtered = {item["label"] for item in cases if has_filter(item)}
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps(cases))
    parsed = await run_in(python, PARSE_SCRIPT, str(answers))
    client = parsed["version"]
    outcomes = {(r["label"], r["model"]): r["outcome"] for r in parsed["results"]}
    print(f"\nwaldur-api-client {client} ({source.label}): {outcomes}", file=sys.stderr)

    # The fields each line made required: compatibility and the owner's (8.1.3), the
    # delivery's (8.1.4; every 8.1.4 build since rc1).
    release = Version(client).release
    requires_813 = release >= (8, 1, 3)
    requires_814 = release >= (8, 1, 4)
    for (label, model), outcome in outcomes.items():
        if label.startswith("no "):
            field = label.removeprefix("no ")
            required = requires_814 or (
                requires_813 and field not in ("delivery", "payload_filters", "last_delivered_at")
            )
            if required:
                assert outcome == f"missing required field {field!r}", (label, model, outcome)
            continue
        if label in filtered and any(
            client.startswith(v) and model == m for v, m in FILTER_DEFECTS
        ):
            assert outcome.startswith("ValueError"), (label, outcome)  # still the client's
            continue
        assert outcome in ("ok", "absent"), f"{client} cannot parse {label} ({model}): {outcome}"
    # Every client parses the identity (all agents) and the legacy models (1.0.5's calls).
    for label in ("identities create", "identities list", "register_event_subscription"):
        assert (
            outcomes[(label, "AgentIdentity" if "identities" in label else "EventSubscription")]
            == "ok"
        )
    if not client.startswith("8.0"):
        assert outcomes[("register_queue", "AgentQueueRegistrationResponse")] == "ok"
        assert outcomes[("event-consumers retrieve", "EventConsumer")] == "ok"
    if requires_814:
        for label in (
            "event-consumers list",
            "event-consumers list, service token",
            "register_webhook",
            "update_webhook",
            "event-consumers list, webhook",
        ):
            assert outcomes[(label, "EventConsumer")] == "ok"
        assert outcomes[("resync", "EventConsumerResyncResponse")] == "ok"


# Runs in the client's virtualenv: its own endpoint functions against queuekeeper with an agent's
# token, then its webhook consumer functions (8.1.4 and later) with a staff user's (`null`
# from a client without them). One interpreter for both: its start and imports are most of
# the cost of a run.
CLIENT_SCRIPT = """
import json, sys
from waldur_api_client.client import AuthenticatedClient
from waldur_api_client.api.event_consumers import (
    event_consumers_count, event_consumers_destroy, event_consumers_list,
    event_consumers_register,
)
from waldur_api_client.api.marketplace_site_agent_identities import (
    marketplace_site_agent_identities_register_queue as register_queue,
    marketplace_site_agent_identities_retrieve as identity_retrieve,
)
from waldur_api_client.models.agent_queue_registration_request import (
    AgentQueueRegistrationRequest,
)
from waldur_api_client.models.event_consumer_registration_request import (
    EventConsumerRegistrationRequest,
)
from waldur_api_client.models.event_consumer_scope_input_request import (
    EventConsumerScopeInputRequest,
)

url, token, offering, identity, admin_token, webhook_url = sys.argv[1:7]
client = AuthenticatedClient(base_url=url, token=token, prefix="Token")
found = identity_retrieve.sync(uuid=identity, client=client)
compatibility = getattr(found, "compatibility", None)
queue = register_queue.sync(
    uuid=identity,
    client=client,
    # All types: 8.1.2's EventConsumer declares `object_types` an object and cannot parse
    # a non-empty list (Waldur's answer has the same shape).
    body=AgentQueueRegistrationRequest(object_types=[]),
)
registered = event_consumers_register.sync(
    client=client,
    body=EventConsumerRegistrationRequest(
        scopes=[EventConsumerScopeInputRequest(type_="offering", uuid=offering)]
    ),
)
count = event_consumers_count.sync(client=client)
listed = event_consumers_list.sync(client=client, page_size=1)
try:  # 8.1.4 and later: the delivery filter and field
    from waldur_api_client.models.delivery_enum import DeliveryEnum
except ImportError:
    by_delivery = None
else:
    by_delivery = [
        [str(c.delivery) for c in event_consumers_list.sync(client=client, delivery=d)]
        for d in (DeliveryEnum.RMQ, DeliveryEnum.WEBHOOK)
    ]
event_consumers_destroy.sync_detailed(uuid=listed[0].uuid, client=client)
endpoints = {
    "compatibility": compatibility.status.value if compatibility else None,
    "queue": [queue.queue_name, queue.rmq_username, queue.vhost, queue.observable_object_types],
    "registered": registered.queue_name,
    "count": count,
    "first": [str(listed[0].uuid), listed[0].rmq_username, listed[0].is_global,
              listed[0].queue_created, [s.uuid for s in listed[0].scopes]],
    "username": getattr(listed[0], "user_username", None),
    "by_delivery": by_delivery,
    "after": event_consumers_count.sync(client=client),
}


def webhook_functions():
    try:
        from waldur_api_client.api.event_consumers import (
            event_consumers_register_webhook as register_webhook,
            event_consumers_resync as resync,
            event_consumers_update_webhook as update_webhook,
        )
    except ImportError:
        return None
    from waldur_api_client.models.event_consumer_webhook_request import (
        EventConsumerWebhookRequest,
    )
    from waldur_api_client.models.event_consumer_webhook_update_request import (
        EventConsumerWebhookUpdateRequest,
    )

    admin = AuthenticatedClient(base_url=url, token=admin_token, prefix="Token")
    made = register_webhook.sync(
        client=admin, body=EventConsumerWebhookRequest(webhook_url=webhook_url, scopes=[])
    )
    changed = update_webhook.sync(
        uuid=made.uuid, client=admin, body=EventConsumerWebhookUpdateRequest(object_types=[])
    )
    started = resync.sync(uuid=made.uuid, client=admin)
    return {
        "made": [str(made.delivery), made.webhook_destination, made.is_global,
                 made.additional_properties.get("webhook_secret", "")[:6]],
        "changed": [str(changed.uuid) == str(made.uuid), changed.webhook_destination],
        "resync": started.object_types,
    }


print(json.dumps({"endpoints": endpoints, "webhooks": webhook_functions()}))
"""
ENDPOINT_CLIENTS = [source for source in CLIENTS if source.agent != "1.0.5"]  # 8.0.9: none


@pytest.mark.timeout(300)
@LOOPBACK_WEBHOOKS
@pytest.mark.parametrize(
    "source", ENDPOINT_CLIENTS, ids=[source.label for source in ENDPOINT_CLIENTS]
)
async def test_the_clients_own_endpoint_and_webhook_functions_work_against_queuekeeper(
    server: Server, source: ClientSource
) -> None:
    python = await asyncio.to_thread(client_python, source)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        backend = Backend(http, SERVICE_TOKEN)
        agent, offering = await backend.agent_with_offering()
        identity = await http.post(
            IDENTITIES,
            json={"offering": offering.hex, "name": "client-e2e", "version": "1.0.8rc12"},
            headers=agent.headers,
        )
        assert identity.status_code == 201, identity.text
        admin = await backend.put_user(is_staff=True)
        both = await run_in(
            python,
            CLIENT_SCRIPT,
            server.url,
            agent.token,
            offering.hex,
            identity.json()["uuid"],
            admin.token,
            WEBHOOK_URL,
        )
    # The endpoint functions, with the agent's token.
    seen = both["endpoints"]
    queue_name, rmq_username, vhost, types = seen["queue"]
    assert queue_name == f"consumer_{rmq_username}"
    assert vhost == agent.vhost
    assert len(types) == 18
    assert seen["registered"].startswith("consumer_")
    assert seen["count"] == 2
    uuid_text, username, is_global, queue_created, scopes = seen["first"]
    assert uuid.UUID(uuid_text).hex == username  # the first registered: register_queue's
    assert (is_global, queue_created, scopes) == (False, True, [offering.hex])
    assert seen["after"] == 1
    if seen["by_delivery"] is not None:  # 8.1.4 reads it
        assert seen["by_delivery"] == [["rmq", "rmq"], []]
    if seen["compatibility"] is not None:  # 8.1.3 reads it
        assert seen["compatibility"] == "compatible"
        assert seen["username"] == f"user-{agent.uuid.hex[:8]}"
    print(f"\n{source.label} endpoint functions: {seen}", file=sys.stderr)

    # The webhook functions (8.1.4 and later), with a staff user's token.
    if both["webhooks"] is None:  # a client before 8.1.4
        return
    assert both["webhooks"] == {
        "made": ["webhook", "http://127.0.0.1:9", True, "whsec_"],
        "changed": [True, "http://127.0.0.1:9"],
        "resync": ["user_role"],
    }
    print(f"\n{source.label} webhook functions: {both['webhooks']}", file=sys.stderr)
