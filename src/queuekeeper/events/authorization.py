"""The rule a copy is published by: its owner may receive the event now
(docs/decisions/021-authorized-when-published.md), and the proof that lets a copy skip it
(`unchanged_sql`, docs/decisions/029-judged-as-it-leaves.md).

Written once, as SQL text, for every statement that publishes or re-creates a copy: the
outbox's recipients, claim, unpark and replay (`outbox_postgres.py`, on asyncpg) and the
redrive's check of dead letters (`deadletters/repository.py`, on SQLAlchemy, which reaches a
binding's offerings through `event_keys_sql` as well); and who may hold a binding
(`binding_allowed_sql`), which registration checks as well
(docs/decisions/025-bindings-authorized-at-delivery.md).
"""

from __future__ import annotations

# The access epoch (migration 0016_access_changes) as the statement's own snapshot sees it:
# a trigger bumps it in the same transaction as every UPDATE or DELETE that can change a
# verdict, so two reads that find the same value saw the same rows the rule reads (inserts
# only add access). No row (a test emptied the table): 0, which no bump leaves behind.
EPOCH_SQL = "coalesce((SELECT value FROM access_epoch WHERE id = 1), 0)"


def last_expiry_sql(now: str) -> str:
    """The latest role or token expiry that has passed by `now` (NULL: none): time ends
    access with no write, so no epoch bump. Two index probes (migration 0016's indexes)."""
    return f"""greatest(
        (SELECT max(ex.expires_at) FROM roles ex WHERE ex.expires_at <= {now}),
        (SELECT max(et.token_expires_at) FROM users et WHERE et.token_expires_at <= {now}))"""  # noqa: S608 - the module's own expressions


def access_sql(now: str) -> str:
    """The columns `epoch` and `expired` (`last_expiry_sql`) at `now`, in one snapshot."""
    return f"{EPOCH_SQL} AS epoch, {last_expiry_sql(now)} AS expired"


def unchanged_sql(judged_epoch: str, since: str, access: str) -> str:
    """Whether a copy judged under the epoch `judged_epoch` at a time no earlier than
    `since` may skip the rule: the epoch is still the one `access` (a row of `access_sql`)
    read, and no role or token expired in between (docs/decisions/029-judged-as-it-leaves.md)."""
    return (
        f"({judged_epoch} = {access}.epoch"
        f" AND ({access}.expired IS NULL OR {access}.expired <= {since}))"
    )


_ACTIVE = """u.is_active AND u.token_hash IS NOT NULL
            AND (u.token_expires_at IS NULL OR u.token_expires_at > {now})"""


# An event's scope keys (contract §12), written once for every statement that matches them
# against bindings: the rule below (`event_keys_sql`), the outbox's recipients statement
# (`outbox_postgres.py`, which reads them for every offering, project and subject user a
# store names at once) and the redrive's check of dead letters. Each function gives the keys
# an entity the event names brings, as rows (`lead`, scope_type, entity), for the entities of
# its table for which the condition `which` (SQL on the function's alias) holds; `lead` is
# columns of that alias to carry before them, each followed by a comma (the recipients
# statement carries the entity the keys came from), or nothing. A key that is NULL (an
# offering without a customer) is no row. One text for both statements, plain SELECTs that
# the planner flattens into the statement's own (docs/decisions/018-outbox-plans.md).


def offering_keys_sql(which: str, lead: str = "") -> str:
    """An offering's keys other than itself (alias `ko`): its customer, its project and that
    project's customer."""
    return f"""
        SELECT {lead}'customer'::varchar AS scope_type, ko.customer_uuid AS entity
        FROM offerings ko WHERE {which} AND ko.customer_uuid IS NOT NULL
        UNION ALL
        SELECT {lead}'project', ko.project_uuid
        FROM offerings ko WHERE {which} AND ko.project_uuid IS NOT NULL
        UNION ALL
        SELECT {lead}'customer', kp.customer_uuid
        FROM offerings ko JOIN projects kp ON kp.uuid = ko.project_uuid
        WHERE {which}"""  # noqa: S608 - the module's own expressions


def project_keys_sql(which: str, lead: str = "") -> str:
    """A project's keys (alias `kp`): the project itself and its customer."""
    return f"""
        SELECT {lead}'project'::varchar AS scope_type, kp.uuid AS entity
        FROM projects kp WHERE {which}
        UNION ALL
        SELECT {lead}'customer', kp.customer_uuid
        FROM projects kp WHERE {which}"""  # noqa: S608 - the module's own expressions


def subject_keys_sql(which: str, lead: str = "") -> str:
    """The key of the user an identity event is about (alias `ku`): that user."""
    return f"""
        SELECT {lead}'user'::varchar AS scope_type, ku.uuid AS entity
        FROM users ku WHERE {which}"""  # noqa: S608 - the module's own expressions


def event_keys_sql(offering: str, project: str, subject: str) -> str:
    """An event's scope keys other than its offering, as rows (scope_type, entity): those of
    its offering, of its own project and of its subject user, as the directory has them (a
    project or user deleted is no key: deleting it deleted the bindings of it as well,
    docs/decisions/025-bindings-authorized-at-delivery.md)."""
    return f"""{offering_keys_sql(f"ko.uuid = {offering}")}
        UNION ALL {project_keys_sql(f"kp.uuid = {project}")}
        UNION ALL {subject_keys_sql(f"ku.uuid = {subject}")}"""


def authorized_sql(
    queue: str,
    consumer: str,
    offering: str,
    now: str,
    project: str = "NULL::uuid",
    subject: str = "NULL::uuid",
) -> str:
    """Whether the owner of the queue `queue` (a subscription queue's uuid) or of the consumer
    `consumer` may receive an event of `offering` (with the other scope keys `project` and
    `subject`) at `now`: active, holding a token that has not expired, and
    - a subscription queue: granted the offering, the queue being for it;
    - a consumer: global with a staff or support owner, or holding a binding that is one of
      the event's keys (its offering, or `event_keys_sql`) which the owner may still hold
      (`binding_allowed_sql`: a grant, a role on the key or an ancestor, the subject itself;
      docs/decisions/025-bindings-authorized-at-delivery.md).
    The arguments are SQL expressions of the callers' own statements (columns, bound
    parameters), never input."""
    active = _ACTIVE.format(now=now)
    offering_allowed = binding_allowed_sql("c.user_uuid", "'offering'", offering, now)
    key_allowed = binding_allowed_sql("c.user_uuid", "b.scope_type", "b.scope_uuid", now)
    keys = event_keys_sql(offering, project, subject)
    return f"""(EXISTS (
        SELECT 1 FROM users u
        JOIN offering_access a ON a.user_uuid = u.uuid AND a.offering_uuid = {offering}
        JOIN event_subscriptions s ON s.user_uuid = u.uuid
        JOIN event_subscription_queues q ON q.subscription_uuid = s.uuid
        WHERE q.uuid = {queue} AND q.offering_uuid = {offering} AND {active}
    ) OR EXISTS (
        SELECT 1 FROM event_consumers c JOIN users u ON u.uuid = c.user_uuid
        WHERE c.uuid = {consumer} AND {active} AND (
            (c.is_global AND (u.is_staff OR u.is_support))
            OR EXISTS (
                SELECT 1 FROM event_consumer_scopes sc
                WHERE sc.consumer_uuid = c.uuid AND sc.offering_uuid = {offering}
                    AND {offering_allowed})
            OR EXISTS (
                SELECT 1 FROM event_consumer_bindings b
                WHERE b.consumer_uuid = c.uuid
                    AND (b.scope_type, b.scope_uuid) IN ({keys})
                    AND {key_allowed})
        )
    ))"""  # noqa: S608 - the module's own expressions


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
            SELECT 1 FROM roles gr
            WHERE gr.user_uuid = {user} AND (gr.expires_at IS NULL OR gr.expires_at > {now})
                AND (
                    (gr.scope_type = {kind} AND gr.scope_uuid = {entity})
                    OR ({kind} = 'project' AND gr.scope_type = 'customer' AND gr.scope_uuid IN (
                        SELECT bp.customer_uuid FROM projects bp WHERE bp.uuid = {entity}))
                    OR ({kind} = 'offering' AND gr.scope_type = 'project' AND gr.scope_uuid IN (
                        SELECT bo.project_uuid FROM offerings bo WHERE bo.uuid = {entity}))
                    OR ({kind} = 'offering' AND gr.scope_type = 'customer' AND gr.scope_uuid IN (
                        SELECT bo.customer_uuid FROM offerings bo WHERE bo.uuid = {entity}
                        UNION ALL
                        SELECT bp.customer_uuid FROM offerings bo
                        JOIN projects bp ON bp.uuid = bo.project_uuid
                        WHERE bo.uuid = {entity}))
                )
        )
    )"""  # noqa: S608 - the module's own expressions
