"""DTensor leaves: a DTensor is sharded as its placements say.

``Shard(d)`` (even or uneven), ``_StridedShard`` (FSDP2 over TP on a 2-D
mesh: the local rows still form one box of the global tensor) and
``Replicate()`` placements on any mesh map
to one ShardedTensor per rank: the local tensor with its global offset
(``compute_local_shape_and_global_offset``, as DCP does) and a replica_id
counting the rank's position along the replicated mesh dimensions. ``Partial``
is refused (reduce it first).
"""

from __future__ import annotations

from typing import Any

from ..errors import ShardingError
from ..sharding import ShardedTensor

_BOXES: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _local_box(shape: tuple[int, ...], mesh: Any, coord: Any, placements: tuple[Any, ...]) -> tuple[Any, Any]:
    """``compute_local_shape_and_global_offset`` (as DCP does), remembered per
    (global shape, mesh shape, this rank's mesh coordinate, placements), all
    it depends on: a state's hundreds of DTensors repeat a few layouts, and
    every save describes each of them again."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    try:
        key: tuple[Any, ...] | None = (shape, tuple(mesh.shape), tuple(int(c) for c in coord), placements)
        got = _BOXES.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable placement or symbolic coordinate: not remembered
        key, got = None, None
    if got is None:
        got = compute_local_shape_and_global_offset(shape, mesh, placements)
        if key is not None:
            if len(_BOXES) >= 8192:
                _BOXES.clear()
            _BOXES[key] = got
    return got


def dtensor_shards(fqn: str, dt: Any) -> list[ShardedTensor]:
    """The ShardedTensor(s) describing this rank's part of DTensor ``dt``.

    Raises:
        ShardingError: a ``Partial`` or otherwise unsupported placement.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return []
    replica = 0
    for d, p in enumerate(dt.placements):
        if isinstance(p, Partial):
            raise ShardingError(f"{fqn}: DTensor with a Partial placement on mesh dim {d} cannot be "
                                "saved; reduce it (redistribute to Replicate/Shard) first")
        if isinstance(p, Replicate):
            replica = replica * mesh.size(d) + coord[d]
        elif not isinstance(p, (Shard, _StridedShard)):  # _StridedShard: FSDP2 over TP
            raise ShardingError(f"{fqn}: DTensor placement {p!r} is not supported")
    shape, offset = _local_box(tuple(dt.shape), mesh, coord, tuple(dt.placements))
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ShardingError(f"{fqn}: DTensor local shape {tuple(local.shape)} differs from the "
                            f"shape {tuple(shape)} its placements imply")
    return [ShardedTensor(fqn, local, global_shape=tuple(dt.shape), global_offset=tuple(offset),
                          replica_id=replica)]
