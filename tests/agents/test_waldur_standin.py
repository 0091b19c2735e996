"""`queuekeeper waldur-standin`, the empty Waldur a trial site points its proxy's `waldur`
upstream at (docs/agents.md): started by the documented command, it answers lists empty and
objects 404, and the published agent's own order lookup takes that for an order Waldur does
not have (None: logged and skipped) where a missing upstream was a 502 for every order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agents.releases import RELEASES
from tests.agents.site_agent_venv import ensure_site_agent_venv
from tests.agents.site_proxy import free_port

QUEUEKEEPER = str(Path(sys.executable).parent / "queuekeeper")
NEWEST = RELEASES[-1].version
ASK = """
import json, sys, types
from waldur_api_client.api.marketplace_orders import marketplace_orders_list
from waldur_site_agent.common import processors, utils
client = utils.get_client(sys.argv[1], "a-trial-token")
print(json.dumps({
    "orders": len(marketplace_orders_list.sync_all(client=client, offering_uuid=sys.argv[2])),
    "order": processors.OfferingOrderProcessor.get_order_info(
        types.SimpleNamespace(waldur_rest_client=client), sys.argv[2]
    ),
}))
"""


@pytest.fixture
def standin() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    process = subprocess.Popen(
        [QUEUEKEEPER, "waldur-standin", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "QUEUEKEEPER_LOG_FORMAT": "json"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                httpx.get(f"{url}/", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, process.communicate()[0]
                assert time.monotonic() < deadline, "the stand-in did not start in 30 s"
                time.sleep(0.1)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=10)


def test_it_answers_as_an_empty_waldur_and_logs_what_it_was_asked(
    standin: tuple[str, subprocess.Popen[str]],
) -> None:
    url, process = standin
    order = uuid.uuid4().hex
    listing = httpx.get(f"{url}/api/marketplace-orders/", params={"offering_uuid": order})
    assert (listing.status_code, listing.json()) == (200, [])
    assert listing.headers["x-result-count"] == "0"
    one = httpx.get(f"{url}/api/marketplace-orders/{order}/")
    assert (one.status_code, one.json()) == (404, {"detail": "Not found."})
    posted = httpx.post(f"{url}/api/marketplace-site-agent-services/", json={})
    assert posted.status_code == 404
    for answer in (listing, one, posted):
        assert answer.headers["x-served-by"] == "waldur-standin"
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=10)[0]
    asked = [
        (line["method"], line["path"], line["status"])
        for line in map(json.loads, filter(str.strip, output.splitlines()))
        if line.get("event") == "waldur_standin_request"
    ]
    assert asked[-3:] == [
        ("GET", "/api/marketplace-orders/", 200),
        ("GET", f"/api/marketplace-orders/{order}/", 404),
        ("POST", "/api/marketplace-site-agent-services/", 404),
    ]


@pytest.mark.timeout(900)
def test_the_published_agent_finds_no_order_there_instead_of_a_502(
    standin: tuple[str, subprocess.Popen[str]],
) -> None:
    url, _ = standin
    python = ensure_site_agent_venv(NEWEST)
    done = subprocess.run(
        [str(python), "-c", ASK, f"{url}/api/", uuid.uuid4().hex],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"orders": 0, "order": None}
