"""Schemathesis over the whole OpenAPI document: no input makes a 5xx, every answer matches
its documented schema, no status code is undocumented, and an answer refusing a request
(400, 403, 404, 409, 413, 422, 5xx) changed nothing in the database or the broker
(contract §14). Beside what the schema allows, the fuzzer sends lone UTF-16 surrogates,
datetimes without an offset or out of range, and values nested thousands of levels deep
(tests/ops/fuzz_hooks.py, which also holds that check).

Runs the `examples`, `coverage` and `fuzzing` phases with a fixed seed and a bounded number
of examples per operation (QK_FUZZ_EXAMPLES; `make test-long` raises it, and adds the
coverage phase's cases of the event accept calls), twice: the agent
operations with an agent's token (a user with an offering it may see), everything else with
the service token. The server is the app of this test's settings (own instance name,
emptied database) on a loopback port.
"""

from __future__ import annotations

import asyncio
import os
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
ROOT = Path(__file__).resolve().parents[2]
SEED = 20261123
# Per operation and phase. `make test` runs a small bounded sample (every operation through
# all three phases, the coverage phase's boundary cases whole but for the two below; each
# call also reads the database's row counts and, after a refused write, the broker's
# objects, three calls to the Management API); the volume is `make test-long`'s, which sets
# QK_FUZZ_EXAMPLES (and QK_FUZZ_TIMEOUT) higher and QK_FUZZ_COVERAGE=all.
MAX_EXAMPLES = int(os.environ.get("QK_FUZZ_EXAMPLES", "4"))
# The coverage phase's cases (which no example count bounds) of every operation but the two
# event accept calls (POST /api/internal/events/ and its batch/): their ~30 payload types made
# 4,100 of the bounded run's 6,600 calls, every one refused by validation, and most of its
# time. `make test-long` (QK_FUZZ_COVERAGE=all) runs them all; in `make test` these two
# operations go through the examples and fuzzing phases, bad input included, as every other.
FULL_COVERAGE = os.environ.get("QK_FUZZ_COVERAGE") == "all"
BOUNDED_COVERAGE = """
[[operations]]
include-path-regex = "^/api/internal/events/(batch/)?$"
phases.coverage.enabled = false
"""
TIMEOUT = int(os.environ.get("QK_FUZZ_TIMEOUT", "600"))
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "response_schema_conformance",
        "content_type_conformance",
        "nothing_changed",  # tests/ops/fuzz_hooks.py
    ]
)
AGENT_TOKEN = "fuzz-agent-token-0123456789abcdef"


def _seed_directory(base_url: str, offering: str) -> None:
    """A user (the fuzzing agent) with one offering, so agent calls get past auth."""
    service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
    user = uuid.uuid4().hex
    with httpx.Client(base_url=base_url, headers=service, timeout=30) as http:
        http.put(
            f"/api/internal/users/{user}/", json={"username": "fuzz", "token": AGENT_TOKEN}
        ).raise_for_status()
        http.put(f"/api/internal/offerings/{offering}/", json={"name": "Fuzz"}).raise_for_status()
        http.put(f"/api/internal/offerings/{offering}/users/{user}/").raise_for_status()


def _environment(settings: Settings) -> dict[str, str]:
    """What the hooks (tests/ops/fuzz_hooks.py) need to read the state the server keeps."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "SCHEMATHESIS_HOOKS": "tests.ops.fuzz_hooks",
        "QK_FUZZ_DATABASE_URL": settings.database_url.replace("+asyncpg", ""),
        "QK_FUZZ_MANAGEMENT_URL": settings.management_urls[0],
        "QK_FUZZ_MANAGEMENT_USER": settings.management_user,
        "QK_FUZZ_MANAGEMENT_PASSWORD": settings.management_password,
        "QK_FUZZ_INSTANCE_TAG": settings.instance_tag,
    }


def _schemathesis(
    base_url: str, header: str, tags: list[str], report: Path, env: dict[str, str]
) -> str:
    config = report / "schemathesis.toml"
    config.write_text("" if FULL_COVERAGE else BOUNDED_COVERAGE)
    command = [
        str(SCHEMATHESIS),
        f"--config-file={config}",
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
    if os.environ.get("QK_FUZZ_PATHS"):  # a few operations only (a regular expression)
        command.append(f"--include-path-regex={os.environ['QK_FUZZ_PATHS']}")
    else:
        command.extend(f"--include-tag={tag}" for tag in tags)
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT, check=False, cwd=report, env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"schemathesis found problems ({' '.join(tags)}):\n{output[-20000:]}"
    )
    return output


@pytest.mark.timeout(TIMEOUT + 60)
async def test_no_input_makes_a_server_error_or_breaks_the_documented_schema(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    if not SCHEMATHESIS.exists():
        pytest.fail(f"{SCHEMATHESIS} is missing: run `make install` (it is a dev dependency)")
    fuzz_settings = settings.model_copy(
        update={"events_wait_timeout": 1.0, "scheduler_enabled": False}
    )

    offering = uuid.uuid4().hex
    env = {**_environment(fuzz_settings), "QK_FUZZ_OFFERING": offering}

    def run() -> list[str]:
        with live_server(fuzz_settings) as base_url:
            _seed_directory(base_url, offering)
            return [
                _schemathesis(
                    base_url, f"Authorization: Token {AGENT_TOKEN}", ["agents"], tmp_path, env
                ),
                _schemathesis(
                    base_url,
                    f"Authorization: Bearer {SERVICE_TOKEN}",
                    ["internal", "admin", "health"],
                    tmp_path,
                    env,
                ),
            ]

    outputs = await asyncio.to_thread(run)
    for output in outputs:
        # Every operation was reached (a filter typo would select none and pass).
        assert "Tested:" in output
        assert "No issues found" in output
