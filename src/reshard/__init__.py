"""reshard: distributed training checkpoints that reshard.

Save the full training state of a model trained with TP/PP/DP/FSDP, commit it
so that a half-written checkpoint never passes for a good one, and load it
into a different parallel layout. See DESIGN.md for the contract.
"""

from . import _moved
from .adapters.data import DataCursor
from .adapters.model import ModelState
from .adapters.optimizer import OptimizerState
from .adapters.rng import RNGState
from .adapters.torch_native import TorchState
from .catalog.verify import VerifyReport, inspect, latest, verify
from .commit.leases import pin
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
from .loading.load import LoadResult, load
from .manager.manager import CheckpointManager
from .ondisk.limits import ReadLimits
from .ondisk.manifest import Manifest
from .options import LoadOptions, SaveOptions
from .saving.save import SaveResult, save
from .saving.staging import SaveHandle, async_save
from .state.sharding import ShardedObject, ShardedTensor

__version__ = "0.1.0"

_moved.install()  # the module paths before the package layout still import (with a warning)

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
    "pin",
    "save",
    "verify",
]
