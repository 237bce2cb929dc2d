"""The torch-free part of the data model: the dtype allow-list (manifest
names, bytes per element, safetensors codes) and chunk geometry (all in
*elements*, row-major, boxes half-open). :mod:`reshard.state.sharding` adds the
torch side (``ShardedTensor``, torch dtypes) and re-exports every name here;
the manifest, the listing and the load dry run use this module alone, so the
``reshard`` command lists, inspects and plans without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import ShardingError

Shape = tuple[int, ...]

#: manifest dtype name -> (safetensors code, bytes per element). The allow-list:
#: every dtype torch has that safetensors can store (the torch dtype of a name
#: is ``getattr(torch, name)``: :func:`reshard.state.sharding.torch_dtype`).
#: complex128: safetensors has no code for it; stored as float64 pairs, i.e. the
#: header says F64 with a trailing dimension of 2 (real, imaginary), and the
#: file's __metadata__ records "reshard.view.<name>": "complex128"
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint64": ("U64", 8),
    "uint32": ("U32", 4),
    "uint16": ("U16", 2),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "complex64": ("C64", 8),
    "complex128": ("F64", 16),
}
# dtype name -> (safetensors code, trailing dimension) for dtypes stored as a view
_ST_VIEWS: dict[str, tuple[str, int]] = {"complex128": ("F64", 2)}
VIEW_METADATA_PREFIX = "reshard.view."
_NAME_OF_ST: dict[str, str] = {st: n for n, (st, _) in DTYPES.items() if n not in _ST_VIEWS}

DTYPE_NAMES: frozenset[str] = frozenset(DTYPES)


def safetensors_code(name: str) -> str:
    """safetensors header code ("F32", "BF16", ...) of a manifest dtype name."""
    return DTYPES[name][0]


def safetensors_entry(name: str, shape: Sequence[int]) -> tuple[str, list[int]]:
    """``(safetensors code, header shape)`` of a tensor of dtype ``name`` and
    ``shape`` (elements): the shape itself, or for a dtype stored as a view
    (complex128 as float64 pairs) the shape with its trailing dimension."""
    view = _ST_VIEWS.get(name)
    if view is None:
        return DTYPES[name][0], list(shape)
    return view[0], [*shape, view[1]]


def safetensors_view(name: str, code: str, shape: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """Inverse of :func:`safetensors_entry` for a header entry recorded as a
    view of dtype ``name``: ``(dtype name, shape)``; ShardingError when the
    entry cannot be that view."""
    view = _ST_VIEWS.get(name)
    if view is None or code != view[0] or not shape or shape[-1] != view[1]:
        raise ShardingError(f"a {code} {list(shape)} entry cannot hold a {name} view "
                            f"(known views: {sorted(_ST_VIEWS)})")
    return name, tuple(shape[:-1])


def dtype_from_safetensors(code: str) -> str:
    """Manifest dtype name of a safetensors dtype code; ShardingError if unknown."""
    try:
        return _NAME_OF_ST[code]
    except KeyError:
        raise ShardingError(f"unsupported safetensors dtype {code!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a manifest dtype name; ShardingError if unknown."""
    try:
        return DTYPES[name][1]
    except KeyError:
        raise ShardingError(f"unknown dtype name {name!r}") from None


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a box (1 for the 0-dim shape ``()``)."""
    return math.prod(shape)


def box_intersection(
    off_a: Sequence[int], shape_a: Sequence[int], off_b: Sequence[int], shape_b: Sequence[int]
) -> tuple[Shape, Shape] | None:
    """Intersection of two boxes, as ``(offset, shape)``, or None when empty.

    Boxes are half-open: ``[off, off + shape)`` per dimension. A 0-dim box
    (``()``, ``()``) intersects another 0-dim box in the 0-dim box.
    """
    off: list[int] = []
    shp: list[int] = []
    for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b, strict=True):
        lo = max(oa, ob)
        hi = min(oa + sa, ob + sb)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Shape, Shape]]:
    """Elements ``[start, stop)`` of the row-major flattening of a box of
    ``shape``, as disjoint boxes ``(offset, shape)`` relative to the box's
    origin, in flat order: at most ``2 * len(shape) - 1`` of them (a partial
    leading row, a run of whole rows, a partial trailing row, recursively).
    An empty range gives ``[]``; a 0-dim box gives ``[((), ())]``.
    """
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, ra = divmod(start, inner)
    r1, rb = divmod(stop, inner)
    zeros = (0,) * (len(shape) - 1)

    def row(r: int, a: int, b: int) -> list[tuple[Shape, Shape]]:
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, ra, rb)
    out: list[tuple[Shape, Shape]] = []
    if ra:
        out += row(r0, ra, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *zeros), (r1 - r0, *shape[1:])))
    if rb:
        out += row(r1, 0, rb)
    return out
