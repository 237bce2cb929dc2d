"""Compare two checkpoints by logical content: what a user asks after a
rollback, a conversion or a reshard.

:func:`diff` reports keys added and removed (tensors, objects, common
values), tensors whose dtype or global shape changed, which tensors' values
differ, and which values and objects differ. Everything is compared by its
logical content, never by how it was laid out:

* Tensors: by chunk digest first -- when both checkpoints hold a tensor in the
  same chunks (offsets, shapes, checksum block size) with checksums, equal
  block digests mean equal bytes, and no data is read. Otherwise (another
  layout: another TP/DP/FSDP split; checksums off; a DCP folder; digests that
  differ) both tensors are read whole through :func:`reshard.load`
  (checksums verified) and compared: bit-exactly, and by the maximum
  absolute difference of their values.
* Per-rank objects (a ShardedObject grid): decoded. A grid whose elements are
  all equal is one value, whatever its grid (the empty leftovers of a
  ``DataCursor`` saved at DP 1 and at DP 2, a replicated object, a common
  value of the same key on the other side); otherwise the grid shape and each
  element are compared.
* Common values: decoded and compared (NaN equals NaN, tensors by value). A
  DCP folder's values (one per DCP leaf) are first grouped into the value
  paths the other side holds, as :func:`reshard.load` does.

Either side may be a PyTorch DCP folder (``.metadata``), read through the
restricted decoders of :mod:`reshard.ondisk.dcp`. A tensor that cannot be
read on either side is reported as unreadable with the reason.

Memory: one tensor of each checkpoint at a time (the largest tensor, twice).
Single process (no process group).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..collectives import SingleProcess
from ..errors import CheckpointError
from ..ondisk import codec
from ..ondisk.manifest import Manifest, TensorEntry
from ..state.sharding import ShardedTensor, torch_dtype
from ..storage import Storage, resolve


@dataclass(frozen=True, kw_only=True)
class DiffReport:
    """Result of :func:`diff` (keys are checkpoint keys).

    Attributes:
        a, b: the two checkpoints compared.
        added: keys in ``b`` only; ``removed``: keys in ``a`` only.
        changed: tensor key -> ``"<dtype> [shape] -> <dtype> [shape]"``.
        differ: tensor key -> maximum absolute difference of the values
            (``nan`` where a NaN meets a number or the dtype has no
            arithmetic; ``0.0`` when the bytes differ but the values are equal,
            e.g. ``-0.0`` and ``0.0``).
        unreadable: tensor key -> why it could not be compared by value.
        values_differ: common values and objects whose contents differ.
        same_by_digest, same_by_value: tensors found equal without reading
            them / by reading them.
    """

    a: str
    b: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: dict[str, str] = field(default_factory=dict)
    differ: dict[str, float] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    values_differ: tuple[str, ...] = ()
    same_by_digest: int = 0
    same_by_value: int = 0

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.differ or self.unreadable
                    or self.values_differ)

    def to_json(self) -> dict[str, Any]:
        """Everything, whole: every key (the CLI's text groups them by subtree)."""
        return {"a": self.a, "b": self.b, "identical": self.identical, "added": list(self.added),
                "removed": list(self.removed), "added_by_subtree": by_subtree(self.added),
                "removed_by_subtree": by_subtree(self.removed), "changed": self.changed,
                "differ": {k: (None if math.isnan(v) else v) for k, v in self.differ.items()},
                "unreadable": self.unreadable, "values_differ": list(self.values_differ),
                "same_by_digest": self.same_by_digest, "same_by_value": self.same_by_value}


def by_subtree(keys: Sequence[str], depth: int = 2) -> dict[str, int]:
    """``keys`` counted by subtree: their first ``depth`` dotted components
    (``optim.state`` for ``optim.state.fc.weight.exp_avg``), in sorted order; a
    key of at most ``depth`` components is its own subtree."""
    out: dict[str, int] = {}
    for k in sorted(keys):
        head = ".".join(k.split(".")[:depth])
        out[head] = out.get(head, 0) + 1
    return out


def _desc(te: TensorEntry) -> str:
    return f"{te.dtype} [{','.join(map(str, te.global_shape))}]"


def _same_by_digest(ma: Manifest, ta: TensorEntry, mb: Manifest, tb: TensorEntry) -> bool | None:
    """True/False when the chunk digests decide, None when they cannot."""
    if ma.checksum_block_bytes != mb.checksum_block_bytes:
        return None
    def sums(c: Any) -> Any:  # the chunk's digest (of its block digests), or the digests themselves
        return c.digest or ",".join(c.checksums)

    ka = sorted((c.global_offset, c.local_shape, c.flattened_range, sums(c)) for c in ta.chunks)
    kb = sorted((c.global_offset, c.local_shape, c.flattened_range, sums(c)) for c in tb.chunks)
    if [k[:3] for k in ka] != [k[:3] for k in kb] or not all(k[3] for k in ka + kb):
        return None
    return [k[3] for k in ka] == [k[3] for k in kb]


def _read(st: Storage, key: str, m: Manifest, fqn: str) -> torch.Tensor:
    from ..formats.hf_write import _sub_manifest
    from ..loading.load import load

    te = m.tensors[fqn]
    buf = torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype))
    req = ShardedTensor(fqn, buf, global_shape=tuple(te.global_shape),
                        global_offset=(0,) * len(te.global_shape))
    load({"t": req}, key, group=SingleProcess(), storage=st, manifest=_sub_manifest(m, fqn))
    return buf


def _max_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.dtype == torch.bool:
        return float((x != y).any())
    try:
        wide = torch.complex128 if x.is_complex() else torch.float64
        d = (x.to(wide) - y.to(wide)).abs()
    except (RuntimeError, TypeError):  # float8 and friends without arithmetic on this build
        return math.nan
    if d.numel() == 0:
        return 0.0
    if x.is_floating_point() or x.is_complex():  # NaN against NaN is no difference
        d = torch.where(torch.isnan(x.to(wide)) & torch.isnan(y.to(wide)), torch.zeros_like(d), d)
    return float(d.max())


def _open(path: str | os.PathLike[str], storage: Storage | None) -> tuple[Storage, str, Manifest]:
    """A checkpoint's (storage, key, manifest): reshard's, or a DCP folder's."""
    from ..loading.load import _read_or_dcp
    from ..options import LoadOptions, hmac_key_of

    st, key = resolve(path, storage)
    st, m = _read_or_dcp(st, key, LoadOptions(progress=False, hmac_key=hmac_key_of(None)))
    return st, key, m


def _regroup(m: Manifest, other: Manifest) -> Manifest:
    """A DCP manifest's leaf values grouped into the value paths ``other`` holds."""
    from ..ondisk.dcp_values import DCP_VALUES, regroup

    if not m.extra.get(DCP_VALUES):
        return m
    return regroup(m, set(other.values or {}))


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *,
         storage_a: Storage | None = None, storage_b: Storage | None = None) -> DiffReport:
    """Compare checkpoint ``a`` with checkpoint ``b`` (see the module docstring);
    either may be a reshard checkpoint or a PyTorch DCP folder.

    A reader lease is held on each while they are read; with an HMAC key
    (the environment's), an unsigned or mis-signed manifest is refused.

    Raises:
        CheckpointNotFoundError, ManifestError: either manifest is missing or
            invalid (a tensor that cannot be read is reported, not raised).
        IntegrityError: with a key, either is unsigned or mis-signed.
    """
    from ..commit.leases import reader_lease

    st_a, k_a = resolve(a, storage_a)
    st_b, k_b = resolve(b, storage_b)
    with reader_lease(st_a, k_a, what="diff"), reader_lease(st_b, k_b, what="diff"):
        return _diff(k_a, k_b, st_a, st_b)


def _diff(a: str, b: str, storage_a: Storage, storage_b: Storage) -> DiffReport:
    sa, ka, ma = _open(a, storage_a)
    sb, kb, mb = _open(b, storage_b)
    ma, mb = _regroup(ma, mb), _regroup(mb, ma)
    keys_a = set(ma.tensors) | set(ma.objects) | set(ma.values or {}) | set(ma.aliases)
    keys_b = set(mb.tensors) | set(mb.objects) | set(mb.values or {}) | set(mb.aliases)
    changed: dict[str, str] = {}
    differ: dict[str, float] = {}
    unreadable: dict[str, str] = {}
    by_digest = by_value = 0
    for fqn in sorted(set(ma.tensors) & set(mb.tensors)):
        ta, tb = ma.tensors[fqn], mb.tensors[fqn]
        if ta.dtype != tb.dtype or tuple(ta.global_shape) != tuple(tb.global_shape):
            changed[fqn] = f"{_desc(ta)} -> {_desc(tb)}"
            continue
        same = _same_by_digest(ma, ta, mb, tb)
        if same:
            by_digest += 1
            continue
        try:
            x, y = _read(sa, ka, ma, fqn), _read(sb, kb, mb, fqn)
        except (CheckpointError, OSError) as e:
            unreadable[fqn] = f"{type(e).__name__}: {' '.join(str(e).split())}"
            continue
        if torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            by_value += 1
        else:
            differ[fqn] = _max_abs(x, y)
        del x, y
    plain_a = set(ma.objects) | set(ma.values or {})
    plain_b = set(mb.objects) | set(mb.values or {})
    values_differ = sorted(
        [k for k in plain_a & plain_b if _logical(sa, ka, ma, k) != _logical(sb, kb, mb, k)]
        + [k for k in set(ma.aliases) & set(mb.aliases) if ma.aliases[k] != mb.aliases[k]])
    return DiffReport(a=ka, b=kb, added=tuple(sorted(keys_b - keys_a)),
                      removed=tuple(sorted(keys_a - keys_b)), changed=changed, differ=differ,
                      unreadable=unreadable, values_differ=tuple(values_differ),
                      same_by_digest=by_digest, same_by_value=by_value)


def _canon(v: Any) -> Any:
    """A form of a decoded value that ``==`` compares by content (NaN equals
    NaN; tensors and arrays by dtype, shape and bytes; mappings whatever their
    order)."""
    t = type(v)
    if t in (int, bool, str, bytes, type(None)):
        return v
    if t is float:
        return ("nan",) if v != v else v
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().contiguous()
        return ("tensor", str(v.dtype), tuple(v.shape), bytes(v.reshape(-1).view(torch.uint8).numpy()))
    if isinstance(v, np.ndarray):
        return ("ndarray", str(v.dtype), v.shape, np.ascontiguousarray(v).tobytes())
    if isinstance(v, Mapping):
        return (type(v).__name__, tuple(sorted(((repr(k), _canon(x)) for k, x in v.items()))))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_canon(x) for x in v))
    if isinstance(v, float) and v != v:
        return ("nan",)
    return v


def _logical(st: Storage, key: str, m: Manifest, k: str) -> Any:
    """The logical content of value or object ``k``, comparable with ``==``: one
    value for a common value or a grid whose elements are all equal (any grid
    shape), else the grid shape and its elements by offset."""
    try:
        if k in (m.values or {}):
            return ("value", _canon(codec.from_json((m.values or {})[k])))
        oe = m.objects[k]
        elems = sorted((tuple(c.global_offset),
                        _canon(codec.decode(bytes(st.read_bytes(st.join(key, c.file), c.offset, c.length)))))
                       for c in oe.chunks)
    except (CheckpointError, OSError, ValueError, TypeError) as e:
        return ("unreadable", f"{type(e).__name__}: {e}", id(m))
    if elems and all(v == elems[0][1] for _, v in elems[1:]):
        return ("value", elems[0][1])
    return ("grid", tuple(oe.global_shape), tuple(elems))
