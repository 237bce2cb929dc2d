"""The floors of docs/architecture.md are the ones the imports measure, and
no modules import each other in a circle.

Every module under src/reshard belongs to one entry of the floors table; an
entry (a package or a module) stands one floor above the highest entry it
imports (every import statement counts: inside functions and under
TYPE_CHECKING too), so the table says what the code does, and an import that
would climb (a module importing from a floor above it) changes a floor here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "reshard"


def _table() -> dict[str, int]:
    """entry (a path under src/reshard: ``storage/``, ``errors.py``) -> its floor."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    out: dict[str, int] = {}
    for m in re.finditer(r"^\| (\d+) \| ([^|]+) \|", text, re.M):
        for name in re.findall(r"`([^`]+)`", m.group(2)):
            out[name.removeprefix("reshard/")] = int(m.group(1))
    assert out, "docs/architecture.md: no floors table (| floor | package | ...)"
    return out


def _module(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The reshard modules ``path`` imports anywhere in it."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    out = set()
    for name in found:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("reshard"):
            out.add(name)
    return out


def _entry_of(path: Path, entries: dict[str, int]) -> str | None:
    rel = path.relative_to(PKG).as_posix()
    if rel in entries:
        return rel
    top = rel.split("/")[0] + "/"
    return top if top in entries else None


def test_floors_table_is_what_the_imports_measure() -> None:
    entries = _table()
    files = sorted(PKG.rglob("*.py"))
    unplaced = [f.relative_to(ROOT).as_posix() for f in files if _entry_of(f, entries) is None]
    assert not unplaced, f"docs/architecture.md's floors table places no entry for {unplaced}"
    known = {_module(f) for f in files}
    by_module = {_module(f): _entry_of(f, entries) for f in files}
    uses: dict[str, set[str]] = {e: set() for e in entries}
    why: dict[tuple[str, str], str] = {}
    for f in files:
        e = by_module[_module(f)]
        assert e is not None
        for m in _imports(f, known):
            other = by_module[m]
            if other is not None and other != e:
                uses[e].add(other)
                why.setdefault((e, other), f"{f.relative_to(ROOT).as_posix()} imports {m}")

    measured: dict[str, int] = {}

    def floor(e: str, path: tuple[str, ...] = ()) -> int:
        assert e not in path, f"the entries import each other in a circle: {' -> '.join((*path, e))}"
        if e not in measured:
            measured[e] = 1 + max((floor(o, (*path, e)) for o in uses[e]), default=0)
        return measured[e]

    wrong = []
    for e, want in sorted(entries.items(), key=lambda kv: (kv[1], kv[0])):
        got = floor(e)
        if got != want:
            top = max(uses[e], key=floor, default=None)
            because = f" ({why[(e, top)]}, on floor {floor(top)})" if top else ""
            wrong.append(f"{e}: the table says floor {want}, the imports measure {got}{because}")
    assert not wrong, "docs/architecture.md's floors table:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    """No circle of imports between modules, inside a package too (every
    import statement counts, as above): a circle works in one import order
    only, and hides which module is the lower one."""
    files = sorted(PKG.rglob("*.py"))
    known = {_module(f) for f in files}
    # a package's __init__ is where its modules are found, not a module they depend on
    graph = {_module(f): {m for m in _imports(f, known) if m != _module(f) and not _module(f).startswith(m + ".")}
             for f in files}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for o in sorted(graph[m]):
            if state.get(o) == 1:
                circle = path[path.index(o):] + [m, o] if o in path else [m, o]
                raise AssertionError("modules that import each other in a circle: " + " -> ".join(circle))
            if o not in state:
                visit(o, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
