"""Replicas on a RabbitMQ cluster lose nothing when a broker node and a replica die.

One cluster for the module (about 30-60 s to form on this machine), one scenario per queue
type on it. The figures are printed and written to $QK_CLUSTER_FIGURES (default
cluster-figures.json in the working directory); docs/scaling.md quotes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import Cluster
from tests.cluster.scenario import RECONCILE_INTERVAL, STALE_INTERVAL, queue_cost, run_scenario

RATE = float(os.environ.get("QK_CLUSTER_RATE", "200"))
SECONDS = float(os.environ.get("QK_CLUSTER_SECONDS", "75"))
AGENTS = int(os.environ.get("QK_CLUSTER_AGENTS", "12"))
FIGURES = Path(os.environ.get("QK_CLUSTER_FIGURES", "cluster-figures.json"))

pytestmark = pytest.mark.timeout(1200)

_figures: dict[str, Any] = {}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    built = Cluster()
    built.up()
    _figures["cluster"] = dict(built.timings)
    try:
        yield built
    finally:
        left = built.down()
        _figures["cluster_beam_pids_left"] = left
        FIGURES.write_text(json.dumps(_figures, indent=1, default=str))
        assert left == [], f"beam processes of ours still running: {left}"


def _common_checks(figures: dict[str, Any]) -> None:
    print(json.dumps(figures, indent=1, default=str))
    # What the issue asks: every *accepted* event consumed. An event the driver could not
    # get accepted within a minute (`never_accepted`: every replica too slow to answer on an
    # overloaded machine) was never promised to anyone; it is reported, not failed.
    assert figures["events_accepted"] > 0
    assert figures["rejected_4xx"] == []
    assert figures["lost"] == 0, "accepted events never consumed"
    assert all(status < 500 for status in figures["registration_statuses"])
    for job, interval in (("reconcile", RECONCILE_INTERVAL), ("cleanup_stale", STALE_INTERVAL)):
        runs = figures["jobs"][job]
        assert runs["runs"] >= 1, job
        # Three schedulers fire every interval; the job must not run twice in one.
        gap = runs["shortest_gap_s"]
        assert gap is None or gap >= interval * 0.5, (job, runs)


async def test_quorum_queues_lose_nothing_when_a_node_and_a_replica_die(
    cluster: Cluster,
) -> None:
    figures = await run_scenario(
        cluster, "quorum", rate=RATE, stream_seconds=SECONDS, agents=AGENTS
    )
    _figures["quorum"] = figures
    _common_checks(figures)
    figures["queue_cost"] = await queue_cost(cluster, "quorum")
    print(json.dumps(figures["queue_cost"]))


async def test_classic_queues_with_mandatory_lose_nothing_but_stall(cluster: Cluster) -> None:
    """Classic queues homed on the dead node are unavailable until it returns: `mandatory`
    turns the broker's silent drop into a return, the relay retries, nothing is lost, and
    those queues' events wait for the node (the cost, reported, not asserted away)."""
    figures = await run_scenario(
        cluster, "classic", rate=RATE, stream_seconds=SECONDS, agents=AGENTS
    )
    _figures["classic"] = figures
    _common_checks(figures)
    figures["queue_cost"] = await queue_cost(cluster, "classic")
    print(json.dumps(figures["queue_cost"]))
