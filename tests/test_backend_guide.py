"""docs/backend.md's worked example works as written: its Python block, extracted verbatim,
runs against a served instance (with the suite's python, which has httpx) and prints what
the page says it prints, the broker's confirm of the waited-for event included."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from queuekeeper.config import Settings
from tests.conftest import ROOT, SERVICE_TOKEN
from tests.ops.live import run_beside_a_server

GUIDE = ROOT / "docs" / "backend.md"


def example() -> tuple[str, str]:
    """The Python block after `<!-- backend:example -->`, and the output printed after it."""
    text = GUIDE.read_text()
    found = re.search(
        r"<!-- backend:example -->\n```python\n(?P<code>.*?)\n```\n\nIt prints:\n\n```text\n"
        r"(?P<output>.*?)\n```",
        text,
        re.S,
    )
    assert found, "docs/backend.md has no backend:example block followed by its output"
    return found["code"], found["output"]


@pytest.mark.timeout(180)
async def test_the_backend_guides_example_prints_what_the_guide_says(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    code, output = example()

    result = await run_beside_a_server(
        settings,
        [sys.executable, "-"],
        cwd=tmp_path,
        home=tmp_path,
        service_token=SERVICE_TOKEN,
        stdin=code,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == output.strip(), result.stdout + result.stderr
