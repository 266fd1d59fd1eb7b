"""Which keepwarm_runtime packages may import which: read from the source, so a new import that
crosses a layer fails here rather than in review. Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import keepwarm_runtime

ROOT = Path(keepwarm_runtime.__file__).parent


def imports_of(source: str, package: str) -> set[str]:
    """Every module ``source`` imports (absolute names; relative ones resolved against ``package``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).rstrip(".")
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return names


def offenders(importers: str, forbidden: str) -> list[str]:
    """Files under ``importers`` (a package path relative to keepwarm_runtime, "" for all) that import
    ``forbidden`` (a dotted package) or anything in it."""
    found = []
    for path in sorted((ROOT / importers).rglob("*.py")):
        package = ".".join(("keepwarm_runtime", *path.relative_to(ROOT).parent.parts))
        names = imports_of(path.read_text(), package)
        bad = sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
        if bad:
            found.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    return found


def test_imports_of_sees_function_level_and_relative_imports() -> None:
    source = "def f():\n    from keepwarm_runtime.server import app\nfrom .state import x\nimport a.b\n"
    names = imports_of(source, "keepwarm_runtime.agent")
    assert {"keepwarm_runtime.server.app", "keepwarm_runtime.agent.state", "a.b"} <= names


def test_nothing_below_the_server_imports_the_server() -> None:
    """The server is the top layer: only it and the command line (keepwarm_runtime/cli.py) import it."""
    below = [f for f in offenders("", "keepwarm_runtime.server") if not f.startswith(("server/", "cli.py"))]
    assert below == []


def test_the_engine_imports_nothing_from_audio() -> None:
    """Audio sits above the engine (its Whisper engine uses the engine's loader), never below it."""
    assert offenders("engine", "keepwarm_runtime.audio") == []


def test_the_cache_and_the_engine_take_the_serving_layout_from_weights_not_each_other() -> None:
    """keepwarm_runtime.weights is the one home of checkpoint reading and the serving layout: the cache
    imports nothing from the engine, and weights imports neither (issue 25)."""
    assert offenders("cache", "keepwarm_runtime.engine") == []
    assert offenders("weights", "keepwarm_runtime.engine") == []
    assert offenders("weights", "keepwarm_runtime.cache") == []


def test_the_server_base_imports_no_route_group() -> None:
    """server/base is what the route groups share (vLLM's serving base): it never reaches up into one,
    so a group can be read, moved or dropped on its own."""
    assert offenders("server/base", "keepwarm_runtime.server.openai") == []
    assert offenders("server/base", "keepwarm_runtime.server.probes") == []


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """keepwarm_runtime's files (under ``root``), each with the files it imports (a package's __init__
    stands for the package only where a module outside it imports it)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("keepwarm_runtime", *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for imported in imports_of(path.read_text(), package):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_circles_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_crosses_packages() -> None:
    """Files of different packages never import each other in a circle (imports inside functions
    included): each package can be read with what it imports, not with what imports it (issue 25)."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    crossing = [sorted(c) for c in circles(module_graph()) if len({package(m) for m in c}) > 1]
    assert crossing == []


def cache_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph`` that hold a file of keepwarm_runtime.cache."""
    return [sorted(c) for c in circles(graph) if any(m.startswith("keepwarm_runtime.cache.") for m in c)]


def test_no_circle_inside_the_cache() -> None:
    """No file of the cache is in a circle of imports (imports inside functions and under
    TYPE_CHECKING included): the daemon core (cache/core.py) is what the request handlers, the
    connection loop, the hand-off and the holder use, and it imports none of them, so each of them
    can be read and changed with what it imports (issue 38)."""
    assert cache_circles(module_graph()) == []


def test_a_circle_inside_the_cache_is_found(tmp_path: Path) -> None:
    """The check above can fail: a tree whose cache files import each other in a circle, one import
    inside a function and one under TYPE_CHECKING, the third relative, is caught."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "__init__.py").write_text("")
    (cache / "core.py").write_text("def f():\n    from keepwarm_runtime.cache import handlers\n")
    (cache / "handlers.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import daemon\n"
    )
    (cache / "daemon.py").write_text("from keepwarm_runtime.cache.core import f\n")
    (cache / "protocol.py").write_text("import keepwarm_runtime.cache.core\n")  # imports, outside the circle
    assert cache_circles(module_graph(tmp_path)) == [
        ["keepwarm_runtime.cache.core", "keepwarm_runtime.cache.daemon", "keepwarm_runtime.cache.handlers"]
    ]
    (cache / "core.py").write_text("")  # the circle broken: nothing left to find
    assert cache_circles(module_graph(tmp_path)) == []


def test_the_daemon_core_imports_none_of_the_parts_that_use_it() -> None:
    parts = ("handlers", "connections", "succession", "adopt", "holder", "holder_link", "daemon")
    core = imports_of((ROOT / "cache" / "core.py").read_text(), "keepwarm_runtime.cache")
    assert sorted(core & {f"keepwarm_runtime.cache.{p}" for p in parts}) == []
