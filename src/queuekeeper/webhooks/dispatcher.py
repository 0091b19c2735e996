"""The webhook dispatcher (contract §13): posts webhook consumers' copies from the outbox.

Beside the queue relay, on the same outbox (docs/decisions/026-webhooks-on-the-outbox.md):
a webhook consumer's copies are outbox rows marked `webhook`, which the relay never claims.
The dispatcher claims per consumer, by its oldest pending copy, only when that copy is due
(`Outbox.claim_webhooks`), and posts that consumer's copies one at a time in acceptance
order; the first that fails ends the run (it is retried after `webhook_retry_seconds`, the
copies behind it are released and wait for it), so a failing receiver holds back its own
consumer only. A 2xx delivers; a 410 disables the consumer (`webhook_gone_at`) and leaves
its copies pending; anything else, a timeout or a connection error is a failed attempt.

At-least-once: a copy is written delivered after its 2xx, so a dispatcher that dies in
between leaves it to its lease and it is posted again, with the same `webhook-id` (the
event's id). Each attempt resolves the URL's host and checks every address
(`addresses.resolve`); a new connection goes to the address checked, never resolving again
(`_PinnedResolver`), and a kept-alive connection was made the same way to its host.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import errno
import os
import random
import socket
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cached_property, partial
from ipaddress import ip_address

import aiohttp
import aiohttp.abc
import httpx
import structlog
import yarl
from sqlalchemy.ext.asyncio import AsyncEngine

from queuekeeper.common.signals import OutboxSignals
from queuekeeper.config import Settings
from queuekeeper.events.delivery_loop import DeliveryLoop, Listeners, Loops, finish
from queuekeeper.events.message import message_body, new_relay_id
from queuekeeper.events.outbox import (
    WEBHOOKS_DUE_CHANNEL,
    Access,
    GivenUp,
    SharedAccess,
    Tried,
    WebhookCopy,
    WebhookRun,
)
from queuekeeper.events.outbox_postgres import KeptAccess
from queuekeeper.models import utcnow
from queuekeeper.observability.metrics import (
    DELIVERY_ATTEMPTS,
    OLDEST_PENDING_BY_KIND,
    PENDING_BY_KIND,
    WEBHOOK_ATTEMPT_SECONDS,
    WEBHOOK_ATTEMPTS,
    WEBHOOK_DELIVERIES,
    WEBHOOK_LONGEST_FAILING,
    WEBHOOKS_FAILING,
    status_class,
)
from queuekeeper.webhooks import schedule, signing
from queuekeeper.webhooks.addresses import AddressRefused, Resolved, resolve

log = structlog.get_logger(__name__)

# Copies of one consumer claimed at once: posted one at a time, in order; the claim is
# one statement for all of them rather than one per copy.
RUN_LENGTH = 32
RETENTION_REASON = "retention: not delivered within event_retention_days; given up"
CONSUMER_GONE = "its webhook consumer was deleted; not posted"
STRANDED_EVERY = 12  # housekeeping rounds (a minute) between looks for stranded copies
STRANDED_PAGE = 1000
_DEFAULT_PORTS = {"http": 80, "https": 443}
_CLOSED = "connection closed by the receiver without an answer"
USER_AGENT = "queuekeeper-webhooks"

# Bound once (a child's lookup per attempt costs more than its increment), and so exported
# at zero from the start.
_DELIVERED = WEBHOOK_DELIVERIES.labels(outcome="delivered")
_GIVEN_UP = WEBHOOK_DELIVERIES.labels(outcome="given_up")
_ATTEMPTS = {
    result: WEBHOOK_ATTEMPTS.labels(result=result)
    for result in (
        "delivered",
        "http_error",
        "gone",
        "timeout",
        "connection_error",
        "address_refused",
    )
}
for _kind in ("queue", "webhook"):
    PENDING_BY_KIND.labels(kind=_kind)
    OLDEST_PENDING_BY_KIND.labels(kind=_kind)
_TRIED = {
    (outcome, klass): DELIVERY_ATTEMPTS.labels(kind="webhook", outcome=outcome, status_class=klass)
    for outcome in ("delivered", "failed")
    for klass in ("2xx", "3xx", "4xx", "5xx", "none")
}

# The address the current attempt checked (set in the attempt's task, read by the connect).
_PINNED: contextvars.ContextVar[Resolved | None] = contextvars.ContextVar(
    "queuekeeper_webhook_pinned", default=None
)


class _PinnedResolver(aiohttp.abc.AbstractResolver):
    """Resolves a host name to the address the current attempt checked, and nothing else:
    the request keeps its host name (the Host header, TLS SNI and certificate check are the
    name's) while a new connection goes to the address that passed `addresses.resolve`,
    never resolving again. aiohttp asks a resolver for every new connection to a name
    (its DNS cache is off) and for none to an address literal (the literal was checked)."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        pinned = _PINNED.get()
        if pinned is None or pinned.host != host or pinned.port != port:
            raise OSError(f"{host}:{port} was not checked for this attempt")
        address = ip_address(pinned.address)
        return [
            {
                "hostname": host,
                "host": pinned.address,
                "port": port,
                "family": socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
        ]

    async def close(self) -> None:
        return None


def new_session(settings: Settings) -> aiohttp.ClientSession:
    """The dispatcher's one connection pool: aiohttp's connections kept alive per host, no
    proxy or environment settings, no cookies kept (a receiver's would be sent back to
    it), nothing decompressed. Requests go to aiohttp itself, not through httpx (as the
    Management API client does, docs/decisions/010-management-api-client.md): httpx's
    request and answer objects around aiohttp's cost about a fifth of a post's CPU
    (py-spy, `python -m bench webhooks`). Redirects are never followed (`_post`)."""
    connector = aiohttp.TCPConnector(
        resolver=_PinnedResolver(),
        use_dns_cache=False,
        ssl=httpx.create_ssl_context(trust_env=False),
        limit=settings.webhook_concurrency,
        limit_per_host=settings.webhook_concurrency_per_destination,
        keepalive_timeout=30.0,
    )
    return aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        # The attempt's own deadline (`asyncio.timeout` in `attempt`) bounds it all.
        timeout=aiohttp.ClientTimeout(total=None),
    )


@dataclass(frozen=True)
class Target:
    """A webhook URL as the dispatcher posts to it: without its credential (sent as a basic
    authorization header instead), and its destination."""

    url: httpx.URL
    destination: tuple[str, str, int]
    authorization: str | None

    @cached_property
    def address(self) -> yarl.URL:
        """The URL as aiohttp takes it: already encoded, not quoted again."""
        return yarl.URL(str(self.url), encoded=True)


def target(raw: str) -> Target | str:
    """The URL parsed, or why it cannot be posted to."""
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as exc:
        return f"invalid webhook URL: {exc}"
    if url.scheme not in _DEFAULT_PORTS or not url.host:
        return f"unsupported webhook URL scheme {url.scheme!r}"
    authorization = None
    if url.userinfo:
        pair = f"{url.username}:{url.password}".encode()
        authorization = "Basic " + base64.b64encode(pair).decode()
        url = url.copy_with(username=None, password=None)
    return Target(url, destination(url), authorization)


@dataclass(frozen=True)
class Attempt:
    """What one attempt came to: `result` is a `WEBHOOK_ATTEMPTS` label; the answer's HTTP
    status (None: none came) and how long the attempt took."""

    result: str
    error: str = ""
    status: int | None = None
    ms: int = 0

    @property
    def delivered(self) -> bool:
        return self.result == "delivered"

    @property
    def gone(self) -> bool:
        return self.result == "gone"


def destination(url: httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port): what `webhook_concurrency_per_destination` bounds; the host as
    it is resolved and connected to (an international name in its IDNA form)."""
    host = url.raw_host.decode("ascii")
    return url.scheme, host, url.port or _DEFAULT_PORTS.get(url.scheme, 0)


def connection_error(exc: BaseException) -> str:
    """A failed connection, in the words `last_error` shows. Never the exception's text: the
    HTTP client's messages name the URL, which may carry a credential (decision 027); the
    operating system's words for its error number, or the error's class, say enough."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError) or (
            isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
        ):
            return "connection refused"
        if isinstance(cause, OSError) and cause.errno:
            return f"connection failed: {os.strerror(cause.errno)}"
        cause = cause.__cause__ or cause.__context__
    return f"connection failed: {type(exc).__name__}"


class WebhookDispatcher(DeliveryLoop):
    kind = "webhooks"
    id_key = "dispatcher"
    channel = WEBHOOKS_DUE_CHANNEL

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        signals: OutboxSignals | None = None,
        dispatcher_id: str | None = None,
    ) -> None:
        self.signals = signals or OutboxSignals()
        super().__init__(settings, engine, dispatcher_id or new_relay_id(), self.signals.webhooks)
        self.engine = engine
        # Each post after a run's first proves the claim's judgment again after the wait
        # (`judged_now`): one statement for the runs that ask together, on a connection
        # kept while runs are under way (a checkout per read cost more than the read).
        self._kept = KeptAccess(engine)
        self._access = SharedAccess(self.outbox, self._read_access)
        self._session: aiohttp.ClientSession | None = None  # made on the first post
        self._targets: dict[str, Target | str] = {}  # parsed URLs, by URL
        self._literals: dict[tuple[str, int], Resolved] = {}  # address literals checked
        self._runs: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(settings.webhook_concurrency)
        self._destinations: dict[tuple[str, str, int], asyncio.Semaphore] = defaultdict(
            lambda: asyncio.Semaphore(settings.webhook_concurrency_per_destination)
        )
        self._retention = settings.event_retention
        self._destination_of: dict[uuid.UUID, tuple[str, str, int]] = {}
        # Consumers with copies announced since the last claim; any: look at every one.
        self._wanted: set[uuid.UUID] = set()
        self._wanted_any = True

    # --- lifecycle (events/delivery_loop.py) ----------------------------------------------
    def start(self) -> None:
        super().start()
        log.info("webhook_dispatcher_started", dispatcher=self.id)

    def _loops(self) -> Loops:
        return [(self._claim_loop(), "webhooks-claim")]

    async def _stopped(self, grace: float, cut_short: int) -> None:
        """The loops ended (a claim under way finished first); the runs in flight get
        `grace` seconds too, then are cut short (they release what they did not post)."""
        await finish(list(self._runs.values()), grace)
        await self.close()
        log.info("webhook_dispatcher_stopped", dispatcher=self.id)

    # --- what to claim: consumers with new copies, or any ----------------------------------
    def _on_accepted(self) -> None:
        """Webhook copies stored by this process: their consumers are wanted."""
        self._wanted |= self.signals.webhook_consumers
        self.signals.webhook_consumers.clear()
        self._wake.notify()

    def _on_announced(self, payload: str) -> None:
        """Webhook copies committed by any process: the consumers the trigger names, or any
        (an empty payload)."""
        try:
            self._wanted.update(uuid.UUID(part) for part in payload.split(",") if part)
        except ValueError:
            payload = ""
        if not payload:
            self._wanted_any = True

    def _claim_wanted(self) -> bool:
        """Whether a claim may find something: a poll, a run ended, a consumer with new
        copies that no run of this process is posting to (one that is, takes them when its
        run ends). Claiming for every accepted copy instead ran a claim transaction per
        event, on the accept path's event loop in the small process models."""
        return self._wanted_any or any(c not in self._runs for c in self._wanted)

    async def close(self) -> None:
        """Close the connections (`stop` does)."""
        await self._kept.release()
        if self._session is not None:
            await self._session.close()

    async def _read_access(self, now: datetime) -> Access:
        epoch, expired = await self._kept.read(now)
        return Access(epoch, expired)

    def _listeners(self) -> Listeners:
        """A NOTIFY on `WEBHOOKS_DUE_CHANNEL`: webhook copies committed by any process."""
        return self._wake.notify, self._on_announced

    def _on_missed(self) -> None:
        self._wanted_any = True
        self._wake.notify()

    # --- claiming -------------------------------------------------------------------------
    def _waiting_on_busy_destinations(self) -> set[uuid.UUID]:
        """Consumers last seen posting to a destination whose every slot is taken now: not
        claimed, so their copies do not wait in this process while other receivers could
        be posted to."""
        busy = {key for key, slots in self._destinations.items() if slots.locked()}
        return {consumer for consumer, key in self._destination_of.items() if key in busy}

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            seen = self._wake.generation
            free = 2 * self.settings.webhook_concurrency - len(self._runs)
            if free > 0 and self._claim_wanted():
                self._wanted_any = False
                self._wanted.clear()
                try:
                    claimed = await self.claim(free)
                    self._looked(claimed > 0)
                except Exception as exc:  # the database is down: keep the loop alive
                    self._wanted_any = True
                    log.error("webhooks_claim_failed", dispatcher=self.id, error=repr(exc)[:500])
                    await self._wake.wait(self.settings.relay_backoff_base)
                    continue
                if claimed >= free and not self._stopping.is_set():
                    self._wanted_any = True  # as many consumers as room: more may be due
                    continue
            if not self._runs:
                await self._kept.release()  # idle: the kept connection goes back to the pool
            await self._wake.wait(self._poll_wait(), since=seen)
            if self._wake.generation == seen:  # the poll interval passed: retries fall due
                self._wanted_any = True

    async def claim(self, consumers: int) -> int:
        """Claim the due copies of up to `consumers` consumers and start a run for each;
        returns how many consumers."""
        now = utcnow()
        copies, lease = await self.outbox.claim_webhooks(
            self.id, now, RUN_LENGTH, consumers, self._waiting_on_busy_destinations()
        )
        by_consumer: dict[uuid.UUID, list[WebhookCopy]] = defaultdict(list)
        for copy in copies:
            self._held[copy.claimed.id] = lease.until
            if copy.claimed.consumer_uuid is not None:
                by_consumer[copy.claimed.consumer_uuid].append(copy)
        for consumer_uuid, run in by_consumer.items():
            task = asyncio.create_task(self._run_logged(consumer_uuid, run))
            self._runs[consumer_uuid] = task
            task.add_done_callback(partial(self._run_done, consumer_uuid))
        return len(by_consumer)

    def _run_done(self, consumer_uuid: uuid.UUID, _task: asyncio.Task[None]) -> None:
        self._runs.pop(consumer_uuid, None)
        self._wanted.add(consumer_uuid)  # its next copies, if any, are due now
        self._wake.notify()

    # --- one consumer's run -----------------------------------------------------------------
    async def _run_logged(self, consumer_uuid: uuid.UUID, copies: list[WebhookCopy]) -> None:
        try:
            await self.deliver(consumer_uuid, copies)
        except Exception as exc:  # what was not settled is posted again when its lease ends
            # The class only: an HTTP client's exception names the URL (decision 027).
            log.error("webhook_run_failed", consumer=consumer_uuid.hex, error=type(exc).__name__)
        finally:
            for copy in copies:
                self._held.pop(copy.claimed.id, None)

    async def deliver(self, consumer_uuid: uuid.UUID, copies: list[WebhookCopy]) -> WebhookRun:
        """Post `copies` (one consumer's, in acceptance order) one at a time until one fails,
        then write what came of them. Each copy after a post is judged again as the
        directory stands then (`judged_now`): a post may take seconds, and a revocation
        answered meanwhile stops the rest of the run."""
        run = WebhookRun(consumer_uuid)
        given_up: list[GivenUp] = []
        waiting = list(copies)
        refused: set[int] = set()
        posted = False
        try:
            while waiting:
                if posted:
                    kept = await self.judged_now(waiting)
                    refused |= {c.claimed.id for c in waiting} - {c.claimed.id for c in kept}
                    waiting = kept
                    if not waiting:
                        break
                copy = waiting.pop(0)
                item = copy.claimed
                now = utcnow()
                if now - item.created > self._retention:
                    reason = RETENTION_REASON
                    if item.last_error:
                        reason += f"; last error: {item.last_error}"
                    given_up.append(GivenUp(item.id, reason, "retention"))
                    continue
                posted = True
                outcome = await self.attempt(copy)
                run.tried[item.id] = Tried(utcnow(), outcome.ms, outcome.status)
                if outcome.delivered:
                    run.delivered.append(item.id)
                    continue
                run.failed, run.error, run.gone = item.id, outcome.error, outcome.gone
                run.retry_at = now if outcome.gone else self._retry_at(item.attempts, item.created)
                run.released = [later.claimed.id for later in waiting]
                break
        except asyncio.CancelledError:
            # Stopping: what was not posted goes back at once (the copy in flight too: it
            # may have arrived, and is posted again with the same webhook-id).
            done = set(run.delivered) | {reason.id for reason in given_up} | refused
            run.failed, run.error, run.gone = None, None, False
            run.released = [c.claimed.id for c in copies if c.claimed.id not in done]
            await asyncio.shield(self._settle(run, given_up))
            raise
        await self._settle(run, given_up)
        return run

    async def judged_now(self, waiting: list[WebhookCopy]) -> list[WebhookCopy]:
        """The run's copies not posted yet that their owner may receive as the directory
        stands now, in order (docs/decisions/029-judged-as-it-leaves.md): one light
        statement proves the claim's judgment still holds (the epoch unchanged, no expiry
        since); only when it does not are they judged again, by the rule in one statement
        that gives up the refused. The runs of several consumers whose posts end together
        share that statement (`SharedAccess`); a run alone reads it itself, sparing the
        sharing's task per read."""
        if len(self._runs) > 1:
            access = await self._access.read()
        else:
            access = await self._read_access(utcnow())
        stale = [c.claimed for c in waiting if not access.unchanged_since(c.claimed)]
        if not stale:
            return waiting
        kept, _refused = await self.outbox.judge_held(self.id, stale, utcnow())
        judged = {item.id: item for item in kept}
        stale_ids = {item.id for item in stale}
        return [
            replace(c, claimed=judged[c.claimed.id]) if c.claimed.id in judged else c
            for c in waiting
            if c.claimed.id not in stale_ids or c.claimed.id in judged
        ]

    def _retry_at(self, attempts: int, created: datetime) -> datetime:
        return schedule.retry_at(
            attempts,
            created,
            utcnow(),
            self.settings.webhook_retry_seconds,
            self._retention,
            random.random(),  # noqa: S311 - jitter, not security
        )

    async def _settle(self, run: WebhookRun, given_up: list[GivenUp]) -> None:
        now = utcnow()
        if given_up:
            await self.outbox.give_up(given_up, now)
            _GIVEN_UP.inc(len(given_up))
        if run.delivered or run.failed is not None or run.released:
            await self.outbox.settle_webhooks(self.id, run, now)
            # Written: an idle loop looks for the failed copy when due (a gone consumer's
            # copies wait for its update, which announces them).
            if run.failed is not None and not run.gone and run.retry_at is not None:
                self._retry_scheduled(run.retry_at)
            for copy_id, tried in run.tried.items():
                if copy_id in run.delivered or copy_id == run.failed:
                    outcome = "delivered" if copy_id in run.delivered else "failed"
                    status = tried.status if isinstance(tried.status, int) else None
                    _TRIED[(outcome, status_class(status))].inc()
        if run.delivered:
            _DELIVERED.inc(len(run.delivered))
            self.signals.settled.notify()
        if run.failed is not None:
            log.info(
                "webhook_attempt_failed",
                consumer=run.consumer_uuid.hex,
                error=run.error,
                gone=run.gone,
                retry_at=run.retry_at.isoformat() if run.retry_at else None,
            )

    # --- one attempt ----------------------------------------------------------------------
    async def attempt(self, copy: WebhookCopy) -> Attempt:
        """Post one copy: resolve and check the host, connect to the address checked, read at
        most `webhook_response_max_bytes` of the answer."""
        if not copy.url or not copy.secrets:
            return Attempt("http_error", "the consumer has no webhook URL or secret")
        parsed = self._targets.get(copy.url)
        if parsed is None:
            if len(self._targets) > 4 * self.settings.webhook_concurrency:
                self._targets.clear()  # bounded: parsed again at the next attempts
            parsed = self._targets[copy.url] = target(copy.url)
        if isinstance(parsed, str):
            return Attempt("http_error", parsed)
        scheme, host, port = parsed.destination
        if copy.claimed.consumer_uuid is not None:
            if len(self._destination_of) > 4 * self.settings.webhook_concurrency:
                self._destination_of.clear()  # bounded: relearnt at the next attempts
            self._destination_of[copy.claimed.consumer_uuid] = (scheme, host, port)
        started = time.perf_counter()
        timeout = self.settings.webhook_timeout_seconds
        async with self._destinations[(scheme, host, port)], self._slots:
            try:
                async with asyncio.timeout(timeout):
                    outcome = await self._post(copy, parsed)
            except TimeoutError:
                outcome = Attempt("timeout", f"timeout after {timeout:g} s")
            except AddressRefused as exc:
                outcome = Attempt("address_refused", f"address refused: {exc.reason}")
            except aiohttp.ServerDisconnectedError:
                outcome = Attempt("connection_error", _CLOSED)
            except aiohttp.ClientResponseError:
                # An answer that is not HTTP (a bad status line, headers too long).
                outcome = Attempt("connection_error", "invalid HTTP answer")
            except (aiohttp.ClientError, OSError) as exc:
                outcome = Attempt("connection_error", connection_error(exc))
        took = time.perf_counter() - started
        WEBHOOK_ATTEMPT_SECONDS.observe(took)
        _ATTEMPTS[outcome.result].inc()
        return replace(outcome, ms=round(took * 1000))

    async def _post(self, copy: WebhookCopy, to: Target) -> Attempt:
        _scheme, host, port = to.destination
        pinned = self._literals.get((host, port))
        if pinned is None:
            pinned = await resolve(host, port, self.settings.webhook_allowed_networks)
            if pinned.address == host:
                # An address literal resolves to itself and the allowed networks are fixed:
                # its check answers the same at every attempt. A name is resolved and
                # checked at each (a DNS answer may change between attempts).
                if len(self._literals) > 4 * self.settings.webhook_concurrency:
                    self._literals.clear()
                self._literals[(host, port)] = pinned
        item = copy.claimed
        body = message_body(item)
        headers = signing.headers(copy.secrets, item.event_id, int(time.time()), body)
        headers["user-agent"] = USER_AGENT
        if to.authorization is not None:
            headers["authorization"] = to.authorization
        if self._session is None:
            self._session = new_session(self.settings)
        token = _PINNED.set(pinned)
        try:
            async with self._session.post(
                to.address, data=body, headers=headers, allow_redirects=False, compress=False
            ) as answer:
                await _read_capped(answer, self.settings.webhook_response_max_bytes)
        finally:
            _PINNED.reset(token)
        code = answer.status
        if 200 <= code < 300:
            return Attempt("delivered", status=code)
        if code == 410:
            return Attempt("gone", "HTTP 410: the receiver is gone; delivery disabled", code)
        return Attempt("http_error", f"HTTP {code}", code)

    # --- housekeeping (after the leases are renewed, events/delivery_loop.py) ---------------
    async def _housekeep(self, rounds: int) -> None:
        await self.refresh_gauges()
        if rounds % STRANDED_EVERY == 0:
            await self.give_up_stranded()

    async def give_up_stranded(self) -> int:
        """Give up the copies no claim will take (a deleted consumer's; a disabled one's past
        retention), page by page; returns how many."""
        now, total = utcnow(), 0
        while True:
            given_up = await self.outbox.give_up_stranded_webhooks(
                now - self._retention, STRANDED_PAGE, now, CONSUMER_GONE, RETENTION_REASON
            )
            total += given_up
            if given_up < STRANDED_PAGE or self._stopping.is_set():
                break
        if total:
            _GIVEN_UP.inc(total)
        return total

    async def refresh_gauges(self) -> None:
        now = utcnow()
        gauges = await self.outbox.webhook_gauges()
        for kind, count, oldest in (
            ("queue", gauges.queue_pending, gauges.queue_oldest),
            ("webhook", gauges.webhook_pending, gauges.webhook_oldest),
        ):
            PENDING_BY_KIND.labels(kind=kind).set(count)
            OLDEST_PENDING_BY_KIND.labels(kind=kind).set(
                (now - oldest).total_seconds() if oldest else 0.0
            )
        WEBHOOKS_FAILING.set(gauges.failing)
        since = gauges.failing_since
        WEBHOOK_LONGEST_FAILING.set((now - since).total_seconds() if since else 0.0)


async def _read_capped(answer: aiohttp.ClientResponse, limit: int) -> int:
    """Read at most `limit` bytes of the answer (as sent: nothing decompressed); what is
    left unread closes the connection when the answer is released."""
    read = 0
    async for chunk in answer.content.iter_any():
        read += len(chunk)
        if read >= limit:
            break
    return read
