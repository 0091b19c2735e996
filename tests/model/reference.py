"""A reference model of who may receive what (contract §11, §12, §13, §14): the
authorization rule as plain Python, written from the contract rather than from the SQL of
`events/authorization.py`, so the model-based test can judge every copy the real service
sends.

The rule, as the contract states it:

- an owner may receive anything only while **active** and holding a **token** that has not
  expired (a removed token counts as expired; §11);
- a **global** consumer (no bindings) receives every event while its owner is staff or
  support (§12);
- otherwise a consumer receives an event when one of its **bindings** is one of the event's
  **keys** and the owner may still hold that binding (§12): staff and support may hold any;
  anyone their own user; an offering they are granted; an entity they hold an unexpired
  role on, or a role on one of its ancestors (a project's customer; an offering's customer,
  its project and that project's customer);
- an event's keys are its offering, that offering's customer, project and the project's
  customer, the event's own project and that project's customer, and its subject user;
- the rule is applied when a copy **leaves** (published to the broker, posted to a webhook),
  whatever path brought it there (§14). A queue copy published while allowed may sit in the
  queue; when access ends it is removed within 15 s (30 s for an expiry by time).

A copy is **owed** when the consumer existed and was allowed when the event was accepted
and stayed allowed until the copy could leave: a copy refused at departure is not owed.

`State` is the directory at one moment; `History` keeps every state with the interval in
which it was coming into force (the request that changed it was in flight), so the checker
can allow either state while a change was in flight (`allowed_during`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

# How long a queue copy may sit in its queue after its owner lost access (§14).
SWEEP_SECONDS = 15.0
SWEEP_BY_TIME_SECONDS = 30.0


@dataclass
class User:
    active: bool = True
    staff: bool = False
    support: bool = False
    token: bool = True
    token_expires_at: float | None = None  # wall-clock seconds

    def may_act(self, now: float) -> bool:
        """Active, holding a token that has not expired (§11)."""
        unexpired = self.token_expires_at is None or self.token_expires_at > now
        return self.active and self.token and unexpired


@dataclass
class Offering:
    customer: str | None
    project: str | None


@dataclass
class Role:
    user: str
    scope: tuple[str, str]  # ("customer"|"project"|"offering", entity)
    expires_at: float | None = None

    def live(self, now: float) -> bool:
        return self.expires_at is None or self.expires_at > now


@dataclass
class Consumer:
    owner: str
    delivery: str  # "rmq" (a queue read over AMQP) or "webhook"
    bindings: frozenset[tuple[str, str]]  # empty: global
    is_global: bool


@dataclass
class Event:
    """What the service was told: the keys are derived from the directory when judged."""

    offering: str | None = None
    project: str | None = None
    subject: str | None = None


@dataclass
class State:
    """The directory (and the consumers) as queuekeeper should see it at one moment."""

    users: dict[str, User] = field(default_factory=dict)
    customers: set[str] = field(default_factory=set)
    projects: dict[str, str] = field(default_factory=dict)  # project -> its customer
    offerings: dict[str, Offering] = field(default_factory=dict)
    grants: set[tuple[str, str]] = field(default_factory=set)  # (user, offering)
    roles: dict[str, Role] = field(default_factory=dict)
    consumers: dict[str, Consumer] = field(default_factory=dict)

    # -- the rule ------------------------------------------------------------------------

    def keys(self, event: Event) -> set[tuple[str, str]]:
        """An event's scope keys (§12), as the directory has them now."""
        found: set[tuple[str, str]] = set()
        if event.offering is not None:
            found.add(("offering", event.offering))
            offering = self.offerings.get(event.offering)
            if offering is not None:
                if offering.customer is not None:
                    found.add(("customer", offering.customer))
                if offering.project is not None:
                    found.add(("project", offering.project))
                    if offering.project in self.projects:
                        found.add(("customer", self.projects[offering.project]))
        if event.project is not None:
            found.add(("project", event.project))
            if event.project in self.projects:
                found.add(("customer", self.projects[event.project]))
        if event.subject is not None:
            found.add(("user", event.subject))
        return found

    def ancestors(self, kind: str, entity: str) -> set[tuple[str, str]]:
        """The entity and every entity a role on which covers it (§12)."""
        found = {(kind, entity)}
        if kind == "project" and entity in self.projects:
            found.add(("customer", self.projects[entity]))
        if kind == "offering" and entity in self.offerings:
            offering = self.offerings[entity]
            if offering.customer is not None:
                found.add(("customer", offering.customer))
            if offering.project is not None:
                found.add(("project", offering.project))
                if offering.project in self.projects:
                    found.add(("customer", self.projects[offering.project]))
        return found

    def may_hold(self, user: str, binding: tuple[str, str], now: float) -> bool:
        """Whether `user` may hold `binding` at `now` (registration and every delivery)."""
        who = self.users.get(user)
        if who is None:
            return False
        if who.staff or who.support:
            return True
        kind, entity = binding
        if kind == "user":
            return entity == user
        if kind == "offering" and (user, entity) in self.grants:
            return True
        covering = self.ancestors(kind, entity)
        return any(
            role.user == user and role.live(now) and role.scope in covering
            for role in self.roles.values()
        )

    def may_receive(self, now: float, consumer: str, event: Event) -> bool:
        """The rule: may `consumer` be sent a copy of `event` at `now`?"""
        found = self.consumers.get(consumer)
        if found is None:
            return False
        owner = self.users.get(found.owner)
        if owner is None or not owner.may_act(now):
            return False
        if found.is_global:
            return owner.staff or owner.support
        return any(
            self.may_hold(found.owner, binding, now)
            for binding in found.bindings & self.keys(event)
        )

    def expiries(self) -> set[float]:
        """Every moment at which the rule may change by time alone."""
        moments = {r.expires_at for r in self.roles.values() if r.expires_at is not None}
        moments |= {
            u.token_expires_at for u in self.users.values() if u.token_expires_at is not None
        }
        return moments

    # -- the directory's changes, as the backend pushes them -----------------------------

    def drop_role(self, role: str) -> None:
        self.roles.pop(role, None)

    def revoke(self, user: str, offering: str) -> None:
        """An offering grant removed: the user's consumers lose the offering as a binding,
        and those bound to it alone are deleted (§9, Lifecycle), whatever else (a role,
        staff) would let the user hold it."""
        self.grants.discard((user, offering))
        binding = ("offering", offering)
        for name, consumer in list(self.consumers.items()):
            if consumer.owner != user or binding not in consumer.bindings:
                continue
            if consumer.bindings == {binding}:
                del self.consumers[name]
            else:
                consumer.bindings = consumer.bindings - {binding}

    def delete_customer(self, customer: str) -> None:
        self.customers.discard(customer)
        self._forget("customer", customer)

    def delete_project(self, project: str) -> None:
        self.projects.pop(project, None)
        self._forget("project", project)

    def delete_offering(self, offering: str) -> None:
        self.offerings.pop(offering, None)
        self.grants = {g for g in self.grants if g[1] != offering}
        self._forget("offering", offering)

    def _forget(self, kind: str, entity: str) -> None:
        """Deleting an entity deletes the roles on it and the bindings of it (decision 025);
        a consumer left without bindings receives nothing (it does not become global)."""
        self.roles = {k: r for k, r in self.roles.items() if r.scope != (kind, entity)}
        for consumer in self.consumers.values():
            consumer.bindings = consumer.bindings - {(kind, entity)}


@dataclass
class Era:
    """A state and the interval in which the request that made it was in flight: from
    `started` the service may already act on it, from `answered` it must."""

    started: float
    answered: float
    state: State


class History:
    """Every state the directory went through, for judging a copy at its departure."""

    def __init__(self, start: float) -> None:
        self.eras: list[Era] = [Era(start, start, State())]

    @property
    def now(self) -> State:
        """The newest state: what a step changes (through `begin` and `commit`)."""
        return self.eras[-1].state

    def begin(self) -> State:
        """A copy of the newest state for a step to change; `commit` it when answered."""
        return copy.deepcopy(self.now)

    def commit(self, state: State, started: float, answered: float) -> None:
        self.eras.append(Era(started, answered, state))

    def states_at(self, moment: float) -> list[State]:
        """The states the service may act on at `moment`: the one in force (its request
        answered), and the next one while its request was in flight."""
        in_force = 0
        for index, era in enumerate(self.eras):
            if era.answered <= moment:
                in_force = index
        found = [self.eras[in_force].state]
        for era in self.eras[in_force + 1 :]:
            if era.started <= moment:
                found.append(era.state)
        return found

    def moments(self, low: float, high: float) -> list[float]:
        """The moments in [low, high] at which the verdict may change: the ends, every
        change's start and answer, and just before every expiry."""
        found = {low, high}
        for era in self.eras:
            found |= {era.started, era.answered}
            found |= {moment - 1e-3 for moment in era.state.expiries()}
        return sorted(m for m in found if low <= m <= high)

    def allowed_during(self, low: float, high: float, consumer: str, event: Event) -> bool:
        """Some moment of [low, high] and some state the service may act on then allow it."""
        return any(
            state.may_receive(moment, consumer, event)
            for moment in self.moments(low, high)
            for state in self.states_at(moment)
        )

    def allowed_throughout(self, low: float, high: float, consumer: str, event: Event) -> bool:
        """Every moment of [low, high] and every state the service may act on then allow
        it: a copy it must deliver (owed)."""
        return all(
            state.may_receive(moment, consumer, event)
            for moment in self.moments(low, high)
            for state in self.states_at(moment)
        )

    def last_allowed(
        self, low: float, high: float, consumer: str, event: Event
    ) -> tuple[float, bool] | None:
        """The latest moment of [low, high] at which the copy was allowed, and whether what
        ended it was time alone (an expiry with no push: the longer sweep bound)."""
        for moment in reversed(self.moments(low, high)):
            for state in self.states_at(moment):
                if state.may_receive(moment, consumer, event):
                    by_time = any(
                        s.may_receive(moment, consumer, event) for s in self.states_at(high)
                    )
                    return moment, by_time
        return None
