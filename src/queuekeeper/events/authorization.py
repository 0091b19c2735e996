"""The rule a copy is published by: its owner may receive the event now
(docs/decisions/021-authorized-when-published.md).

Written once, as SQL text, for every statement that publishes or re-creates a copy: the
outbox's claim, unpark and replay (`outbox_postgres.py`, on asyncpg) and the redrive's
check of dead letters (`deadletters/repository.py`, on SQLAlchemy). A new condition (a
role, a binding) is a change here, not a new path.
"""

from __future__ import annotations


def authorized_sql(queue: str, consumer: str, offering: str, now: str) -> str:
    """Whether the owner of the queue `queue` (a subscription queue's uuid) or of the consumer
    `consumer` may receive an event of `offering` at `now`: active, holding a token that has
    not expired, granted the offering, and (a consumer) still scoped to it. The arguments
    are SQL expressions of the callers' own statements (columns, bound parameters), never
    input."""
    return f"""EXISTS (
        SELECT 1 FROM users u
        JOIN offering_access a ON a.user_uuid = u.uuid AND a.offering_uuid = {offering}
        WHERE u.is_active AND u.token_hash IS NOT NULL
            AND (u.token_expires_at IS NULL OR u.token_expires_at > {now})
            AND u.uuid IN (
                SELECT s.user_uuid FROM event_subscription_queues q
                JOIN event_subscriptions s ON s.uuid = q.subscription_uuid
                WHERE q.uuid = {queue} AND q.offering_uuid = {offering}
                UNION ALL
                SELECT c.user_uuid FROM event_consumers c
                JOIN event_consumer_scopes sc ON sc.consumer_uuid = c.uuid
                    AND sc.offering_uuid = {offering}
                WHERE c.uuid = {consumer}
            )
    )"""  # noqa: S608 - the module's own expressions


def binding_allowed_sql(user: str, kind: str, entity: str, now: str) -> str:
    """Whether the user `user` may hold the binding (`kind`, `entity`) at `now` (contract
    §12): staff and support may hold any, global (`kind` 'global') included; anyone their
    own user; an offering they are granted; and an entity they hold an unexpired role on,
    or a role on one of its ancestors (a project's customer; an offering's customer, its
    project and that project's customer). Checked at registration and again for each event
    delivered (docs/decisions/025-bindings-authorized-at-delivery.md). The arguments are SQL
    expressions of the callers' own statements, never input."""
    return f"""(
        EXISTS (SELECT 1 FROM users su WHERE su.uuid = {user} AND (su.is_staff OR su.is_support))
        OR ({kind} = 'user' AND {entity} = {user})
        OR ({kind} = 'offering' AND EXISTS (
            SELECT 1 FROM offering_access ga
            WHERE ga.user_uuid = {user} AND ga.offering_uuid = {entity}))
        OR EXISTS (
            SELECT 1 FROM roles r
            WHERE r.user_uuid = {user} AND (r.expires_at IS NULL OR r.expires_at > {now})
                AND (
                    (r.scope_type = {kind} AND r.scope_uuid = {entity})
                    OR ({kind} = 'project' AND r.scope_type = 'customer' AND r.scope_uuid IN (
                        SELECT bp.customer_uuid FROM projects bp WHERE bp.uuid = {entity}))
                    OR ({kind} = 'offering' AND r.scope_type = 'project' AND r.scope_uuid IN (
                        SELECT bo.project_uuid FROM offerings bo WHERE bo.uuid = {entity}))
                    OR ({kind} = 'offering' AND r.scope_type = 'customer' AND r.scope_uuid IN (
                        SELECT bo.customer_uuid FROM offerings bo WHERE bo.uuid = {entity}
                        UNION ALL
                        SELECT bp.customer_uuid FROM offerings bo
                        JOIN projects bp ON bp.uuid = bo.project_uuid
                        WHERE bo.uuid = {entity}))
                )
        )
    )"""  # noqa: S608 - the module's own expressions
