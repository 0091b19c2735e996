"""Histories for the model-based test of the authorization rule: steps, a seeded generator,
a runner that plays a history against the real service (its API, PostgreSQL, RabbitMQ, and
webhook receivers on 127.0.0.1) and a checker that judges every copy received against the
reference model (`reference.py`).

Why a seeded generator rather than hypothesis' `RuleBasedStateMachine`: every history runs
on a real clock (slow receivers, parking after a consumer leaves, roles expiring a few
seconds ahead), so a history costs seconds and the same steps may interleave differently
on a second run. Hypothesis' shrinker expects cheap, repeatable runs (it stops with `Flaky`
when an outcome changes); here a seed gives the same step list every time, and a bounded
delta-debugging pass (`shrink`) removes steps while the violation still shows, printing
the shortest history it found.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aio_pika
import httpx
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage
from aiohttp import web

from tests.brokers import BROKER
from tests.conftest import SERVICE_TOKEN
from tests.model.reference import (
    SWEEP_BY_TIME_SECONDS,
    SWEEP_SECONDS,
    Consumer,
    Event,
    History,
    Offering,
    Role,
    State,
    User,
)
from tests.webhooks.support import Receiver

SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# How long before a copy's arrival it may have been judged: the service judges a copy, then
# publishes or posts it; under load that takes this long at most. A revocation answered
# earlier than this before the arrival was in force when the copy left.
DEPARTURE_SLACK = 0.5
# How long an owed copy may take, once the history is over, to arrive.
OWED_WAIT = 25.0


@dataclass(frozen=True)
class Step:
    """One thing that happens: `kind` and its arguments (names, not uuids, so a shrunk
    history still reads)."""

    kind: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.args))})"


@dataclass
class Violation:
    what: str
    consumer: str
    event: str
    at: float
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.what}: {self.consumer} got {self.event} at +{self.at:.2f}s {self.detail}"


# -- the generator ------------------------------------------------------------------------


@dataclass
class _Names:
    """What the generator knows it made (symbolic; the runner skips a step whose names a
    shrink removed)."""

    users: dict[str, bool] = field(default_factory=dict)  # name -> staff
    customers: list[str] = field(default_factory=list)
    projects: dict[str, str] = field(default_factory=dict)
    offerings: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    roles: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    count: int = 0

    def new(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def entities(self) -> list[tuple[str, str]]:
        return (
            [("customer", c) for c in self.customers]
            + [("project", p) for p in self.projects]
            + [("offering", o) for o in self.offerings]
        )


def generate(seed: int, steps: int) -> list[Step]:
    """A history of about `steps` steps: a small directory first, then a random mix of
    directory changes, events of every scope, consumers arriving and leaving, replays,
    resyncs and waits (for expiries and for slow receivers' backlogs)."""
    rnd = random.Random(seed)
    names = _Names()
    history: list[Step] = []
    for _ in range(2):
        c = names.new("C")
        names.customers.append(c)
        history.append(Step("customer", (c,)))
    for _ in range(3):
        p = names.new("P")
        names.projects[p] = rnd.choice(names.customers)
        history.append(Step("project", (p, names.projects[p])))
    for _ in range(3):
        o = names.new("O")
        placed = (rnd.choice(names.customers), rnd.choice([None, *names.projects]))
        names.offerings[o] = placed
        history.append(Step("offering", (o, *placed)))
    for staff in (True, False, False):
        u = names.new("u")
        names.users[u] = staff
        history.append(Step("user", (u, "staff" if staff else "plain")))

    def some_binding(user: str) -> tuple[str, str]:
        if rnd.random() < 0.15:
            return ("user", user)
        return rnd.choice(names.entities())

    choices: list[tuple[float, Callable[[], Step | None]]] = []

    def role() -> Step:
        r = names.new("r")
        names.roles.append(r)
        kind, entity = rnd.choice(names.entities())
        expiry = rnd.choice([None, None, None, round(rnd.uniform(0.5, 4.0), 1), -1.0])
        return Step("role", (r, rnd.choice(list(names.users)), kind, entity, expiry))

    def unrole() -> Step | None:
        if not names.roles:
            return None
        r = rnd.choice(names.roles)
        names.roles.remove(r)
        return Step("unrole", (r,))

    def move() -> Step | None:
        if not names.roles:
            return None
        kind, entity = rnd.choice(names.entities())
        return Step("move", (rnd.choice(names.roles), kind, entity))

    def grant() -> Step:
        kind = rnd.choice(["grant", "grant", "revoke"])
        return Step(kind, (rnd.choice(list(names.users)), rnd.choice(list(names.offerings))))

    def flags() -> Step:
        change = rnd.choice(
            [
                *("demote", "promote", "support", "deactivate", "activate"),
                *("untoken", "retoken", "expire-token", "expire-token-soon"),
            ]
        )
        return Step("flags", (rnd.choice(list(names.users)), change))

    def delete() -> Step | None:
        kind, entity = rnd.choice(names.entities())
        if rnd.random() < 0.6:
            return None  # rarer than the rest: it narrows every later history
        if kind == "customer":
            names.customers.remove(entity)
            for p in [p for p, c in names.projects.items() if c == entity]:
                del names.projects[p]
        elif kind == "project":
            del names.projects[entity]
        else:
            del names.offerings[entity]
        return Step("delete", (kind, entity))

    def event() -> Step | None:
        shape = rnd.choice(["offering", "offering", "project", "subject"])
        if shape == "subject":
            return Step("event", (names.new("e"), None, None, rnd.choice(list(names.users))))
        if not names.offerings:
            return None
        o = rnd.choice(list(names.offerings))
        p = rnd.choice(list(names.projects)) if shape == "project" and names.projects else None
        return Step("event", (names.new("e"), o, p, None))

    def burst() -> Step | None:
        if not names.offerings:
            return None
        return Step("burst", (names.new("e"), rnd.choice(list(names.offerings)), rnd.randint(2, 4)))

    def queue() -> Step | None:
        if len(names.queues) >= 4 or not names.entities():
            return None
        q = names.new("q")
        names.queues.append(q)
        user = rnd.choice(list(names.users))
        bindings = [] if rnd.random() < 0.15 else [some_binding(user)]
        if rnd.random() < 0.3:
            bindings.append(some_binding(user))
        return Step("queue", (q, user, tuple(bindings)))

    def hook() -> Step | None:
        if len(names.hooks) >= 3 or not names.entities():
            return None
        w = names.new("w")
        names.hooks.append(w)
        staff = [u for u, s in names.users.items() if s] or list(names.users)
        user = rnd.choice(staff)
        bindings = () if rnd.random() < 0.3 else (some_binding(user),)
        delay = rnd.choice([0.0, round(rnd.uniform(0.3, 1.5), 1), 1.5])
        return Step("hook", (w, user, bindings, delay))

    def away() -> Step | None:
        if rnd.random() < 0.6:
            if not names.queues:
                return None
            return Step(rnd.choice(["away", "back"]), (rnd.choice(names.queues),))
        if not names.hooks:
            return None
        # A webhook receiver down (connection refused: retried) and up again.
        return Step(rnd.choice(["down", "up"]), (rnd.choice(names.hooks),))

    def dead_letter() -> Step | None:
        if not names.queues:
            return None
        return Step(rnd.choice(["reject", "redrive"]), (rnd.choice(names.queues),))

    def replay() -> Step | None:
        every = names.queues + names.hooks
        return Step("replay", (rnd.choice(every),)) if every else None

    def resync() -> Step | None:
        every = names.queues + names.hooks
        return Step("resync", (rnd.choice(every),)) if every else None

    def wait() -> Step:
        # Now and then longer than the sweep's bound (§14): an agent away that long must
        # not find copies its owner lost access to in the meantime.
        return Step("wait", (rnd.choice([0.3, 0.5, 1.0, 2.0, 3.0] * 5 + [16.0]),))

    choices = [
        (3, role),
        (2, unrole),
        (1, move),
        (2, grant),
        (2.5, flags),
        (0.5, delete),
        (5, event),
        (2, burst),
        (1.5, queue),
        (1.5, hook),
        (1, away),
        (0.5, replay),
        (1, dead_letter),
        (0.5, resync),
        (2, wait),
    ]
    weights = [w for w, _ in choices]
    # Consumers first, so the rest has someone to deliver to.
    history.append(queue() or Step("wait", (0.1,)))
    history.append(hook() or Step("wait", (0.1,)))
    while len(history) < steps:
        made = rnd.choices(choices, weights)[0][1]()
        if made is not None:
            history.append(made)
    return history


# -- the runner ---------------------------------------------------------------------------


@dataclass
class Copy:
    event_id: str
    at: float  # wall-clock seconds when it reached the reader or the receiver
    replay: bool
    # A queue copy: when its reader had subscribed (a copy read as it subscribes may have
    # waited in the queue); None for a webhook copy, which leaves as it is posted.
    subscribed: float | None = None


@dataclass
class _QueueReader:
    """A queue consumer's reader: an AMQP consumer on its queue (as an administrator, so a
    changed token does not log it out), or none while its agent is away."""

    vhost: str
    queue: str
    received: list[Copy]
    name_copy: Callable[[str, bytes], str]
    connection: AbstractConnection | None = None
    since: float = 0.0  # when it last subscribed
    reject_next: bool = False  # dead-letter the next copy (read, then rejected)

    async def connect(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            return
        try:
            # Not a robust connection: the service may delete the queue and its vhost.
            connection = await aio_pika.connect(BROKER.amqp_url(self.vhost))
        except (aio_pika.exceptions.AMQPError, OSError):
            return  # its vhost is gone with its owner's last consumer
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.queue, passive=True)
            self.since = time.time()
            await queue.consume(self._take)
        except Exception:
            await connection.close()
            return  # the queue is gone (its consumer deleted): nothing to read
        self.connection = connection

    async def _take(self, message: AbstractIncomingMessage) -> None:
        replay = (message.headers or {}).get("x-queuekeeper-replay") in ("true", b"true")
        event_id = self.name_copy(message.message_id or "", message.body)
        self.received.append(Copy(event_id, time.time(), replay, self.since))
        if self.reject_next:
            self.reject_next = False
            await message.reject(requeue=False)  # to the vhost's dead-letter queue
        else:
            await message.ack()

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
            self.connection = None


class Run:
    """One history played against the service at `client`, judged as it goes."""

    def __init__(self, client: httpx.AsyncClient, steps: list[Step]) -> None:
        self.client = client
        self.steps = steps
        self.tag = uuid.uuid4().hex[:6]
        self.start = time.time()
        self.model = History(self.start)
        self.uuids: dict[str, uuid.UUID] = {}
        self.names: dict[str, str] = {}  # uuid hex -> name
        self.tokens: dict[str, str | None] = {}
        self.token_expiry: dict[str, float | None] = {}
        self.events: dict[str, tuple[Event, float, float, str]] = {}  # id -> event, window
        self.readers: dict[str, _QueueReader] = {}
        self.receivers: dict[str, Receiver] = {}
        self.delays: dict[str, float] = {}
        self.received: dict[str, list[Copy]] = {}
        self.checked: dict[str, int] = {}
        self.consumer_uuid: dict[str, str] = {}
        self.violations: list[Violation] = []
        self.skipped: list[Step] = []  # steps whose names a shrink removed, or refused
        self.judged = 0  # copies judged
        self.owed_count = 0  # copies the model said must arrive
        self.log: list[str] = []
        self.offset = time.time() - time.monotonic()

    # -- bookkeeping --

    def name_of(self, name: str) -> uuid.UUID:
        if name not in self.uuids:
            self.uuids[name] = uuid.uuid4()
            self.names[self.uuids[name].hex] = name
        return self.uuids[name]

    def known(self, *names: Any) -> bool:
        state = self.model.now
        every = (
            set(state.users)
            | state.customers
            | set(state.projects)
            | set(state.offerings)
            | set(state.roles)
            | set(state.consumers)
        )
        return all(n in every for n in names if isinstance(n, str))

    async def _change(
        self, method: str, path: str, body: Any, apply: Callable[[State], None]
    ) -> httpx.Response:
        state = self.model.begin()
        started = time.time()
        response = await self.client.request(
            method, f"/api/internal{path}", json=body, headers=SERVICE
        )
        answered = time.time()
        if response.status_code < 300:
            apply(state)
            self.model.commit(state, started, answered)
        return response

    async def _put_user(self, name: str, user: User) -> httpx.Response:
        def apply(state: State) -> None:
            state.users[name] = user

        token = self.tokens.get(name)
        body = {
            "username": f"{name}-{self.tag}",
            "token": token if user.token else None,
            "token_expires_at": _iso(user.token_expires_at),
            "is_active": user.active,
            "is_staff": user.staff,
            "is_support": user.support,
        }
        return await self._change("PUT", f"/users/{self.name_of(name).hex}/", body, apply)

    # -- steps --

    async def play(self, step: Step) -> None:
        handler = getattr(self, f"_step_{step.kind}")
        at = time.time() - self.start
        did = await handler(*step.args)
        self.log.append(f"+{at:6.2f}s {step}{'' if did is not False else '  (skipped)'}")
        if did is False:
            self.skipped.append(step)
        self.check()

    async def _step_customer(self, c: str) -> None:
        await self._change(
            "PUT", f"/customers/{self.name_of(c).hex}/", {"name": c}, lambda s: s.customers.add(c)
        )

    async def _step_project(self, p: str, c: str) -> bool:
        if not self.known(c):
            return False

        def apply(state: State) -> None:
            state.projects[p] = c

        body = {"name": p, "customer_uuid": self.name_of(c).hex}
        await self._change("PUT", f"/projects/{self.name_of(p).hex}/", body, apply)
        return True

    async def _step_offering(self, o: str, c: str | None, p: str | None) -> bool:
        if not self.known(c, p):
            return False

        def apply(state: State) -> None:
            state.offerings[o] = Offering(c, p)

        body = {
            "name": o,
            "customer_uuid": self.name_of(c).hex if c else None,
            "project_uuid": self.name_of(p).hex if p else None,
        }
        await self._change("PUT", f"/offerings/{self.name_of(o).hex}/", body, apply)
        return True

    async def _step_user(self, u: str, kind: str) -> None:
        self.tokens[u] = secrets.token_hex(20)
        await self._put_user(u, User(staff=kind == "staff"))

    async def _step_flags(self, u: str, change: str) -> bool:
        if not self.known(u):
            return False
        user = User(**vars(self.model.now.users[u]))
        if change == "demote":
            user.staff = user.support = False
        elif change == "promote":
            user.staff = True
        elif change == "support":
            user.support = True
        elif change == "deactivate":
            user.active = False
        elif change == "activate":
            user.active = True
        elif change == "untoken":
            user.token = False
        elif change == "retoken":
            self.tokens[u] = secrets.token_hex(20)
            user.token, user.token_expires_at = True, None
        elif change == "expire-token":
            user.token_expires_at = time.time() - 1
        else:  # expire-token-soon: by time, with no push when it happens
            user.token_expires_at = time.time() + 2.0
        await self._put_user(u, user)
        return True

    async def _step_grant(self, u: str, o: str) -> bool:
        if not self.known(u, o):
            return False
        await self._change(
            "PUT",
            f"/offerings/{self.name_of(o).hex}/users/{self.name_of(u).hex}/",
            None,
            lambda s: s.grants.add((u, o)),
        )
        return True

    async def _step_revoke(self, u: str, o: str) -> bool:
        if not self.known(u, o):
            return False
        await self._change(
            "DELETE",
            f"/offerings/{self.name_of(o).hex}/users/{self.name_of(u).hex}/",
            None,
            lambda s: s.revoke(u, o),
        )
        return True

    async def _step_role(
        self, r: str, u: str, kind: str, entity: str, expires_in: float | None
    ) -> bool:
        if not self.known(u, entity):
            return False
        expires_at = None if expires_in is None else time.time() + expires_in
        await self._put_role(r, u, kind, entity, expires_at)
        return True

    async def _put_role(
        self, r: str, u: str, kind: str, entity: str, expires_at: float | None
    ) -> None:
        def apply(state: State) -> None:
            state.roles[r] = Role(u, (kind, entity), expires_at)

        body = {
            "user_uuid": self.name_of(u).hex,
            "role_name": f"{kind}.member",
            "scope": {"type": kind, "uuid": self.name_of(entity).hex},
            "expires_at": _iso(expires_at),
        }
        await self._change("PUT", f"/roles/{self.name_of(r).hex}/", body, apply)

    async def _step_unrole(self, r: str) -> bool:
        if not self.known(r):
            return False
        await self._change(
            "DELETE", f"/roles/{self.name_of(r).hex}/", None, lambda s: s.drop_role(r)
        )
        return True

    async def _step_move(self, r: str, kind: str, entity: str) -> bool:
        if not self.known(r, entity):
            return False
        role = self.model.now.roles[r]
        await self._put_role(r, role.user, kind, entity, role.expires_at)
        return True

    async def _step_delete(self, kind: str, entity: str) -> bool:
        if not self.known(entity):
            return False

        def apply(state: State) -> None:
            if kind == "customer":
                for p in [p for p, c in state.projects.items() if c == entity]:
                    state.delete_project(p)
                state.delete_customer(entity)
            elif kind == "project":
                state.delete_project(entity)
            else:
                state.delete_offering(entity)

        response = await self._change(
            "DELETE", f"/{kind}s/{self.name_of(entity).hex}/", None, apply
        )
        return response.status_code < 300

    async def _post_event(self, e: str, event: Event) -> None:
        body: dict[str, Any] = {"event_id": f"{self.tag}-{e}"}
        if event.subject is not None:
            subject = self.name_of(event.subject).hex
            body.update(
                object_type="user_profile",
                subject_user_uuid=subject,
                payload={"user_uuid": subject, "email": "x@example.org"},
            )
        else:
            body.update(object_type="order", payload={"order_uuid": uuid.uuid4().hex})
        if event.offering is not None:
            body["offering_uuid"] = self.name_of(event.offering).hex
        if event.project is not None:
            body["project_uuid"] = self.name_of(event.project).hex
        started = time.time()
        response = await self.client.post("/api/internal/events/", json=body, headers=SERVICE)
        if response.status_code < 300:
            self.events[body["event_id"]] = (event, started, time.time(), e)

    async def _step_event(self, e: str, o: str | None, p: str | None, s: str | None) -> bool:
        if not self.known(o, p, s):
            return False
        await self._post_event(e, Event(o, p, s))
        return True

    async def _step_burst(self, e: str, o: str, count: int) -> bool:
        if not self.known(o):
            return False
        for n in range(count):
            await self._post_event(f"{e}.{n}", Event(o))
        return True

    async def _register(
        self, c: str, u: str, path: str, body: dict[str, Any], consumer: Consumer
    ) -> bool:
        token = self.tokens.get(u)
        if not self.known(u) or token is None:
            return False
        state = self.model.begin()
        started = time.time()
        response = await self.client.post(
            f"/api/event-consumers/{path}/", json=body, headers={"Authorization": f"Token {token}"}
        )
        answered = time.time()
        if response.status_code >= 300:
            self.log.append(f"         refused: {response.status_code} {response.text[:120]}")
            return False
        answer = response.json()
        # A queue's registration answers with its broker user, which is the consumer's uuid.
        found = uuid.UUID(answer.get("uuid") or answer["rmq_username"]).hex
        if found in self.names:  # the same owner and bindings: the same consumer (§12)
            self.log.append(f"         the same consumer as {self.names[found]}")
            return False
        self.consumer_uuid[c] = found
        self.names[found] = c
        state.consumers[c] = consumer
        self.model.commit(state, started, answered)
        self.received[c] = []
        self.checked[c] = 0
        if consumer.delivery == "rmq":
            reader = _QueueReader(
                answer["vhost"], answer["queue_name"], self.received[c], self.name_copy
            )
            self.readers[c] = reader
            await reader.connect()
        return True

    async def _step_queue(self, q: str, u: str, bindings: tuple[tuple[str, str], ...]) -> bool:
        if not self.known(u, *(entity for _, entity in bindings)):
            return False
        scopes = [{"type": kind, "uuid": self.name_of(entity).hex} for kind, entity in bindings]
        consumer = Consumer(u, "rmq", frozenset(bindings), not bindings)
        return await self._register(q, u, "register", {"scopes": scopes}, consumer)

    async def _step_hook(
        self, w: str, u: str, bindings: tuple[tuple[str, str], ...], delay: float
    ) -> bool:
        if not self.known(u, *(entity for _, entity in bindings)):
            return False
        self.delays[w] = delay

        async def answer(_request: web.Request, _number: int) -> web.StreamResponse:
            await asyncio.sleep(self.delays[w])
            return web.Response(status=200, text="ok")

        receiver = Receiver(answer)
        await receiver.start()
        self.receivers[w] = receiver
        body: dict[str, Any] = {"webhook_url": receiver.url}
        if bindings:
            body["scopes"] = [
                {"type": kind, "uuid": self.name_of(entity).hex} for kind, entity in bindings
            ]
        consumer = Consumer(u, "webhook", frozenset(bindings), not bindings)
        return await self._register(w, u, "register_webhook", body, consumer)

    async def _step_away(self, q: str) -> bool:
        if q not in self.readers:
            return False
        await self.readers[q].close()
        return True

    async def _step_back(self, q: str) -> bool:
        if q not in self.readers:
            return False
        await self.readers[q].connect()
        return True

    async def _step_down(self, w: str) -> bool:
        if w not in self.receivers:
            return False
        await self.receivers[w].stop()
        return True

    async def _step_up(self, w: str) -> bool:
        receiver = self.receivers.get(w)
        if receiver is None or receiver._runner is not None:
            return False
        await receiver.start(receiver.port)
        return True

    async def _step_reject(self, q: str) -> bool:
        if q not in self.readers:
            return False
        self.readers[q].reject_next = True
        return True

    async def _step_redrive(self, q: str) -> bool:
        if q not in self.readers:
            return False
        response = await self.client.post(
            "/api/admin/dead-letters/redrive/",
            params={"vhost": self.readers[q].vhost},
            headers=SERVICE,
        )
        self.log.append(f"         redrive: {response.status_code} {response.text[:80]}")
        return True

    async def _step_replay(self, c: str) -> bool:
        if c not in self.consumer_uuid:
            return False
        response = await self.client.post(
            f"/api/event-consumers/{self.consumer_uuid[c]}/replay/",
            json={"since": _iso(self.start)},
            headers=SERVICE,
        )
        self.log.append(f"         replay: {response.status_code} {response.text[:80]}")
        return True

    async def _step_resync(self, c: str) -> bool:
        if c not in self.consumer_uuid:
            return False
        response = await self.client.post(
            f"/api/event-consumers/{self.consumer_uuid[c]}/resync/", headers=SERVICE
        )
        self.log.append(f"         resync: {response.status_code} {response.text[:80]}")
        return True

    async def _step_wait(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _step_until(self, c: str, count: int) -> bool:
        """Until consumer `c` has received `count` copies (10 s at most)."""
        deadline = time.monotonic() + 10
        while len(self.copies(c)) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(self.copies(c)) >= count

    # -- judging --

    def copies(self, c: str) -> list[Copy]:
        if c in self.receivers:
            found = []
            for got in self.receivers[c].received:
                replay = got.headers.get("x-queuekeeper-replay") == "true"
                event_id = self.name_copy(got.headers.get("webhook-id", ""), got.body)
                found.append(Copy(event_id, got.at + self.offset, replay))
            return found
        return self.received.get(c, [])

    def name_copy(self, message_id: str, body: bytes) -> str:
        """A copy's event id; a resync's snapshot (its id is new per resync) by what it is
        about: `snapshot:kind:scope:user`."""
        if not message_id.startswith("resync:"):
            return message_id
        try:
            payload = json.loads(body)
            kind = payload["scope_type"]
            scope = self.names.get(payload["scope_uuid"], payload["scope_uuid"])
            subject = self.names.get(payload["user_uuid"], payload["user_uuid"])
        except (ValueError, KeyError):
            return message_id
        return f"snapshot:{kind}:{scope}:{subject}"

    def event_of(self, event_id: str) -> tuple[Event, float, str] | None:
        """The event behind a copy's id, when it was accepted (start of its request), and its
        name; a resync's snapshot names the role's scope and user (consumers/service.py)."""
        if event_id in self.events:
            event, started, _answered, name = self.events[event_id]
            return event, started, name
        if event_id.startswith("snapshot:"):
            _, kind, scope, subject = event_id.split(":")
            event = Event(
                offering=scope if kind == "offering" else None,
                project=scope if kind == "project" else None,
                subject=subject,
            )
            return event, self.start, f"snapshot of {subject}'s role on {scope}"
        return None

    def check(self) -> None:
        """Judge every copy received since the last check."""
        for c, copies in list(self.received.items()):
            copies = self.copies(c)
            for got in copies[self.checked[c] :]:
                self._judge(c, got)
            self.checked[c] = len(copies)

    def _judge(self, c: str, got: Copy) -> None:
        self.judged += 1
        found = self.event_of(got.event_id)
        if found is None:
            self.violations.append(Violation("a copy of an unknown event", c, got.event_id, 0))
            return
        event, accepted, name = found
        at = got.at - self.start
        if self.model.allowed_during(got.at - DEPARTURE_SLACK, got.at, c, event):
            return
        if got.subscribed is None or got.at > got.subscribed + DEPARTURE_SLACK:
            # A webhook copy, or a queue copy read live: it left just now.
            self.violations.append(
                Violation("sent after access ended", c, name, at, "(refused at departure)")
            )
            return
        # Read as its consumer subscribed: it may have waited in the queue since it was
        # published; it must have been allowed then, and be swept within the bound since.
        last = self.model.last_allowed(accepted, got.at, c, event)
        if last is None:
            self.violations.append(Violation("never allowed", c, name, at))
            return
        moment, by_time = last
        bound = SWEEP_BY_TIME_SECONDS if by_time else SWEEP_SECONDS
        if got.at - moment > bound:
            self.violations.append(
                Violation(
                    "left in the queue past the sweep bound",
                    c,
                    name,
                    at,
                    f"(access ended at +{moment - self.start:.2f}s, bound {bound:.0f} s)",
                )
            )

    async def finish(self) -> None:
        """Every agent back, every receiver quick, then wait for what is owed."""
        for c in self.delays:
            self.delays[c] = 0.0
        for reader in self.readers.values():
            await reader.connect()
        for c in self.receivers:
            await self._step_up(c)
        end = time.time()
        owed = self.owed(end)
        self.owed_count = len(owed)
        deadline = time.monotonic() + OWED_WAIT
        while time.monotonic() < deadline:
            if all(self._arrived(c, event_id) for c, event_id in owed):
                break
            await asyncio.sleep(0.2)
        self.check()
        for c, event_id in owed:
            if not self._arrived(c, event_id):
                name = self.events[event_id][3]
                self.violations.append(
                    Violation("owed but never arrived", c, name, time.time() - self.start)
                )

    def owed(self, end: float) -> list[tuple[str, str]]:
        """(consumer, event id) for every copy the service must deliver: the consumer was
        registered when the event's request began and allowed from then to the end."""
        found = []
        for event_id, (event, started, _answered, _name) in self.events.items():
            for c in self.consumer_uuid:
                if c not in self.model.states_at(started)[0].consumers:
                    continue  # not registered yet when the event came: no copy made
                # Through the wait for it too: a role may expire by time meanwhile.
                if self.model.allowed_throughout(started, end + OWED_WAIT, c, event):
                    found.append((c, event_id))
        return found

    def _arrived(self, c: str, event_id: str) -> bool:
        return any(got.event_id == event_id for got in self.copies(c))

    async def close(self) -> None:
        for reader in self.readers.values():
            await reader.close()
        for consumer in self.consumer_uuid.values():
            await self.client.delete(f"/api/event-consumers/{consumer}/", headers=SERVICE)
        for receiver in self.receivers.values():
            await receiver.stop()


def _iso(moment: float | None) -> str | None:
    return None if moment is None else datetime.fromtimestamp(moment, UTC).isoformat()


async def play(client: httpx.AsyncClient, steps: list[Step]) -> Run:
    """Play a history and judge it; the run's `violations` say what went wrong."""
    run = Run(client, steps)
    try:
        for step in steps:
            await run.play(step)
        await run.finish()
    finally:
        await run.close()
    return run


async def shrink(
    client: httpx.AsyncClient, steps: list[Step], first: Run, budget: float
) -> tuple[list[Step], Run | None]:
    """The shortest history found within `budget` seconds that still shows a violation
    (delta debugging: drop chunks of steps, halving the chunk when none can go)."""
    deadline = time.monotonic() + budget
    best, best_run = list(steps), None
    # First without the steps that did nothing in `first`, its run (a refused registration,
    # a name gone).
    done = [step for step in steps if step not in first.skipped]
    if len(done) < len(steps):
        again = await play(client, done)
        if again.violations:
            best, best_run = done, again
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        removed = False
        start = 0
        while start < len(best) and time.monotonic() < deadline:
            candidate = best[:start] + best[start + chunk :]
            run = await play(client, candidate)
            if run.violations:
                best, best_run, removed = candidate, run, True
            else:
                start += chunk
        if not removed:
            chunk //= 2
    return best, best_run
