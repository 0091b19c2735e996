"""External tools the operations tests use: found on PATH, or the test skips saying how to
get them (`make test` installs them first, with scripts/ensure-tools.sh, when root)."""

from __future__ import annotations

import shutil

import pytest

PACKAGES = {
    "promtool": "prometheus",
    "chromium": "chromium",
    "podman": "podman",
    "buildah": "buildah",
    "runc": "runc",
    "debootstrap": "debootstrap",
}


def require(command: str) -> str:
    path = shutil.which(command) or shutil.which(command, path="/usr/sbin:/sbin")
    if path is None:
        package = PACKAGES.get(command, command)
        pytest.skip(
            f"{command} is not installed: run `bash scripts/ensure-tools.sh` as root "
            f"(or `apt-get install {package}`); `make test` does"
        )
    return path
