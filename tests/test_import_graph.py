"""The import graph of `src/mist`: no cycles, and every function-local import says why it is lazy.

Every module under src/mist is parsed with `ast` (nothing is imported). An edge A → B is any
import of B in A, at module level or inside a function, relative imports resolved, `from
package import name` counted as an import of the submodule `package.name` when that is a module.
The strongly connected components of that graph must all be single modules.

A function-local import of mist, torch, matplotlib or scipy must carry a comment containing
"lazy:" on the line above it or on one of the lines of its run of consecutive imports, saying
what it keeps out of which import (for example `# lazy: keeps torch out of the CLI start-up`);
an import that only dodged a cycle belongs at the top of the module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "mist"
HEAVY = ("mist", "torch", "matplotlib", "scipy")
MARK = "lazy:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str, known: dict):
    """(target module, line, inside a function, top-level package) for every import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    out = []

    def targets(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        return [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    out.append((t, child.lineno, in_function, t.split(".")[0]))
            visit(child, inner)

    visit(tree, False)
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for name, path in known.items():
        edges = set()
        for target, _, _, top in _imports(path, name, known):
            if top != "mist":
                continue
            while target and target not in known:  # `from mist.x import function` → mist.x
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _import_groups(tree: ast.AST):
    """Runs of consecutive import statements inside functions (one statement list each)."""
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for key in ("body", "orelse", "finalbody", "handlers"):
                run = []
                body = getattr(node, key, None)
                for stmt in body if isinstance(body, list) else []:
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        run.append(stmt)
                        continue
                    if run:
                        yield run
                    run = []
                if run:
                    yield run


def unexplained_lazy_imports() -> list[str]:
    """Function-local imports of mist/torch/matplotlib/scipy whose group of consecutive import
    lines (or the line above it) has no "lazy:" comment."""
    bad = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for run in _import_groups(ast.parse(text)):
            where = "\n".join(lines[max(run[0].lineno - 2, 0) : run[-1].end_lineno])
            if MARK in where:
                continue
            for stmt in run:
                names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module or ""]
                if stmt.__class__ is ast.ImportFrom and stmt.level:
                    names = ["mist"]  # a relative import stays inside the package
                if any(n.split(".")[0] in HEAVY for n in names):
                    bad.add(f"{path.relative_to(SRC.parent)}:{stmt.lineno} imports {', '.join(names)}")
    return sorted(bad)


def test_tarjan_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_graph_is_read():
    graph = import_graph()
    assert "mist.hardware.profile" in graph["mist.hardware.registry"]
    assert "mist.runtime.handoff" in graph["mist.runtime.layout"]


def test_no_import_cycles():
    assert strongly_connected(import_graph()) == []


def test_every_function_local_import_says_why():
    assert unexplained_lazy_imports() == [], (
        f"function-local imports need a '# {MARK} <reason>' comment (or belong at module level)"
    )


def _heavy_after_import(module: str) -> str:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'scipy', 'matplotlib') if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_cli_start_up_leaves_the_heavy_packages_out():
    """What the "lazy:" comments promise: `import mist.cli` loads no torch, scipy or matplotlib, and
    `mist.hardware` / `mist.profiling` (which every spawned measuring process imports) no torch or
    scipy."""
    assert _heavy_after_import("mist.cli") == "[]"
    assert _heavy_after_import("mist.hardware, mist.profiling") == "[]"
