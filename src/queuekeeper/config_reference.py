"""The configuration reference, generated from `Settings`, so the docs cannot drift from it.

`queuekeeper settings-table --write README.md --write docs/reference/settings.md` rewrites the
tables between the `<!-- settings-table:start -->` and `<!-- settings-table:end -->`
markers; a test fails when a committed table differs from what this module generates.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dotenv import dotenv_values
from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from queuekeeper.config import Settings

START_MARKER = "<!-- settings-table:start -->"
END_MARKER = "<!-- settings-table:end -->"
ENV_PREFIX = "QUEUEKEEPER_"


@dataclass(frozen=True)
class SettingDoc:
    name: str
    env: list[str]
    default: str
    description: str


def env_names(name: str, field: FieldInfo) -> list[str]:
    """Every environment variable that sets this field, the canonical one first."""
    names = [f"{ENV_PREFIX}{name.upper()}"]
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        for choice in alias.choices:
            if isinstance(choice, str) and choice.isupper() and choice not in names:
                names.append(choice)
    return names


def all_env_names() -> set[str]:
    return {env for name, field in Settings.model_fields.items() for env in env_names(name, field)}


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None:
        return "(unset)"
    if value == [] or value == "":
        return "(empty)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    return str(value) if not isinstance(value, dict) else json.dumps(value)


def settings_docs() -> list[SettingDoc]:
    return [
        SettingDoc(
            name=name,
            env=env_names(name, field),
            default=_default(field),
            description=(field.description or "").strip(),
        )
        for name, field in Settings.model_fields.items()
    ]


def undocumented_settings() -> list[str]:
    return [doc.name for doc in settings_docs() if not doc.description]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table() -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for doc in settings_docs():
        variables = " or ".join(f"`{env}`" for env in doc.env)
        lines.append(f"| {variables} | `{_cell(doc.default)}` | {_cell(doc.description)} |")
    return "\n".join(lines) + "\n"


def embedded_table(text: str) -> str | None:
    """The table between the markers of a document, or None without markers."""
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        return None
    return text[start + len(START_MARKER) : end].strip("\n") + "\n"


def with_table(text: str, table: str | None = None) -> str:
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"no {START_MARKER} … {END_MARKER} markers")
    table = render_table() if table is None else table
    return text[: start + len(START_MARKER)] + "\n" + table + text[end:]


def write_table(path: Path) -> bool:
    """Rewrite the table in `path`; True when the file changed."""
    text = path.read_text(encoding="utf-8")
    updated = with_table(text)
    if updated == text:
        return False
    path.write_text(updated, encoding="utf-8")
    return True


@dataclass(frozen=True)
class UnknownSetting:
    """A `QUEUEKEEPER_*` variable that is not a setting, and the closest setting's name."""

    name: str
    closest: str | None

    @property
    def detail(self) -> str:
        return f"{self.name} is not a queuekeeper setting and is ignored" + (
            f"; did you mean {self.closest}?" if self.closest else ""
        )


def unknown_in_environment() -> list[UnknownSetting]:
    """The unknown `QUEUEKEEPER_*` variables of the environment and of the .env file the
    settings also read: what `serve` logs and `settings` prints at start."""
    environment = {**dotenv_values(".env"), **os.environ}
    return [UnknownSetting(name, closest) for name, closest in unknown_settings(environment)]


def unknown_settings(environ: Mapping[str, str | None]) -> list[tuple[str, str | None]]:
    """`QUEUEKEEPER_*` variables that are not settings (a typo is silently ignored by the
    settings loader), each with the closest setting's name when one is close."""
    known = sorted(name for name in all_env_names() if name.startswith(ENV_PREFIX))
    found = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            # Compared without the prefix, which every name shares.
            suffixes = [candidate.removeprefix(ENV_PREFIX) for candidate in known]
            suffix = name.removeprefix(ENV_PREFIX)
            close = difflib.get_close_matches(suffix, suffixes, n=1, cutoff=0.6)
            if not close:  # a prefix of a setting (QUEUEKEEPER_INSTANCE for _INSTANCE_NAME)
                close = [candidate for candidate in suffixes if candidate.startswith(suffix)][:1]
            found.append((name, ENV_PREFIX + close[0] if close else None))
    return found
