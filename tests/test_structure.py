"""The code's shape, checked: no import cycle inside ``tidal``, every
``TIDAL_*`` variable read through :mod:`tidal.settings`, no class over 300
lines or function over 80, no issue numbers in the code, and the docs that
list settings and the largest classes and functions agree with the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tidal import settings

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "tidal"
DOCS = SRC.parent / "docs"
MAX_CLASS, MAX_FUNC = 300, 80


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        if "migrations" in p.parts:
            continue  # alembic revisions are data, run by alembic
        rel = p.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> tidal modules it imports (at module level or inside functions)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            for t in targets:
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_tidal() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def tidal_strings(path: Path) -> list[tuple[int, str]]:
    """String literals (not docstrings) that name a TIDAL_* variable; a
    mention for people (``"$TIDAL_HOME"`` in a help text) is not a name."""
    tree = ast.parse(path.read_text())
    docs = _docstring_ids(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and re.search(r"(?<!\$)\bTIDAL_[A-Z]", n.value)]


def test_tidal_variables_are_read_only_through_settings() -> None:
    bad = [f"{p.relative_to(SRC)}:{line}: {s!r}" for p in modules().values() if p.name != "settings.py"
           for line, s in tidal_strings(p)]
    assert not bad, "TIDAL_* named outside tidal/settings.py (use tidal.settings):\n" + "\n".join(bad)


def test_the_settings_check_catches_a_direct_read(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""Docs may say $TIDAL_HOME."""\nimport os\nx = os.environ.get("TIDAL_HOME")\n'
                 'y = {"TIDAL_WORKER_ID": "w0"}\nhelp = "default: $TIDAL_HOME/token"\n')
    assert tidal_strings(f) == [(3, "TIDAL_HOME"), (4, "TIDAL_WORKER_ID")]


def sizes() -> list[tuple[int, str, str]]:
    """(lines, kind, qualified name) of every class and function (alembic
    revisions included)."""
    out = []
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        tree = ast.parse(path.read_text())

        def walk(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    q = f"{prefix}.{child.name}"
                    out.append((child.end_lineno - child.lineno + 1, kind, q))
                    walk(child, q)
                else:
                    walk(child, prefix)

        walk(tree, name)
    return out


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    bad = [f"{kind} {q}: {n} lines" for n, kind, q in sizes()
           if n > (MAX_CLASS if kind == "class" else MAX_FUNC)]
    assert not bad, "\n".join(sorted(bad))


def test_architecture_lists_the_five_largest_classes_and_functions() -> None:
    text = (DOCS / "architecture.md").read_text()
    all_sizes = sorted(sizes(), reverse=True)
    for kind in ("class", "function"):
        top = [q for n, k, q in all_sizes if k == kind][:5]
        missing = [q for q in top if f"`{q}`" not in text]
        assert not missing, f"docs/architecture.md should list the five largest {kind}es: missing {missing}"


def test_no_issue_numbers_in_code() -> None:
    bad = []
    for p in modules().values():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\bissues? #?\d+", line, re.IGNORECASE):
                bad.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_settings_doc_is_generated_from_the_table() -> None:
    assert (DOCS / "settings.md").read_text() == settings.markdown(), \
        "regenerate: python -m tidal.settings > docs/settings.md"


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("off", False)])
def test_a_setting_parses_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv(settings.OVERLAP.name, raw)
    assert settings.OVERLAP.get() is value


def test_a_bad_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.HEARTBEAT_S.name, "fast")
    with pytest.raises(ValueError, match="TIDAL_HEARTBEAT_S"):
        settings.HEARTBEAT_S.get()


def sizes_markdown() -> str:
    """The two lists in docs/architecture.md (``python tests/test_structure.py``)."""
    all_sizes = sorted(sizes(), reverse=True)
    out = []
    for kind in ("class", "function"):
        rows = [f"| `{q}` | {n} |" for n, k, q in all_sizes if k == kind][:5]
        out.append("\n".join([f"| {kind} | lines |", "|---|---|", *rows]))
    return "\n\n".join(out)


if __name__ == "__main__":  # pragma: no cover - docs helper
    print(sizes_markdown())
