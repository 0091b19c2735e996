"""docs/agents.md's agent installation and "Configuration that works", checked against the
published agent and its slurm plugin: the install line names the release the suite runs,
and the configuration loads with the agent's own loader, the plugin's schema finding
nothing missing (the agent only logs what that schema refuses, then fails later)."""

from __future__ import annotations

import re

from tests.agents.releases import RELEASES
from tests.conftest import ROOT

NEWEST = RELEASES[-1].version
# Agent and plugin at the same version: the plugin requires `waldur-site-agent>=` its own.
PACKAGES = ("waldur-site-agent", "waldur-site-agent-slurm")
LOAD = """
import json, logging, sys
from waldur_site_agent.common import plugin_schemas, utils
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger().addHandler(Keep())
configuration = utils.load_configuration(sys.argv[1])
print(json.dumps({
    "schemas": sorted(plugin_schemas.get_plugin_backend_settings_schemas()),
    "backend_settings": [o.backend_settings for o in configuration.waldur_offerings],
    "warnings": warnings,
}))
"""


def documented(heading: str, language: str) -> str:
    """The first `language` block after `heading` in the docs (whichever page holds it)."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text()
        found = re.search(
            rf"^#+ {re.escape(heading)}\n.*?^```{language}\n(?P<block>.*?)^```",
            text,
            re.M | re.S,
        )
        if found:
            return found["block"]
    raise AssertionError(f"no {language} block after a '{heading}' heading in docs/")


def test_the_install_line_pins_the_release_the_suite_runs() -> None:
    install = documented("Installing and starting the agent", "console")
    (line,) = [line for line in install.splitlines() if "pip install" in line]
    pinned = dict(re.findall(r"'?([a-z-]+)==([^' ]+)'?", line))
    assert pinned == dict.fromkeys(PACKAGES, NEWEST), line
