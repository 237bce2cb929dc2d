"""What a load into another layout would read, without loading anything
(``reshard plan CKPT --layout L``).

From the manifest alone: each rank of the target layout requests the boxes
its layout gives it (below), the load planner (:func:`reshard.planning.planner.plan_reads`)
intersects them with the saved chunks, and the ranges several ranks need
are given one reader each, as a load with replicas read once does
(:func:`reshard.planning.coordination_load.assign_readers`). Pure: no I/O.

Target layouts:

* ``tpT,ppP,dpD`` (the demo's syntax: any order, missing degrees are 1;
  ranks ordered with tp fastest, then dp, then pp). A tensor is split over
  TP along the dimension its saved chunks split (a tensor saved whole, or
  split only by flat ranges, is needed whole by every TP rank); over PP by
  its layer, the first integer component of its key (``layers.7.``,
  ``h.7.``), layers dealt out to stages in contiguous runs; a key without
  one goes to the first stage when it names an embedding (``emb``, ``wte``,
  ``wpe``), else to the last; DP ranks hold replicas (no ZeRO split).
* ``fsdpN`` or a bare ``N``: FSDP over N ranks (FSDP2's ``Shard(0)``:
  dim 0 cut as ``torch.chunk`` does, ``ceil(rows / N)`` rows per rank, the
  last ranks possibly empty; 0-dim tensors whole on every rank).
* ``dpN``: N replicas, every rank needs every tensor whole.

Only tensors are counted (objects and values are small and are read by each
rank that needs them).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CoverageError, ShardingError
from ..ondisk.manifest import Chunk, Manifest, TensorEntry
from ..ondisk.shardfile import BlockTables
from ..state.geometry import box_intersection, flat_range_boxes, numel
from .coordination_load import Unit, assign_readers
from .planner import check_entry_coverage
from .read_plan import Request, plan_reads

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_EMBED = ("emb", "wte", "wpe")


@dataclass(frozen=True, kw_only=True)
class TargetLayout:
    """A target layout: ``kind`` "grid" (tp x pp x dp) or "fsdp"."""

    kind: str
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp", "dp", "tp"}`` of ``rank`` (grid; tp fastest), ``{"fsdp": rank}``."""
        if self.kind == "fsdp":
            return {"fsdp": rank}
        return {"pp": rank // (self.tp * self.dp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def __str__(self) -> str:
        if self.kind == "fsdp":
            return f"fsdp{self.dp}"
        return f"tp{self.tp},pp{self.pp},dp{self.dp}"


def parse_target_layout(text: str) -> TargetLayout:
    """``"tp2,pp2,dp2"``, ``"dp4"``, ``"fsdp8"`` or ``"8"`` (FSDP) -> TargetLayout.

    Raises:
        ValueError: anything else (the message gives the accepted forms).
    """
    s = text.strip().lower()
    m = re.fullmatch(r"(?:fsdp)?(\d+)", s)
    if m:
        n = int(m[1])
        if n < 1:
            raise ValueError(f"layout {text!r}: the world size must be >= 1")
        return TargetLayout(kind="fsdp", dp=n)
    kw: dict[str, int] = {}
    for part in re.split(r"[,\s×x*]+", s):
        mt = re.fullmatch(r"(tp|pp|dp)(\d+)", part)
        if not mt or mt[1] in kw or int(mt[2]) < 1:
            raise ValueError(f"layout {text!r}: expected e.g. 'tp2,pp2,dp2', 'dp4', 'fsdp8' or '8' "
                             f"(a world size for FSDP), got {part!r}")
        kw[mt[1]] = int(mt[2])
    return TargetLayout(kind="grid", **kw)


def tp_dim(entry: TensorEntry) -> int | None:
    """The dimension the saved chunks' boxes split (the one with the most
    distinct offsets), or None when every box is the whole tensor."""
    best, count = None, 1
    for d, g in enumerate(entry.global_shape):
        offs = {c.global_offset[d] for c in entry.chunks if c.local_shape[d] < g}
        n = len(offs | {0}) if offs else 1
        if n > count:
            best, count = d, n
    return best


def layer_of(key: str) -> int | None:
    """The layer index of a key: its first integer component."""
    m = _LAYER.search(key)
    return int(m[1]) if m else None


def _stages(m: Manifest, pp: int) -> dict[str, int]:
    keys = sorted(m.tensors)
    layers = [layer_of(k) for k in keys]
    n = max((x for x in layers if x is not None), default=-1) + 1
    out: dict[str, int] = {}
    for k, lay in zip(keys, layers, strict=True):
        if lay is not None:
            out[k] = lay * pp // n
        else:
            out[k] = 0 if any(e in k.lower() for e in _EMBED) else pp - 1
    return out


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts


def rank_requests(m: Manifest, layout: TargetLayout, rank: int,
                  stages: dict[str, int] | None = None) -> list[Request]:
    """The requests of ``rank`` of ``layout`` (see the module docstring)."""
    out: list[Request] = []
    if layout.kind == "fsdp":
        for k in sorted(m.tensors):
            g = tuple(m.tensors[k].global_shape)
            if not g:
                out.append(Request(fqn=k, global_offset=(), local_shape=()))
                continue
            per = -(-g[0] // layout.dp)
            a, b = min(g[0], rank * per), min(g[0], (rank + 1) * per)
            if a < b:
                out.append(Request(fqn=k, global_offset=(a,) + (0,) * (len(g) - 1),
                                   local_shape=(b - a, *g[1:])))
        return out
    c = layout.coords(rank)
    stages = stages if stages is not None else _stages(m, layout.pp)
    for k in sorted(m.tensors):
        if stages[k] != c["pp"]:
            continue
        e = m.tensors[k]
        g = tuple(e.global_shape)
        d = tp_dim(e) if layout.tp > 1 else None
        if d is None:
            out.append(Request(fqn=k, global_offset=(0,) * len(g), local_shape=g))
            continue
        a, b = _split(g[d], layout.tp, c["tp"])
        if a < b:
            out.append(Request(fqn=k, global_offset=tuple(a if i == d else 0 for i in range(len(g))),
                               local_shape=tuple(b - a if i == d else s for i, s in enumerate(g))))
    return out


def _boxes(c: Chunk) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if c.flattened_range is None:
        return [(tuple(c.global_offset), tuple(c.local_shape))]
    return [(tuple(o + d for o, d in zip(c.global_offset, bo, strict=True)), bs)
            for bo, bs in flat_range_boxes(c.local_shape, *c.flattened_range)]


def first_missing(entry: TensorEntry, req: Request) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The first region (in row-major order) of the box ``req`` that no saved
    chunk holds, as ``(offset, shape)``; None when the chunks cover it."""
    off, shp = tuple(req.global_offset), tuple(req.local_shape)
    if numel(shp) == 0:
        return None
    boxes = [b for c in entry.chunks for b in _boxes(c) if numel(b[1]) > 0]
    if not off:
        return None if boxes else ((), ())
    cuts = []
    for d, (o, s) in enumerate(zip(off, shp, strict=True)):
        pts = {o, o + s}
        for bo, bs in boxes:
            pts.update(x for x in (bo[d], bo[d] + bs[d]) if o < x < o + s)
        cuts.append(sorted(pts))
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        lo = tuple(cuts[d][i] for d, i in enumerate(cell))
        if not any(box_intersection(bo, bs, lo, (1,) * len(lo)) for bo, bs in boxes):
            return lo, tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
    return None


def _uncovered(m: Manifest, layout: TargetLayout, stages: dict[str, int] | None, fqn: str, first: int,
               err: Exception) -> CoverageError:
    """The refusal of a layout whose rank ``first`` (the first to need it)
    reads a tensor whose chunks do not tile it: the first region no chunk
    holds, and the first rank whose request touches it."""
    e = m.tensors[fqn]
    g = tuple(e.global_shape)
    miss = first_missing(e, Request(fqn=fqn, global_offset=(0,) * len(g), local_shape=g))
    if miss is None:  # chunks overlap but leave no hole
        return CoverageError(f"layout {layout}: rank {first} {layout.coords(first)} needs {fqn!r}, "
                             f"which a load refuses: {err}")
    who = first
    for r in range(first, layout.world):
        if any(q.fqn == fqn and (not g or box_intersection(q.global_offset, q.local_shape, *miss))
               for q in rank_requests(m, layout, r, stages)):
            who = r
            break
    return CoverageError(
        f"layout {layout}: no saved chunk holds {fqn!r} at offset {list(miss[0])} shape "
        f"{list(miss[1])} (global_shape {list(g)}), needed by rank {who} {layout.coords(who)}")


@dataclass(frozen=True, kw_only=True)
class RankReads:
    """What one target rank of a load needs and reads.

    Attributes:
        rank: the target rank; coords: its layout coordinates.
        needed_bytes: bytes of saved chunk ranges its requests need.
        read_bytes: bytes it reads from storage with replicas read once
            (whole checksum blocks at the edges of a range counted).
        read_bytes_alone: bytes it would read with ``read_once=False``.
        files: the data files it reads (replicas read once).
        ranges: chunk ranges it needs; received: of them, read by another rank.
    """

    rank: int
    coords: dict[str, int]
    needed_bytes: int
    read_bytes: int
    read_bytes_alone: int
    files: tuple[str, ...]
    ranges: int
    received: int


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """:func:`plan_layout`'s answer.

    Attributes:
        layout: the target layout (text); world: its ranks.
        ranks: one :class:`RankReads` per rank.
        total_read_bytes: bytes all ranks read from storage together
            (each distinct range of at least ``read_once_min_bytes`` once,
            smaller ones by each rank needing them; whole checksum blocks
            at a range's edges).
        largest: the rank that reads the most (replicas read once).
    """

    layout: str
    world: int
    ranks: list[RankReads] = field(default_factory=list)
    total_read_bytes: int = 0
    largest: int = 0


def _read_span(m: Manifest, c: Chunk, lo: int, hi: int) -> int:
    """Bytes the reader reads for chunk bytes [lo, hi): whole checksum blocks."""
    if not BlockTables.has(c):
        return hi - lo
    b = m.checksum_block_bytes
    return min(-(-hi // b) * b, c.length) - lo // b * b


def plan_layout(m: Manifest, layout: TargetLayout, *, read_once_min_bytes: int = 64 << 10) -> LayoutPlan:
    """Per target rank, what a load of ``m`` into ``layout`` reads (ranges of
    at least ``read_once_min_bytes`` read once, as ``LoadOptions`` of the
    same value would; smaller ones by every rank that needs them).

    Raises:
        CoverageError: a needed tensor's chunks do not tile it (a load
            refuses it): the first region no saved chunk holds is named,
            with the first rank that needs it (or the overlap, when there is
            no hole).
    """
    stages = _stages(m, layout.pp) if layout.kind == "grid" else None
    names = sorted(m.tensors)
    index = {k: i for i, k in enumerate(names)}
    checked: set[str] = set()
    units: list[list[Unit]] = []
    spans: dict[Unit, tuple[str, int]] = {}  # unit -> (file, bytes read)
    for r in range(layout.world):
        groups: dict[tuple[str, int], tuple[int, int]] = {}
        for req in rank_requests(m, layout, r, stages):
            e = m.tensors[req.fqn]
            if req.fqn not in checked:
                try:
                    check_entry_coverage(req.fqn, e)
                except (CoverageError, ShardingError) as err:
                    raise _uncovered(m, layout, stages, req.fqn, r, err) from None
                checked.add(req.fqn)
            for it in plan_reads(e, req):
                k = (req.fqn, it.chunk_index)
                lo, hi = groups.get(k, (it.byte_start, it.byte_stop))
                groups[k] = (min(lo, it.byte_start), max(hi, it.byte_stop))
        us: list[Unit] = []
        for (f, ci), (lo, hi) in groups.items():
            u = (index[f], ci, lo, hi)
            us.append(u)
            if u not in spans:
                c = m.tensors[f].chunks[ci]
                spans[u] = (c.file, _read_span(m, c, lo, hi))
        units.append(us)
    big = [[u for u in us if u[3] - u[2] >= read_once_min_bytes] for us in units]
    hand = assign_readers(big)
    out: list[RankReads] = []
    for r, us in enumerate(units):
        recv_units = {big[r][i] for i in hand[r].recv}
        recv = recv_units
        mine = [u for u in us if u not in recv_units]
        out.append(RankReads(rank=r, coords=layout.coords(r), needed_bytes=sum(u[3] - u[2] for u in us),
                             read_bytes=sum(spans[u][1] for u in mine),
                             read_bytes_alone=sum(spans[u][1] for u in us),
                             files=tuple(sorted({spans[u][0] for u in mine})),
                             ranges=len(us), received=len(recv)))
    largest = max(range(len(out)), key=lambda i: (out[i].read_bytes, -i)) if out else 0
    return LayoutPlan(layout=str(layout), world=layout.world, ranks=out,
                      total_read_bytes=sum(r.read_bytes for r in out), largest=largest)


__all__: Sequence[str] = ("LayoutPlan", "RankReads", "TargetLayout", "first_missing", "layer_of",
                          "parse_target_layout", "plan_layout", "rank_requests", "tp_dim")
