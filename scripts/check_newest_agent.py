"""`make check-newest-agent`: the end-to-end matrix test against the newest waldur-site-agent
on PyPI, pre-releases included, whatever tests/agents/releases.py lists.

Asks pip which version is newest (`pip index versions --pre`), then runs
tests/agents/test_agent_matrix.py with `QK_AGENT_VERSION=<it>`: the agent is installed
into its own cached virtualenv (tests/agents/site_agent_venv.py says where) and runs
unchanged but for its message handlers. Prints the version tried, the waldur-api-client it pins (the
client that parsed queuekeeper's answers in that run) and the verdict; exits non-zero when
the agent does not set up, receive every type it subscribes to once, and restart cleanly.
Run it before every upgrade of queuekeeper and whenever an agent is released
(docs/agents.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.agents.site_agent_venv import venv_path  # noqa: E402 - the checkout, just put on the path

PACKAGE = "waldur-site-agent"


def newest_version() -> str:
    found = subprocess.run(  # noqa: S603 - our own interpreter, fixed arguments
        [sys.executable, "-m", "pip", "index", "versions", "--pre", PACKAGE],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    match = re.search(rf"^{re.escape(PACKAGE)} \(([^)]+)\)", found.stdout, re.MULTILINE)
    if found.returncode != 0 or match is None:
        sys.exit(f"could not ask PyPI for {PACKAGE}'s versions:\n{found.stdout}{found.stderr}")
    return match.group(1)


def pinned_client(version: str) -> str:
    """The waldur-api-client version installed beside the agent in its virtualenv."""
    python = venv_path(version) / "bin" / "python"
    if not python.exists():
        return "unknown (the agent's virtualenv was not built)"
    found = subprocess.run(  # noqa: S603 - the agent's own interpreter, fixed arguments
        [
            str(python),
            "-c",
            "from importlib.metadata import version; print(version('waldur-api-client'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return found.stdout.strip() or f"unknown ({found.stderr.strip()[-200:]})"


def main() -> int:
    asked = os.environ.get("QK_AGENT_VERSION")
    version = asked or newest_version()
    why = "as QK_AGENT_VERSION asks" if asked else "newest on PyPI, pre-releases included"
    print(f"check-newest-agent: trying {PACKAGE} {version} ({why})", flush=True)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:logging",
            "tests/agents/test_agent_matrix.py",
        ],
        cwd=ROOT,
        env={**os.environ, "QK_AGENT_VERSION": version},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = (run.stdout + run.stderr).splitlines()
    findings = [
        line
        for line in lines
        if line.startswith(("waldur-site-agent ", f"{version} subscribes", "FAILED", "ERROR", "E "))
        or re.search(r"\d+ (passed|failed)", line)
    ]
    print("\n".join(findings))
    print(f"check-newest-agent: with waldur-api-client {pinned_client(version)} (the agent's pin)")
    if run.returncode == 0:
        print(
            f"check-newest-agent: {PACKAGE} {version}: COMPATIBLE (sets up, receives every "
            "type it subscribes to once, restarts without changes, acks as expected)"
        )
    else:
        print("\n".join(lines[-80:]))
        print(
            f"check-newest-agent: {PACKAGE} {version}: NOT COMPATIBLE (see the failures "
            "above; the agent's log is in the failing assertion)"
        )
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
