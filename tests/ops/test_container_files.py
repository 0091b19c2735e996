"""Dockerfile, compose.yaml and .env.example, checked without a Docker engine: the compose
file against the Compose Specification schema, every name against the code it refers to,
the Dockerfile with hadolint and by its structure, and the installed package it ships."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import typer
import yaml
from dockerfile_parse import DockerfileParser

from queuekeeper.cli import app as cli_app
from queuekeeper.config import Settings
from queuekeeper.config_reference import all_env_names
from tests.brokers import BROKER
from tests.conftest import pg_rows

ROOT = Path(__file__).resolve().parents[2]
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}")
ENV_LINE = re.compile(r"^\s*#?\s*(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return document


def compose_schema() -> dict[str, Any]:
    # The Compose Specification's JSON schema, as vendored by check-jsonschema.
    path = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return schema


def env_example() -> dict[str, str]:
    """Every variable of .env.example, including the commented-out optional ones."""
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        match = ENV_LINE.match(line)
        if match:
            values[match["name"]] = match["value"].strip()
    return values


def active_env_example() -> dict[str, str]:
    return {
        key: value
        for key, value in env_example().items()
        if any(
            line.startswith(f"{key}=") for line in (ROOT / ".env.example").read_text().splitlines()
        )
    }


def interpolate(value: str, variables: dict[str, str]) -> str:
    return INTERPOLATION.sub(lambda m: variables.get(m["name"]) or (m["default"] or ""), value)


def cli_commands() -> set[str]:
    commands: dict[str, Any] = typer.main.get_command(cli_app).commands  # type: ignore[attr-defined]
    return set(commands)


def console_scripts() -> dict[str, str]:
    scripts: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    return scripts


# --- compose.yaml ---------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    errors = [f"{list(error.path)}: {error.message}" for error in validator.iter_errors(compose())]
    assert errors == []
    # The schema does reject mistakes (so the check above can fail).
    broken = compose()
    broken["services"]["queuekeeper"]["depends_on"]["migrate"]["condition"] = "finished"
    assert list(validator.iter_errors(broken))


def test_services_start_in_order_and_report_health() -> None:
    services = compose()["services"]
    assert set(services) == {"rabbitmq", "postgres", "migrate", "queuekeeper"}
    app = services["queuekeeper"]
    assert app["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "postgres": {"condition": "service_healthy"},
        "rabbitmq": {"condition": "service_healthy"},
    }
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["command"] == ["queuekeeper", "migrate"]
    assert services["migrate"]["restart"] == "no"
    assert app["command"] == ["queuekeeper", "serve"]
    for name in ("rabbitmq", "postgres", "queuekeeper"):
        assert services[name]["healthcheck"]["test"], name
    assert app["healthcheck"]["test"] == ["CMD", "queuekeeper", "healthcheck"]


def test_rabbitmq_has_the_plugins_and_ports_agents_need() -> None:
    document = compose()
    rabbitmq = document["services"]["rabbitmq"]
    published = {port.split(":")[-1] for port in rabbitmq["ports"]}
    assert {"5672", "15672", "61613", "15674"} <= published
    # The administrator's ports stay on loopback unless RABBITMQ_BIND says otherwise.
    for port in ("5672", "15672"):
        (entry,) = [item for item in rabbitmq["ports"] if item.endswith(f":{port}")]
        assert entry == f"${{RABBITMQ_BIND:-127.0.0.1}}:{port}:{port}", entry
    assert active_env_example()["RABBITMQ_BIND"] == "127.0.0.1"
    # The agents' plain listeners and queuekeeper only for the TLS proxy on the same host:
    # an agent's passcode is its API token.
    for entry in [*rabbitmq["ports"], *document["services"]["queuekeeper"]["ports"]]:
        if "RABBITMQ_BIND" not in entry:
            assert entry.startswith("127.0.0.1:"), entry
    # `guest` is never created: the default user is queuekeeper's administrator.
    assert rabbitmq["environment"]["RABBITMQ_DEFAULT_USER"] == "${RABBITMQ_USER:-queuekeeper}"
    assert active_env_example()["RABBITMQ_USER"] not in ("", "guest")
    assert "Compose 2.24" in (ROOT / "compose.yaml").read_text()
    (config,) = rabbitmq["configs"]
    assert config["target"] == "/etc/rabbitmq/enabled_plugins"
    plugins_file = ROOT / document["configs"][config["source"]]["file"]
    plugins = plugins_file.read_text().strip()
    assert plugins.endswith("].")
    assert set(plugins.strip("[].").split(",")) == {
        "rabbitmq_management",
        "rabbitmq_stomp",
        "rabbitmq_web_stomp",
        "rabbitmq_event_exchange",  # presence: consumers arriving and leaving
    }


async def test_compose_runs_the_rabbitmq_release_line_the_suite_runs() -> None:
    image = compose()["services"]["rabbitmq"]["image"]
    match = re.fullmatch(r"rabbitmq:(\d+\.\d+)(?:\.\d+)?-management", image)
    assert match, image
    async with httpx.AsyncClient(
        base_url=BROKER.management_url, auth=(BROKER.user, BROKER.password), timeout=10
    ) as management:
        overview = (await management.get("/api/overview")).json()
    running = ".".join(overview["rabbitmq_version"].split(".")[:2])
    assert match[1] == running, f"compose pins {image}; the suite runs RabbitMQ {running}"


def test_everything_compose_refers_to_exists() -> None:
    document = compose()
    declared_volumes = set(document.get("volumes") or {})
    for name, service in document["services"].items():
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert (context / "Dockerfile").is_file(), name
        for entry in service.get("env_file", []):
            path, required = (
                (entry, True)
                if isinstance(entry, str)
                else (
                    entry["path"],
                    entry.get("required", True),
                )
            )
            assert not required or (ROOT / path).is_file(), f"{name}: {path}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {source}"
            else:
                assert source in declared_volumes, f"{name}: volume {source} not declared"
        for dependency in service.get("depends_on", {}):
            assert dependency in document["services"], f"{name} depends on {dependency}"
    assert "postgres-data" in declared_volumes
    for config in (document.get("configs") or {}).values():
        assert (ROOT / config["file"]).is_file()


def test_environment_names_are_settings() -> None:
    known = all_env_names()
    compose_text = (ROOT / "compose.yaml").read_text()
    named_in_compose = set(re.findall(r"\bQUEUEKEEPER_[A-Z0-9_]+", compose_text))
    assert named_in_compose - known == set()
    example = env_example()
    queuekeeper_names = {name for name in example if name.startswith("QUEUEKEEPER_")}
    assert queuekeeper_names - known == set()
    # The others are compose's own variables: each must be used by compose.yaml.
    interpolated = {match["name"] for match in INTERPOLATION.finditer(compose_text)}
    assert set(example) - queuekeeper_names == interpolated


def test_compose_environment_makes_valid_settings_for_the_containers() -> None:
    variables = active_env_example()
    service = compose()["services"]["queuekeeper"]
    environment = {key: value for key, value in variables.items() if key.startswith("QUEUEKEEPER_")}
    environment.update(
        {key: interpolate(str(value), variables) for key, value in service["environment"].items()}
    )
    fields = {
        name: environment[f"QUEUEKEEPER_{name.upper()}"]
        for name in Settings.model_fields
        if f"QUEUEKEEPER_{name.upper()}" in environment
    }
    settings = Settings.model_validate(fields)
    assert settings.database_url == (
        "postgresql+asyncpg://queuekeeper:queuekeeper@postgres:5432/queuekeeper"
    )
    assert settings.amqp_url == "amqp://queuekeeper:queuekeeper@rabbitmq:5672/"
    assert settings.management_url == "http://rabbitmq:15672"
    assert settings.management_password == variables["RABBITMQ_PASSWORD"]
    assert settings.service_tokens
    rabbitmq_env = compose()["services"]["rabbitmq"]["environment"]
    assert interpolate(rabbitmq_env["RABBITMQ_DEFAULT_USER"], variables) == settings.management_user


# --- Dockerfile -------------------------------------------------------------------------


def dockerfile() -> list[dict[str, Any]]:
    structure: list[dict[str, Any]] = DockerfileParser(path=str(ROOT / "Dockerfile")).structure
    return [item for item in structure if item["instruction"] != "COMMENT"]


def stages() -> list[list[dict[str, Any]]]:
    result: list[list[dict[str, Any]]] = []
    for item in dockerfile():
        if item["instruction"] == "FROM":
            result.append([])
        if result:
            result[-1].append(item)
    return result


def test_dockerfile_is_multi_stage_with_a_clean_slim_runtime() -> None:
    build, runtime = stages()
    # Both stages start from BASE_IMAGE, which users leave at the official slim image (the
    # image test passes a local Debian base instead, as no registry is reachable there).
    (base,) = [
        item["value"]
        for item in dockerfile()
        if item["instruction"] == "ARG" and item["value"].startswith("BASE_IMAGE=")
    ]
    assert re.fullmatch(r"BASE_IMAGE=python:3\.11-slim", base)
    assert build[0]["value"] == "${BASE_IMAGE} AS build"
    assert runtime[0]["value"] == "${BASE_IMAGE} AS runtime"
    runtime_text = " ".join(item["value"] for item in runtime)
    for tool in ("gcc", "build-essential", "apt-get install", "libc6-dev"):
        assert tool not in runtime_text
    copies = [item["value"] for item in runtime if item["instruction"] == "COPY"]
    assert copies == ["--from=build /opt/queuekeeper /opt/queuekeeper"]


def test_dockerfile_runs_as_non_root_with_real_commands() -> None:
    runtime = stages()[-1]
    (user,) = [item["value"] for item in runtime if item["instruction"] == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    (command,) = [item["value"] for item in runtime if item["instruction"] == "CMD"]
    (healthcheck,) = [item["value"] for item in runtime if item["instruction"] == "HEALTHCHECK"]
    health_command = json.loads(healthcheck.split("CMD", 1)[1])
    for argv in (json.loads(command), health_command):
        assert argv[0] in console_scripts()
        assert argv[1] in cli_commands(), argv
    assert json.loads(command) == ["queuekeeper", "serve"]
    env = " ".join(item["value"] for item in runtime if item["instruction"] == "ENV")
    assert "QUEUEKEEPER_HOST=0.0.0.0" in env


def test_dockerfile_copies_only_what_exists_and_is_not_ignored() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for stage in stages():
        for item in stage:
            if item["instruction"] != "COPY" or item["value"].startswith("--from"):
                continue
            *sources, _destination = item["value"].split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source not in ignored, source
    for must_ignore in (".venv", ".git", ".env", "tests"):
        assert must_ignore in ignored


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- what the image installs -------------------------------------------------------------


@pytest.fixture(scope="module")
def installed_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as `pip install .` puts it in the image (a wheel, not the checkout)."""
    from hatchling.build import build_wheel

    dist = tmp_path_factory.mktemp("dist")
    target = tmp_path_factory.mktemp("site")
    cwd = Path.cwd()
    os.chdir(ROOT)
    try:
        wheel = build_wheel(str(dist))
    finally:
        os.chdir(cwd)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(dist / wheel),
        ],
        check=True,
    )
    return target


def test_installed_package_migrates_without_the_source_tree(
    installed_copy: Path, tmp_path: Path, empty_database: str
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(installed_copy),
        "QUEUEKEEPER_DATABASE_URL": empty_database,
    }
    script = (
        "import queuekeeper, sys; print(queuekeeper.__file__, file=sys.stderr); "
        "from queuekeeper.cli import app; app(['migrate'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert str(installed_copy) in result.stderr  # the wheel's copy ran, not the checkout
    tables = {row[0] for row in pg_rows(empty_database, "SELECT tablename FROM pg_tables")}
    assert {"users", "event_subscription_queues", "deliveries", "alembic_version"} <= tables
