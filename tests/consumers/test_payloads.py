"""Payload rules for the types waldur-site-agent 1.0.7 handles (agent-protocols 1.0.7 §5,
contract §6)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.events.support import post_event
from tests.helpers import Backend

pytestmark = pytest.mark.settings(relay_enabled=False)

U = "6f1c2a3b4d5e4f60a1b2c3d4e5f60718"
ROTATE = {
    "action": "rotate",
    "resource_uuid": U,
    "api_key_uuid": U,
    "resource_backend_id": "slurm-acc-1",
    "client_id": "client-1",
}


@pytest.mark.parametrize(
    ("object_type", "payload", "field", "words"),
    [
        ("order", {"order_uuid": U, "order_state": "pending consumer"}, "payload.order_state", ""),
        ("order", {"order_uuid": U, "order_state": "PENDING-CONSUMER"}, "payload.order_state", ""),
        (
            "resource_api_key_rotation",
            {k: v for k, v in ROTATE.items() if k != "client_id"},
            "payload",
            "client_id required when action is rotate",
        ),
        (
            "resource_api_key_rotation",
            {**ROTATE, "resource_backend_id": ""},
            "payload",
            "resource_backend_id required",
        ),
        ("resource_api_key_rotation", {**ROTATE, "action": "renew"}, "payload.action", ""),
        ("user_role", {"project_uuid": U, "project_name": "P", "resource_uuid": "x"}, "", ""),
    ],
    ids=[
        "order-state-space",
        "order-state-case",
        "rotate-no-client",
        "rotate-empty-backend-id",
        "rotation-action",
        "user-role-resource-not-uuid",
    ],
)
async def test_refused(
    client: httpx.AsyncClient,
    backend: Backend,
    object_type: str,
    payload: dict[str, Any],
    field: str,
    words: str,
) -> None:
    offering = await backend.put_offering()
    response = await post_event(
        client, {"offering_uuid": offering.hex, "object_type": object_type, "payload": payload}
    )
    assert response.status_code == 400, response.text
    error = response.json()["errors"][0]
    assert error["field"] == (field or "payload.resource_uuid")
    assert words in error["message"]


@pytest.mark.parametrize(
    ("object_type", "payload"),
    [
        *[
            ("order", {"order_uuid": U, "order_state": state})
            for state in (
                "pending-consumer",
                "pending-provider",
                "pending-project",
                "pending-start-date",
                "executing",
                "done",
                "erred",
                "canceled",
                "rejected",
            )
        ],
        ("resource_api_key_rotation", ROTATE),
        # revoke: identifiers only (1.0.7 logs it as unknown; a later agent may handle it)
        ("resource_api_key_rotation", {"action": "revoke", "resource_uuid": U, "api_key_uuid": U}),
        ("user_role", {"project_uuid": U, "project_name": "P", "resource_uuid": U}),
        ("user_profile", {"user_uuid": U}),
    ],
)
async def test_accepted(
    client: httpx.AsyncClient, backend: Backend, object_type: str, payload: dict[str, Any]
) -> None:
    offering = await backend.put_offering()
    response = await post_event(
        client, {"offering_uuid": offering.hex, "object_type": object_type, "payload": payload}
    )
    assert response.status_code == 202, response.text
