"""A virtualenv holding the published waldur-site-agent, built once and cached.

The agent pins its dependencies (`pyyaml==6.0.1`, `sentry-sdk==2.8.0`,
`waldur-api-client==…`), which must not meet ours, so it gets a virtualenv of
its own under the project's git-ignored `build/` folder. A marker file records
the installed version; a file lock keeps concurrent test runs from building it
twice at once. A fresh machine needs PyPI (or a configured mirror) once.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from filelock import FileLock

SITE_AGENT_VERSION = "1.0.5"
REQUIREMENT = f"waldur-site-agent=={SITE_AGENT_VERSION}"
ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
VENV = BUILD / f"site-agent-venv-{SITE_AGENT_VERSION}"
MARKER = VENV / ".queuekeeper-installed"
INSTALL_TIMEOUT = 600


def _python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def _ready() -> bool:
    return MARKER.is_file() and MARKER.read_text().strip() == REQUIREMENT and _python(VENV).exists()


def ensure_site_agent_venv() -> Path:
    """The python of a virtualenv with waldur-site-agent installed; builds it when missing."""
    if _ready():
        return _python(VENV)
    BUILD.mkdir(exist_ok=True)
    with FileLock(str(BUILD / f"site-agent-venv-{SITE_AGENT_VERSION}.lock"), timeout=900):
        if _ready():  # another run built it while we waited for the lock
            return _python(VENV)
        venv.EnvBuilder(clear=True, with_pip=True).create(VENV)
        result = subprocess.run(
            [str(_python(VENV)), "-m", "pip", "install", "--quiet", REQUIREMENT],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"could not install {REQUIREMENT} into {VENV} (needs PyPI once):\n"
                f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        MARKER.write_text(REQUIREMENT + "\n")
    return _python(VENV)
