"""Schema migrations applied at load: the saved checkpoint is read through
them into targets of a newer schema. Nothing is ever cast, renamed, split or
padded implicitly; each of these is a transform passed to ``load`` (and the
manifest's ``schema_version`` is checked against ``LoadOptions.schema_version``).

Transforms that rename or drop saved keys act on the manifest view
(:meth:`apply_manifest`). Transforms that change geometry or dtype turn one
target request into *pieces*: parts of saved tensors and the destination
region each fills (:func:`resolve`). Every piece is checked against the saved
global shape before anything is written.

Available:

* :class:`Rename` (regex over saved names), :class:`Reset` (drop saved state
  of chosen keys and initialise them: optimizer reset),
* :class:`Cast` (explicit dtype conversion, e.g. bf16 optimizer state <->
  fp32 master weights), :class:`Transpose`,
* :class:`Split` (a saved fused tensor, e.g. ``qkv`` packed ``[q; k; v]`` or
  ``[gate; up]``, into target parts) and :class:`Merge` (saved parts into a
  fused target),
* :class:`ResizeVocab` (grow or shrink one dimension, new rows filled by a rule).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from .errors import ShardingError
from .ondisk.manifest import Manifest, TensorEntry
from .state.sharding import ShardedTensor, dtype_name

Shape = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Fill ``dst`` (a view of, or a temporary for, the target's data) from the
    box ``[offset, offset + shape)`` (optionally ``flattened_range``) of the
    saved tensor ``saved``."""

    saved: str
    offset: Shape
    shape: Shape
    dst: torch.Tensor
    flattened_range: tuple[int, int] | None = None


@dataclass
class Resolution:
    pieces: list[Piece] = field(default_factory=list)
    #: run after every read of this load succeeded (copy temporaries back, fill)
    finalize: list[Callable[[], None]] = field(default_factory=list)


def _match(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


@dataclass(frozen=True)
class Rename:
    """Rename saved keys (tensors, objects, values, aliases) by regex:
    ``re.sub(pattern, repl, name)``, e.g. ``Rename(r"^model\\.", "")``."""

    pattern: str
    repl: str

    def apply_manifest(self, m: Manifest) -> Manifest:
        rx = re.compile(self.pattern)

        def ren(d: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in d.items():
                nk = rx.sub(self.repl, k)
                if nk in out:
                    raise ShardingError(f"Rename({self.pattern!r}, {self.repl!r}): two saved keys "
                                        f"map to {nk!r}")
                out[nk] = v
            return out

        aliases = {rx.sub(self.repl, a): rx.sub(self.repl, t) for a, t in m.aliases.items()}
        return msgspec.structs.replace(m, tensors=ren(m.tensors), objects=ren(m.objects),
                                       values=ren(m.values or {}), aliases=aliases)


@dataclass(frozen=True)
class Reset:
    """Ignore the saved state of keys matching ``pattern`` (glob) and
    initialise their targets by ``rule`` ("zeros", "keep" or a callable
    ``(fqn, tensor) -> None``): e.g. reset optimizer state of new layers."""

    pattern: str
    rule: Any = "zeros"

    def apply_manifest(self, m: Manifest) -> Manifest:
        keep = {k: v for k, v in m.tensors.items() if not _match(self.pattern, k)}
        objs = {k: v for k, v in m.objects.items() if not _match(self.pattern, k)}
        return msgspec.structs.replace(m, tensors=keep, objects=objs)

    def allow_missing(self) -> tuple[str, Any]:
        return (self.pattern, self.rule)


@dataclass(frozen=True)
class Cast:
    """Allow loading saved tensors matching ``pattern`` (glob over target
    fqns) into targets of another dtype (``dtype``: only into that dtype;
    None: into any)."""

    pattern: str
    dtype: torch.dtype | None = None

    def allows(self, fqn: str, dtype: torch.dtype) -> bool:
        return _match(self.pattern, fqn) and (self.dtype is None or self.dtype == dtype)


@dataclass(frozen=True)
class Transpose:
    """The saved tensor is the transpose (``dims`` swapped) of the target
    (e.g. a Conv1D-style ``[in, out]`` weight loaded as ``[out, in]``)."""

    pattern: str
    dims: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class Split:
    """A saved fused tensor ``source`` (concatenation of ``targets`` along
    ``dim``, with ``sizes`` along it) fills the separate target tensors."""

    source: str
    targets: tuple[str, ...]
    sizes: tuple[int, ...]
    dim: int = 0


@dataclass(frozen=True)
class Merge:
    """Saved separate tensors ``sources`` (with ``sizes`` along ``dim``) fill
    one fused target ``target`` (their concatenation along ``dim``)."""

    sources: tuple[str, ...]
    target: str
    sizes: tuple[int, ...]
    dim: int = 0


@dataclass(frozen=True)
class ResizeVocab:
    """Targets matching ``pattern`` may differ from the saved tensor along
    ``dim`` (vocabulary resize): common rows are loaded; extra rows are filled
    with ``fill`` (a number, or "mean" of the saved rows this rank read)."""

    pattern: str
    dim: int = 0
    fill: float | str = 0.0


def manifest_view(m: Manifest, transforms: Sequence[Any]) -> Manifest:
    for t in transforms:
        fn = getattr(t, "apply_manifest", None)
        if fn is not None:
            m = fn(m)
    return m


def provided_by(transforms: Sequence[Any], m: Manifest) -> set[str]:
    """Target names that transforms can fill though the checkpoint lacks them."""
    out: set[str] = set()
    for t in transforms:
        if isinstance(t, Split) and _saved(m, t.source) in m.tensors:
            out.update(t.targets)
        elif isinstance(t, Merge) and all(_saved(m, src) in m.tensors for src in t.sources):
            out.add(t.target)
    return out


def consumed_by(transforms: Sequence[Any], requested: Any, m: Manifest | None = None) -> set[str]:
    """Saved names that transforms read on behalf of requested targets (with
    ``m``, an alias they name counts its saved tensor as read too)."""
    out: set[str] = set()
    for t in transforms:
        if isinstance(t, Split) and any(x in requested for x in t.targets):
            out.add(t.source)
        elif isinstance(t, Merge) and t.target in requested:
            out.update(t.sources)
    if m is not None:
        out |= {_saved(m, k) for k in out}
    return out


def extra_allow_missing(transforms: Sequence[Any]) -> list[Any]:
    return [t.allow_missing() for t in transforms if hasattr(t, "allow_missing")]


def _box_slices(off: Shape, shape: Shape, base: Shape) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(off, shape, base, strict=True))


def resolve(s: ShardedTensor, m: Manifest, transforms: Sequence[Any]) -> Resolution | None:
    """Pieces that fill target ``s``; None when ``s.fqn`` is not in the
    checkpoint (after transforms). The first geometric transform (Split,
    Merge, Transpose, ResizeVocab) that applies to ``s`` gives the pieces;
    without one, ``s`` reads the saved tensor of its name (or alias) as it
    is. Raises ShardingError on a dtype or shape mismatch that no transform
    allows."""
    res = Resolution()
    for t in transforms:
        if isinstance(t, Split) and s.fqn in t.targets:
            _split_pieces(s, t, m, res)
        elif isinstance(t, Merge) and s.fqn == t.target:
            _merge_pieces(s, t, m, res)
        elif isinstance(t, Transpose) and _match(t.pattern, s.fqn):
            _transpose_pieces(s, t, m, res)
        elif isinstance(t, ResizeVocab) and _match(t.pattern, s.fqn) and _saved(m, s.fqn) in m.tensors:
            _resize_pieces(s, t, m, res)
        else:
            continue
        return _cast(s, m, transforms, res)
    name = m.aliases.get(s.fqn, s.fqn)
    if name not in m.tensors:
        return None
    entry = m.tensors[name]
    if tuple(entry.global_shape) != tuple(s.global_shape):
        raise ShardingError(f"{s.fqn}: saved global_shape {list(entry.global_shape)}, requested "
                            f"{list(s.global_shape)}")
    res.pieces.append(Piece(saved=name, offset=s.global_offset, shape=s.local_shape, dst=s.data,
                            flattened_range=s.flat_bounds))
    return _cast(s, m, transforms, res)


def _split_pieces(s: ShardedTensor, t: Split, m: Manifest, res: Resolution) -> None:
    """Target ``s`` is part ``t.targets.index(s.fqn)`` of saved ``t.source``:
    one piece, its box shifted along ``t.dim`` by the sizes of the parts before it."""
    _need_box(s, t)
    i = t.targets.index(s.fqn)
    shift = sum(t.sizes[:i])
    off = tuple(o + shift if d == t.dim else o for d, o in enumerate(s.global_offset))
    entry = _entry(m, t.source)
    want = tuple(t.sizes[i] if d == t.dim else g for d, g in enumerate(entry.global_shape))
    _check_shape(s, want, f"{t.source} (split part {i})")
    res.pieces.append(Piece(saved=_saved(m, t.source), offset=off, shape=s.local_shape, dst=s.data))


def _merge_pieces(s: ShardedTensor, t: Merge, m: Manifest, res: Resolution) -> None:
    """Target ``s`` is the concatenation of saved ``t.sources`` along
    ``t.dim``: one piece per source that overlaps this chunk's box, each
    filling a view of ``s.data``.

    Raises:
        ShardingError: a source's saved shape is not its part of the target;
            the sizes do not add up to the target's extent along ``t.dim``.
    """
    _need_box(s, t)
    start = 0
    for src, size in zip(t.sources, t.sizes, strict=True):
        lo = max(start, s.global_offset[t.dim])
        hi = min(start + size, s.global_offset[t.dim] + s.local_shape[t.dim])
        if lo < hi:
            off = tuple(lo - start if d == t.dim else o for d, o in enumerate(s.global_offset))
            shp = tuple(hi - lo if d == t.dim else n for d, n in enumerate(s.local_shape))
            doff = tuple(lo if d == t.dim else o for d, o in enumerate(s.global_offset))
            dst = s.data[_box_slices(doff, shp, s.global_offset)]
            entry = _entry(m, src)
            want = tuple(size if d == t.dim else g for d, g in enumerate(s.global_shape))
            if tuple(entry.global_shape) != want:
                raise ShardingError(f"{src}: saved global_shape {list(entry.global_shape)}, "
                                    f"Merge into {t.target} expects {list(want)}")
            res.pieces.append(Piece(saved=_saved(m, src), offset=off, shape=shp, dst=dst))
        start += size
    if start != s.global_shape[t.dim]:
        raise ShardingError(f"{t.target}: Merge sizes add up to {start}, target has "
                            f"{s.global_shape[t.dim]} along dim {t.dim}")


def _transpose_pieces(s: ShardedTensor, t: Transpose, m: Manifest, res: Resolution) -> None:
    """The saved tensor of ``s.fqn`` is ``s`` with ``t.dims`` swapped: its
    transposed box is read into a temporary, permuted into ``s.data`` after
    the reads."""
    _need_box(s, t)
    a, b = t.dims
    perm = list(range(len(s.global_shape)))
    perm[a], perm[b] = perm[b], perm[a]
    entry = _entry(m, s.fqn)
    _check_shape(s, tuple(entry.global_shape[p] for p in perm), "Transpose")
    tmp = torch.empty([s.local_shape[p] for p in perm], dtype=s.data.dtype)
    res.pieces.append(Piece(saved=_saved(m, s.fqn), offset=tuple(s.global_offset[p] for p in perm),
                            shape=tuple(s.local_shape[p] for p in perm), dst=tmp))

    def transpose_back(tmp: torch.Tensor = tmp, perm: list[int] = perm) -> None:
        s.data.copy_(tmp.permute(perm))

    res.finalize.append(transpose_back)


def _resize_pieces(s: ShardedTensor, t: ResizeVocab, m: Manifest, res: Resolution) -> None:
    """The saved tensor of ``s.fqn`` differs from ``s`` along ``t.dim`` only:
    the rows of this chunk's box that it has are read in place; the rows past
    its end are filled by ``t.fill`` after the reads.

    Raises:
        ShardingError: the shapes differ along another dim; ``fill="mean"``
            with no saved row in this chunk (found before anything is written).
    """
    _need_box(s, t)
    name = _saved(m, s.fqn)
    entry = m.tensors[name]
    d = t.dim
    if any(g != e for k, (g, e) in enumerate(zip(s.global_shape, entry.global_shape, strict=True))
           if k != d):
        raise ShardingError(f"{s.fqn}: ResizeVocab changes dim {d} only; saved "
                            f"{list(entry.global_shape)}, requested {list(s.global_shape)}")
    lo, hi = s.global_offset[d], min(s.global_offset[d] + s.local_shape[d], entry.global_shape[d])
    if lo < hi:
        shp = tuple(hi - lo if k == d else n for k, n in enumerate(s.local_shape))
        dst = s.data[_box_slices(s.global_offset, shp, s.global_offset)]
        res.pieces.append(Piece(saved=name, offset=s.global_offset, shape=shp, dst=dst))
    if hi < s.global_offset[d] + s.local_shape[d]:
        start = max(hi, lo) - s.global_offset[d]
        extra = s.data.narrow(d, start, s.local_shape[d] - start)
        read = s.data.narrow(d, 0, start) if start else None
        if t.fill == "mean" and read is None:  # found before anything is written
            raise ShardingError(f"{s.fqn}: fill='mean' needs saved rows on this rank")

        def fill(extra: torch.Tensor = extra, read: Any = read, t: ResizeVocab = t, d: int = d) -> None:
            if t.fill == "mean":
                if read is None:
                    raise ShardingError(f"{s.fqn}: fill='mean' needs saved rows on this rank")
                extra.copy_(read.float().mean(dim=d, keepdim=True).expand_as(extra))
            else:
                extra.fill_(float(t.fill))

        res.finalize.append(fill)


def _saved(m: Manifest, name: str) -> str:
    """The saved tensor ``name`` reads: its alias's target where it is an
    alias (a piece names the saved tensor, never the alias)."""
    return m.aliases.get(name, name)


def _entry(m: Manifest, name: str) -> TensorEntry:
    try:
        return m.tensors[_saved(m, name)]
    except KeyError:
        raise ShardingError(f"{name}: named by a transform but not in the checkpoint") from None


def _need_box(s: ShardedTensor, t: Any) -> None:
    if s.flattened_range is not None:
        raise ShardingError(f"{s.fqn}: {type(t).__name__} does not apply to flattened targets")


def _check_shape(s: ShardedTensor, want: Shape, what: str) -> None:
    if tuple(s.global_shape) != tuple(want):
        raise ShardingError(f"{s.fqn}: {what} gives global_shape {list(want)}, the target has "
                            f"{list(s.global_shape)}")


def _cast(s: ShardedTensor, m: Manifest, transforms: Sequence[Any], res: Resolution) -> Resolution:
    """Check dtypes; where a Cast allows a difference, read into temporaries
    of the saved dtype and convert after the reads."""
    want = dtype_name(s.data.dtype)
    out = Resolution(finalize=[])
    for p in res.pieces:
        saved = m.tensors[p.saved].dtype
        if saved == want:
            out.pieces.append(p)
            continue
        if not any(isinstance(t, Cast) and t.allows(s.fqn, s.data.dtype) for t in transforms):
            raise ShardingError(f"{s.fqn}: saved dtype {saved}, requested {want}; nothing is cast "
                                f"silently (pass transforms=[reshard.transforms.Cast({s.fqn!r})])")
        from .state.sharding import torch_dtype

        tmp = torch.empty(p.dst.shape, dtype=torch_dtype(saved))
        out.pieces.append(Piece(saved=p.saved, offset=p.offset, shape=p.shape, dst=tmp,
                                flattened_range=p.flattened_range))

        def copy_back(dst: torch.Tensor = p.dst, tmp: torch.Tensor = tmp) -> None:
            dst.copy_(tmp)

        out.finalize.append(copy_back)
    out.finalize.extend(res.finalize)
    return out
