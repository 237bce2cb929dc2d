"""Sharded data model: ShardedTensor, ShardedObject and chunk geometry.

Conventions (the field's standard terms; all in *elements*, row-major,
intervals half-open):

* ``global_shape``: shape of the logical (unsharded) tensor.
* ``global_offset``: index in the global tensor where ``data[0, ..., 0]`` sits.
* ``local_shape``: shape of the box this shard covers.
* ``flattened_range``: a ``slice(start, stop)`` over the row-major flattening
  of the ``local_shape`` box (ZeRO / flat-buffer optimizers); ``data`` is then
  1-D of length ``stop - start``.
* A *chunk* is ``(global_offset, local_shape[, flattened_range])``.
* ``replica_id``: identifies one holder among several holding the same bytes of
  a chunk. The save planner chooses which holder writes; any value is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import ShardingError
from .geometry import (  # noqa: F401 - the torch-free part, re-exported under its old names
    _ST_VIEWS,
    DTYPE_NAMES,
    DTYPES,
    VIEW_METADATA_PREFIX,
    Shape,
    box_intersection,
    dtype_from_safetensors,
    flat_range_boxes,
    itemsize,
    numel,
    safetensors_code,
    safetensors_entry,
    safetensors_view,
)

# torch dtype <-> manifest dtype name (the allow-list of :data:`DTYPES`)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {n: (getattr(torch, n), code) for n, (code, _) in DTYPES.items()}
_NAME_OF: dict[torch.dtype, str] = {t: n for n, (t, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Manifest name of a torch dtype; ShardingError if not on the allow-list."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ShardingError(
            f"dtype {dtype} is not supported (allowed: {', '.join(sorted(_DTYPES))})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a manifest dtype name; ShardingError if unknown."""
    try:
        return _DTYPES[name][0]
    except KeyError:
        raise ShardingError(f"unknown dtype name {name!r}") from None


def _as_shape(value: Any, what: str, fqn: str) -> Shape:
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ShardingError(f"{fqn}: {what} must be a sequence of ints, got {value!r}") from None
    if any(v < 0 for v in out):
        raise ShardingError(f"{fqn}: {what} has a negative entry: {out}")
    return out


def _as_replica(value: Any) -> int | tuple[int, ...]:
    if isinstance(value, int):
        return value
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ShardedTensor:
    """One rank's shard of a logical tensor, or a request for one at load.

    Args:
        fqn: stable name of the logical tensor, relative to its container in
            the state tree: it takes the place of the key under which the
            record sits (``{"model": {"w": ShardedTensor("mlp.gate", ...)}}``
            saves ``model.mlp.gate``; at the root the fqn is the key).
        data: the local tensor. Shape ``local_shape``; or, with
            ``flattened_range``, 1-D of length ``stop - start``. At load it is
            the destination buffer, filled in place.
        global_shape: shape of the logical tensor, in elements.
        global_offset: where ``data[0, ..., 0]`` sits in the logical tensor.
        local_shape: shape of the box this shard covers (default ``data.shape``;
            required with ``flattened_range``).
        flattened_range: ``slice(start, stop)`` of the row-major flattening of
            the ``local_shape`` box held in ``data`` (step must be 1).
        replica_id: which holder of these bytes this is (int or tuple of ints);
            the save planner picks one writer among holders of the same chunk.

    Raises:
        ShardingError: offsets outside ``global_shape``, ``local_shape`` not
            matching ``data``, an unsupported dtype, a bad ``flattened_range``.
    """

    fqn: str
    data: torch.Tensor
    global_shape: Shape = field(kw_only=True)
    global_offset: Shape = field(kw_only=True)
    # None (the default) stands for data.shape; __post_init__ replaces it with a Shape
    local_shape: Shape = field(default=cast(Shape, None), kw_only=True)
    flattened_range: slice | None = field(default=None, kw_only=True)
    replica_id: int | tuple[int, ...] = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        fqn = self.fqn
        if not isinstance(fqn, str) or not fqn:
            raise ShardingError(f"ShardedTensor fqn must be a non-empty str, got {fqn!r}")
        if not isinstance(self.data, torch.Tensor):
            raise ShardingError(f"{fqn}: data must be a torch.Tensor, got {type(self.data).__name__}")
        dtype_name(self.data.dtype)
        gshape = _as_shape(self.global_shape, "global_shape", fqn)
        goff = _as_shape(self.global_offset, "global_offset", fqn)
        if len(goff) != len(gshape):
            raise ShardingError(
                f"{fqn}: global_offset {goff} has {len(goff)} dims, global_shape {gshape} has {len(gshape)}"
            )
        fr = self.flattened_range
        if fr is None:
            lshape = _as_shape(
                self.data.shape if self.local_shape is None else self.local_shape, "local_shape", fqn
            )
            if tuple(self.data.shape) != lshape:
                raise ShardingError(
                    f"{fqn}: local_shape {lshape} does not match data shape {tuple(self.data.shape)}"
                )
        else:
            if self.local_shape is None:
                raise ShardingError(f"{fqn}: flattened_range needs local_shape (the chunk box)")
            lshape = _as_shape(self.local_shape, "local_shape", fqn)
            if not isinstance(fr, slice) or fr.step not in (None, 1):
                raise ShardingError(f"{fqn}: flattened_range must be a slice with step 1, got {fr!r}")
            start, stop = fr.start or 0, fr.stop
            if stop is None or not (0 <= start <= stop <= numel(lshape)):
                raise ShardingError(
                    f"{fqn}: flattened_range {start}:{stop} is outside the box of {numel(lshape)} elements"
                )
            if self.data.dim() != 1 or self.data.numel() != stop - start:
                raise ShardingError(
                    f"{fqn}: with flattened_range {start}:{stop}, data must be 1-D of length "
                    f"{stop - start}, got shape {tuple(self.data.shape)}"
                )
            object.__setattr__(self, "flattened_range", slice(start, stop))
        if len(lshape) != len(gshape):
            raise ShardingError(f"{fqn}: local_shape {lshape} and global_shape {gshape} differ in rank")
        for d, (o, s, g) in enumerate(zip(goff, lshape, gshape, strict=True)):
            if o + s > g or (s > 0 and o >= g):
                raise ShardingError(
                    f"{fqn}: dim {d}: global_offset {o} + local_shape {s} exceeds global_shape {g}"
                )
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "global_offset", goff)
        object.__setattr__(self, "local_shape", lshape)
        object.__setattr__(self, "replica_id", _as_replica(self.replica_id))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def flat_bounds(self) -> tuple[int, int] | None:
        """``(start, stop)`` of ``flattened_range``, or None."""
        fr = self.flattened_range
        return None if fr is None else (int(fr.start), int(fr.stop))

    @classmethod
    def from_rank_offsets(
        cls,
        fqn: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: int | tuple[int, ...] = 0,
    ) -> ShardedTensor:
        """Megatron-style constructor: ``(axis, rank, num_shards)`` per sharded axis.

        The axis must be split evenly: the global size of ``axis`` is
        ``data.shape[axis] * num_shards`` and the offset ``rank * data.shape[axis]``.
        """
        gshape = list(data.shape)
        goff = [0] * data.dim()
        for axis, rank, n in rank_offsets:
            goff[axis] = rank * data.shape[axis]
            gshape[axis] = data.shape[axis] * n
        return cls(fqn, data, global_shape=tuple(gshape), global_offset=tuple(goff), replica_id=replica_id)


@dataclass(frozen=True)
class ShardedObject:
    """A per-rank value that is not a replica: one element of a grid of objects.

    Args:
        key: stable name of the object grid, relative to its container in the
            state tree like a tensor's fqn.
        value: a plain value (stored in reshard's typed, pickle-free encoding).
        global_shape: shape of the grid, e.g. ``(pp, tp)`` or ``(world_size,)``;
            ``()`` for a single object.
        global_offset: this element's index in the grid.
        replica_id: holders of the same element with another replica_id are
            replicas; one of them writes.

    Loading into a grid of another shape raises ShardingError unless a rule for
    the object says how to reshard it.
    """

    key: str
    value: Any
    global_shape: Shape = field(default=(), kw_only=True)
    global_offset: Shape = field(default=(), kw_only=True)
    replica_id: int | tuple[int, ...] = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ShardingError(f"ShardedObject key must be a non-empty str, got {self.key!r}")
        gshape = _as_shape(self.global_shape, "global_shape", self.key)
        goff = _as_shape(self.global_offset, "global_offset", self.key)
        if len(gshape) != len(goff) or any(o >= g for o, g in zip(goff, gshape, strict=True)):
            raise ShardingError(
                f"{self.key}: global_offset {goff} is not inside the object grid {gshape}"
            )
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "global_offset", goff)
        object.__setattr__(self, "replica_id", _as_replica(self.replica_id))

    @property
    def fqn(self) -> str:
        return self.key
