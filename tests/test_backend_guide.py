"""docs/backend.md's worked example works as written: its Python block, extracted verbatim,
runs against a served instance (with the suite's python, which has httpx) and prints what
the page says it prints, the broker's confirm of the waited-for event included."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from queuekeeper.app import create_app
from queuekeeper.common.access import declared_routes
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


def test_the_push_order_names_every_directory_push() -> None:
    """Every PUT of the backend's directory routes is in "Push order", the fields of its body
    with it: a push left out there is one the backend team never learns to make."""
    text = GUIDE.read_text()
    section = text[text.index("## Push order") :]
    section = section[: section.index("\n## ", 1)]
    pushes = {
        found.path: found.route
        for found in declared_routes(create_app(Settings()).routes)
        if isinstance(found.route, APIRoute)
        and "PUT" in found.methods
        and found.path.startswith("/api/internal/")
        and found.route.body_field is not None
    }
    assert pushes, "no directory PUT routes found"
    for path, route in pushes.items():
        written = re.sub(r"\{[a-z_]+\}", "{uuid}", path)
        found = re.search(rf"`PUT {re.escape(written)}` `\{{(?P<fields>[^`]*)\}}`", section)
        assert found, f"docs/backend.md's push order leaves out PUT {path}"
        documented = set(re.findall(r"[a-z_]+", found["fields"])) - {"customer", "project"}
        assert route.body_field is not None
        body = route.body_field.field_info.annotation
        assert isinstance(body, type)
        assert issubclass(body, BaseModel)
        assert set(body.model_fields) <= documented, (path, set(body.model_fields) - documented)
