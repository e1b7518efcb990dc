"""Checks the import structure of the packages against DESIGN.md's layout:

- no import circle inside a package (module imports, lazy ones in functions included);
- no import against the dependency direction between top-level packages (`ALLOWED`);
- no import of a third-party package a package must not use (`FORBIDDEN`: flax in `optim`);
- no import of an entry point (a module with an ``if __name__ == "__main__":`` block: a script, whose
  reusable parts belong in a library module).

    python -m experiments.check_imports     # prints each problem, exit code 1 if there is one

It reads the source (`ast`); nothing is imported.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level package -> the top-level packages it may import.
ALLOWED = {
    "experiments": {"lm", "optim", "sharding", "kernels_pallas"},
    "lm": {"sharding", "kernels_pallas"},
    "optim": {"sharding", "kernels_pallas"},
    "sharding": set(),
    "kernels_pallas": set(),
}
FORBIDDEN = {"optim": {"flax"}}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages in `ALLOWED`, by dotted name."""
    return {module_name(p, root): p for package in ALLOWED for p in sorted((root / package).rglob("*.py"))}


def is_entry_point(path: Path) -> bool:
    """Whether the module at ``path`` has a top-level ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text(), str(path)).body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
            if any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators):
                return True
    return False


def imported_names(path: Path, name: str) -> Iterator[str]:
    """Dotted names ``path`` imports anywhere in its code, relative imports resolved against module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the packages' modules, third-party top-level names each module imports)."""
    known = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in known}
    external: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target in imported_names(path, name):
            if target in known:
                parts = target.split(".")
                for k in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
                    module = ".".join(parts[:k])
                    if module in known and module != name and not name.startswith(f"{module}."):
                        edges[name].add(module)
            elif target.split(".")[0] not in ALLOWED:
                external[name].add(target.split(".")[0])
    return edges, external


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def problems(root: Path = ROOT) -> list[str]:
    """One line per import circle inside a package, upward import and forbidden import."""
    edges, external = graph(root)
    entry_points = {name for name, path in modules(root).items() if is_entry_point(path)}
    out = []
    for package in ALLOWED:
        inside = {m: {t for t in ts if t.split(".")[0] == package} for m, ts in edges.items() if m.split(".")[0] == package}
        out += [f"import circle in {package}/: {' -> '.join(c)}" for c in cycles(inside)]
    for name, targets in sorted(edges.items()):
        package = name.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != package and other not in ALLOWED[package]:
                out.append(f"upward import: {name} imports {target} ({package} may import {', '.join(sorted(ALLOWED[package])) or 'no package'})")
        for lib in sorted(external[name] & FORBIDDEN.get(package, set())):
            out.append(f"forbidden import: {name} imports {lib}")
        for entry in sorted(targets & entry_points):
            out.append(f"entry point imported: {name} imports {entry}; import the library modules it uses instead")
    return out


def main() -> None:
    found = problems()
    for line in found:
        print(line)
    if found:
        sys.exit(1)
    print(f"imports ok: {len(modules())} modules, no circle inside a package, no upward import")


if __name__ == "__main__":
    main()
