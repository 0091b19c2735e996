"""Settings, read from `QUEUEKEEPER_*` environment variables (and `.env`).

Every field here is documented in the README's configuration table; a test
checks that the two agree.
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def split_urls(value: str) -> list[str]:
    """A comma-separated node list; a single URL is a list of one."""
    return [url.strip() for url in value.split(",") if url.strip()]


# How a PostgreSQL URL may begin; the asyncpg driver is used whichever it is.
POSTGRESQL_SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg")

# RabbitMQ's `x-overflow` values: a typo is refused at start-up, not by the broker at the
# first registration.
Overflow = Literal["drop-head", "reject-publish", "reject-publish-dlx"]

IPNetwork = IPv4Network | IPv6Network


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="QUEUEKEEPER_", env_file=".env", extra="ignore", populate_by_name=True
    )

    # --- identity of this installation -----------------------------------------------
    instance_name: str = Field(
        default="queuekeeper",
        description="Vhosts and broker users are tagged `queuekeeper:<instance_name>` (for "
        "people) and with this database's installation identity, which decides what is "
        "ours. One name per installation: two installations sharing a broker need two names.",
    )

    # --- connections ---------------------------------------------------------------
    database_url: str = Field(
        default="",
        description="PostgreSQL URL, `postgresql://user:password@host:port/database` "
        "(`postgres://` and `postgresql+asyncpg://` too; the asyncpg driver is used): "
        "PostgreSQL is the only database. Empty: the embedded PostgreSQL server in "
        "`embedded_data_dir`, started when needed (`pip install 'queuekeeper[embedded]'`; "
        "`make run` installs it).",
    )
    embedded_data_dir: str = Field(
        default=".queuekeeper/pg",
        description="With no `database_url`: the directory of the embedded PostgreSQL server "
        "(its data, kept across restarts, its log and its Unix socket; relative to the "
        "working directory). The first command that needs it starts it, the last to exit "
        "stops it.",
    )
    database_pool_size: int = Field(
        default=10,
        ge=1,
        description="PostgreSQL connections kept per process (as many again may overflow).",
    )
    database_connect_timeout: float = Field(
        default=5.0,
        gt=0,
        description="Seconds to open a PostgreSQL connection; a request that needs one and "
        "does not get it in time answers 503.",
    )
    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        validation_alias=AliasChoices("QUEUEKEEPER_AMQP_URL", "RABBIT_URL", "amqp_url"),
        description="AMQP connection string; `RABBIT_URL` is used when this is not set. "
        "Events go to each user's own vhost; the path (vhost) here is only opened by the "
        "`/readyz` check, so the user needs access to it (default `/`). For a cluster, "
        "several node URLs separated by commas (same scheme for all): connections go to the "
        "first node that answers, in this order, and a node that failed is skipped for "
        "`broker_node_retry_seconds`.",
    )
    management_url: str = Field(
        default="http://127.0.0.1:15672",
        description="RabbitMQ Management API base URL (`https://` with the TLS settings below). "
        "For a cluster, several node URLs separated by commas: a call that cannot connect or "
        "gets a 5xx goes to the next node.",
    )
    management_user: str = Field(
        default="guest",
        description="Management API user; needs the `administrator` tag (it creates vhosts "
        "and users).",
    )
    management_password: str = Field(default="guest", description="Management API password.")
    management_timeout: float = Field(default=5.0, gt=0, description="Seconds per call.")
    broker_node_retry_seconds: float = Field(
        default=15.0,
        gt=0,
        description="With several AMQP or Management URLs: how long a node that failed is "
        "tried only after the others; then it is preferred again in its configured order.",
    )
    tls_ca_file: str | None = Field(
        default=None, description="CA bundle for `amqps://` and an `https://` Management API."
    )
    tls_cert_file: str | None = Field(default=None, description="Client certificate (PEM).")
    tls_key_file: str | None = Field(default=None, description="Client certificate key (PEM).")
    tls_verify: bool = Field(
        default=True, description="Certificate checks; switch off only for testing."
    )

    # --- HTTP -----------------------------------------------------------------------------
    service_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated service tokens for /api/internal and /api/admin "
        "(several, for rotation).",
    )
    public_url: str = Field(
        default="",
        description="Base of the `url` fields in responses (include any path prefix). Empty: "
        "`http://<QUEUEKEEPER_HOST>:<QUEUEKEEPER_PORT><QUEUEKEEPER_ROOT_PATH>` (127.0.0.1 for a "
        "host of 0.0.0.0 or ::); set it to the address agents use when a proxy is in front.",
    )
    root_path: str = Field(
        default="",
        description="Path prefix behind a proxy, e.g. `/qk`: requests are answered with and "
        "without it (whether or not the proxy strips it).",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address `queuekeeper serve` listens on (`0.0.0.0` in a container).",
    )
    port: int = Field(default=8000, description="Port `queuekeeper serve` listens on.")
    http_keep_alive_seconds: int = Field(
        default=75,
        ge=1,
        description="Seconds `serve` keeps an idle HTTP connection open. Above the idle time "
        "of every client and proxy in front (httpx, which agents use, keeps one 5 s; nginx's "
        "upstream 60 s): a connection the server closes as a client reuses it fails that "
        "request (docs/decisions/037-http-keep-alive.md).",
    )
    retry_after_seconds: int = Field(
        default=5, ge=1, description="`Retry-After` sent with a 503 when the broker is down."
    )
    forwarded_allow_ips: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated addresses or networks (CIDR) of the proxies in front of "
        "queuekeeper; `X-Forwarded-For`/`X-Forwarded-Proto` are believed only from these "
        "(`*` = from anyone, only when nothing else can reach the port). Empty: headers are "
        "ignored and `source_ip` is the real peer.",
    )

    # --- limits on what one request or one agent can take (docs/howto/security.md) --
    body_max_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest request body of every route except event publishing (agent "
        "registration, directory pushes, admin calls); larger answers 413 before it is read.",
    )
    event_payload_max_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest `payload` of one event (its JSON). A single-event body may be this "
        "plus 4 KiB for the envelope; a batch body `events_batch_max` times that.",
    )
    text_max_length: int = Field(
        default=1000,
        ge=1,
        description="Most characters of a free-text field an agent sends (a subscription's or "
        "an identity's `description`, names, versions, endpoint lists); longer is a 400.",
    )
    max_subscriptions_per_user: int = Field(
        default=100,
        ge=1,
        description="Event subscriptions (so broker users) one user may hold; one more is a 409.",
    )
    max_queues_per_user: int = Field(
        default=1000,
        ge=1,
        description="Registered queues one user may hold across its subscriptions; one more "
        "is a 409.",
    )
    max_identities_per_user: int = Field(
        default=20,
        ge=1,
        description="Agent identities one user may hold; one more is a 409.",
    )
    max_consumers_per_user: int = Field(
        default=20,
        ge=1,
        description="Unified event consumers (contract §9) one user may hold; one more is a 409 "
        "(for the consumer registration to check with `common.quotas.check_quota`).",
    )
    registration_rate_limit: str = Field(
        default="20/second;600/minute",
        description="Per API token, on the registration routes (create a subscription, "
        "`create_queue`, identities, `register_event_subscription`): `limits` notation, "
        "several separated by `;`. Over it answers 429 with `Retry-After`. Counted in memory "
        "per process: with N replicas a token gets up to N times this.",
    )
    broker_vhost_max_connections: int = Field(
        default=1000,
        ge=1,
        description="RabbitMQ `max-connections` of every user vhost queuekeeper creates "
        "(agents' STOMP connections plus queuekeeper's own); restored by reconcile.",
    )
    broker_vhost_max_queues: int = Field(
        default=1100,
        ge=1,
        description="RabbitMQ `max-queues` of every user vhost queuekeeper creates (the queue "
        "and consumer quotas, the dead-letter queue, room for repairs); restored by reconcile.",
    )
    broker_user_max_connections: int = Field(
        default=64,
        ge=1,
        description="RabbitMQ `max-connections` of every agent broker user (one login); "
        "restored by reconcile.",
    )
    broker_user_max_channels: int = Field(
        default=256,
        ge=1,
        description="RabbitMQ `max-channels` of every agent broker user, over all its "
        "connections; restored by reconcile.",
    )

    # --- agents (contract §10) --------------------------------------------------------------
    minimum_agent_version: str = Field(
        default="1.0.5",
        description="Oldest waldur-site-agent version reported `compatible` in every identity "
        "answer's `compatibility` (older: `incompatible`; none or unparsable: `unknown`). "
        "Default: the oldest release the test suite runs end to end.",
    )

    # --- queue arguments (contract §3) -------------------------------------------------------
    queue_type: Literal["classic", "quorum"] = Field(
        default="classic",
        description="`classic`, or `quorum` for a RabbitMQ cluster (replicated; survives a node "
        "loss). Quorum queues and their dead-letter queue get `x-queue-type: quorum`, "
        "`x-overflow: reject-publish` and `x-dead-letter-strategy: at-least-once` instead of "
        "`queue_overflow`; a full queue's nack is retried with backoff. Changing it on a "
        'running installation: docs/howto/upgrade.md, "Moving from classic to quorum queues".',
    )
    queue_message_ttl_ms: int = Field(
        default=3_600_000, ge=0, description="`x-message-ttl` of every registered queue."
    )
    queue_max_length: int = Field(
        default=10_000, ge=1, description="`x-max-length` of every registered queue."
    )
    queue_overflow: Overflow = Field(
        default="reject-publish-dlx",
        description="`x-overflow` of every registered classic queue: `drop-head`, "
        "`reject-publish` or `reject-publish-dlx`. Under `reject-publish-dlx` a full queue "
        "dead-letters what it nacks and the copy ends `rejected`; under `reject-publish` "
        "nothing is kept and the nacked copy is retried with backoff.",
    )
    dead_letter_exchange: str = Field(
        default="",
        description='`x-dead-letter-exchange` of every registered queue (`""` is the default '
        "exchange).",
    )
    dlq_name: str = Field(
        default="waldur.dlq.messages",
        description="Dead-letter queue declared in every user vhost; also the registered "
        "queues' `x-dead-letter-routing-key`.",
    )
    dlq_max_length: int = Field(
        default=100_000, ge=1, description="`x-max-length` of the dead-letter queue."
    )
    dlq_message_ttl_ms: int = Field(
        default=7 * 24 * 3_600_000,
        ge=0,
        description="`x-message-ttl` of the dead-letter queue (7 days).",
    )
    dlq_overflow: Overflow = Field(
        default="drop-head",
        description="`x-overflow` of the dead-letter queue: `drop-head` (the oldest dead "
        "letter goes), `reject-publish` or `reject-publish-dlx`.",
    )

    # --- operations (logs, health) ------------------------------------------------------
    log_level: str = Field(
        default="INFO",
        description="Root log level (`DEBUG`, `INFO`, `WARNING`, `ERROR`).",
    )
    log_accepted_events: bool = Field(
        default=False,
        description="Log each answer of the backend's accept routes (POST "
        "/api/internal/events/ and /batch/) that stored or recognised its events at INFO, "
        "as every other request is. Off: at DEBUG, so a backend's single events do not "
        "cost a log line each (refusals and failures are logged at INFO or WARNING "
        "either way; the `queuekeeper_events_accepted_total` metric counts them).",
    )
    log_format: Literal["auto", "json", "console"] = Field(
        default="auto",
        description="`json` (one object per line), `console` (readable), or `auto`: "
        "console in a terminal, JSON otherwise.",
    )
    readiness_timeout: float = Field(
        default=2.0,
        gt=0,
        description="Seconds each `/readyz` check (database, AMQP, Management API) may take.",
    )

    # --- reconcile, stale cleanup, dead-letter redrive (contract §7) -----------------------------
    scheduler_enabled: bool = Field(
        default=True,
        description="Run the scheduled jobs in this process. Switch off on replicas that "
        "should only serve requests; with it on everywhere, an advisory lock still lets one "
        "run at a time.",
    )
    scheduler_jitter_seconds: int = Field(
        default=60, ge=0, description="Random shift of each scheduled run, so replicas spread out."
    )
    reconcile_interval_seconds: int = Field(
        default=6 * 3600, ge=1, description="Seconds between scheduled reconcile runs."
    )
    stale_cleanup_interval_seconds: int = Field(
        default=24 * 3600, ge=1, description="Seconds between scheduled stale-subscription runs."
    )
    redrive_interval_seconds: int = Field(
        default=0,
        ge=0,
        description="Seconds between scheduled dead-letter redrives; 0 = only on demand.",
    )
    reconcile_delete_concurrency: int = Field(
        default=8,
        ge=1,
        description="Orphan queues a reconcile run deletes at the same time (the Management "
        "API has no bulk delete; one at a time made a run deleting 1,000 orphans three times "
        "as long as its listing).",
    )
    reconcile_max_deletions: int = Field(
        default=100,
        ge=0,
        description="Deletion guard: a reconcile or stale-cleanup run that would delete more "
        "broker objects than this (orphan queues, vhosts and the queues in them, broker "
        "users) deletes nothing and reports why, unless run with `--force` / `?force=true`.",
    )
    reconcile_max_delete_share: float = Field(
        default=0.25,
        ge=0,
        le=1,
        description="Deletion guard: the same when a run would delete more than this share "
        "of the broker objects this installation owns (a database restored from an older "
        "backup makes everything registered since look orphaned), and more than "
        "`reconcile_deletions_always_allowed`.",
    )
    reconcile_deletions_always_allowed: int = Field(
        default=2,
        ge=0,
        description="Deletion guard: a run deleting at most this many objects is never held "
        "for their share (a small installation's stray orphan queue or broker user).",
    )
    reconcile_page_size: int = Field(
        default=500, ge=1, le=500, description="Queues per Management API page (broker max 500)."
    )
    access_sweep_interval_seconds: int = Field(
        default=5,
        ge=1,
        description="Seconds between runs of the job that takes out of broker queues the "
        "copies their owner may no longer receive (contract §14): it also runs at once on "
        "every change of access; the interval catches a role or token expiring by time.",
    )
    token_expiry_interval_seconds: int = Field(
        default=10,
        ge=1,
        description="Seconds between runs of the job that takes the broker logins of users "
        "whose token has expired (password removed, connections closed).",
    )
    redrive_max_age_seconds: int = Field(
        default=24 * 3600,
        ge=1,
        description="A dead letter older than this (from its publish time) is given up.",
    )
    redrive_max_attempts: int = Field(
        default=5, ge=1, description="A dead letter redriven this many times is given up."
    )
    redrive_max_messages: int = Field(
        default=10_000,
        ge=1,
        description="Dead letters examined per vhost per redrive run (bounds memory).",
    )
    dead_letter_census_seconds: int = Field(
        default=30,
        ge=1,
        description="Seconds between counts of a vhost's dead letters by their queue, for the "
        "`dead_letters` of `/status/` and `GET /api/admin/queues/`: a status call answers at "
        "once from the latest count (`dead_letters_counted_at`) and, when it is this old, "
        "starts the next in the background, one at a time per vhost and process. Each count "
        "takes the vhost's dead letters (at most QUEUEKEEPER_REDRIVE_MAX_MESSAGES) "
        "unacknowledged and gives them all back.",
    )

    # --- presence: who reads each queue (contract §11) --------------------------------------------
    presence_events_enabled: bool = Field(
        default=True,
        description="Learn within seconds when a consumer arrives at or leaves a registered "
        "queue, from RabbitMQ's event exchange (plugin `rabbitmq_event_exchange`, read in vhost "
        "`/`). Off: only the periodic check (QUEUEKEEPER_PRESENCE_INTERVAL_SECONDS) does.",
    )
    presence_interval_seconds: int = Field(
        default=60,
        ge=0,
        description="Seconds between checks of every registered queue's consumers against the "
        "Management API (repairs a missed event or a restart); 0 = only on demand.",
    )

    # --- publishing (contract §6) ----------------------------------------------------------------
    events_batch_max: int = Field(
        default=1000, ge=1, description="Most events one POST /api/internal/events/batch/ takes."
    )
    events_accept_queue: int = Field(
        default=2000,
        ge=1,
        description="Most events waiting to be stored (accept requests queue while the "
        "transaction before them commits, then share the next one); past it a request is "
        "answered 503 with Retry-After at once instead of waiting seconds. At least "
        "`events_batch_max`, or a full batch is refused whenever anything else waits.",
    )
    events_accept_max_wait: float = Field(
        default=1.0,
        gt=0,
        description="Seconds an accept request may wait to be stored; while the oldest waiting "
        "request has waited longer (the process is starved of CPU, the database is slow), new "
        "ones are answered 503 with Retry-After at once instead of queueing into seconds.",
    )
    events_max_in_flight: int = Field(
        default=64,
        ge=1,
        description="Most accept requests (single events and batches) this process handles at "
        "once, from their arrival to their answer; past it a request is answered 503 with "
        "Retry-After before its body is read. Bounds how long an answer takes when more is "
        "offered than the process can store: the excess is refused at once instead of every "
        "request slowing down.",
    )
    events_wait_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds `?wait=true` waits for every copy to be confirmed or to fail; "
        "copies still unsettled then are answered as `pending`.",
    )
    event_retention_days: float = Field(
        default=14,
        gt=0,
        description="Days events and their copies are kept after acceptance (contract §11): a "
        "parked copy older than this is given up with the reason `retention`, the retention "
        "job deletes older events whose copies are settled, a repeated event_id is recognised "
        "within this window, and a replay reaches this far back.",
    )
    park_after_seconds: float = Field(
        default=300,
        gt=0,
        description="Seconds a registered queue may have no consumer before its new copies are "
        "parked in the outbox instead of published and its status says `agent_away` (contract "
        "§11); the parked copies are published, in acceptance order, when a consumer returns.",
    )
    park_release_max_in_flight: int = Field(
        default=1000,
        ge=1,
        description="Most messages a queue holds ready while its parked copies are released: "
        "the release publishes only while the queue (counted exactly, on the broker) is below "
        "it. Keep it well below `queue_max_length`.",
    )
    replay_max_copies: int = Field(
        default=10_000,
        ge=1,
        description="Most copies one replay may write (contract §11): a window holding more "
        "is refused with 400 naming the limit and the count (narrow it with `until` or "
        "`object_types`). The default is a queue's `x-max-length`.",
    )
    replay_copies_per_second: float = Field(
        default=500,
        gt=0,
        description="How fast replayed copies fall due, all replays together (contract §11): "
        "a replay's copies are spaced this far apart behind every replay copy still pending, "
        "so replays add at most this many copies a second to the relay's work and live copies "
        "never wait behind them. Keep it well below the single-event capacity "
        "(docs/benchmarks.md).",
    )
    park_check_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between each replica's look at which queues park their copies and "
        "which have a consumer again (the first parked copy reaches a returning agent within "
        "its presence delay plus this).",
    )
    retention_interval_seconds: int = Field(
        default=21_600,
        ge=0,
        description="Seconds between retention runs (give up parked copies past retention, "
        "delete events past it page by page); 0 = only on demand.",
    )
    relay_enabled: bool = Field(
        default=True,
        description="Run the outbox relay inside the service. Switch off when the relay runs "
        "as its own process (`queuekeeper relay`).",
    )
    accept_workers: int | None = Field(
        default=None,
        ge=1,
        description="Processes `serve` starts to accept HTTP requests, all on the one port. "
        "Default, from the cores this process may use (its CPU affinity): 1 on 2 cores or "
        "fewer, else half of them (docs/scaling.md). What each number costs beside the relay "
        "choice: QUEUEKEEPER_RELAY_PROCESSES.",
    )
    relay_processes: int | None = Field(
        default=None,
        ge=0,
        description="Outbox relay processes `serve` starts beside the accept workers; 0 runs "
        "the relay inside each accept process instead. Default, from the cores this process "
        "may use (its CPU affinity): 0 on 2 cores or fewer (one process with the relay "
        "inside costs the least CPU per event there), else a quarter of them, at least 1; "
        "0 when `relay_enabled` is off. Measured on the benchmarks' 2-vCPU VM, quiet (two "
        "runs; docs/reference/settings.md, What a process model costs), CPU per single event "
        "over every process at 200/s and 800/s, then p99 accept-to-consume at 200/s and "
        "800/s: 1 accept + 0 relay 1.29 and 0.83-0.84 ms, 6.1-7.2 and 17.8-20.0 ms (the only "
        "model holding 800/s at p99 <= 20 ms); 1 + 1: 1.67-1.69 and 0.78 ms, 14.1-26.7 and "
        "21.3-24.3 ms; 2 + 1: 1.67-1.73 and 0.78-0.82 ms, 11.4-12.1 and 46.4-55.5 ms; 1 + 2: "
        "2.12-2.15 and 0.77-0.79 ms, 20.3-24.4 and 37.7-41.0 ms; 2 + 2: 2.09-2.22 and "
        "0.79-0.80 ms, 21.3-21.8 and 41.0-50.6 ms (the raw pipeline: 0.74-0.82 and 0.52-0.54 "
        "ms, 4.4-4.5 and 6.0-28.7 ms).",
    )
    relay_batch_size: int = Field(default=1000, ge=1, description="Deliveries claimed at once.")
    relay_concurrency: int = Field(
        default=2, ge=1, description="Batches one relay keeps in flight at the same time."
    )
    relay_lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How long a claim lasts; a relay that dies holding claims releases them "
        "when the lease runs out. Must exceed `publish_timeout`.",
    )
    relay_poll_interval: float = Field(
        default=0.5,
        gt=0,
        description="Seconds an idle relay waits before looking for due deliveries again "
        "(events accepted by the same process wake it at once).",
    )
    relay_idle_poll_max: float = Field(
        default=5.0,
        gt=0,
        description="Seconds an idle relay or webhook dispatcher waits at most between looks "
        "for due copies while it listens for them (NOTIFY): each look that finds nothing "
        "doubles the wait from `relay_poll_interval` up to this; a retry it scheduled wakes "
        "it when due. Copies accepted, released or made due are announced at once; only a "
        "dead replica's copies (their lease ended) wait for a look "
        "(docs/decisions/034-idle-polls.md).",
    )
    relay_settle_interval: float = Field(
        default=0.05,
        ge=0,
        description="Seconds the relay gathers confirmed copies before writing them "
        "published in one statement (a `?wait=true` request waiting in the same process "
        "has them written at once); 0 writes each batch as it is confirmed.",
    )
    relay_backoff_base: float = Field(
        default=1.0, gt=0, description="First retry delay (s) after the broker was unreachable."
    )
    relay_backoff_max: float = Field(
        default=60.0, gt=0, description="Cap (s) of the exponential retry delay."
    )
    delivery_max_age: float = Field(
        default=86_400.0,
        gt=0,
        description="Seconds after which a copy still not confirmed is given up (reason stored).",
    )
    publish_timeout: float = Field(
        default=10.0, gt=0, description="Seconds to wait for a broker confirm before retrying."
    )
    amqp_pool_size: int = Field(
        default=64,
        ge=1,
        description="Most AMQP connections open at once (one per vhost); the least recently "
        "used is closed to make room.",
    )
    amqp_idle_seconds: float = Field(
        default=300.0, gt=0, description="An AMQP connection unused this long is closed."
    )
    amqp_connect_timeout: float = Field(
        default=5.0, gt=0, description="Seconds to open an AMQP connection."
    )

    # --- webhook consumers (contract §13; docs/webhooks.md) -----------------------------
    webhook_allowed_networks: Annotated[list[IPNetwork], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated networks (CIDR) a webhook may point into although they "
        "are loopback, private, link-local or otherwise not public (e.g. `10.0.5.0/24` for a "
        "receiver inside the site). Empty: public addresses only.",
    )
    webhook_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Seconds one webhook request may take (connect, send, answer) before the "
        "attempt counts as failed.",
    )
    webhook_retry_seconds: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [1.0, 5.0, 25.0, 60.0, 300.0, 900.0, 3600.0],
        description="Comma-separated delays (s) after the 1st, 2nd, ... failed attempt of a "
        "webhook copy, the last repeated until retention gives the copy up; each with up to "
        "20 % jitter.",
    )
    webhook_concurrency: int = Field(
        default=64,
        ge=1,
        description="Webhook requests in flight at once in one relay, all receivers together.",
    )
    webhook_concurrency_per_destination: int = Field(
        default=8,
        ge=1,
        description="Webhook requests in flight at once to one destination (scheme, host and "
        "port): a slow receiver takes at most this many, the others go on.",
    )
    webhook_response_max_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="Most bytes of a receiver's answer read (the rest is dropped; the "
        "status code decides).",
    )

    @field_validator("webhook_allowed_networks", mode="before")
    @classmethod
    def _networks(cls, value: object) -> object:
        if isinstance(value, str):
            return [
                ip_network(part.strip(), strict=False) for part in value.split(",") if part.strip()
            ]
        return value

    @field_validator("webhook_retry_seconds", mode="before")
    @classmethod
    def _delays(cls, value: object) -> object:
        if isinstance(value, str):
            delays = [float(part) for part in value.split(",") if part.strip()]
            if not delays or any(delay <= 0 for delay in delays):
                raise ValueError("a comma-separated list of positive seconds")
            return delays
        return value

    @field_validator("service_tokens", "forwarded_allow_ips", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("registration_rate_limit")
    @classmethod
    def _rate_limit(cls, value: str) -> str:
        from limits import parse_many

        parse_many(value)  # a ValueError here names the setting at start-up
        return value

    @field_validator("minimum_agent_version")
    @classmethod
    def _agent_version(cls, value: str) -> str:
        from packaging.version import Version

        Version(value)  # an InvalidVersion here names the setting at start-up
        return value.strip()

    @field_validator("amqp_url", "management_url")
    @classmethod
    def _node_list(cls, value: str, info: ValidationInfo) -> str:
        urls = split_urls(value)
        allowed = ("amqp", "amqps") if info.field_name == "amqp_url" else ("http", "https")
        if not urls:
            raise ValueError("at least one URL is required")
        schemes = {urlsplit(url).scheme for url in urls}
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in allowed or not parts.hostname:
                raise ValueError(
                    f"{url!r} is not a {' or '.join(allowed)} URL with a host "
                    "(several nodes: separate them with commas)"
                )
        if len(schemes) > 1:
            raise ValueError("every node URL must use the same scheme (one TLS set-up)")
        return ",".join(urls)

    @field_validator("database_url")
    @classmethod
    def _postgresql(cls, value: str) -> str:
        """A PostgreSQL URL, on asyncpg whichever way it is spelled; empty for the embedded
        server (embedded.py)."""
        if not value.strip():
            return ""
        scheme, separator, rest = value.strip().partition("://")
        if separator and scheme in POSTGRESQL_SCHEMES:
            return "postgresql+asyncpg://" + rest
        # Only the scheme is shown: the rest may hold a password.
        given = f"a {scheme}:// URL" if separator else "not a URL"
        raise ValueError(
            f"QUEUEKEEPER_DATABASE_URL must be a PostgreSQL URL "
            f"(postgresql://user:password@host:port/database), got {given}: PostgreSQL is "
            "the only database queuekeeper runs on"
        )

    @field_validator("root_path")
    @classmethod
    def _normalise_root_path(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value and not value.startswith("/"):
            value = "/" + value
        return value

    @model_validator(mode="after")
    def _public_url_from_address(self) -> Settings:
        if not self.public_url:
            self.public_url = f"http://{self.local_host}:{self.port}{self.root_path}"
        return self

    @property
    def local_host(self) -> str:
        """Where this host reaches `serve`: the listen address, loopback for a wildcard."""
        return self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"  # noqa: S104

    @property
    def amqp_urls(self) -> list[str]:
        """The AMQP node URLs, in the configured order (one for a single broker)."""
        return split_urls(self.amqp_url)

    @property
    def management_urls(self) -> list[str]:
        """The Management API base URLs, in the configured order, without a trailing slash."""
        return [url.rstrip("/") for url in split_urls(self.management_url)]

    @property
    def event_retention(self) -> timedelta:
        return timedelta(days=self.event_retention_days)

    @property
    def instance_tag(self) -> str:
        return f"queuekeeper:{self.instance_name}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
