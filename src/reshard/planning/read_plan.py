"""Load plan: pure functions, no I/O and no torch.distributed.

Load planning intersects each requested box (or flat range of a box) with the
saved chunks of its fqn (``TensorEntry.chunks``) and yields read items with
the exact byte range of the chunk that each needs (after DCP's
``create_read_items_for_chunk_list``). The save plan is in
:mod:`reshard.planning.planner`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardingError
from ..ondisk.manifest import Chunk, TensorEntry
from ..state.geometry import box_intersection, itemsize, numel

Shape = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Request:
    """What one target shard needs: a box of the logical tensor, optionally
    only ``flattened_range`` of its row-major flattening (then the destination
    is 1-D)."""

    fqn: str
    global_offset: Shape
    local_shape: Shape
    flattened_range: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        fr = self.flattened_range
        return numel(self.local_shape) if fr is None else fr[1] - fr[0]


@dataclass(frozen=True, kw_only=True)
class ReadItem:
    """Copy part of one saved chunk into part of one request's destination.

    ``kind`` is

    * ``"box"``: neither side flattened. ``box_offset``/``box_shape`` is the
      overlap in global coordinates; the source is that box inside the chunk
      and the destination that box inside the request.
    * ``"flat"``: same box on both sides: elements ``[flat_start, flat_stop)``
      of the box's flattening are copied (1-D).
    * ``"gather"``: boxes differ and a side is flattened: element-wise index
      mapping over the overlap box (computed at execution).

    ``byte_start``/``byte_stop``: the bytes of the chunk's data (relative to
    the chunk's first byte, half-open) that hold every element this item needs.
    """

    kind: str
    chunk_index: int
    box_offset: Shape
    box_shape: Shape
    flat_start: int = 0
    flat_stop: int = 0
    byte_start: int = 0
    byte_stop: int = 0


def _strides(shape: Shape) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _flat_span(box_off: Shape, box_shape: Shape, sub_off: Shape, sub_shape: Shape) -> tuple[int, int]:
    """Row-major flat index range ``[first, last + 1)`` of sub-box inside box."""
    st = _strides(box_shape)
    first = sum((o - b) * s for o, b, s in zip(sub_off, box_off, st, strict=True))
    last = sum((o + n - 1 - b) * s for o, n, b, s in zip(sub_off, sub_shape, box_off, st, strict=True))
    return first, last + 1


def plan_reads(entry: TensorEntry, req: Request) -> list[ReadItem]:
    """Read items that together fill ``req`` from the saved chunks of ``entry``.

    Raises:
        ShardingError: the request lies outside ``entry.global_shape``.
    """
    gshape = entry.global_shape
    if len(req.global_offset) != len(gshape) or any(
        o + s > g for o, s, g in zip(req.global_offset, req.local_shape, gshape, strict=True)
    ):
        raise ShardingError(
            f"{req.fqn}: requested box at {list(req.global_offset)} shape {list(req.local_shape)} "
            f"lies outside the saved global_shape {list(gshape)}"
        )
    isz = itemsize(entry.dtype)
    out: list[ReadItem] = []
    if req.numel == 0:
        return out
    for ci, c in enumerate(entry.chunks):
        if c.numel == 0:
            continue
        if len(gshape) == 0:
            inter: tuple[Shape, Shape] | None = ((), ())
        else:
            inter = box_intersection(c.global_offset, c.local_shape, req.global_offset, req.local_shape)
        if inter is None:
            continue
        ioff, ishape = inter
        cfr, rfr = c.flattened_range, req.flattened_range
        if cfr is None and rfr is None:
            a, b = _flat_span(c.global_offset, c.local_shape, ioff, ishape)
            out.append(ReadItem(kind="box", chunk_index=ci, box_offset=ioff, box_shape=ishape,
                                byte_start=a * isz, byte_stop=b * isz))
            continue
        if c.global_offset == req.global_offset and c.local_shape == req.local_shape:
            n = numel(c.local_shape)
            ca, cb = cfr if cfr is not None else (0, n)
            ra, rb = rfr if rfr is not None else (0, n)
            lo, hi = max(ca, ra), min(cb, rb)
            if lo < hi:
                out.append(ReadItem(kind="flat", chunk_index=ci, box_offset=ioff, box_shape=ishape,
                                    flat_start=lo, flat_stop=hi,
                                    byte_start=(lo - ca) * isz, byte_stop=(hi - ca) * isz))
            continue
        # general case: the overlap box, restricted to both flat ranges
        a, b = _flat_span(c.global_offset, c.local_shape, ioff, ishape)
        if cfr is not None:
            a, b = max(a, cfr[0]), min(b, cfr[1])
            if a >= b:
                continue
            base = cfr[0]
        else:
            base = 0
        if rfr is not None:
            ra, rb = _flat_span(req.global_offset, req.local_shape, ioff, ishape)
            if max(ra, rfr[0]) >= min(rb, rfr[1]):
                continue
        out.append(ReadItem(kind="gather", chunk_index=ci, box_offset=ioff, box_shape=ishape,
                            byte_start=(a - base) * isz, byte_stop=(b - base) * isz))
    return out


def chunk_request(c: Chunk, fqn: str) -> Request:
    """The request that reads a saved chunk exactly (used by verify and export)."""
    return Request(fqn=fqn, global_offset=c.global_offset, local_shape=c.local_shape,
                   flattened_range=c.flattened_range)
