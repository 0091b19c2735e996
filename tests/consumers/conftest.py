"""Fixtures for the consumer tests."""

from __future__ import annotations

import pytest

from queuekeeper.config import Settings


@pytest.fixture
def settings(settings: Settings, request: pytest.FixtureRequest) -> Settings:
    """`@pytest.mark.settings(relay_enabled=False, ...)` changes fields for one test."""
    marker = request.node.get_closest_marker("settings")
    if marker is None:
        return settings
    return settings.model_copy(update=marker.kwargs)
