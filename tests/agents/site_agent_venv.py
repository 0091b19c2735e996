"""Virtualenvs holding the published waldur-site-agent releases, built once and cached.

The agent pins its dependencies (`pyyaml==6.0.1`, `sentry-sdk==2.8.0`,
`waldur-api-client==…`), which must not meet ours, so each release gets a
virtualenv of its own in the user's cache, outside the checkout
(`~/.cache/queuekeeper/agent-venvs/site-agent-venv-<version>`; QK_AGENT_VENVS_DIR
names another folder), so a fresh clone reuses what an earlier one built, as the image
test keeps its base image (tests/ops/test_image.py). A marker file records the installed
version; a file lock per release keeps concurrent test runs from building it twice at
once. A fresh machine needs PyPI (or a configured mirror) once.

A build is the suite's pip installing into a virtualenv made without pip of its own
(ensurepip cost ~8 s of CPU a virtualenv). An agent's is byte-compiled, as pip does by
default: the agent imports all of waldur-api-client's ~5,600 modules at start, and
compiling them then would slow its first start past what the tests wait for on a busy
machine. A client's alone is not: its scripts import a few dozen modules
(tests/agents/test_api_clients.py), compiled on first import, so its build costs ~6 s of
CPU, not ~29.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import venv
from pathlib import Path

from filelock import FileLock

# 1.0.5: one subscription and queue per object type. 1.0.7: one register_queue call
# and one queue per offering (there is no 1.0.6 on PyPI).
LEGACY_VERSION = "1.0.5"
UNIFIED_VERSION = "1.0.7"
BUILD = Path(
    os.environ.get("QK_AGENT_VENVS_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "queuekeeper"
    / "agent-venvs"
)
INSTALL_TIMEOUT = 600


def _python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def venv_path(version: str) -> Path:
    return BUILD / f"site-agent-venv-{version}"


def _ready(path: Path, requirement: str) -> bool:
    marker = path / ".queuekeeper-installed"
    return marker.is_file() and marker.read_text().strip() == requirement and _python(path).exists()


def ensure_venv(path: Path, requirement: str, *pip_options: str) -> Path:
    """The python of a virtualenv at `path` holding `requirement`, installed with
    `pip_options`; builds it when missing."""
    if _ready(path, requirement):
        return _python(path)
    BUILD.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_name(path.name + ".lock")), timeout=900):
        if _ready(path, requirement):  # another run built it while we waited for the lock
            return _python(path)
        venv.EnvBuilder(clear=True, with_pip=False).create(path)
        install = ["install", "--quiet", *pip_options, requirement]
        result = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(_python(path)), *install],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"could not install {requirement} into {path} (needs PyPI once):\n"
                f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        (path / ".queuekeeper-installed").write_text(requirement + "\n")
    return _python(path)


def ensure_site_agent_venv(version: str = LEGACY_VERSION) -> Path:
    """The python of a virtualenv with waldur-site-agent `version`; builds it when missing."""
    return ensure_venv(venv_path(version), f"waldur-site-agent=={version}")


def ensure_api_client_venv(version: str) -> Path:
    """The python of a virtualenv with waldur-api-client `version` alone (a client line no
    published agent pins exactly, e.g. 8.1.3 final beside 1.0.8rc12's 8.1.3rc23)."""
    path = BUILD / f"api-client-venv-{version}"
    return ensure_venv(path, f"waldur-api-client=={version}", "--no-compile")


# The newest waldur-api-client build on the package index, pre-releases included, asked once
# a day: the answer is kept with the virtualenvs, and the last one known stands
# when the index cannot be reached.
NEWEST_CLIENT_FILE = BUILD / "newest-waldur-api-client.txt"
NEWEST_CLIENT_MAX_AGE = 24 * 3600.0


def newest_api_client() -> str:
    """The newest waldur-api-client version on the package index (`pip index versions
    --pre`), cached for a day beside the virtualenvs."""
    cached = NEWEST_CLIENT_FILE.read_text().strip() if NEWEST_CLIENT_FILE.is_file() else ""
    if cached and time.time() - NEWEST_CLIENT_FILE.stat().st_mtime < NEWEST_CLIENT_MAX_AGE:
        return cached
    found = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "--pre", "waldur-api-client"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    match = re.search(r"^waldur-api-client \(([^)]+)\)", found.stdout, re.MULTILINE)
    if found.returncode != 0 or match is None:
        if cached:
            return cached
        raise RuntimeError(
            f"could not ask the package index for waldur-api-client's versions:\n"
            f"{found.stdout[-2000:]}{found.stderr[-2000:]}"
        )
    BUILD.mkdir(parents=True, exist_ok=True)
    NEWEST_CLIENT_FILE.write_text(match.group(1) + "\n")
    return match.group(1)


if __name__ == "__main__":  # python -m tests.agents.site_agent_venv 1.0.7
    print(ensure_site_agent_venv(*sys.argv[1:2]))
