"""What the docs say of the code's own tables is what the code holds, and the docs stay
navigable: tests/test_docs.py checks that the names the docs cite exist; these check what
is said of them.

- the jobs tables of README.md ("Jobs") and docs/architecture.md list exactly the jobs of
  the job table (`JOBS` in app.py), each with its default interval and (architecture) the
  module of its body;
- docs/architecture.md's locks table names every advisory lock the code takes (read from
  the source: every `lock_key("...")`, every `*_key`/`*_lock` function returning
  `"<family>:..."`, every name given to `guard`, `guard_all`, `transaction_holding`);
- docs/contract.md counts and names every object type and every `action` its payload
  models accept;
- every page (README.md, docs/**/*.md but the decision records) is at most 400 lines,
  docs/index.md links every page, every relative link and anchor resolves, no page but a
  decision record names SQLite, and a decision record naming SQLite or a removed file
  says at its top what amended or superseded it.

When one fails after a job, a lock or an object type was added: add its row to the doc.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from queuekeeper.app import JOBS
from queuekeeper.config import Settings
from queuekeeper.events.payloads import OBJECT_TYPES, PAYLOAD_MODELS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "queuekeeper"
DOCS = ROOT / "docs"
DECISIONS = DOCS / "decisions"
README = ROOT / "README.md"
MAX_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6}) (.*)$")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HTML_ANCHOR = re.compile(r"<a (?:id|name)=\"([^\"]+)\"")
SPAN = re.compile(r"`([^`]+)`")


def pages() -> list[Path]:
    """README.md and every docs page but the decision records (history, not docs of now)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if DECISIONS not in p.parents)]


def every_page() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _number, line in prose(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def section(path: Path, title: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        match = HEADING.match(line)
        if match and match.group(2).strip() == title:
            level = len(match.group(1))
            body = []
            for following in lines[index + 1 :]:
                other = HEADING.match(following)
                if other and len(other.group(1)) <= level:
                    break
                body.append(following)
            return "\n".join(body)
    raise AssertionError(f"{path.relative_to(ROOT)} has no heading {title!r}")


def table(text: str, first_header: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table whose first header cell is `first_header`."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[0] == first_header:
            rows = []
            for row in lines[index + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"no table whose first column is {first_header!r}")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _name(cell: str) -> str:
    """The first code span of a cell (`reconcile` in "`reconcile` (every 6 h)")."""
    match = SPAN.search(cell)
    assert match, f"no code span in {cell!r}"
    return match.group(1)


# --- the jobs ------------------------------------------------------------------------------


AGREEMENT = "Keeping broker and database in agreement"  # architecture.md's jobs section


def default_interval(seconds: int) -> str:
    """How the docs write a default interval: hours when whole hours, else seconds."""
    if seconds <= 0:
        return "off"
    if seconds % 3600 == 0:
        return f"every {seconds // 3600} h"
    return f"every {seconds} s"


def job_defaults() -> dict[str, str]:
    defaults = Settings.model_construct()  # the declared defaults, no environment
    return {job.value: default_interval(spec.interval(defaults)) for job, spec in JOBS.items()}


@pytest.mark.parametrize(
    ("page", "heading"),
    [(README, "Jobs"), (DOCS / "architecture.md", AGREEMENT)],
    ids=["README", "architecture"],
)
def test_a_jobs_table_lists_every_job_with_its_default(page: Path, heading: str) -> None:
    rows = table(section(page, heading), "job")
    documented = {_name(row[0]): row[1] for row in rows}
    wanted = job_defaults()
    assert set(documented) == set(wanted), (
        f"{page.relative_to(ROOT)}: jobs not documented: {sorted(set(wanted) - set(documented))}; "
        f"documented but not in JOBS: {sorted(set(documented) - set(wanted))}"
    )
    wrong = {job: (said, wanted[job]) for job, said in documented.items() if said != wanted[job]}
    assert not wrong, f"{page.relative_to(ROOT)}: (says, default) {wrong}"


def test_architecture_names_each_jobs_body_module() -> None:
    rows = table(section(DOCS / "architecture.md", AGREEMENT), "job")
    said = {_name(row[0]): _name(row[3]) for row in rows}
    wanted = {
        job.value: spec.body.__module__.removeprefix("queuekeeper.").replace(".", "/") + ".py"
        for job, spec in JOBS.items()
    }
    assert said == wanted


def test_reconciles_table_names_only_jobs() -> None:
    rows = table((DOCS / "reconcile.md").read_text(encoding="utf-8"), "job")
    assert {_name(row[0]) for row in rows} <= set(job_defaults())


def test_the_job_defaults_are_rendered_as_the_docs_write_them() -> None:
    assert [default_interval(s) for s in (0, 10, 60, 21600, 86400)] == [
        "off",
        "every 10 s",
        "every 60 s",
        "every 6 h",
        "every 24 h",
    ]


# --- the advisory locks --------------------------------------------------------------------

LOCK_TAKERS = {"lock_key", "guard", "guard_all", "transaction_holding"}


def _called(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def locks_in(source: str, module: str) -> set[str]:
    """The lock families a module's source takes: `job:` for `job:<job>`, `replays` whole."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _called(node) in LOCK_TAKERS:
            for argument in node.args[1:] if _called(node) != "lock_key" else node.args:
                found.update(
                    item.value
                    for item in ast.walk(argument)
                    if isinstance(item, ast.Constant) and isinstance(item.value, str)
                )
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.endswith(
            ("_key", "_lock")
        ):
            for item in ast.walk(node):
                if (
                    isinstance(item, ast.Return)
                    and isinstance(item.value, ast.JoinedStr)
                    and item.value.values
                    and isinstance(item.value.values[0], ast.Constant)
                    and re.fullmatch(r"[a-z-]+:", str(item.value.values[0].value))
                ):
                    found.add(str(item.value.values[0].value))
        elif module == "common/locks.py" and isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            value = node.value
            if isinstance(value, ast.Constant) and any(name.endswith("_KEY") for name in names):
                found.add(str(value.value))
    return found


def code_locks() -> set[str]:
    found: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        found |= locks_in(path.read_text(encoding="utf-8"), path.relative_to(PACKAGE).as_posix())
    return found


def family(name: str) -> str:
    return name[: name.index(":") + 1] if ":" in name else name


def test_the_locks_are_read_from_the_source() -> None:
    source = """
WEBHOOK = f"SELECT pg_advisory_xact_lock({lock_key('webhook-claims')})"
def release_lock(vhost, queue):
    return f"release:{vhost}/{queue}"
async def f(session):
    async with guard(session, "sweeps", exclusive=True): ...
    async with guard_all(session, [(user_key(u), True), ("other", False)]): ...
def scope_key(x):
    return f"{x}:{x}"
"""
    assert locks_in(source, "events/x.py") == {"webhook-claims", "release:", "sweeps", "other"}
    assert {"job:", "user:", "vhost:", "broker-users", "release:", "replays"} <= code_locks()


def test_the_locks_table_names_every_lock() -> None:
    rows = table(section(DOCS / "architecture.md", "Advisory locks"), "lock")
    documented = {family(_name(row[0])) for row in rows}
    taken = code_locks()
    assert documented == taken, (
        f"docs/architecture.md, Advisory locks: not documented {sorted(taken - documented)}; "
        f"documented but taken nowhere {sorted(documented - taken)}"
    )


# --- the object types ----------------------------------------------------------------------

CONTRACT = DOCS / "contract.md"


def test_the_contract_counts_and_names_every_object_type() -> None:
    text = CONTRACT.read_text(encoding="utf-8")
    bullet = re.search(r"^- \*\*Object types\*\* \((\d+),(.*?)(?=^- |^$)", text, re.M | re.S)
    assert bullet, "docs/contract.md has no '- **Object types** (N, ...' bullet"
    assert int(bullet.group(1)) == len(OBJECT_TYPES)
    named = {span for span in SPAN.findall(bullet.group(2)) if re.fullmatch(r"[a-z_]+", span)}
    assert named == set(OBJECT_TYPES)


def test_the_contracts_payload_table_covers_every_type_and_action() -> None:
    rows = table(section(CONTRACT, "6. Publishing"), "object type")
    by_type = {name.strip(): row[1] for row in rows for name in row[0].split(",")}
    assert set(by_type) == set(OBJECT_TYPES)
    for object_type, model in PAYLOAD_MODELS.items():
        actions = _actions(model)
        if not actions:
            continue
        said = by_type[object_type]
        listed = re.search(r"`action` in ([\w/]+)|`action = (\w+)`", said)
        assert listed, f"contract §6: {object_type} names no action"
        assert set((listed.group(1) or listed.group(2)).split("/")) == actions, object_type


def _actions(model: type[BaseModel]) -> set[str]:
    field = model.model_fields.get("action")
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return set()
    return {str(value) for value in typing.get_args(field.annotation)}


# --- the pages -----------------------------------------------------------------------------


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_is_longer_than_400_lines(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{page.relative_to(ROOT)}: {lines} lines; split it by task"


def _target(page: Path, link: str) -> tuple[Path, str] | None:
    """The file and anchor a relative link points to; None for a URL or an absolute path."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("/"):
        return None
    path, _, anchor = link.partition("#")
    return (Path(os.path.normpath(page.parent / path)) if path else page), anchor


def test_the_index_links_every_page() -> None:
    index = DOCS / "index.md"
    linked = set()
    for _number, line in prose(index.read_text(encoding="utf-8")):
        for link in LINK.findall(line):
            target = _target(index, link)
            if target:
                linked.add(target[0])
    missing = [str(p.relative_to(ROOT)) for p in every_page() if p != index and p not in linked]
    assert not missing, f"docs/index.md lists no line for {missing}"


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in every_page():
        for number, line in prose(page.read_text(encoding="utf-8")):
            for link in LINK.findall(line):
                target = _target(page, link)
                if target is None:
                    continue
                path, anchor = target
                where = f"{page.relative_to(ROOT)}:{number}: {link}"
                if not path.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_page_but_a_decision_record_names_sqlite() -> None:
    naming = [str(p.relative_to(ROOT)) for p in pages() if "sqlite" in p.read_text().lower()]
    assert not naming, f"PostgreSQL is the only database (decision 022); named in {naming}"


@cache
def tracked_python_files() -> frozenset[str]:
    listing = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return frozenset(Path(path).name for path in listing)


def _removed_files(text: str) -> list[str]:
    tracked = tracked_python_files()
    return [s for s in SPAN.findall(text) if s.endswith(".py") and Path(s).name not in tracked]


@pytest.mark.parametrize("record", sorted(DECISIONS.glob("*.md")), ids=lambda p: p.name)
def test_a_decision_record_that_no_longer_holds_says_so_at_its_top(record: Path) -> None:
    text = record.read_text(encoding="utf-8")
    stale = (["SQLite"] if "sqlite" in text.lower() else []) + _removed_files(text)
    if stale:
        top = "\n".join(text.splitlines()[:6])
        assert re.search(r"(Superseded|Amended) by", top), (
            f"{record.name} names {stale}: say at its top what superseded or amended it"
        )


# --- the layers ----------------------------------------------------------------------------


def service_calls(source: str) -> dict[str, set[str]]:
    """Per function of an endpoints module, the functions it calls on a service module (a
    name with `service` in it: `service`, `events_service`)."""
    calls = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            calls[node.name] = {
                item.func.attr
                for item in ast.walk(node)
                if isinstance(item, ast.Call)
                and isinstance(item.func, ast.Attribute)
                and isinstance(item.func.value, ast.Name)
                and "service" in item.func.value.id
            }
    return calls


def test_an_endpoint_calls_one_service_function_and_facts_of_besides() -> None:
    """docs/architecture.md, "The layers": an endpoint calls the one service function that
    does the work; a consumer route that shows consumers (consumers/, webhooks/) also calls
    `facts_of`."""
    route = "async def f():\n    a = await service.get(x)\n    service.facts_of(a)"
    assert service_calls(route) == {"f": {"get", "facts_of"}}
    more = {}
    for path in sorted(PACKAGE.rglob("endpoints.py")):
        for route, called in service_calls(path.read_text(encoding="utf-8")).items():
            shows_consumers = path.parent.name in {"consumers", "webhooks"}
            work = called - {"facts_of"} if shows_consumers else called
            if len(work) > 1:
                more[f"{path.relative_to(PACKAGE)}:{route}"] = sorted(called)
    assert not more, f"endpoints calling several service functions: {more}"
