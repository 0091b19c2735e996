"""The configuration reference in README.md and docs/reference/settings.md is generated from
`Settings`; these fail when a setting is added, renamed or re-described without
regenerating it (`make docs`: `queuekeeper settings-table --write README.md --write
docs/reference/settings.md`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from queuekeeper.cli import app
from queuekeeper.config_reference import (
    END_MARKER,
    START_MARKER,
    all_env_names,
    embedded_table,
    render_table,
    undocumented_settings,
)

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "reference" / "settings.md"]
REGENERATE = "run `queuekeeper settings-table --write README.md --write docs/reference/settings.md`"


def test_every_setting_has_a_description() -> None:
    assert undocumented_settings() == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_committed_table_matches_the_settings(document: Path) -> None:
    assert embedded_table(document.read_text()) == render_table(), REGENERATE


def test_table_has_one_row_per_setting_with_its_default() -> None:
    table = render_table()
    assert (
        "| `QUEUEKEEPER_AMQP_URL` or `RABBIT_URL` | `amqp://guest:guest@127.0.0.1:5672/` |" in table
    )
    assert "| `QUEUEKEEPER_SERVICE_TOKENS` | `(empty)` |" in table
    assert "| `QUEUEKEEPER_TLS_VERIFY` | `true` |" in table
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(all_env_names()) - 1  # RABBIT_URL shares the AMQP row


def test_docs_name_only_settings_that_exist() -> None:
    known = all_env_names()
    texts = {path: path.read_text() for path in [*DOCUMENTS, *sorted((ROOT / "docs").glob("*.md"))]}
    unknown = {
        f"{path.name}: {name}"
        for path, text in texts.items()
        for name in re.findall(r"\bQUEUEKEEPER_[A-Z0-9_]+\*?", text)
        if not name.endswith("*") and name not in known  # QUEUEKEEPER_QUEUE_* is a family
    }
    assert unknown == set()


def test_cli_checks_and_rewrites_a_stale_table(tmp_path: Path) -> None:
    runner = CliRunner()
    document = tmp_path / "ops.md"
    document.write_text(f"# Ops\n\n{START_MARKER}\n| stale |\n{END_MARKER}\n\nmore text\n")
    check = runner.invoke(app, ["settings-table", "--write", str(document), "--check"])
    assert check.exit_code == 1
    assert "out of date" in check.output
    write = runner.invoke(app, ["settings-table", "--write", str(document)])
    assert write.exit_code == 0
    assert embedded_table(document.read_text()) == render_table()
    assert document.read_text().endswith(f"{END_MARKER}\n\nmore text\n")
    assert (
        runner.invoke(app, ["settings-table", "--write", str(document), "--check"]).exit_code == 0
    )
    printed = runner.invoke(app, ["settings-table"])
    assert printed.output == render_table()
