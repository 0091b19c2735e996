"""docs/backend.md's worked example works as written: its Python block, extracted verbatim,
runs against a served instance (with the suite's python, which has httpx) and prints what
the page says it prints, the broker's confirm of the waited-for event included."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from queuekeeper.config import Settings
from tests.conftest import ROOT, SERVICE_TOKEN
from tests.ops.live import live_server

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

    def run() -> subprocess.CompletedProcess[str]:
        with live_server(settings) as base_url:
            return subprocess.run(
                [sys.executable, "-"],
                input=code,
                cwd=tmp_path,
                env={
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "HOME": str(tmp_path),
                    "QK": base_url,
                    "QUEUEKEEPER_SERVICE_TOKENS": SERVICE_TOKEN,
                },
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

    result = await asyncio.to_thread(run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == output.strip(), result.stdout + result.stderr
