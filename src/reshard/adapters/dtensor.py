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

import torch

from ..errors import ShardingError
from ..state.sharding import ShardedTensor


def dtensor_shards(fqn: str, dt: Any) -> list[ShardedTensor]:
    """The ShardedTensor(s) describing this rank's part of DTensor ``dt``.

    Raises:
        ShardingError: a ``Partial`` or otherwise unsupported placement.
    """
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return []
    gshape, placements = tuple(dt.shape), tuple(dt.placements)
    try:
        key: tuple[Any, ...] | None = (gshape, tuple(mesh.shape), tuple(int(c) for c in coord), placements)
        box = _BOXES.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable placement or a symbolic coordinate: not remembered
        key, box = None, None
    if box is None:
        box = _box(gshape, mesh, coord, placements)
        if key is not None:
            if len(_BOXES) >= 8192:
                _BOXES.clear()
            _BOXES[key] = box
    if isinstance(box, str):
        raise ShardingError(f"{fqn}: {box}")
    shape, offset, replica = box
    # the local shard itself: ``to_local()`` without its autograd node (what
    # ``to_local`` returns under no_grad; the same storage either way)
    local = getattr(dt, "_local_tensor", None)
    if not isinstance(local, torch.Tensor):
        local = dt.to_local()
    if tuple(local.shape) != shape:
        raise ShardingError(f"{fqn}: DTensor local shape {tuple(local.shape)} differs from the "
                            f"shape {shape} its placements imply")
    return [ShardedTensor(fqn, local, global_shape=gshape, global_offset=offset, replica_id=replica)]


#: ``_box`` results by (global shape, mesh shape, this rank's mesh coordinate,
#: placements), all they depend on: a state's hundreds of DTensors repeat a
#: few layouts, and every save and load describes each of them again
_BOXES: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...], int] | str] = {}


def _box(gshape: tuple[int, ...], mesh: Any, coord: Any,
         placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int] | str:
    """This rank's ``(local shape, global offset, replica id)`` of a DTensor of
    global shape ``gshape`` on ``mesh`` (where this rank sits at ``coord``)
    with ``placements`` (``compute_local_shape_and_global_offset``, as DCP
    does); a str: why the placements are refused."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    replica = 0
    for d, p in enumerate(placements):
        if isinstance(p, Partial):
            return (f"DTensor with a Partial placement on mesh dim {d} cannot be saved; reduce it "
                    "(redistribute to Replicate/Shard) first")
        if isinstance(p, Replicate):
            replica = replica * mesh.size(d) + coord[d]
        elif not isinstance(p, (Shard, _StridedShard)):  # _StridedShard: FSDP2 over TP
            return f"DTensor placement {p!r} is not supported"
    shape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
    return tuple(shape), tuple(offset), replica
