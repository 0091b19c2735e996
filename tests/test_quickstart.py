"""The README's quickstart works as written: its blocks, extracted verbatim, run in bash
against a served instance (the serve block's `make run` is what `tests/ops/test_make_run.py`
covers; here the suite's own server stands in for it, on the suite's database)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from queuekeeper.config import Settings
from tests.conftest import ROOT, SERVICE_TOKEN
from tests.ops.live import run_beside_a_server

README = ROOT / "README.md"


def block(name: str) -> str:
    """The shell block right after `<!-- quickstart:<name> -->`."""
    found = re.search(
        rf"<!-- quickstart:{name} -->\n```sh\n(?P<code>.*?)\n```", README.read_text(), re.S
    )
    assert found, f"README.md has no quickstart:{name} block"
    return found["code"]


def test_the_serve_block_starts_with_a_service_token_and_waits_for_readiness() -> None:
    serve = block("serve")
    assert serve.startswith("export QUEUEKEEPER_SERVICE_TOKENS=")
    assert "make run" in serve
    assert "/readyz" in serve


def readiness_loop() -> str:
    """The serve block's wait for the server, bounded: a wrong URL waits forever."""
    (loop,) = [line for line in block("serve").splitlines() if line.startswith("until ")]
    return f"timeout 30 bash -c {shlex.quote(loop)}"


@pytest.mark.timeout(180)
async def test_quickstart_calls_and_consumer_deliver_the_event(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    """On the port the reader chose: QUEUEKEEPER_PORT, which `make run` serves on, is all
    the readiness loop and the calls are told (not the URL the harness hands out as QK)."""
    on_its_port = 'export QUEUEKEEPER_PORT="${QK##*:}"; unset QK'
    script = "\n".join(
        ["set -euo pipefail", on_its_port, readiness_loop(), block("calls"), block("consume")]
    )

    result = await run_beside_a_server(
        settings, ["bash", "-c", script], cwd=ROOT, home=tmp_path, service_token=SERVICE_TOKEN
    )
    assert result.returncode == 0, result.stdout + result.stderr
    received = [line for line in result.stdout.splitlines() if line.startswith("received: ")]
    assert len(received) == 1, result.stdout + result.stderr
    event = json.loads(received[0].removeprefix("received: "))
    assert event["order_state"] == "executing"
    assert result.stdout.startswith("ready\n"), result.stdout
    lines = result.stdout.splitlines()[1:]
    # Each push prints the service's answer and its status.
    for line in lines[:3]:
        answer, _, status = line.rpartition(" ")
        assert status == "201", result.stdout
        assert isinstance(json.loads(answer), dict), line
    published = json.loads(lines[3])
    assert [d["state"] for d in published["deliveries"]] == ["published"], result.stdout


@pytest.mark.timeout(180)
async def test_calls_pasted_without_the_token_show_the_services_reason(
    settings: Settings, clean_state: None, tmp_path: Path
) -> None:
    """Pasted into a shell where the token was not exported (no `set -e` there either):
    every refusal is shown with the service's reason, and no traceback hides it."""

    result = await run_beside_a_server(
        settings, ["bash", "-c", block("calls")], cwd=ROOT, home=tmp_path, service_token=None
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    pushes = result.stdout.splitlines()[:3]
    for line in pushes:
        answer, _, status = line.rpartition(" ")
        assert status == "401", output
        assert "service token" in json.loads(answer)["detail"].lower(), line
    assert "returned error: 401" in result.stderr, output
    assert 'no uuid in the answer: {"detail":' in result.stderr, output
