"""Every documented public path imports at the path users write.

The public packages (every module of ``reshard.formats``, ``reshard.adapters``
and ``reshard.storage``, found by walking them), the names of
``reshard.__all__``, the command's entry point read from pyproject.toml, and
every ``reshard.`` path that README.md and docs/*.md name: in code spans and
code blocks, as dotted paths (``reshard.adapters.layouts``,
``reshard.demo.parity.grad_atol``) and as ``from reshard... import ...``
statements. The paths are read from the text, so a page added or a path
rewritten by a move is covered without editing this file.

A path may warn when it imports (a shim naming the new path), never fail.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import reshard

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# the public surface the layout keeps (the documented paths below are added to it)
PUBLIC = [
    "reshard.transforms",
    "reshard.collectives.SingleProcess",
    "reshard.testing.storage_conformance.StorageConformance",
    "reshard.errors",
    "reshard.storage",
]
PACKAGES = ["reshard.formats", "reshard.adapters", "reshard.storage"]

# a dotted path not glued to a word, quote, slash or dot (`"reshard.read_once"` is a notes key,
# `__reshard__/blocks` a file entry, `pip install 'reshard[s3]'` an extra)
DOTTED = re.compile(r"(?<![\w\"'/.-])reshard(?:\.[A-Za-z_]\w*)+")
FROM = re.compile(r"^\s*from\s+(reshard(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#.*)?$", re.M)


def _walk(path: str) -> tuple[Any, str]:
    """The object at dotted ``path`` as a user reaches it (``import reshard``,
    then attributes, importing a submodule where no attribute has its name)
    and the name of the last module on the way."""
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    module = parts[0]
    for i, attr in enumerate(parts[1:], start=1):
        if not hasattr(obj, attr) and inspect.ismodule(obj):
            name = ".".join(parts[:i + 1])
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise  # the module exists but needs something missing
        if not hasattr(obj, attr):
            raise AttributeError(f"{path}: {'.'.join(parts[:i])} has no {attr!r}")
        obj = getattr(obj, attr)
        if inspect.ismodule(obj):
            module = obj.__name__
    return obj, module


def resolve(path: str) -> Any:
    """The object at dotted ``path``; ImportError / AttributeError naming it."""
    return _walk(path)[0]


def code_of(text: str) -> list[str]:
    """The code of ``text``: its fenced blocks and its inline code spans (a
    span broken across lines joined back, ``reshard.state.sharding.\\n flat_range_boxes``)."""
    out = re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S)
    rest = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)
    out += [re.sub(r"\.\s+", ".", s) for s in re.findall(r"`([^`]+)`", rest)]
    return out


def documented() -> dict[str, str]:
    """Documented path -> where it is named first (``file``)."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for code in code_of(doc.read_text()):
            for m in DOTTED.finditer(code):
                found.setdefault(m.group(0), doc.name)
            for mod, names in FROM.findall(code):
                for name in (n.strip() for n in names.split(",")):
                    if name:
                        found.setdefault(f"{mod}.{name.split(' as ')[0].strip()}", doc.name)
    return found


def test_the_docs_name_the_paths_this_test_reads() -> None:
    paths = documented()
    # a few the pages have always named: the extraction itself is checked
    for p in ("reshard.adapters.layouts", "reshard.collectives.SingleProcess", "reshard.transforms.Rename",
              "reshard.formats.hf_export.export_hf", "reshard.CheckpointManager"):
        assert any(x == p or x.startswith(p + ".") for x in paths), (p, sorted(paths))
    assert not any(p.startswith(("reshard.read_once", "reshard.format_migration")) for p in paths)
    assert "reshard.state.sharding.flat_range_boxes" in paths  # a span broken across two lines


@pytest.mark.parametrize("path", sorted(documented()))
def test_documented_path_imports(path: str) -> None:
    resolve(path)


def test_all_names_import() -> None:
    assert reshard.__all__
    missing = [n for n in reshard.__all__ if not hasattr(reshard, n)]
    assert not missing, missing
    ns: dict[str, Any] = {}
    exec("from reshard import *", ns)  # noqa: S102
    assert set(reshard.__all__) <= set(ns)


@pytest.mark.parametrize("path", PUBLIC)
def test_public_path_imports(path: str) -> None:
    resolve(path)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_of_a_public_package_imports(package: str) -> None:
    pkg = importlib.import_module(package)
    names = [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=package + ".")]
    assert names, package
    for name in names:
        importlib.import_module(name)


def test_entry_point_of_the_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["reshard"] == "reshard.cli:main", scripts
    for target in scripts.values():
        mod, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(mod), attr)), target


def module_of(path: str) -> str:
    """The module ``path`` is found in (the last module on the way to it)."""
    return _walk(path)[1]


def test_each_module_imports_first() -> None:
    """Each module a documented path lives in, as the first ``reshard`` import
    of its interpreter (every ``reshard`` module dropped from ``sys.modules``
    before it, in one fresh process): an import cycle that works in one order
    only, hidden here because this process imported everything already, fails."""
    mods = sorted({module_of(p) for p in (*documented(), *PUBLIC, *PACKAGES)})
    code = "\n".join([
        "import importlib, sys",
        f"for m in {mods!r}:",
        "    for k in [k for k in sys.modules if k == 'reshard' or k.startswith('reshard.')]:",
        "        del sys.modules[k]",
        "    importlib.import_module(m)",
        "print('ok')",
    ])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr


def test_module_paths_before_the_package_layout_still_import() -> None:
    """Every module path of the flat layout (reshard.tiers, reshard.manifest,
    reshard.testing.faults, ...) imports as the module at its new path (the
    same object) with one FutureWarning naming the new path and the release
    that removes the old one; the public functions reshard.save/load/verify
    stay functions; `from reshard.manager import CheckpointManager` works."""
    import subprocess
    import sys

    code = r'''
import importlib, sys, warnings
import reshard
from reshard._moved import MOVED, REMOVED_IN
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new), (old, new)
    assert [str(x.message) for x in w if x.category is FutureWarning] == \
        [f"{old} has moved to {new}: import it from there; the old path is an alias that will be "
         f"removed in reshard {REMOVED_IN}"], (old, [str(x.message) for x in w])
assert callable(reshard.save) and callable(reshard.load) and callable(reshard.verify)
from reshard.manager import CheckpointManager
assert CheckpointManager is reshard.CheckpointManager
print(len(MOVED))
'''
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert int(p.stdout.strip()) >= 30


def test_the_dcp_re_exports_warn_with_their_removal_version() -> None:
    """``reshard.formats.dcp`` (and ``dcp_metadata``, ``dcp_values``,
    ``dcp_blob``), the re-exports of the DCP reader in ``reshard.ondisk``, still
    import, as the module in ``reshard.ondisk``, with a FutureWarning naming
    that module and the release that removes the alias (0.2, the minor
    version after pyproject.toml's); the names stay in ``reshard.formats``
    without a warning."""
    code = r'''
import warnings
warnings.simplefilter("error")
import reshard.formats
from reshard.formats import DCPStorage, open_dcp, read_dcp_metadata
import reshard.ondisk.dcp, reshard.ondisk.dcp_metadata
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    from reshard.formats.dcp import open_dcp as old_open, DCPStorage as old_storage
    from reshard.formats.dcp_metadata import MAX_METADATA_BYTES, read_dcp_metadata as old_read
assert old_open is open_dcp and old_storage is DCPStorage and old_read is read_dcp_metadata
assert MAX_METADATA_BYTES == reshard.ondisk.dcp_metadata.MAX_METADATA_BYTES
for x in w:
    print(x.category.__name__, x.message)
'''
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == [
        "FutureWarning reshard.formats.dcp has moved to reshard.ondisk.dcp: import it from there; "
        "the old path is an alias that will be removed in reshard 0.2",
        "FutureWarning reshard.formats.dcp_metadata has moved to reshard.ondisk.dcp_metadata: import it "
        "from there; the old path is an alias that will be removed in reshard 0.2",
    ], p.stdout + p.stderr

    from reshard._moved import REMOVED_IN

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    release = tuple(int(x) for x in version.split(".")[:2])
    assert release < tuple(int(x) for x in REMOVED_IN.split(".")), (
        f"pyproject.toml's version {version} has reached {REMOVED_IN}, the release that removes the "
        "aliases of reshard/_moved.py: remove them (and docs/architecture.md's paragraph on them)")
