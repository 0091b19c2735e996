"""The docs cite only what exists: every file path (`events/outbox.py`, `tests/`, `jobs/`) and
every code name (`topology.queue_name`, `Outbox.store`, `jobs/runs.py:run_job`) that
README.md and docs/**/*.md put in backticks is found in the tree. Decision records are left
out: they tell what was decided when.

A span is a path when it looks like one (no spaces, no `<`, not starting with `/` or `.`)
and starts with a directory of the repository, the package or the docs, or is a `.py` or
`.md` file's name; a dotted name when its first part is a module or a class of
src/queuekeeper. Everything else (environment variables, shell commands, JSON fields, URLs,
broker names, other projects' files) is prose.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "queuekeeper"
DOCS = [
    ROOT / "README.md",
    *sorted(
        path
        for path in (ROOT / "docs").rglob("*.md")
        if (ROOT / "docs" / "decisions") not in path.parents
    ),
]
# Where a relative path in the docs may start: the repository, the package, the docs.
BASES = [ROOT, PACKAGE, ROOT / "docs"]
# A file named without its directory is looked for anywhere in the tree when it is one of these.
OWN_FILES = {".py", ".md"}

FENCE = re.compile(r"^\s*(```|~~~)")
SPAN = re.compile(r"(`+)(.+?)\1")
PATH = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/?")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every inline code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for match in SPAN.finditer(line):
                yield number, match.group(2).strip()


@dataclass
class Module:
    """What a module defines: its names, and for each class, its members."""

    names: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)


def _members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in ast.walk(node):
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        # Instance attributes: `self.name = ...` in a method.
        if (
            isinstance(item, ast.Attribute)
            and isinstance(item.value, ast.Name)
            and item.value.id == "self"
            and isinstance(item.ctx, ast.Store)
        ):
            members.add(item.attr)
    return members


def _module(path: Path) -> Module:
    module = Module()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like
            nodes: list[ast.stmt] = [*node.body, *node.orelse]
        else:
            nodes = [node]
        for item in nodes:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                module.names.add(item.name)
            elif isinstance(item, ast.ClassDef):
                module.names.add(item.name)
                module.classes[item.name] = _members(item)
            elif isinstance(item, ast.Assign):
                module.names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                module.names.add(item.target.id)
            elif isinstance(item, ast.Import | ast.ImportFrom):
                module.names.update((a.asname or a.name).split(".")[0] for a in item.names)
    return module


@cache
def modules() -> dict[str, Module]:
    """Every module by dotted name below queuekeeper (`broker.topology`), a package by its
    own (`broker`), the package itself as `queuekeeper`."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts) or "queuekeeper"] = _module(path)
    return found


def _heads(name: str) -> list[str]:
    """The modules a name's first part may mean: `topology` is broker.topology."""
    every = modules()
    return [key for key in every if key == name or key.endswith("." + name)]


def resolves(dotted: str) -> bool | None:
    """Whether a dotted name exists; None when it names nothing of queuekeeper's at all."""
    parts = dotted.split(".")
    if parts[0] == "queuekeeper":
        parts = parts[1:] or ["queuekeeper"]
    every = modules()
    # A module's dotted name: `broker.topology`, `topology`, `events.outbox.Outbox`.
    starts = [(key, 1) for key in _heads(parts[0])]
    for length in range(2, len(parts) + 1):
        if ".".join(parts[:length]) in every:
            starts.append((".".join(parts[:length]), length))
    # A class's name: `Outbox.store`.
    classes = [(key, parts[0]) for key, module in every.items() if parts[0] in module.classes]
    if not starts and not classes:
        return None
    for key, used in starts:
        rest = parts[used:]
        module = every[key]
        while rest and f"{key}.{rest[0]}" in every:  # `broker.topology` from `broker`
            key = f"{key}.{rest.pop(0)}"
            module = every[key]
        if not rest:
            return True
        if rest[0] in module.classes and (len(rest) == 1 or rest[1] in module.classes[rest[0]]):
            return True
        if rest[0] in module.names and rest[0] not in module.classes and len(rest) <= 2:
            return True  # a module-level object's attribute: not followed further
    return any(len(parts) == 1 or parts[1] in every[key].classes[name] for key, name in classes)


def path_exists(text: str, doc: Path) -> bool | None:
    """Whether a path exists; None when the span is not a path of ours: a path must start
    with a directory of the repository, the package or the docs (`waldur_mastermind/...`
    is the backend's, `event-consumers/register/` a URL's end), and a file name alone
    must be of code or docs (`rabbitmq.conf` is the broker's)."""
    if not PATH.fullmatch(text) or text.startswith("."):
        return None
    parts = text.rstrip("/").split("/")
    if len(parts) == 1 and not text.endswith("/"):
        if Path(text).suffix not in OWN_FILES:
            return None
        return text in tracked()
    if parts[0] not in directories():
        return None
    return any((base / text).exists() for base in [doc.parent, *BASES])


@cache
def directories() -> set[str]:
    return {path.name for base in BASES for path in base.iterdir() if path.is_dir()}


@cache
def tracked() -> dict[str, list[str]]:
    """Tracked files by their name."""
    listing = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    names: dict[str, list[str]] = {}
    for path in listing:
        names.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    return names


def citations() -> Iterator[tuple[str, str, str]]:
    """(where, what, why) for each citation that names nothing in the tree."""
    for doc in DOCS:
        where = doc.relative_to(ROOT)
        for number, span in spans(doc.read_text(encoding="utf-8")):
            text = re.sub(r"\(\)$", "", span)
            if ":" in text and not text.startswith(":"):  # `jobs/runs.py:run_job`
                file, _, name = text.partition(":")
                if Path(file).suffix == ".py" and name.isidentifier():
                    base = next((b / file for b in BASES if (b / file).exists()), None)
                    if base is None:
                        yield f"{where}:{number}", span, "no such file"
                    elif name not in _module(base).names:
                        yield f"{where}:{number}", span, f"{file} defines no {name}"
                    continue
            found = path_exists(text, doc)
            if found is False:
                yield f"{where}:{number}", span, "no such file or directory"
            if found is None and DOTTED.fullmatch(text) and resolves(text) is False:
                yield f"{where}:{number}", span, "no such module, class or name"


def test_every_path_and_code_name_the_docs_cite_exists() -> None:
    missing = list(citations())
    assert not missing, "the docs cite what is not in the tree:\n" + "\n".join(
        f"  {where}: `{what}` ({why})" for where, what, why in missing
    )


@pytest.mark.parametrize(
    ("span", "exists"),
    [
        ("broker/topology.py", True),
        ("broker/nowhere.py", False),
        ("jobs/", True),
        ("jobs/nowhere/", False),
        ("nowhere/", None),  # not a directory of ours: a URL's end, say
        ("tests/events/test_accept.py", True),
        ("text/plain", None),  # a media type
        ("outbox.py", True),
        ("outbox_nowhere.py", False),
        ("rabbitmq.conf", None),  # the broker's
        ("waldur_mastermind/marketplace/models.py", None),  # the backend's
        ("QUEUEKEEPER_DATABASE_URL", None),
    ],
)
def test_paths_are_told_from_prose(span: str, exists: bool | None) -> None:
    assert path_exists(span, ROOT / "docs" / "architecture.md") is exists


@pytest.mark.parametrize(
    ("name", "exists"),
    [
        ("topology.queue_name", True),
        ("topology.is_subscription_queue", False),
        ("broker.topology.queue_arguments", True),
        ("Outbox.store", True),
        ("Outbox.nothing", False),
        ("app.Runtime", True),
        ("db.read_one", True),
        ("amq.rabbitmq.event", None),  # the broker's exchange
        ("httpx.TransportError", None),
    ],
)
def test_dotted_names_resolve_against_the_package(name: str, exists: bool | None) -> None:
    assert resolves(name) is exists


def test_no_tracked_file_points_outside_the_repository() -> None:
    """A symbolic link to a path outside the checkout works on one machine only."""
    listing = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listing if line.startswith("120000")]
    outside = [link for link in links if not (ROOT / link).resolve().is_relative_to(ROOT.resolve())]
    assert not outside


# `docs/benchmarks.md, "What limits the goals"`: a section cited by its title. With `at
# <commit>` it is a past version's (a decision record's figures), not checked here.
SECTION = re.compile(r'([A-Za-z0-9_./-]+\.md)( at [0-9a-f]{7,40})?, "([^"]+)"')


def cited_sections() -> Iterator[tuple[str, str]]:
    """(where, citation) for each section the README or a doc (decision records included)
    cites by title that its file has no heading for."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = " ".join(doc.read_text(encoding="utf-8").split())  # titles wrap across lines
        for match in SECTION.finditer(text):
            name, past, title = match.groups()
            if past:
                continue
            target = next(
                (
                    base / name
                    for base in (doc.parent, ROOT, ROOT / "docs")
                    if (base / name).is_file()
                ),
                None,
            )
            headings = (
                []
                if target is None
                else [
                    " ".join(line.lstrip("#").split())
                    for line in target.read_text(encoding="utf-8").splitlines()
                    if line.startswith("#")
                ]
            )
            if not any(heading.startswith(title) for heading in headings):
                yield str(doc.relative_to(ROOT)), match.group(0)


def test_every_section_cited_by_title_is_a_heading_of_its_file() -> None:
    """A section moved or renamed leaves its citations pointing nowhere; a decision record
    that means the figures of its day cites the commit (`docs/benchmarks.md at 5e73739,
    "Issue 32"`)."""
    missing = list(cited_sections())
    assert not missing, "\n".join(f"  {where}: {what}" for where, what in missing)


# A change number in code: "issue 14", "Issue 32".
_CHANGE_NUMBER = re.compile(r"\b[Ii]ssue \d+\b")


def test_code_cites_decision_records_not_change_numbers() -> None:
    """A comment or docstring says why, citing a decision record: an issue's number means
    nothing to whoever reads the code after the tracker has moved on."""
    this = Path(__file__).resolve()
    cited = [
        f"{path.relative_to(ROOT)}:{number}"
        for top in ("src", "tests", "bench")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.resolve() != this
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _CHANGE_NUMBER.search(line)
    ]
    assert _CHANGE_NUMBER.search("limit an agent meets (issue 14)")  # the check sees one
    assert not cited, "change numbers cited in code:\n" + "\n".join(cited)
