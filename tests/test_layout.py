"""The package's shape: no import cycle between its modules (function-level imports
included; a package ``__init__`` loading its own modules lazily by name is not an import
the parser sees, and is allowed), and no source file over 600 non-blank lines outside
``tests/`` and ``benchmarks/``."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import ast
from pathlib import Path

import pytest

ROOT = suite_paths.ROOT
#: top-level folder -> import package (pyproject's package-dir mapping)
PACKAGES = {"specjax": "specjax", "kernels": "specjax.kernels", "models": "specjax.models",
            "converters": "specjax.converters"}
MAX_LINES = 600

pytestmark = pytest.mark.smoke


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for top, pkg in PACKAGES.items():
        for f in sorted((root / top).rglob("*.py")):
            parts = list(f.relative_to(root / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = m if is_pkg else m.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = pkg + ("." + base if base else "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith("specjax") else None
                if r is not None and r != m:
                    edges[m].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph(modules()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The checker itself: a function-level import back into a module is a cycle."""
    for top in PACKAGES:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "models" / "a.py").write_text("from specjax.kernels.b import f\n")
    (tmp_path / "kernels" / "b.py").write_text(
        "def f():\n    from specjax.models.a import g\n    return g\n")
    (tmp_path / "specjax" / "c.py").write_text("import specjax.kernels.b\n")
    mods = modules(tmp_path)
    assert cycles(import_graph(mods)) == [["specjax.kernels.b", "specjax.models.a"]]


def test_no_source_file_over_600_lines():
    long = {}
    for f in modules().values():
        n = sum(1 for line in f.read_text().splitlines() if line.strip())
        if n > MAX_LINES:
            long[str(f.relative_to(ROOT))] = n
    assert not long, f"source files over {MAX_LINES} non-blank lines: {long}"


def test_docs_layout_names_every_module():
    """docs/layout.md lists every source file (demo-model data aside) and nothing that is gone."""
    import re

    text = (ROOT / "docs" / "layout.md").read_text()
    listed = set(re.findall(r"^- `((?:specjax|kernels|models|converters)/[\w/]+\.py)`", text, re.M))
    have = {str(f.relative_to(ROOT)) for f in modules().values()
            if "demo_models" not in f.parts or f.name == "__init__.py"}
    assert not have - listed, f"modules missing from docs/layout.md: {sorted(have - listed)}"
    assert not listed - have, f"docs/layout.md lists files that do not exist: {sorted(listed - have)}"


#: the most lines a module's or a class's docstring may take, and the share of the
#: library's non-blank lines docstrings may take: docstrings are specifications
MAX_DOC_LINES, MAX_DOC_SHARE = 25, 0.15


def docstring_lines(src: str) -> list[tuple[str, int]]:
    """``(owner, lines)`` of every module, class and function docstring in ``src``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                kind = "module" if isinstance(node, ast.Module) else \
                    "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((f"{kind} {getattr(node, 'name', '')}".strip(),
                            first.end_lineno - first.lineno + 1))
    return out


def test_docstrings_are_specifications_not_essays():
    total = doc = 0
    long = []
    for name, f in modules().items():
        src = f.read_text()
        total += sum(1 for line in src.splitlines() if line.strip())
        for owner, n in docstring_lines(src):
            doc += n
            if not owner.startswith("function") and n > MAX_DOC_LINES:
                long.append(f"{name} {owner}: {n}")
    assert not long, f"module / class docstrings over {MAX_DOC_LINES} lines: {long}"
    assert doc <= MAX_DOC_SHARE * total, \
        f"docstrings take {doc} of {total} non-blank lines ({doc / total:.1%} > {MAX_DOC_SHARE:.0%})"


def test_the_docstring_count_counts():
    src = '"""m\n\nx"""\nclass A:\n    """a\n    b"""\n    def f(self):\n        """f"""\n'
    assert docstring_lines(src) == [("module", 3), ("class A", 2), ("function f", 1)]


def test_no_history_or_machine_figures_in_the_library():
    """Timings, GPU names, session history and research notes live in benchmarks/RESULTS.md,
    the commit log and docs/, not in the code."""
    import re

    pat = re.compile(r"H200|research/|\b(\d+(st|nd|rd|th)|[a-z]+(teenth|tieth)) session")
    hits = [f"{name}:{i}" for name, f in modules().items()
            for i, line in enumerate(f.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, f"history or machine figures in library code: {hits[:10]}"
    assert not [p for p in (ROOT / "docs").glob("*.md") if "research/" in p.read_text()]
