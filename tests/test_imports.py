"""Dependencies point one way: no import cycle in src/queuekeeper, between modules or between
packages, counting imports inside functions (they run later, but still tie the two together)
and those under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "queuekeeper"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported(path: Path, name: str, modules: dict[str, Path]) -> Iterator[str]:
    """The queuekeeper modules that `name` (at `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` steps up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b`: the module a.b when there is one, else a's attribute b.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == ROOT or not target.startswith(ROOT + "."):
                continue
            while target not in modules:  # `import a.b.c` of a name below a module
                target = target.rpartition(".")[0]
            yield target


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {
        name: {target for target in imported(path, name, modules) if target != name}
        for name, path in modules.items()
    }


def package_of(module: str) -> str:
    """The layer a module belongs to: its package below queuekeeper, or itself (`app`)."""
    return module.split(".")[1] if module != ROOT else ROOT


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one node
    (Tarjan's algorithm, then a path back to the start within the component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    found = []
    for component in components:
        start = min(component)
        # Breadth first from start, within the component, back to start: a shortest cycle.
        paths = {start: [start]}
        queue = [start]
        cycle: list[str] = []
        while queue and not cycle:
            node = queue.pop(0)
            for target in sorted(edges.get(node, set()) & component):
                if target == start:
                    cycle = [*paths[node], start]
                    break
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    queue.append(target)
        found.append(cycle)
    return found


def test_the_graph_sees_module_level_and_function_local_imports() -> None:
    edges = graph()
    # Module level: the composition root imports the settings.
    assert "queuekeeper.config" in edges["queuekeeper.app"]
    # Inside a function only: `migrate` loads the migration tooling when it runs.
    assert "queuekeeper.preflight" in edges["queuekeeper.cli"]


def test_cycles_finds_one_through_a_function_local_import() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    found = cycles(graph())
    assert not found, "import cycles between modules:\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_no_package_imports_itself_back() -> None:
    """Between packages (subscriptions -> consumers -> subscriptions is a cycle even when no
    two modules import each other)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph().items():
        source = package_of(module)
        packages.setdefault(source, set()).update(
            package_of(target) for target in targets if package_of(target) != source
        )
    found = cycles(packages)
    assert not found, "import cycles between packages:\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


@pytest.mark.parametrize(
    ("module", "below"),
    [
        # What every endpoint depends on: the settings and the broker's clients, no domain.
        ("queuekeeper.state", {"config", "common", "broker"}),
        # What subscriptions, consumers, identities and the directory build on.
        (
            "queuekeeper.owners",
            {"config", "common", "broker", "auth", "db", "models", "exceptions"},
        ),
    ],
)
def test_lower_layers_import_nothing_above_them(module: str, below: set[str]) -> None:
    imports = {
        package_of(target)
        for source, targets in graph().items()
        if source == module or source.startswith(module + ".")
        for target in targets
    }
    assert imports - {package_of(module)} <= below


# What speaks to RabbitMQ over AMQP: its client libraries.
AMQP_LIBRARIES = ("aio_pika", "aiormq", "pamqp")


def third_party(path: Path) -> Iterator[str]:
    """The top-level names of what the module at `path` imports from outside queuekeeper."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.partition(".")[0]


def test_only_the_broker_package_speaks_amqp() -> None:
    """RabbitMQ's names and rules live in `broker/`: no other package imports an AMQP client,
    so a change of client, or of what the broker answers, is made in one place."""
    speaking = {
        name
        for name, path in module_names().items()
        if any(library in AMQP_LIBRARIES for library in third_party(path))
    }
    assert "queuekeeper.broker.publisher" in speaking  # the check sees such imports
    assert {name for name in speaking if package_of(name) != "broker"} == set()
