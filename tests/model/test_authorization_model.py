"""The authorization rule, tested against a reference model (contract §11-§14): random
histories of directory changes, events of every scope, consumers of every binding and both
deliveries, agents leaving and returning, replays and resyncs, played against the real
service; every copy a queue reader or a webhook receiver gets is judged by the model at the
moment it left, and every copy the model says is owed must arrive.

`make test` plays a few histories of fixed seeds and one written out (the copies a slow
webhook receiver held back behind its head); `make test-model` plays many more
(`QK_MODEL_STEPS` steps in total, `QK_MODEL_SEED` the first seed) and prints what it ran.
A failure prints its seed and the shortest history found (`QK_MODEL_SHRINK_SECONDS`).
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.model.history import Run, Step, generate, play, shrink
from tests.webhooks.support import WEBHOOK_SETTINGS

STEPS = int(os.environ.get("QK_MODEL_STEPS", "0"))

pytestmark = [
    pytest.mark.settings(
        **{
            **WEBHOOK_SETTINGS,
            # Slow receivers answer within 1.5 s: no attempt is a timeout.
            "webhook_timeout_seconds": 5.0,
            # An agent away for a second is away: its new copies are parked.
            "park_after_seconds": 1.0,
        }
    ),
    # `make test`: a few histories, each shrunk for a minute at most when it fails.
    pytest.mark.timeout(0 if STEPS else 400),
]

FIRST_SEED = int(os.environ.get("QK_MODEL_SEED", "1"))
HISTORY_STEPS = int(os.environ.get("QK_MODEL_HISTORY_STEPS", "40"))
SHRINK_SECONDS = float(os.environ.get("QK_MODEL_SHRINK_SECONDS", "240" if STEPS else "60"))
SHRINK_FAILURES = int(os.environ.get("QK_MODEL_SHRINK_FAILURES", "3" if STEPS else "1"))
# `make test`: these seeds' histories (seeds 5, 7 and 30 showed the leak of copies held behind a
# slow webhook receiver on the code before every copy was judged as it left).
SUITE_SEEDS: tuple[int, ...] = (5, 7, 30)
SUITE_HISTORY_STEPS = 40


def report(seed: int | str, run: Run, steps: list[Step], shortest: Run | None) -> str:
    lines = [f"seed {seed}: {len(run.violations)} violation(s)"]
    lines += [f"  {v}" for v in run.violations[:10]]
    lines.append(f"shortest history found ({len(steps)} steps):")
    lines += [f"  {line}" for line in (shortest or run).log]
    if shortest is not None:
        lines += [f"  -> {v}" for v in shortest.violations[:10]]
    return "\n".join(lines)


async def judged(
    client: httpx.AsyncClient, seed: int | str, steps: list[Step], shrinking: bool
) -> tuple[Run, str | None]:
    """The history's run, and None when it shows no violation, else the report of its
    shortest form (when `shrinking`, else of the history as generated)."""
    run = await play(client, steps)
    if not run.violations:
        return run, None
    if not shrinking:
        return run, report(seed, run, steps, None)
    shortest, shortest_run = await shrink(client, steps, run, SHRINK_SECONDS)
    return run, report(seed, run, shortest, shortest_run)


async def test_a_slow_receivers_held_back_copies_are_judged_when_they_leave(
    app: object, client: httpx.AsyncClient
) -> None:
    """A staff user holds a role on P and a webhook consumer bound to P whose receiver
    answers after 1.5 s; three events of P are accepted, then the user is demoted and the
    role deleted: the two copies held behind the head must not be posted after that."""
    steps = [
        Step("customer", ("C1",)),
        Step("project", ("P1", "C1")),
        Step("offering", ("O1", "C1", "P1")),
        Step("user", ("u1", "staff")),
        Step("role", ("r1", "u1", "project", "P1", None)),
        Step("hook", ("w1", "u1", (("project", "P1"),), 1.5)),
        Step("burst", ("e", "O1", 3)),
        Step("flags", ("u1", "demote")),
        Step("unrole", ("r1",)),
        Step("wait", (4.0,)),
    ]
    run = await play(client, steps)
    assert not run.violations, report("written", run, steps, None)


async def test_copies_claimed_together_are_judged_one_by_one_as_they_leave(
    app: object, client: httpx.AsyncClient
) -> None:
    """The receiver answers after 2.5 s: the copies accepted while the first is posted are
    claimed together (one run of the webhook dispatcher) when it is answered. The role goes
    as the second arrives: the ones after it must be judged as each leaves, not at the
    claim."""
    steps = [
        Step("customer", ("C1",)),
        Step("project", ("P1", "C1")),
        Step("offering", ("O1", "C1", "P1")),
        Step("user", ("u1", "plain")),
        Step("role", ("r1", "u1", "project", "P1", None)),
        Step("flags", ("u1", "promote")),
        Step("hook", ("w1", "u1", (("project", "P1"),), 2.5)),
        Step("flags", ("u1", "demote")),
        Step("burst", ("e", "O1", 4)),
        Step("until", ("w1", 2)),
        Step("unrole", ("r1",)),
        Step("wait", (6.0,)),
    ]
    run = await play(client, steps)
    assert not run.violations, report("written", run, steps, None)


async def test_random_histories_agree_with_the_model(
    app: object, client: httpx.AsyncClient, capsys: pytest.CaptureFixture[str]
) -> None:
    seeds = range(FIRST_SEED, FIRST_SEED + 10**6) if STEPS else SUITE_SEEDS
    length = HISTORY_STEPS if STEPS else SUITE_HISTORY_STEPS
    played, histories, copies, owed = 0, 0, 0, 0
    failures: list[str] = []
    started = time.monotonic()
    for seed in seeds:
        steps = generate(seed, length)
        run, found = await judged(client, seed, steps, len(failures) < SHRINK_FAILURES)
        played += len(steps)
        copies, owed = copies + run.judged, owed + run.owed_count
        histories += 1
        if STEPS:
            with capsys.disabled():
                print(  # make test-model's progress
                    f"seed {seed}: {len(run.violations)} violation(s), {run.judged} copies"
                    f" judged, {run.owed_count} owed; {played} steps so far",
                    flush=True,
                )
        if found is not None:
            failures.append(found)
            with capsys.disabled():
                print(found, flush=True)
        if STEPS and played >= STEPS:
            break
    summary = (
        f"model: {histories} histories, {played} steps, {copies} copies judged, {owed} owed,"
        f" {len(failures)} with violations,"
        f" {time.monotonic() - started:.0f} s"
    )
    with capsys.disabled():
        print(summary, flush=True)
    assert not failures, summary + "\n\n" + "\n\n".join(failures)
