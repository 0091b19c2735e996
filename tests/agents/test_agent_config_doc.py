"""docs/agents.md's agent installation and "Configuration that works", checked against the
published agent and its slurm plugin: the install line names the release the suite runs,
and the configuration loads with the agent's own loader, the plugin's schema finding
nothing missing (the agent only logs what that schema refuses, then fails later)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.agents.releases import RELEASES
from tests.agents.site_agent_venv import BUILD, ensure_venv
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


@pytest.mark.timeout(900)
def test_the_documented_configuration_passes_the_slurm_plugins_schema(tmp_path: Path) -> None:
    python = ensure_venv(
        BUILD / f"site-agent-slurm-venv-{NEWEST}",
        f"waldur-site-agent-slurm=={NEWEST}",
        f"waldur-site-agent=={NEWEST}",
    )
    config = tmp_path / "waldur-site-agent-config.yaml"
    config.write_text(documented("Configuration that works", "yaml"))
    done = subprocess.run(
        [str(python), "-c", LOAD, str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "slurm" in loaded["schemas"]  # the plugin's schema was there to check it
    assert loaded["warnings"] == []
    assert loaded["backend_settings"][0]["default_account"]
