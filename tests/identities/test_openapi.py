"""The identity routes exist as the agent calls them and are documented (tests/ops checks
the shape of every route; this checks the codes the agent depends on)."""

from __future__ import annotations

from queuekeeper.app import create_app
from queuekeeper.config import Settings


def test_identity_routes_are_documented() -> None:
    spec = create_app(Settings()).openapi()
    schemas = spec["components"]["schemas"]
    operations = [
        (method, path, operation)
        for path, item in spec["paths"].items()
        if path.startswith("/api/marketplace-site-agent-identities/")
        for method, operation in item.items()
    ]
    assert {(method, path) for method, path, _ in operations} == {
        ("get", "/api/marketplace-site-agent-identities/"),
        ("post", "/api/marketplace-site-agent-identities/"),
        ("get", "/api/marketplace-site-agent-identities/{identity_uuid}/"),
        ("put", "/api/marketplace-site-agent-identities/{identity_uuid}/"),
        ("delete", "/api/marketplace-site-agent-identities/{identity_uuid}/"),
        (
            "post",
            "/api/marketplace-site-agent-identities/{identity_uuid}/register_event_subscription/",
        ),
        ("post", "/api/marketplace-site-agent-identities/{identity_uuid}/register_queue/"),
    }
    for method, path, operation in operations:
        where = f"{method.upper()} {path}"
        assert operation["tags"] == ["agents"], where
        assert operation["summary"], where
        assert operation["description"], where
        assert "401" in operation["responses"], where
        if "{identity_uuid}" in path:
            assert "404" in operation["responses"], where
        body = operation.get("requestBody")
        if body is not None:
            name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
            assert schemas[name]["examples"], where
    register = spec["paths"][
        "/api/marketplace-site-agent-identities/{identity_uuid}/register_event_subscription/"
    ]["post"]
    assert {"200", "201", "403", "503"} <= set(register["responses"])
    register_queue = spec["paths"][
        "/api/marketplace-site-agent-identities/{identity_uuid}/register_queue/"
    ]["post"]
    assert {"200", "201", "400", "403", "404", "409", "503"} <= set(register_queue["responses"])
