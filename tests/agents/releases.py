"""The published waldur-site-agent releases the suite runs end to end, and the
waldur-api-client versions whose models parse queuekeeper's answers (contract §10).

Adding the next agent release is one line in RELEASES: its version, what it subscribes
to with every feature on (in the order it sends them), and how it acknowledges. The
matrix tests (test_agent_matrix.py, test_api_clients.py) take every row (1.0.5's and
1.0.7's end-to-end run in test_site_agent_e2e.py and test_site_agent_107_e2e.py). `make
check-newest-agent` runs the same end-to-end test against the newest release on PyPI,
pre-releases included, whatever this table says (`QK_AGENT_VERSION`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from tests.agents.harness import AGENT_105_TYPES, AGENT_107_TYPES

# 1.0.8: 1.0.7's, with `service_provider_project_group` after the membership types when
# the username backend writes project groups (event_processing/utils.py).
AGENT_108_TYPES = [
    *AGENT_107_TYPES[:8],
    "service_provider_project_group",
    *AGENT_107_TYPES[8:],
]

Ack = Literal["auto", "client-individual"]


@dataclass(frozen=True)
class Release:
    version: str
    # "legacy": register_event_subscription + create_queue per type; "unified": register_queue
    protocol: Literal["legacy", "unified"]
    types: tuple[str, ...]
    # The STOMP `ack` mode it subscribes with, and the prefetch-count it asks for (None:
    # none asked, RabbitMQ's default applies).
    ack: Ack
    prefetch: int | None


RELEASES = [
    Release("1.0.5", "legacy", tuple(AGENT_105_TYPES), "auto", None),
    Release("1.0.7", "unified", tuple(AGENT_107_TYPES), "auto", None),
    Release("1.0.8rc12", "unified", tuple(AGENT_108_TYPES), "client-individual", 1),
]
NEWEST_ENV = "QK_AGENT_VERSION"
# waldur-api-client lines no agent of RELEASES pins exactly, parsed as well: 8.1.3 final
# (1.0.8rc12 pins 8.1.3rc23, whose models are the same for everything queuekeeper serves),
# and the newest build on the package index, pre-releases included (NEWEST_CLIENT: resolved
# when the test runs, tests/agents/site_agent_venv.newest_api_client), which the next agent
# release will pin.
NEWEST_CLIENT = "newest"
EXTRA_CLIENTS = ["8.1.3", NEWEST_CLIENT]


@dataclass(frozen=True)
class ClientSource:
    """Where a waldur-api-client version is installed: an agent's virtualenv (the client
    it pins) or a virtualenv of the client alone."""

    agent: str | None = None
    client: str | None = None

    @property
    def label(self) -> str:
        return f"agent-{self.agent}" if self.agent else f"client-{self.client}"


CLIENTS = [ClientSource(agent=r.version) for r in RELEASES] + [
    ClientSource(client=version) for version in EXTRA_CLIENTS
]


def releases_under_test() -> list[Release]:
    """RELEASES, or with `QK_AGENT_VERSION=<version>` only that release: a row of the table
    when it has one, else the newest line's expectations (the newest row), which the test
    checks against what the agent actually registered."""
    wanted = os.environ.get(NEWEST_ENV)
    if not wanted:
        return RELEASES
    for release in RELEASES:
        if release.version == wanted:
            return [release]
    newest = RELEASES[-1]
    return [Release(wanted, newest.protocol, newest.types, newest.ack, newest.prefetch)]
