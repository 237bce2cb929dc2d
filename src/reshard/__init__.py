"""reshard: distributed training checkpoints that reshard.

Save the full training state of a model trained with TP/PP/DP/FSDP, commit it
so that a half-written checkpoint never passes for a good one, and load it
into a different parallel layout. See DESIGN.md for the contract.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import wrapt

from . import _moved
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoverageError,
    IntegrityError,
    ManifestError,
    RankFailure,
    RootOwnedError,
    ShardingError,
    StorageError,
)

if TYPE_CHECKING:  # imported on first use (below), so `import reshard` does not import torch
    from .adapters.data import DataCursor
    from .adapters.model import ModelState
    from .adapters.optimizer import OptimizerState
    from .adapters.rng import RNGState
    from .adapters.torch_native import TorchState
    from .catalog.newest import load_latest, pin_latest
    from .catalog.verify import VerifyReport, inspect, latest, verify
    from .commit.leases import pin
    from .loading.load import LoadResult, load
    from .loading.read_state import read_state
    from .manager.manager import CheckpointManager
    from .ondisk.limits import ReadLimits
    from .ondisk.manifest import Manifest
    from .options import LoadOptions, SaveOptions
    from .saving.save import SaveResult, save
    from .saving.staging import SaveHandle, async_save, prewarm_staging, wait_for_staging
    from .state.kinds import register_state_kind
    from .state.sharding import ShardedObject, ShardedTensor

#: public name -> the module that defines it; imported when the name is first
#: used (PEP 562), so that ``import reshard`` and the ``reshard`` command's
#: listing and inspection import no torch (the CLI starts in a fraction of a second)
_LAZY: dict[str, str] = {
    "DataCursor": ".adapters.data",
    "ModelState": ".adapters.model",
    "OptimizerState": ".adapters.optimizer",
    "RNGState": ".adapters.rng",
    "TorchState": ".adapters.torch_native",
    "load_latest": ".catalog.newest",
    "pin_latest": ".catalog.newest",
    "VerifyReport": ".catalog.verify",
    "inspect": ".catalog.verify",
    "latest": ".catalog.verify",
    "verify": ".catalog.verify",
    "pin": ".commit.leases",
    "LoadResult": ".loading.load",
    "load": ".loading.load",
    "read_state": ".loading.read_state",
    "CheckpointManager": ".manager.manager",
    "ReadLimits": ".ondisk.limits",
    "Manifest": ".ondisk.manifest",
    "LoadOptions": ".options",
    "SaveOptions": ".options",
    "SaveResult": ".saving.save",
    "save": ".saving.save",
    "SaveHandle": ".saving.staging",
    "async_save": ".saving.staging",
    "prewarm_staging": ".saving.staging",
    "wait_for_staging": ".saving.staging",
    "register_state_kind": ".state.kinds",
    "ShardedObject": ".state.sharding",
    "ShardedTensor": ".state.sharding",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; a subpackage or
    module of reshard (``reshard.collectives`` after a bare ``import reshard``),
    imported when first named."""
    mod = _LAZY.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(mod, __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

_moved.install()  # the module paths before the package layout still import (with a warning)


def _watch_optimizer_steps(optimizer_module: Any) -> None:
    from .adapters import grads

    grads.install(optimizer_module)


# OptimizerState tells a step boundary from gradient accumulation by a global
# optimizer step post-hook: installed as soon as torch.optim is imported (at once
# when it already is), so every step is seen without `import reshard` importing torch
wrapt.register_post_import_hook(_watch_optimizer_steps, "torch.optim.optimizer")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DataCursor",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "CheckpointNotFoundError",
    "CoverageError",
    "IntegrityError",
    "LoadOptions",
    "LoadResult",
    "Manifest",
    "ManifestError",
    "RankFailure",
    "ReadLimits",
    "RootOwnedError",
    "SaveOptions",
    "SaveResult",
    "SaveHandle",
    "ShardedObject",
    "ShardedTensor",
    "ShardingError",
    "StorageError",
    "TorchState",
    "VerifyReport",
    "async_save",
    "inspect",
    "latest",
    "load",
    "load_latest",
    "pin",
    "pin_latest",
    "prewarm_staging",
    "read_state",
    "register_state_kind",
    "save",
    "verify",
    "wait_for_staging",
]
