"""The container image, built and run on this machine: podman/buildah, no registry, no
network during the build.

The base is made here (debootstrap of Debian bookworm minbase with python3 and
python3-venv: Python 3.11, like the official `python:3.11-slim` the Dockerfile uses by
default) and passed as `BASE_IMAGE`; dependencies come from a wheelhouse built on the host.
The image then runs as its non-root user against the local PostgreSQL and RabbitMQ (host
network): `queuekeeper migrate`, `serve`, `/readyz` 200, an agent registers a subscription and
a queue and receives an event over STOMP, the image's HEALTHCHECK answers, and SIGTERM stops
it cleanly. The base image, the wheelhouse and the build's layers are kept under
QK_CONTAINERS_DIR (default /var/tmp/queuekeeper-containers, with `-<uid>` for a user other than
root), so a repeat run only builds the
image itself (about 1.5 min here). Skipped, saying why, where containers cannot run or for a
user other than root (debootstrap needs root); under `make test` as root it must run.

`make test` runs this once (`make test-image`, beside the suite); the suite's pass leaves it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from queuekeeper.config import Settings
from tests.conftest import PG_ADMIN_DSN, _remove_broker_objects, pg_admin
from tests.ops.tools import require, unavailable
from tests.stomp_client import StompConsumer

pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
# Per user: root's kept storage is not another user's to write.
CACHE = Path(
    os.environ.get(
        "QK_CONTAINERS_DIR",
        "/var/tmp/queuekeeper-containers" + ("" if os.geteuid() == 0 else f"-{os.geteuid()}"),
    )
)
SUITE = "bookworm"
MIRROR = os.environ.get("QK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = "python3,python3-venv,passwd"
IMAGE = "localhost/queuekeeper:test"
SERVICE_TOKEN = "image-test-service-token-0123456789"
AGENT_TOKEN = "image-test-agent-token-0123456789"

CONTAINERS_CONF = """\
# podman/buildah settings that work on this kind of machine (hybrid cgroups, no systemd):
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
"""


def log(message: str) -> None:
    print(f"[image] {message}", file=sys.stderr, flush=True)


def run(
    *argv: str, check: bool = True, timeout: float = 900, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-5000:]}"
            f"\n{result.stderr[-5000:]}"
        )
    return result  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def podman() -> str:
    """podman (and buildah) configured for this machine, in a storage of their own."""
    if os.geteuid() != 0:
        unavailable("the image test builds its base with debootstrap, which needs root")
    for tool in ("buildah", "runc", "debootstrap"):
        require(tool)
    podman = require("podman")
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    storage = CACHE / "storage.conf"
    storage.write_text(
        f'[storage]\ndriver = "vfs"\nrunroot = "{CACHE}/run"\ngraphroot = "{CACHE}/storage"\n'
    )
    os.environ["CONTAINERS_CONF"] = str(conf)
    os.environ["CONTAINERS_STORAGE_CONF"] = str(storage)
    info = run(podman, "info", "--format", "json", check=False, timeout=120)
    if info.returncode != 0:
        unavailable(f"containers cannot run here (`podman info` failed): {info.stderr.strip()}")
    return podman


def base_image(podman: str) -> str:
    """A Debian bookworm base with Python 3.11, made by debootstrap once and kept."""
    key = hashlib.sha256(f"{SUITE} minbase {BASE_PACKAGES} {MIRROR}".encode()).hexdigest()[:12]
    tag = f"localhost/queuekeeper-test-base:{SUITE}-{key}"
    if run(podman, "image", "exists", tag, check=False).returncode == 0:
        log(f"base image {tag} (kept from an earlier run)")
        return tag
    rootfs = CACHE / f"rootfs-{key}"
    shutil.rmtree(rootfs, ignore_errors=True)
    started = time.monotonic()
    run(
        "debootstrap",
        "--variant=minbase",
        f"--include={BASE_PACKAGES}",
        SUITE,
        str(rootfs),
        MIRROR,
        timeout=1200,
    )
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_file():
                path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    run(podman, "import", "-", tag, stdin=tar.stdout)
    assert tar.wait() == 0
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"base image {tag} made by debootstrap in {time.monotonic() - started:.0f} s")
    return tag


def wheelhouse() -> Path:
    """Wheels of every runtime dependency (and the build backend), built on the host."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = sorted(
        [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    )
    key = hashlib.sha256(json.dumps([requirements, sys.version_info[:2]]).encode()).hexdigest()[:12]
    directory = CACHE / f"wheelhouse-{key}"
    if (directory / ".complete").exists():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(directory),
        *requirements)  # fmt: skip
    (directory / ".complete").touch()
    return directory


def build_image(podman: str) -> str:
    with FileLock(str(CACHE / "build.lock")):
        base = base_image(podman)
        wheels = wheelhouse()
        context = CACHE / "context"
        shutil.rmtree(context, ignore_errors=True)
        context.mkdir()
        for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, context / name)
        for name in ("src", "migrations"):
            shutil.copytree(
                ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        shutil.copytree(ROOT / "deploy" / "wheelhouse", context / "deploy" / "wheelhouse")
        for wheel in wheels.glob("*.whl"):
            shutil.copy2(wheel, context / "deploy" / "wheelhouse" / wheel.name)
        started = time.monotonic()
        run(
            "buildah", "bud",
            "--format", "docker",  # OCI images have no HEALTHCHECK
            "--isolation", "oci", "--runtime", "runc",
            "--network", "none",  # the build needs nothing from outside
            # One working container per stage: with the vfs driver a layer per step costs a
            # copy of the whole file system each, so a cached build was slower than this.
            "--layers=false",
            "--tag", IMAGE,
            "--build-arg", f"BASE_IMAGE={base}",
            "--build-arg", "BUILD_PACKAGES=",
            "--build-arg", "PIP_INSTALL_OPTIONS=--no-index --find-links /build/wheelhouse",
            str(context),
            timeout=1200,
        )  # fmt: skip
        log(f"image built in {time.monotonic() - started:.0f} s")
        # The previous build's image, now untagged.
        run(podman, "image", "prune", "--force", check=False)
        return IMAGE


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_image_builds_runs_serves_an_agent_and_stops_cleanly(podman: str) -> None:
    image = build_image(podman)
    size = int(run(podman, "image", "inspect", "--format", "{{.Size}}", image).stdout)
    log(f"image size: {size / 1e6:.0f} MB ({image}, base {SUITE} minbase + virtualenv)")
    print(f"queuekeeper image size: {size / 1e6:.0f} MB")
    user = run(podman, "image", "inspect", "--format", "{{.Config.User}}", image).stdout
    assert user.strip() == "10001:10001"
    healthcheck = run(
        podman, "image", "inspect", "--format", "{{json .Config.Healthcheck}}", image
    ).stdout
    assert json.loads(healthcheck)["Test"] == ["CMD", "queuekeeper", "healthcheck"]

    database = f"qk_image_{uuid.uuid4().hex[:12]}"
    instance = f"qki-{uuid.uuid4().hex[:10]}"
    name = f"queuekeeper-image-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        "QUEUEKEEPER_DATABASE_URL": f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{database}",
        "QUEUEKEEPER_INSTANCE_NAME": instance,
        "QUEUEKEEPER_SERVICE_TOKENS": SERVICE_TOKEN,
        "QUEUEKEEPER_HOST": "127.0.0.1",
        "QUEUEKEEPER_PORT": str(port),
        "QUEUEKEEPER_PUBLIC_URL": base_url,
        "QUEUEKEEPER_SCHEDULER_ENABLED": "false",
    }
    env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    asyncio.run(pg_admin(f'CREATE DATABASE "{database}"'))
    try:
        started = time.monotonic()
        migrate = run(podman, "run", "--rm", "--network", "host", *env_args, image,
                      "queuekeeper", "migrate", timeout=300)  # fmt: skip
        log(f"queuekeeper migrate in the image: {time.monotonic() - started:.1f} s")
        assert migrate.returncode == 0
        run(podman, "run", "--detach", "--name", name, "--network", "host", *env_args, image)
        try:
            _serve_an_agent(podman, name, base_url)
        finally:
            run(podman, "rm", "--force", "--time", "0", name, check=False)
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        asyncio.run(_remove_broker_objects(Settings(instance_name=instance)))


def _serve_an_agent(podman: str, name: str, base_url: str) -> None:
    started = time.monotonic()
    deadline = started + 90
    with httpx.Client(base_url=base_url, timeout=15) as http:
        while True:
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            state = run(podman, "inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", run(podman, "logs", name, check=False).stderr[-5000:]
            assert time.monotonic() < deadline, "the container never became ready"
            time.sleep(0.5)
        log(f"serve: /readyz 200 after {time.monotonic() - started:.1f} s")
        uid = run(podman, "exec", name, "id", "-u").stdout.strip()
        assert uid == "10001"

        service = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
        user, offering = uuid.uuid4(), uuid.uuid4()
        for path, body in [
            (f"/api/internal/users/{user.hex}/", {"username": "site-agent", "token": AGENT_TOKEN}),
            (f"/api/internal/offerings/{offering.hex}/", {"name": "HPC"}),
            (f"/api/internal/offerings/{offering.hex}/users/{user.hex}/", None),
        ]:
            response = http.put(path, json=body, headers=service)
            assert response.status_code in (200, 201), response.text
        agent = {"Authorization": f"Token {AGENT_TOKEN}"}
        subscription = http.post("/api/event-subscriptions/", json={}, headers=agent)
        assert subscription.status_code == 201, subscription.text
        sub_uuid = subscription.json()["uuid"]
        queue = http.post(
            f"/api/event-subscriptions/{sub_uuid}/create_queue/",
            json={"offering_uuid": offering.hex, "object_type": "order"},
            headers=agent,
        )
        assert queue.status_code == 201, queue.text
        consumer = StompConsumer(vhost=user.hex, login=sub_uuid, passcode=AGENT_TOKEN)
        consumer.connect()
        try:
            consumer.subscribe(f"/amq/queue/{queue.json()['queue_name']}")
            order = uuid.uuid4().hex
            event = http.post(
                "/api/internal/events/?wait=true",
                json={
                    "offering_uuid": offering.hex,
                    "object_type": "order",
                    "payload": {"order_uuid": order, "order_state": "executing"},
                },
                headers=service,
            )
            assert event.status_code == 200, event.text
            assert [d["state"] for d in event.json()["deliveries"]] == ["published"]
            messages = consumer.wait_for(1, timeout=20)
            assert messages, "the agent received nothing over STOMP"
            assert order in messages[0].body
        finally:
            consumer.close()
        log("agent: subscription, queue, event received over STOMP")

    health = run(podman, "healthcheck", "run", name, check=False)
    if health.returncode != 0 and "systemd" in health.stderr:
        health = run(podman, "exec", name, "queuekeeper", "healthcheck", check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    log(f"HEALTHCHECK: {(health.stdout.strip() or 'healthy')}")

    started = time.monotonic()
    run(podman, "stop", "--time", "30", name, timeout=60)
    stopped_in = time.monotonic() - started
    exit_code = run(podman, "inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
    logs = run(podman, "logs", name).stdout + run(podman, "logs", name).stderr
    assert exit_code == "0", logs[-5000:]
    assert stopped_in < 25, f"SIGTERM took {stopped_in:.1f} s: killed, not stopped"
    assert "queuekeeper_stopped" in logs
    log(f"SIGTERM: exited 0 in {stopped_in:.1f} s")
