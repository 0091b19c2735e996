"""`compatibility` of an agent identity: its reported version against the configured minimum.

waldur-api-client 8.1.3 (pinned by waldur-site-agent 1.0.8) refuses an identity answer
without this object; older clients ignore it (contract §10).
"""

from __future__ import annotations

from typing import Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, Field

CompatibilityStatus = Literal["compatible", "incompatible", "unknown"]


class Compatibility(BaseModel):
    """waldur-api-client 8.1.3's `AgentCompatibility`."""

    status: CompatibilityStatus = Field(
        description="`compatible`: the reported version is at least the minimum; "
        "`incompatible`: it is lower; `unknown`: none reported or not a version."
    )
    message: str = Field(description="What it means and what to do, for a person.")
    minimum_required: str = Field(description="The minimum agent version this server accepts.")


def assess(version: str | None, minimum: str) -> Compatibility:
    """Compare `version` (as the agent reported it) with `minimum` (PEP 440, pre-releases
    ordered before their release: 1.0.8rc12 < 1.0.8)."""
    reported = (version or "").strip()
    if not reported:
        return Compatibility(
            status="unknown",
            message="The agent reported no version. Run waldur-site-agent "
            f"{minimum} or later and restart it, so its version is registered.",
            minimum_required=minimum,
        )
    try:
        parsed = Version(reported)
    except InvalidVersion:
        return Compatibility(
            status="unknown",
            message=f"The reported version {reported!r} is not a version number; "
            f"waldur-site-agent {minimum} or later is supported.",
            minimum_required=minimum,
        )
    if parsed < Version(minimum):
        return Compatibility(
            status="incompatible",
            message=f"waldur-site-agent {reported} is older than {minimum}, the oldest "
            f"version this server supports: upgrade the agent to {minimum} or later.",
            minimum_required=minimum,
        )
    return Compatibility(
        status="compatible",
        message=f"waldur-site-agent {reported} is supported (minimum {minimum}).",
        minimum_required=minimum,
    )
