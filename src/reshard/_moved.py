"""The module paths of reshard before its package layout keep importing, until
reshard :data:`REMOVED_IN`.

``import reshard.tiers`` (now :mod:`reshard.manager.tiers`) and the like
resolve, through a finder on ``sys.meta_path``, to the module at its new path
(the same module object, so its classes are the same), with one
FutureWarning naming the new path and the release that removes the old one.
The re-export modules ``reshard.formats.dcp``, ``dcp_metadata``,
``dcp_values`` and ``dcp_blob`` are aliases here too (their modules live in
:mod:`reshard.ondisk`; the names users import, ``open_dcp``, ``DCPStorage``,
``read_dcp_metadata``, ..., stay in :mod:`reshard.formats`). Only whole
modules are mapped here; names that are public API are in ``reshard.__all__``
and its subpackages (``reshard.formats``, ``reshard.adapters``,
``reshard.storage``, ``reshard.transforms``, ``reshard.collectives``,
``reshard.testing``).
``reshard.save``, ``reshard.load`` and ``reshard.verify`` are the public
functions, so their old modules are not mapped (their contents are at
:mod:`reshard.saving.save`, :mod:`reshard.loading.load`,
:mod:`reshard.catalog.verify`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: the release that removes every path of :data:`MOVED` (the next minor
#: version after the one that made them aliases)
REMOVED_IN = "0.2"

#: old dotted module path -> its path now
MOVED: dict[str, str] = {
    "reshard.attempts": "reshard.commit.attempts",
    "reshard.cli_bench": "reshard.cli.bench",
    "reshard.cli_demo": "reshard.cli.demo",
    "reshard.cli_faults": "reshard.cli.faults",
    "reshard.cli_plan": "reshard.cli.plan",
    "reshard.cli_support": "reshard.cli.support",
    "reshard.codec": "reshard.ondisk.codec",
    "reshard.coordination": "reshard.planning.coordination",
    "reshard.coordination_load": "reshard.planning.coordination_load",
    "reshard.diff": "reshard.catalog.diff",
    "reshard.formats.dcp": "reshard.ondisk.dcp",
    "reshard.formats.dcp_blob": "reshard.ondisk.dcp_blob",
    "reshard.formats.dcp_metadata": "reshard.ondisk.dcp_metadata",
    "reshard.formats.dcp_values": "reshard.ondisk.dcp_values",
    "reshard.dryrun": "reshard.planning.dryrun",
    "reshard.lineage": "reshard.commit.lineage",
    "reshard.manifest": "reshard.ondisk.manifest",
    "reshard.pending": "reshard.saving.pending",
    "reshard.plan_store": "reshard.planning.plan_store",
    "reshard.reading": "reshard.loading.reading",
    "reshard.records": "reshard.catalog.records",
    "reshard.resume": "reshard.manager.resume",
    "reshard.retention": "reshard.commit.retention",
    "reshard.shardfile": "reshard.ondisk.shardfile",
    "reshard.sharding": "reshard.state.sharding",
    "reshard.staging": "reshard.saving.staging",
    "reshard.testing.data": "reshard.demo.data",
    "reshard.testing.demo": "reshard.demo.job",
    "reshard.testing.demo_core": "reshard.demo.ranks",
    "reshard.testing.fault_matrix": "reshard.faults.matrix",
    "reshard.testing.fault_matrix_s3": "reshard.faults.matrix_s3",
    "reshard.testing.faults": "reshard.faults.inject",
    "reshard.testing.fuzz": "reshard.fuzz.runner",
    "reshard.testing.fuzz_cases": "reshard.fuzz.cases",
    "reshard.testing.model": "reshard.demo.model",
    "reshard.testing.parity": "reshard.demo.parity",
    "reshard.testing.real_ranks": "reshard.bench.real_ranks",
    "reshard.testing.scale_layout": "reshard.bench.scale_layout",
    "reshard.testing.scale_sim": "reshard.bench.scale_sim",
    "reshard.testing.simulate": "reshard.bench.simulate",
    "reshard.testing.trainer": "reshard.demo.trainer",
    "reshard.tiers": "reshard.manager.tiers",
    "reshard.tree": "reshard.state.tree",
}


def message(old: str) -> str:
    """The FutureWarning an import of the old path ``old`` gives."""
    return (f"{old} has moved to {MOVED[old]}: import it from there; the old path is an alias "
            f"that will be removed in reshard {REMOVED_IN}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads them as the new module."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(message(spec.name), FutureWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: :meth:`create_module` returned the imported module."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
