"""The import graph: no circle among the modules of the library (async_cosyvoice) and of the packages
above it (grpc_async, http_api, ray_app, cosyvoice_cli), and the library never imports the
transports, the command line or its own tools.

Imports are read with `ast` from every file, wherever they are (module level, inside functions,
under TYPE_CHECKING), absolute and relative. An edge goes to the module named, or for
`from package import name` to package.name when that is a module."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import async_cosyvoice

LIBRARY = Path(async_cosyvoice.__file__).parent
ROOT = LIBRARY.parent
PACKAGES = ("async_cosyvoice", "cosyvoice_cli", "grpc_async", "http_api", "ray_app")
FORBIDDEN = ("grpc_async", "http_api", "ray_app", "cosyvoice_cli", "async_cosyvoice.tools")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    if name.split(".")[0] not in PACKAGES:
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> set[str]:
    """Every module `path` imports."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.add(sub if is_module(sub) else source)
    return out


@functools.lru_cache
def graph(packages: tuple[str, ...] = ("async_cosyvoice",)) -> dict[str, set[str]]:
    return {module_name(p): imports(p) for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm over the graph's own modules (edges to others are left out)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    edges = graph()
    assert "async_cosyvoice.request" in edges["async_cosyvoice.tts"]
    above = graph(PACKAGES)
    assert "async_cosyvoice.progress" in above["cosyvoice_cli.bench.progress"]
    assert {"cosyvoice_cli.options", "cosyvoice_cli.speakers"} <= above["cosyvoice_cli.cli"]
    assert "grpc_async.server" in above["cosyvoice_cli.serve"]


def test_no_import_circle():
    circles = [c for c in strongly_connected(graph(PACKAGES)) if len(c) > 1]
    assert circles == []


def test_the_library_imports_no_transport_cli_or_tools():
    found = set()
    for module, targets in graph().items():
        for target in targets:
            if module.startswith("async_cosyvoice.tools") and target.startswith("async_cosyvoice.tools"):
                continue
            if any(target == f or target.startswith(f + ".") for f in FORBIDDEN):
                found.add((module, target))
    assert found == set()


def test_a_circle_would_be_found():
    edges = {"a": {"b"}, "b": {"c", "x"}, "c": {"a"}, "d": {"a"}}
    assert sorted(map(sorted, strongly_connected(edges))) == [["a", "b", "c"], ["d"]]
