"""Every Prometheus metric queuekeeper exports, in one place.

Domains import the metric they move; nothing defines metrics elsewhere. Names
follow Prometheus conventions (`_total` counters, `_seconds` durations).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# --- HTTP ------------------------------------------------------------------------------
HTTP_REQUESTS = Counter(
    "queuekeeper_http_requests_total",
    "HTTP requests by route template and status.",
    ["method", "route", "status"],
)
HTTP_LATENCY = Histogram(
    "queuekeeper_http_request_duration_seconds",
    "HTTP request latency by route template.",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
)

# --- registration ------------------------------------------------------------------------
CREATE_QUEUE = Counter(
    "queuekeeper_create_queue_total",
    "create_queue calls by outcome: created, existing, repaired, kept (a busy queue of the "
    "other type, kept until it can be converted), conflict, broker_unavailable.",
    ["outcome"],
)

# --- publishing ------------------------------------------------------------------------
EVENTS_ACCEPTED = Counter(
    "queuekeeper_events_accepted_total", "Events accepted (duplicates not counted)."
)
EVENTS_DUPLICATE = Counter(
    "queuekeeper_events_duplicate_total", "Events whose event_id had been accepted before."
)
SKIPPED_UNREGISTERED = Counter(
    "queuekeeper_deliveries_skipped_unregistered_total",
    "Subscriptions that would have received an event but registered no queue for it.",
)
DELIVERIES = Counter(
    "queuekeeper_deliveries_total",
    "Delivery attempts by outcome: published, rejected (queue full: dead-lettered), "
    "nacked (nothing dead-lettered: retried), returned (unroutable), retried, given_up.",
    ["outcome"],
)
# multiprocess_mode says how workers' values combine in multiprocess mode (common/processes.py;
# ignored otherwise): each worker reads the same outbox, so the largest live value is it.
OUTBOX_PENDING = Gauge(
    "queuekeeper_outbox_pending",
    "Deliveries waiting to be published.",
    multiprocess_mode="livemax",
)
OUTBOX_OLDEST_AGE = Gauge(
    "queuekeeper_outbox_oldest_pending_age_seconds",
    "Age of the oldest pending delivery.",
    multiprocess_mode="livemax",
)
CONFIRM_LATENCY = Histogram(
    "queuekeeper_publish_confirm_seconds",
    "From publish to broker confirm.",
    buckets=LATENCY_BUCKETS,
)
AMQP_POOL_SIZE = Gauge(
    "queuekeeper_amqp_pool_connections",
    "Open AMQP connections (one per vhost).",
    multiprocess_mode="livesum",
)
AMQP_RECONNECTS = Counter("queuekeeper_amqp_reconnects_total", "AMQP connections re-opened.")
BROKER_NODE_FAILURES = Counter(
    "queuekeeper_broker_node_failures_total",
    "Attempts on one broker node (of several configured) that failed and went to the next: "
    "kind amqp or management, node host:port.",
    ["kind", "node"],
)

# --- Management API ----------------------------------------------------------------------
MANAGEMENT_CALLS = Counter(
    "queuekeeper_management_api_calls_total",
    "Management API calls by endpoint kind and status.",
    ["kind", "status"],
)
MANAGEMENT_LATENCY = Histogram(
    "queuekeeper_management_api_call_seconds",
    "Management API call latency by endpoint kind.",
    ["kind"],
    buckets=LATENCY_BUCKETS,
)

# --- scheduled jobs --------------------------------------------------------------------
JOB_RUNS = Counter(
    "queuekeeper_job_runs_total",
    "Runs of reconcile, stale cleanup and redrive by status.",
    ["job", "status"],
)
JOB_DURATION = Histogram(
    "queuekeeper_job_run_duration_seconds",
    "Duration of job runs.",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900),
)
RECONCILE_ITEMS = Counter(
    "queuekeeper_reconcile_items_total",
    "What reconcile and stale-cleanup runs did: orphans_deleted, queues_recreated, drift_found, "
    "drift_repaired, users_restored, permissions_restored, vhosts_created, vhosts_deleted, "
    "users_deleted, subscriptions_marked_broken, dead_letter_queues_ensured, "
    "subscriptions_removed, queues_deleted, failures.",
    ["action"],
)
DEAD_LETTERS = Counter(
    "queuekeeper_dead_letters_total", "Dead letters by outcome: redriven, given_up.", ["outcome"]
)
JOB_LAST_SUCCESS = Gauge(
    "queuekeeper_job_last_success_timestamp_seconds",
    "Unix time of the last successful run.",
    ["job"],
    multiprocess_mode="max",
)


def observe_management_call(kind: str, status: str, seconds: float) -> None:
    MANAGEMENT_CALLS.labels(kind=kind, status=status).inc()
    MANAGEMENT_LATENCY.labels(kind=kind).observe(seconds)


# --- site agents ---------------------------------------------------------------------------
AGENT_REGISTRATIONS = Counter(
    "queuekeeper_agent_registrations_total",
    "register_event_subscription calls by outcome: reused (200), created (201, first start), "
    "replaced (201, the old subscription's broker user was gone).",
    ["outcome"],
)
AGENT_OFFERING_UUID_FORM = Counter(
    "queuekeeper_agent_offering_uuid_not_lowercase_total",
    "Agent identities registered with an offering uuid that is not lowercase hex/dashed: "
    "such an agent computes queue names that do not exist and reconnects in a loop.",
)

# --- unified consumers (contract §9) -------------------------------------------------------------
CONSUMER_REGISTRATIONS = Counter(
    "queuekeeper_consumer_registrations_total",
    "Consumer registrations by route (register_queue: site agents 1.0.7; api: "
    "/api/event-consumers/register/; register_webhook: webhook consumers) and outcome: "
    "created (201), reused (200), conflict, broker_unavailable.",
    ["route", "outcome"],
)
CONSUMERS = Gauge(
    "queuekeeper_consumers",
    "Consumers registered (refreshed by the relay's housekeeping).",
    multiprocess_mode="livemax",
)
COPIES = Counter(
    "queuekeeper_copies_total",
    "Event copies by kind (legacy: a subscription's per-type queue; consumer: a consumer's "
    "queue) and stage (queued: written to the outbox; published: confirmed by the broker).",
    ["kind", "stage"],
)

# --- presence, parking, replay (contract §11) ---------------------------------------------------
# Set by the `presence` job on whichever replica ran it last: every replica reads the same
# database, so the largest live value is the truth.
QUEUES_WITHOUT_CONSUMER = Gauge(
    "queuekeeper_queues_without_consumer",
    "Registered queues that have no consumer now.",
    multiprocess_mode="livemax",
)
QUEUES_LONGEST_AWAY = Gauge(
    "queuekeeper_queue_longest_away_seconds",
    "How long the registered queue without a consumer for the longest has had none (0: every "
    "queue has one).",
    multiprocess_mode="livemax",
)
PARKED_COPIES = Gauge(
    "queuekeeper_parked_copies",
    "Copies held in the outbox because their queue's agent is away.",
    multiprocess_mode="livemax",
)
OLDEST_PARKED_AGE = Gauge(
    "queuekeeper_oldest_parked_copy_age_seconds",
    "Age (since its event's acceptance) of the oldest parked copy; 0 when none is parked.",
    multiprocess_mode="livemax",
)
COPIES_PARKED = Counter(
    "queuekeeper_copies_parked_total",
    "Copies parked in the outbox because their queue's agent was away (or its backlog was).",
)
COPIES_RELEASED = Counter(
    "queuekeeper_copies_released_total",
    "Parked copies released to their queue after a consumer returned.",
)
COPIES_REFUSED = Counter(
    "queuekeeper_copies_refused_total",
    "Copies given up when they were to be published (claimed or released) because their "
    "owner could no longer receive the event: access, scope, token or activity lost "
    "(docs/decisions/021-authorized-when-published.md).",
)
COPIES_GIVEN_UP_RETENTION = Counter(
    "queuekeeper_copies_given_up_retention_total",
    "Parked copies given up because they were older than QUEUEKEEPER_EVENT_RETENTION_DAYS.",
)
REPLAYS = Counter(
    "queuekeeper_replays_total",
    "Replays of a time window to a queue, by who asked.",
    ["caller"],
)

# --- webhook consumers (contract §13) ------------------------------------------------------------
WEBHOOK_DELIVERIES = Counter(
    "queuekeeper_webhook_deliveries_total",
    "Webhook copies settled, by outcome: delivered (a 2xx), given_up (past retention).",
    ["outcome"],
)
WEBHOOK_ATTEMPTS = Counter(
    "queuekeeper_webhook_attempts_total",
    "Webhook requests made (or refused before connecting), by result: delivered, http_error "
    "(any status but 2xx and 410), gone (410), timeout, connection_error, address_refused.",
    ["result"],
)
WEBHOOK_ATTEMPT_SECONDS = Histogram(
    "queuekeeper_webhook_attempt_seconds",
    "One webhook attempt, from the address check to the answer read.",
    buckets=LATENCY_BUCKETS,
)
# Refreshed by the webhook dispatcher's housekeeping from the outbox every replica reads.
PENDING_BY_KIND = Gauge(
    "queuekeeper_pending_copies",
    "Copies not yet delivered, by consumer kind (queue: published by the relay; webhook: "
    "posted by the webhook dispatcher).",
    ["kind"],
    multiprocess_mode="livemax",
)
OLDEST_PENDING_BY_KIND = Gauge(
    "queuekeeper_oldest_pending_copy_age_seconds",
    "Age (since acceptance) of the oldest copy not yet delivered, by consumer kind; 0: none.",
    ["kind"],
    multiprocess_mode="livemax",
)
WEBHOOKS_FAILING = Gauge(
    "queuekeeper_webhook_consumers_failing",
    "Webhook consumers whose last attempt failed (410s excluded: those are disabled).",
    multiprocess_mode="livemax",
)
WEBHOOK_LONGEST_FAILING = Gauge(
    "queuekeeper_webhook_longest_failing_seconds",
    "How long the webhook consumer failing for the longest has failed, from the first failed "
    "attempt of its run (0: none failing).",
    multiprocess_mode="livemax",
)
# --- every copy's attempts (contract §14; docs/decisions/031-delivery-log.md) ----------------
DELIVERY_ATTEMPTS = Counter(
    "queuekeeper_delivery_attempts_total",
    "Attempts to deliver a copy, counted when the attempt is written to the copy, by consumer "
    "kind (queue: published by the relay; webhook: posted by the webhook dispatcher), outcome "
    "(delivered: a broker confirm or a 2xx; failed: anything else) and the answer's HTTP status "
    "class (2xx, 3xx, 4xx, 5xx; none: no HTTP answer, every queue attempt).",
    ["kind", "outcome", "status_class"],
)


def status_class(status: int | None) -> str:
    """An HTTP status's class label (`2xx` ... `5xx`), `none` without one: bounded."""
    if status is None or not 200 <= status < 600:
        return "none"
    return f"{status // 100}xx"
