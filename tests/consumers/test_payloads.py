"""Payload rules for the types waldur-site-agent 1.0.7 and 1.0.8 handle (agent-protocols 1.0.7
§5, contract §6 and §10)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.events.support import post_event
from tests.helpers import Backend

# Each test posts one event for an offering of its own and reads the answer: one app for the
# module (tests/conftest.py, module_client).
pytestmark = [pytest.mark.settings(relay_enabled=False), pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture
def client(module_client: httpx.AsyncClient) -> httpx.AsyncClient:
    return module_client


U = "6f1c2a3b4d5e4f60a1b2c3d4e5f60718"
ROTATE = {
    "action": "rotate",
    "resource_uuid": U,
    "api_key_uuid": U,
    "resource_backend_id": "slurm-acc-1",
    "client_id": "client-1",
}
KEY = {"resource_uuid": U, "api_key_uuid": U, "resource_backend_id": "slurm-acc-1"}
GROUP = {"service_provider_uuid": U, "customer_uuid": U}


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
        *[
            (
                "resource_api_key_rotation",
                {**KEY, "action": action},
                "payload",
                f"client_id required when action is {action}",
            )
            for action in ("pause", "resume", "update")
        ],
        (
            "resource_api_key_rotation",
            {**KEY, "action": "create", "resource_backend_id": None},
            "payload",
            "resource_backend_id required when action is create",
        ),
        (
            "resource_api_key_rotation",
            {**KEY, "action": "delete", "api_key_uuid": None},
            "payload.api_key_uuid",
            "",
        ),
        (
            "resource_api_key_rotation",
            {**ROTATE, "limits": [1]},
            "payload.limits",
            "",
        ),
        (
            "user_role",
            {
                "project_uuid": U,
                "project_name": "P",
                "user_uuid": U,
                "user_username": "",
                "granted": True,
            },
            "payload",
            "a non-empty user_username required when user_uuid is set",
        ),
        (
            "service_provider_project_group",
            {**GROUP, "action": "update", "name": "pg"},
            "payload",
            "project_group_uuid required when action is update",
        ),
        (
            "service_provider_project_group",
            {**GROUP, "action": "switch"},
            "payload",
            "project_groups_enabled required when action is switch",
        ),
        (
            "service_provider_project_group",
            {**GROUP, "action": "rename", "project_group_uuid": U},
            "payload.action",
            "",
        ),
    ],
    ids=[
        "order-state-space",
        "order-state-case",
        "rotate-no-client",
        "rotate-empty-backend-id",
        "rotation-action",
        "user-role-resource-not-uuid",
        "key-pause-no-client",
        "key-resume-no-client",
        "key-update-no-client",
        "key-create-no-backend-id",
        "key-delete-no-key",
        "key-limits-not-object",
        "user-role-empty-username",
        "group-update-no-group",
        "group-switch-no-setting",
        "group-action",
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
        # agent 1.0.8's commands: create has no client_id yet, nor has the delete of a key
        # that never reached the backend
        ("resource_api_key_rotation", {**KEY, "action": "create", "limits": {"k": 1}}),
        ("resource_api_key_rotation", {**KEY, "action": "delete"}),
        *[
            ("resource_api_key_rotation", {**KEY, "action": action, "client_id": "c-1"})
            for action in ("pause", "resume", "update", "delete")
        ],
        (
            "resource_api_key_rotation",
            {**ROTATE, "allowed_models": ["*"], "spending_limits": {"k": {"month": 5}}},
        ),
        ("service_provider_project_group", {**GROUP, "action": "delete", "project_group_uuid": U}),
        (
            "service_provider_project_group",
            {**GROUP, "action": "switch", "project_groups_enabled": False},
        ),
        ("call", {"anything": 1}),
        ("service_provider_account", {}),
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
