"""Schemathesis over the whole OpenAPI document: no input makes a 5xx, every answer matches
its documented schema, and no status code is undocumented.

Runs the `examples`, `coverage` and `fuzzing` phases with a fixed seed and a bounded number
of examples per operation, twice: the agent operations with an agent's token (a user with
an offering it may see), everything else with the service token. The server is the app of
this test's settings (own instance name, emptied database) on a loopback port.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from queuekeeper.config import Settings
from tests.conftest import SERVICE_TOKEN
from tests.ops.live import live_server

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
SEED = 20261123
MAX_EXAMPLES = 25
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "response_schema_conformance",
        "content_type_conformance",
    ]
)
AGENT_TOKEN = "fuzz-agent-token-0123456789abcdef"


def _seed_directory(base_url: str) -> None:
    """A user (the fuzzing agent) with one offering, so agent calls get past auth."""
    service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
    user, offering = uuid.uuid4().hex, uuid.uuid4().hex
    with httpx.Client(base_url=base_url, headers=service, timeout=30) as http:
        http.put(
            f"/api/internal/users/{user}/", json={"username": "fuzz", "token": AGENT_TOKEN}
        ).raise_for_status()
        http.put(f"/api/internal/offerings/{offering}/", json={"name": "Fuzz"}).raise_for_status()
        http.put(f"/api/internal/offerings/{offering}/users/{user}/").raise_for_status()


def _schemathesis(base_url: str, header: str, tags: list[str], report: Path) -> str:
    command = [
        str(SCHEMATHESIS),
        "run",
        f"{base_url}/openapi.json",
        "--phases=examples,coverage,fuzzing",
        f"--checks={CHECKS}",
        f"--seed={SEED}",
        f"--max-examples={MAX_EXAMPLES}",
        "--no-shrink",
        "--workers=1",
        "--continue-on-failure",
        "--request-timeout=30",
        "--warnings=off",
        f"--header={header}",
        f"--report-dir={report}",
        "--report=junit",
    ]
    for tag in tags:
        command.append(f"--include-tag={tag}")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, cwd=report
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"schemathesis found problems ({' '.join(tags)}):\n{output[-20000:]}"
    )
    return output


@pytest.mark.timeout(600)
async def test_no_input_makes_a_server_error_or_breaks_the_documented_schema(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    if not SCHEMATHESIS.exists():
        pytest.fail(f"{SCHEMATHESIS} is missing: run `make install` (it is a dev dependency)")
    fuzz_settings = settings.model_copy(
        update={"events_wait_timeout": 1.0, "scheduler_enabled": False}
    )

    def run() -> list[str]:
        with live_server(fuzz_settings) as base_url:
            _seed_directory(base_url)
            return [
                _schemathesis(
                    base_url, f"Authorization: Token {AGENT_TOKEN}", ["agents"], tmp_path
                ),
                _schemathesis(
                    base_url,
                    f"Authorization: Bearer {SERVICE_TOKEN}",
                    ["internal", "admin", "health"],
                    tmp_path,
                ),
            ]

    outputs = await asyncio.to_thread(run)
    for output in outputs:
        # Every operation was reached (a filter typo would select none and pass).
        assert "Tested:" in output
        assert "No issues found" in output
