"""TorchTitan's dataloader state in a reshard checkpoint, without unpickling at load.

TorchTitan's ``ParallelAwareDataloader.state_dict()`` is ``{"dp_rank_<r>":
pickle.dumps(StatefulDataLoader.state_dict()), "world_size": dp}``. At save the
blob is decoded by an unpickler that resolves no class (:func:`decode_loader_blob`)
and stored as plain values in reshard's typed encoding, one element per DP rank of
a ``(dp,)`` :class:`~reshard.ShardedObject` grid (:class:`LoaderState`); a blob
that holds more than plain data stays a blob, loaded only when trusted. Used by
:mod:`reshard.integrations.torchtitan`; imports no TorchTitan.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError, ShardingError
from ..ondisk import codec
from ..ondisk.manifest import Manifest
from ..state.sharding import ShardedObject

__all__ = ["DCPLoaderState", "LoaderState", "decode_loader_blob"]

_RANK_KEY = re.compile(r"^dp_rank_(\d+)$")


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that resolves no global at all: only the opcodes of plain
    data (None, bools, ints, floats, str, bytes, lists, tuples, dicts, sets)
    can build anything, so nothing runs while it reads."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")


def decode_loader_blob(blob: bytes, *, trust: bool = False, where: str = "dataloader") -> Any:
    """The state a TorchTitan dataloader pickled (``pickle.dumps`` of its
    ``StatefulDataLoader.state_dict()``), read by an unpickler that resolves no
    class, so a crafted blob cannot run anything. ``trust=True``: a blob that
    holds more than plain data is read with ``pickle.loads``.

    Raises:
        CheckpointError: the blob holds a class or callable and ``trust`` is False
            (one line naming ``trust_pickled_dataloader``), or it is not a pickle.
    """
    try:
        return _PlainUnpickler(io.BytesIO(blob)).load()
    except pickle.UnpicklingError as e:
        if not str(e).startswith("refused"):
            raise CheckpointError(f"{where}: not a pickle ({e})") from None
        if trust:
            return pickle.loads(blob)  # noqa: S301 - the caller trusts this checkpoint (explicit option)
        raise CheckpointError(
            f"{where}: the dataloader state holds more than plain data ({e}); reshard unpickles "
            "nothing by default: pass ReshardCheckpointManager.Config(trust_pickled_dataloader=True) "
            "if you trust this checkpoint, or exclude_from_loading=['dataloader']") from None
    except (EOFError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"{where}: not a pickle ({type(e).__name__}: {e})") from None


def _plain(x: Any) -> bool:
    """Whether ``x`` round-trips through reshard's typed encoding."""
    try:
        return codec.from_json(codec.to_json(x, path="dataloader")) == x
    except (TypeError, ValueError):
        return False


def _encode_loader_state(sd: Mapping[str, Any], trust: bool) -> dict[str, Any]:
    """A dataloader's ``state_dict()`` as a value of reshard's encoding:
    ``{"plain": {...}, "blobs": {key: decoded state}, "pickled": {key: blob}}``
    (a blob that is not plain data stays a blob, loaded only when trusted)."""
    plain: dict[str, Any] = {}
    blobs: dict[str, Any] = {}
    pickled: dict[str, bytes] = {}
    for k, v in sd.items():
        if isinstance(v, bytes) and _RANK_KEY.match(str(k)):
            try:  # this process pickled it a moment ago; still read without resolving classes
                state = decode_loader_blob(v)
            except CheckpointError:
                pickled[str(k)] = v
                continue
            if _plain(state):
                blobs[str(k)] = state
            else:
                pickled[str(k)] = v
        else:
            plain[str(k)] = v
    return {"plain": plain, "blobs": blobs, "pickled": pickled}


def _decode_loader_state(value: Any, trust: bool, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not {"plain", "blobs", "pickled"} <= set(value):
        raise ShardingError(f"{where}: the saved dataloader state is not in the form this "
                            "integration writes ({'plain', 'blobs', 'pickled'})")
    sd = dict(value["plain"])
    for k, v in value["blobs"].items():
        sd[k] = pickle.dumps(v)  # plain values this process re-pickles for TorchTitan's loader
    for k, v in value["pickled"].items():
        sd[k] = pickle.dumps(decode_loader_blob(v, trust=trust, where=where))
    return sd


class LoaderState:
    """Stateful: a TorchTitan dataloader's state as element ``(dp_rank,)`` of a
    ``(dp_size,)`` grid of objects (the ranks of one DP rank hold replicas)."""

    def __init__(self, dataloader: Any, dp_rank: int, dp_size: int, replica: int, trust: bool):
        self.dataloader, self.dp_rank, self.dp_size = dataloader, dp_rank, dp_size
        self.replica, self.trust = replica, trust

    def state_dict(self) -> dict[str, Any]:
        value = _encode_loader_state(self.dataloader.state_dict(), self.trust)
        return {"state": ShardedObject("state", value, global_shape=(self.dp_size,),
                                       global_offset=(self.dp_rank,), replica_id=self.replica)}

    def reshard_prepare_load(self, m: Manifest) -> None:
        oe = m.objects.get("state")
        if oe is not None and tuple(oe.global_shape) != (self.dp_size,):
            raise ShardingError(
                f"TorchTitan dataloader state was saved by {oe.global_shape[0]} DP ranks and this "
                f"run has {self.dp_size}: its per-rank state cannot be resharded; resume at "
                f"{oe.global_shape[0]} DP ranks, exclude_from_loading=['dataloader'] (the data "
                "restarts), or use a reshard.DataCursor loader")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ob = sd["state"]
        self.dataloader.load_state_dict(_decode_loader_state(ob.value, self.trust, "dataloader.state"))


class DCPLoaderState:
    """Stateful: a TorchTitan DCP checkpoint's dataloader values of this DP rank
    (``dp_rank_<r>`` and ``world_size``), their blob decoded by
    :func:`decode_loader_blob` (before the load: see
    :meth:`ReshardCheckpointManager._load_dcp`)."""

    def __init__(self, dataloader: Any, dp_rank: int, dp_size: int, decoded: Any):
        self.dataloader, self.dp_rank, self.dp_size, self.decoded = dataloader, dp_rank, dp_size, decoded

    def state_dict(self) -> dict[str, Any]:
        # every DP rank's entry is asked for (small values), so that no saved one is unexpected
        return {**{f"dp_rank_{r}": b"" for r in range(self.dp_size)}, "world_size": 0}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.dataloader.load_state_dict({f"dp_rank_{self.dp_rank}": pickle.dumps(self.decoded),
                                         "world_size": sd["world_size"]})
