"""The shipped nginx site (deploy/nginx/queuekeeper-beside-waldur.conf) run by a test: nginx
in the foreground with its own prefix, the stand-in for Waldur's other endpoints that
`queuekeeper waldur-standin` serves (queuekeeper/waldur_standin.py), and the
certificate of a loopback host name made by a test CA."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme
import uvicorn

from queuekeeper.waldur_standin import WaldurStandIn
from tests.conftest import ROOT
from tests.ops.tools import require, unavailable

SHIPPED = ROOT / "deploy" / "nginx" / "queuekeeper-beside-waldur.conf"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_loopback_address(port: int) -> str:
    """A loopback address of 127.0.0.0/8 other than 127.0.0.1 on which `port` is free.

    The published agents dial the broker on port 443 when their configuration names none,
    so a test serving them on their defaults needs 443: each test takes an address of its
    own (Linux answers the whole /8 on `lo`), and tests running side by side never meet
    (decision 024)."""
    for _ in range(50):
        address = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except PermissionError:
                unavailable(f"binding port {port} needs root (or CAP_NET_BIND_SERVICE)")
            except OSError:
                continue
            return address
    raise AssertionError(f"no free loopback address for port {port} in 50 tries")


@asynccontextmanager
async def serving(app: WaldurStandIn, port: int) -> AsyncIterator[None]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the stand-in did not start"
        await asyncio.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@dataclass(frozen=True)
class Certificate:
    """A test CA's certificate for `name`: what the site serves and what the agent trusts."""

    name: str
    chain: Path  # the server's certificate chain (nginx ssl_certificate)
    key: Path  # its private key (nginx ssl_certificate_key)
    ca: Path  # the CA's certificate (the agent's SSL_CERT_FILE)


def certificate_for(name: str, directory: Path) -> Certificate:
    ca = trustme.CA(organization_name="queuekeeper test CA")
    issued = ca.issue_cert(name)
    directory.mkdir(parents=True, exist_ok=True)
    chain, key, ca_file = directory / "site.pem", directory / "site.key", directory / "ca.pem"
    issued.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    ca.cert_pem.write_to_path(str(ca_file))
    return Certificate(name, chain, key, ca_file)


@contextmanager
def nginx(site: str, workdir: Path, address: tuple[str, int]) -> Iterator[Path]:
    """nginx in the foreground with this site, once it listens on `address`; yields its
    access log."""
    binary = require("nginx")
    workdir.mkdir()
    (workdir / "site.conf").write_text(site)
    access = workdir / "access.log"
    temp = "\n".join(f"    {kind}_temp_path {workdir / kind};" for kind in ("client_body", "proxy"))
    (workdir / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"worker_processes 1;\npid {workdir / 'nginx.pid'};\n"
        f"error_log {workdir / 'error.log'} info;\nevents {{}}\nhttp {{\n"
        f"    access_log {access};\n{temp}\n    include {workdir / 'site.conf'};\n}}\n"
    )
    process = subprocess.Popen(
        [binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            with socket.socket() as probe:
                if probe.connect_ex(address) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not listen within 20 s"
            time.sleep(0.1)
        yield access
    finally:
        process.terminate()
        process.wait(timeout=20)
