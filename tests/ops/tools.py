"""External tools the operations tests use: found on PATH, or the test skips saying how to
get them (`make test` installs them first, with scripts/ensure-tools.sh, when root).

Under `make test` as root (CI), where the tools were just installed, `QK_REQUIRE_TOOLS=1`
turns that skip into a failure: CI never passes with an operations test silently skipped."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

PACKAGES = {
    "promtool": "prometheus",
    "chromium": "chromium",
    "podman": "podman",
    "buildah": "buildah",
    "runc": "runc",
    "debootstrap": "debootstrap",
    "nginx": "nginx-light",
}


def require(command: str) -> str:
    path = shutil.which(command) or shutil.which(command, path="/usr/sbin:/sbin")
    if path is None:
        package = PACKAGES.get(command, command)
        unavailable(
            f"{command} is not installed: run `bash scripts/ensure-tools.sh` as root "
            f"(or `apt-get install {package}`); `make test` does"
        )
    return path


def unavailable(reason: str) -> NoReturn:
    """Skip for lack of a tool or a capability of the machine; fail instead where the tools
    are required (`QK_REQUIRE_TOOLS=1`, set by `make test` when it runs as root)."""
    if os.environ.get("QK_REQUIRE_TOOLS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
