"""/api/event-consumers/ and register_queue through the published waldur-api-client 8.1.2
(the one waldur-site-agent 1.0.7 pins), from the agent's virtualenv: its models parse
queuekeeper's answers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from tests.agents.harness import Server
from tests.conftest import SERVICE_TOKEN
from tests.helpers import Backend

CLIENT_SCRIPT = """
import json, sys
from waldur_api_client.client import AuthenticatedClient
from waldur_api_client.api.event_consumers import (
    event_consumers_count, event_consumers_destroy, event_consumers_list,
    event_consumers_register,
)
from waldur_api_client.api.marketplace_site_agent_identities import (
    marketplace_site_agent_identities_register_queue as register_queue,
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

url, token, offering, identity = sys.argv[1:5]
client = AuthenticatedClient(base_url=url, token=token, prefix="Token")
queue = register_queue.sync(
    uuid=identity,
    client=client,
    # All types: 8.1.2's EventConsumer model declares `object_types` an object and cannot
    # parse a non-empty list (Waldur's answer has the same shape), so the listing below
    # parses only consumers without a filter.
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
event_consumers_destroy.sync_detailed(uuid=listed[0].uuid, client=client)
print(json.dumps({
    "queue": [queue.queue_name, queue.rmq_username, queue.vhost, queue.observable_object_types],
    "registered": registered.queue_name,
    "count": count,
    "first": [str(listed[0].uuid), listed[0].rmq_username, listed[0].is_global,
              listed[0].queue_created, [s.uuid for s in listed[0].scopes]],
    "after": event_consumers_count.sync(client=client),
}))
"""


@pytest.mark.timeout(300)
async def test_waldur_api_client_812_parses_queuekeepers_consumer_answers(
    server: Server, site_agent_107_python: Path
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        backend = Backend(http, SERVICE_TOKEN)
        agent, offering = await backend.agent_with_offering()
        identity = await http.post(
            "/api/marketplace-site-agent-identities/",
            json={"offering": offering.hex, "name": "client-812"},
            headers=agent.headers,
        )
        assert identity.status_code == 201, identity.text
        process = await asyncio.create_subprocess_exec(
            str(site_agent_107_python),
            "-c",
            CLIENT_SCRIPT,
            server.url,
            agent.token,
            offering.hex,
            identity.json()["uuid"],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 0, err.decode()[-4000:]
        seen = json.loads(out.decode().strip().splitlines()[-1])
    queue_name, rmq_username, vhost, types = seen["queue"]
    assert queue_name == f"consumer_{rmq_username}"
    assert vhost == agent.vhost
    assert len(types) == 14
    assert seen["registered"].startswith("consumer_")
    assert seen["count"] == 2
    uuid_text, username, is_global, queue_created, scopes = seen["first"]
    assert uuid_text.replace("-", "") == username  # the first registered: register_queue's
    assert (is_global, queue_created, scopes) == (False, True, [offering.hex])
    assert seen["after"] == 1
    print(f"\nwaldur-api-client 8.1.2 answers: {seen}", file=sys.stderr)
