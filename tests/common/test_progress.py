"""The CLI progress helper: a bar in a terminal, a line per tenth of the way in a log."""

from __future__ import annotations

import io

from queuekeeper.common.progress import Phases, Progress


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress("reconcile", total=250, file=out) as progress:
        for index in range(250):
            progress.advance()
            if index == 99:
                progress.note("deleted orphan subscription_x")
    lines = out.getvalue().splitlines()
    assert lines[0] == "reconcile: 0/250"
    assert lines[-1] == "reconcile: 250/250 (100%)"
    assert "deleted orphan subscription_x" in lines
    counts = [line for line in lines if line.startswith("reconcile: ") and "%" in line]
    assert len(counts) == 10
    assert "\r" not in out.getvalue()


def test_every_item_is_a_line_when_there_are_few() -> None:
    out = io.StringIO()
    with Progress("redrive", total=3, file=out) as progress:
        for _ in range(3):
            progress.advance()
    assert out.getvalue().splitlines() == [
        "redrive: 0/3",
        "redrive: 1/3 (33%)",
        "redrive: 2/3 (66%)",
        "redrive: 3/3 (100%)",
    ]


def test_nothing_to_do_still_finishes() -> None:
    out = io.StringIO()
    with Progress("import-directory", total=0, file=out):
        pass
    assert out.getvalue() == "import-directory: 0/0\n"


def test_a_bar_in_a_terminal() -> None:
    out = io.StringIO()
    with Progress("import-directory", total=4, file=out, interactive=True) as progress:
        for _ in range(4):
            progress.advance()
        progress.note("done with the users")
    text = out.getvalue()
    assert "━" in text  # the bar
    assert "4/4" in text
    assert "done with the users" in text
    assert "\x1b[" in text  # drawn with terminal control sequences


def test_phases_give_each_job_phase_its_own_progress_lines() -> None:
    out = io.StringIO()
    with Phases(file=out, interactive=False) as report:
        for done in range(1, 4):
            report("vhosts", done, 3)
        report("stale users", 1, 1)
    assert out.getvalue().splitlines() == [
        "vhosts: 0/3",
        "vhosts: 1/3 (33%)",
        "vhosts: 2/3 (66%)",
        "vhosts: 3/3 (100%)",
        "stale users: 0/1",
        "stale users: 1/1 (100%)",
    ]
