"""Webhook consumer routes (contract §13, §14): register_webhook, update_webhook,
rotate_secret. Under /api/event-consumers/ beside the routes every consumer has
(consumers/endpoints.py), on a router of the same caller and tag."""

from __future__ import annotations

from typing import Annotated

from fastapi import Body, Request, status

from queuekeeper.auth.dependencies import AgentOrService, credentials
from queuekeeper.common.access import Caller, service_too
from queuekeeper.common.access import router as caller_router
from queuekeeper.common.openapi import error_responses
from queuekeeper.consumers import service as consumers_service
from queuekeeper.consumers.schemas import ConsumerOut
from queuekeeper.state import SessionDep, SettingsDep
from queuekeeper.webhooks import service
from queuekeeper.webhooks.schemas import (
    RotatedSecretOut,
    RotateSecret,
    WebhookConsumerOut,
    WebhookRegistration,
    WebhookUpdate,
)

router = caller_router(Caller.AGENT, tags=["agents"])


_STAFF_403 = (
    "You are neither a staff nor a support user (webhook consumers are theirs and the "
    "service token's), or a binding you may not hold (named)."
)


@router.post(
    "/api/event-consumers/register_webhook/",
    status_code=status.HTTP_201_CREATED,
    summary="Register a webhook consumer (staff and support, or the service token)",
    description="A consumer whose copies are POSTed as JSON to `webhook_url`, signed as "
    "Standard Webhooks sign (`webhook-id`, `webhook-timestamp`, `webhook-signature`), "
    "instead of waiting in a queue: the same bindings, filters and authorization at delivery "
    "as /api/event-consumers/register/, and no broker object. The answer holds "
    "`webhook_secret`, the signing secret, this once. Every call makes a new consumer. A "
    "service token names the owner (a staff or support user) in `user_uuid`.",
    responses=error_responses(
        400,
        401,
        403,
        descriptions={
            400: "`webhook_url` refused (the reason is named: not http(s), too long, a "
            "fragment, no host, does not resolve, or an address not allowed), a bad body, "
            "an unknown scope entity, or, for a service token, `user_uuid` missing or "
            "unknown.",
            403: _STAFF_403,
        },
    ),
)
@service_too
async def register_webhook(
    body: WebhookRegistration,
    request: Request,
    caller: AgentOrService,
    session: SessionDep,
    settings: SettingsDep,
) -> WebhookConsumerOut:
    token = None if caller is None else credentials(request.headers.get("Authorization"))
    consumer = await service.register_webhook(session, settings, caller, token, body)
    facts = await consumers_service.facts_of(session, settings, [consumer])
    return WebhookConsumerOut(
        **ConsumerOut.from_row(
            consumer, facts[consumer.uuid], as_staff=caller is None
        ).model_dump(),
        webhook_secret=consumer.webhook_secret or "",
    )


@router.post(
    "/api/event-consumers/{consumer_uuid}/update_webhook/",
    summary="Change a webhook consumer",
    description="Changes what the body names of `webhook_url`, `object_types`, "
    "`payload_filters` and `scopes` (checked as at registration); omitted fields stay. A "
    "consumer stopped by its receiver's 410 resumes, and its waiting copies fall due now. "
    "Copies not yet delivered that narrowed bindings no longer allow are given up. The "
    "secret stays.",
    responses=error_responses(
        400,
        401,
        403,
        404,
        descriptions={
            400: "A queue (`rmq`) consumer, `webhook_url` refused (the reason named), or a bad "
            "body.",
            403: _STAFF_403,
            404: "No such consumer, or another user's (a service token sees every one).",
        },
    ),
)
@service_too
async def update_webhook(
    consumer_uuid: str,
    body: WebhookUpdate,
    caller: AgentOrService,
    session: SessionDep,
    settings: SettingsDep,
) -> ConsumerOut:
    consumer = await service.update_webhook(session, settings, caller, consumer_uuid, body)
    facts = await consumers_service.facts_of(session, settings, [consumer])
    return ConsumerOut.from_row(consumer, facts[consumer.uuid], as_staff=caller is None)


@router.post(
    "/api/event-consumers/{consumer_uuid}/rotate_secret/",
    summary="Rotate a webhook consumer's signing secret (staff and support, or the service token)",
    description="A new signing secret, shown in this answer only. The previous one stays valid "
    "for `previous_valid_seconds` (default 86400, at most 604800; 0: not at all): until then "
    "every delivery's `webhook-signature` carries both signatures, the new one first "
    "(`v1,<new> v1,<previous>`), so a receiver verifying against either secret accepts it "
    "while it switches over.",
    responses=error_responses(
        400,
        401,
        403,
        404,
        descriptions={
            400: "A queue (`rmq`) consumer, `previous_valid_seconds` out of range, or an "
            "unknown field (named).",
            403: _STAFF_403,
            404: "No such consumer, or another user's (a service token sees every one).",
        },
    ),
)
@service_too
async def rotate_secret(
    consumer_uuid: str,
    caller: AgentOrService,
    session: SessionDep,
    # No body at all: the default window.
    body: Annotated[RotateSecret, Body(default_factory=RotateSecret)],
) -> RotatedSecretOut:
    secret, until = await service.rotate_secret(session, caller, consumer_uuid, body)
    return RotatedSecretOut(webhook_secret=secret, previous_valid_until=until)
