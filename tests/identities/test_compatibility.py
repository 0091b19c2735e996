"""`compatibility` on every identity answer (contract §10): waldur-api-client 8.1.3 refuses an
identity without it; its status follows the reported version and the configured minimum."""

from __future__ import annotations

import httpx
import pytest

from queuekeeper.identities.compatibility import assess
from tests.helpers import Backend
from tests.identities.test_identities import IDENTITIES, register


@pytest.mark.parametrize(
    ("version", "minimum", "status", "words"),
    [
        ("1.0.5", "1.0.5", "compatible", "is supported"),
        ("1.0.8rc12", "1.0.5", "compatible", "is supported"),
        ("1.0.7", "1.0.8rc1", "incompatible", "upgrade the agent to 1.0.8rc1 or later"),
        # a pre-release comes before its release
        ("1.0.8rc12", "1.0.8", "incompatible", "older than 1.0.8"),
        (None, "1.0.5", "unknown", "reported no version"),
        ("  ", "1.0.5", "unknown", "reported no version"),
        ("dev-build", "1.0.5", "unknown", "not a version number"),
    ],
)
def test_status_follows_the_version(
    version: str | None, minimum: str, status: str, words: str
) -> None:
    found = assess(version, minimum)
    assert (found.status, found.minimum_required) == (status, minimum)
    assert words in found.message


@pytest.mark.settings(minimum_agent_version="1.0.7")
async def test_every_identity_answer_carries_it(
    client: httpx.AsyncClient, backend: Backend
) -> None:
    agent, offering = await backend.agent_with_offering()
    created = await register(agent, offering.hex, version="1.0.5")
    assert created.status_code == 201, created.text
    expected = created.json()["compatibility"]
    assert expected["status"] == "incompatible"
    assert expected["minimum_required"] == "1.0.7"
    assert "upgrade the agent to 1.0.7" in expected["message"]
    identity = created.json()["uuid"]

    listed = await client.get(
        IDENTITIES, params={"name": f"agent-{offering.hex}"}, headers=agent.headers
    )
    assert listed.json()[0]["compatibility"] == expected
    retrieved = await client.get(f"{IDENTITIES}{identity}/", headers=agent.headers)
    assert retrieved.json()["compatibility"] == expected

    body = {"offering": offering.hex, "name": f"agent-{offering.hex}", "version": "1.0.8rc12"}
    updated = await client.put(f"{IDENTITIES}{identity}/", json=body, headers=agent.headers)
    assert updated.status_code == 200, updated.text
    assert updated.json()["compatibility"]["status"] == "compatible"


def test_a_minimum_that_is_not_a_version_is_refused_at_start_up() -> None:
    from pydantic import ValidationError

    from queuekeeper.config import Settings

    with pytest.raises(ValidationError, match="minimum_agent_version"):
        Settings(minimum_agent_version="newest")
