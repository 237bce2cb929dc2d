"""Property tests of the pure planners: plan_save (dedup, balance, coverage) and
plan_reads (intersections and byte ranges: reshard.planning.read_plan, whose
property tests share this file's layout strategies)."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from reshard.errors import ShardingError
from reshard.ondisk.manifest import Chunk, TensorEntry
from reshard.planning.planner import (
    LocalObjectItem,
    LocalPlan,
    LocalTensorItem,
    check_entry_coverage,
    chunk_file_name,
    data_file_name,
    plan_save,
)
from reshard.planning.read_plan import Request, chunk_request, plan_reads
from reshard.state.sharding import numel

Shape = tuple[int, ...]
ISZ = 4  # float32
# examples per property: the loaded profile's, capped to keep the suite fast
FEW = settings(max_examples=min(settings.default.max_examples, 40))


@dataclass(frozen=True)
class Piece:
    """One distinct saved chunk: a box, optionally a flat range of it, and its holders."""

    offset: Shape
    shape: Shape
    fr: tuple[int, int] | None
    holders: tuple[int, ...]  # ranks; holders[0] is replica 0

    @property
    def numel(self) -> int:
        return numel(self.shape) if self.fr is None else self.fr[1] - self.fr[0]


@dataclass(frozen=True)
class Layout:
    fqn: str
    gshape: Shape
    pieces: tuple[Piece, ...]


@st.composite
def grids(draw, min_dims: int = 1, max_dims: int = 3, max_size: int = 12) -> tuple[Shape, list]:
    """A global shape and a grid partition of it into boxes (random cut points per dim)."""
    ndim = draw(st.integers(min_dims, max_dims))
    gshape = tuple(draw(st.integers(0, max_size)) for _ in range(ndim))
    bounds = []
    for g in gshape:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, g - 1)), max_size=2))) if g > 1 else []
        b = [0, *cuts, g]
        bounds.append(list(zip(b[:-1], b[1:])))
    boxes = [(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
             for cell in itertools.product(*bounds)]
    return gshape, boxes


@st.composite
def layouts(draw, nranks: int, fqn: str = "w", flat: bool = True) -> Layout:
    gshape, boxes = draw(grids())
    pieces: list[Piece] = []
    for off, shape in boxes:
        n = numel(shape)
        ranges: list[tuple[int, int] | None] = [None]
        if flat and n >= 2 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=2)))
            b = [0, *cuts, n]
            ranges = list(zip(b[:-1], b[1:]))
        for fr in ranges:
            owner = draw(st.integers(0, nranks - 1))
            others = [r for r in range(nranks) if r != owner]
            extra = draw(st.lists(st.sampled_from(others), unique=True, max_size=len(others))) if others else []
            pieces.append(Piece(off, shape, fr, (owner, *extra)))
    return Layout(fqn, gshape, tuple(pieces))


@st.composite
def scenarios(draw) -> tuple[int, list[Layout]]:
    nranks = draw(st.integers(1, 4))
    n = draw(st.integers(1, 3))
    return nranks, [draw(layouts(nranks, fqn=f"t{i}")) for i in range(n)]


def make_plans(nranks: int, lays: list[Layout], dtype: str = "float32") -> list[LocalPlan]:
    per_rank: dict[int, list[LocalTensorItem]] = defaultdict(list)
    for lay in lays:
        for k, p in enumerate(lay.pieces):
            for rid, r in enumerate(p.holders):
                per_rank[r].append(LocalTensorItem(
                    fqn=lay.fqn, dtype=dtype, global_shape=lay.gshape, global_offset=p.offset,
                    local_shape=p.shape, flattened_range=p.fr, replica_id=rid, nbytes=p.numel * ISZ,
                    digest=f"{lay.fqn}-{k}"))
    return [LocalPlan(rank=r, tensors=tuple(per_rank[r])) for r in range(nranks)]


def written_chunks(plans: list[LocalPlan], sp) -> list[tuple[int, str, tuple]]:
    out = []
    for r, items in sp.writes.items():
        for w in items:
            assert w.kind == "tensor"
            it = plans[r].tensors[w.index]
            assert w.file in sp.files[r]
            out.append((r, it.fqn, it.chunk_key))
    return out


# ----------------------------------------------------------------------------- plan_save


@FEW
@given(scenarios(), st.integers(1, 3))
def test_each_chunk_has_exactly_one_writer_among_its_holders(sc, files_per_rank: int) -> None:
    nranks, lays = sc
    plans = make_plans(nranks, lays)
    sp = plan_save(plans, files_per_rank=files_per_rank)
    got = written_chunks(plans, sp)
    keys = [(fqn, key) for _, fqn, key in got]
    expected = {(lay.fqn, (p.offset, p.shape, p.fr)): p for lay in lays for p in lay.pieces}
    assert Counter(keys) == Counter(expected.keys())  # exactly once each, nothing else
    for r, fqn, key in got:
        assert r in expected[(fqn, key)].holders
    # bytes per rank are the bytes of what the rank writes
    load = Counter()
    for r, fqn, key in got:
        load[r] += expected[(fqn, key)].numel * ISZ
    assert sp.bytes_per_rank == {r: load[r] for r in range(nranks)}
    # files: named per rank, at most files_per_rank, none empty
    for r in range(nranks):
        sizes = [plans[r].tensors[w.index].nbytes for w in sp.writes[r]]
        assert len(sp.files[r]) <= min(files_per_rank, len(sizes))
        if all(sizes):  # positive sizes: the first items each open their own file
            assert len(sp.files[r]) == min(files_per_rank, len(sizes))
        assert set(sp.files[r]) == {data_file_name(r, k) for k in range(len(sp.files[r]))}
        assert {w.file for w in sp.writes[r]} == set(sp.files[r])
    # deterministic
    assert plan_save(plans, files_per_rank=files_per_rank) == sp


@FEW
@given(scenarios())
def test_replicated_chunks_go_to_a_least_loaded_holder(sc) -> None:
    """List-scheduling invariant: for a rank's last (smallest) replicated chunk c, its final
    load exceeds that of every other holder of c by at most c's size."""
    nranks, lays = sc
    plans = make_plans(nranks, lays)
    sp = plan_save(plans)
    pieces = {(lay.fqn, (p.offset, p.shape, p.fr)): p for lay in lays for p in lay.pieces}
    load = sp.bytes_per_rank
    mine: dict[int, list[Piece]] = defaultdict(list)
    for r, fqn, key in written_chunks(plans, sp):
        p = pieces[(fqn, key)]
        if len(p.holders) > 1:
            mine[r].append(p)
    for r, ps in mine.items():
        smallest = min(p.numel for p in ps)
        assert any(
            all(load[r] <= load[h] + p.numel * ISZ for h in p.holders)
            for p in ps if p.numel == smallest
        ), (r, load, ps)


@FEW
@given(st.integers(2, 4), st.lists(st.integers(1, 40), min_size=1, max_size=12))
def test_fully_replicated_balance_bound(nranks: int, sizes: list[int]) -> None:
    """Every chunk held by every rank: max load <= mean + largest chunk."""
    total = sum(sizes)
    lay = Layout("w", (total,), tuple(
        Piece((sum(sizes[:i]),), (s,), None, tuple(range(nranks))) for i, s in enumerate(sizes)))
    sp = plan_save(make_plans(nranks, [lay]))
    loads = [sp.bytes_per_rank[r] for r in range(nranks)]
    assert sum(loads) == total * ISZ
    assert max(loads) <= total * ISZ / nranks + max(sizes) * ISZ


def test_balance_exact_small_case() -> None:
    # [8, 4, 4] replicated on ranks 0 and 1: greedy largest-first gives 8 | 4+4
    lay = Layout("w", (16,), (Piece((0,), (8,), None, (0, 1)), Piece((8,), (4,), None, (0, 1)),
                              Piece((12,), (4,), None, (1, 0))))
    sp = plan_save(make_plans(2, [lay]))
    assert sp.bytes_per_rank == {0: 32, 1: 32}
    # a rank that must write its own unique chunk gets fewer replicated ones
    lay2 = Layout("w", (16,), (Piece((0,), (8,), None, (0,)), Piece((8,), (4,), None, (0, 1)),
                               Piece((12,), (4,), None, (0, 1))))
    sp2 = plan_save(make_plans(2, [lay2]))
    assert sp2.bytes_per_rank == {0: 32, 1: 32}


def _nonempty(lay: Layout) -> list[int]:
    return [i for i, p in enumerate(lay.pieces) if p.numel > 0]


@FEW
@given(layouts(nranks=3))
def test_removing_a_chunk_is_a_hole(lay: Layout) -> None:
    idx = _nonempty(lay)
    assume(len(idx) >= 2)
    drop = idx[len(idx) // 2]
    broken = Layout(lay.fqn, lay.gshape, lay.pieces[:drop] + lay.pieces[drop + 1:])
    with pytest.raises(ShardingError, match="hole") as ei:
        plan_save(make_plans(3, [broken]))
    assert "w:" in str(ei.value)


@FEW
@given(layouts(nranks=3), st.data())
def test_overlapping_box_is_refused(lay: Layout, data) -> None:
    idx = _nonempty(lay)
    assume(idx)
    p = lay.pieces[data.draw(st.sampled_from(idx))]
    # a box at the same offset, one larger or smaller in some dimension: overlaps p, differs from it
    options = []
    for d, (o, s, g) in enumerate(zip(p.offset, p.shape, lay.gshape)):
        if s >= 2:
            options.append((d, -1))
        if o + s < g:
            options.append((d, +1))
    assume(options)
    d, delta = data.draw(st.sampled_from(options))
    shape = tuple(s + delta if k == d else s for k, s in enumerate(p.shape))
    extra = Piece(p.offset, shape, None, (data.draw(st.integers(0, 2)),))
    broken = Layout(lay.fqn, lay.gshape, (*lay.pieces, extra))
    with pytest.raises(ShardingError, match="overlap") as ei:
        plan_save(make_plans(3, [broken]))
    assert "w:" in str(ei.value)


def test_overlap_and_hole_messages_name_fqn_and_ranks() -> None:
    lay = Layout("enc.w", (4,), (Piece((0,), (3,), None, (0,)), Piece((2,), (2,), None, (1,))))
    with pytest.raises(ShardingError, match=r"enc\.w: overlapping chunks .*ranks \[0, 1\]"):
        plan_save(make_plans(2, [lay]))
    lay = Layout("enc.w", (6,), (Piece((0,), (6,), (0, 2), (0,)), Piece((0,), (6,), (3, 6), (1,))))
    with pytest.raises(ShardingError, match=r"enc\.w: hole: elements \[2, 3\)"):
        plan_save(make_plans(2, [lay]))
    lay = Layout("enc.w", (6,), (Piece((0,), (6,), (0, 4), (0,)), Piece((0,), (6,), (3, 6), (1,))))
    with pytest.raises(ShardingError, match=r"enc\.w: flattened ranges overlap at element 3"):
        plan_save(make_plans(2, [lay]))
    lay = Layout("enc.w", (6,), (Piece((0,), (6,), (0, 6), (0,)), Piece((0,), (6,), None, (1,))))
    with pytest.raises(ShardingError, match=r"both whole and as flattened ranges"):
        plan_save(make_plans(2, [lay]))


@FEW
@given(scenarios(), st.data())
def test_conflicting_dtype_or_shape_names_fqn_and_both_ranks(sc, data) -> None:
    nranks, lays = sc
    assume(nranks >= 2)
    plans = make_plans(nranks, lays)
    first = next((p for p in plans if p.tensors), None)
    assume(first is not None)
    it = first.tensors[0]
    other = data.draw(st.sampled_from([r for r in range(nranks) if r != first.rank]))
    if data.draw(st.booleans()):
        bad = LocalTensorItem(fqn=it.fqn, dtype="bfloat16", global_shape=it.global_shape,
                              global_offset=it.global_offset, local_shape=it.local_shape,
                              flattened_range=it.flattened_range, replica_id=9, nbytes=it.nbytes // 2)
        needle = "dtype bfloat16"
    else:
        gs = (it.global_shape[0] + 1, *it.global_shape[1:])
        bad = LocalTensorItem(fqn=it.fqn, dtype=it.dtype, global_shape=gs, global_offset=it.global_offset,
                              local_shape=it.local_shape, flattened_range=it.flattened_range, replica_id=9,
                              nbytes=it.nbytes)
        needle = f"global_shape {list(gs)}"
    plans[other] = LocalPlan(rank=other, tensors=(*plans[other].tensors, bad))
    with pytest.raises(ShardingError) as ei:
        plan_save(plans)
    msg = str(ei.value)
    assert msg.startswith(f"{it.fqn}:")
    assert needle in msg
    # both ranks are named: the first declarer and the conflicting one
    ranks_declaring = sorted({p.rank for p in plans for t in p.tensors if t.fqn == it.fqn})
    assert f"rank {ranks_declaring[0]} declares" in msg
    assert f"rank {other} declares" in msg or other == ranks_declaring[0]


@FEW
@given(scenarios(), st.data())
def test_replicas_with_different_digests_are_refused(sc, data) -> None:
    nranks, lays = sc
    candidates = [(lay, p) for lay in lays for p in lay.pieces if len(p.holders) > 1]
    assume(candidates)
    lay, p = data.draw(st.sampled_from(candidates))
    plans = make_plans(nranks, lays)
    r = p.holders[-1]
    tensors = [t if not (t.fqn == lay.fqn and t.chunk_key == (p.offset, p.shape, p.fr))
               else LocalTensorItem(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "digest": "X"})
               for t in plans[r].tensors]
    plans[r] = LocalPlan(rank=r, tensors=tuple(tensors))
    with pytest.raises(ShardingError, match=rf"{lay.fqn}: replicas of chunk .* differ: ranks"):
        plan_save(plans)


def test_objects_dedup_and_grid_checks() -> None:
    def ob(key, shape, off, rid, digest="d"):
        return LocalObjectItem(key=key, global_shape=shape, global_offset=off, replica_id=rid,
                               nbytes=10, digest=digest + str(off))

    plans = [LocalPlan(rank=0, objects=(ob("rng", (2,), (0,), 0), ob("cfg", (), (), 0))),
             LocalPlan(rank=1, objects=(ob("rng", (2,), (1,), 0), ob("cfg", (), (), 1)))]
    sp = plan_save(plans)
    objs = [(r, plans[r].objects[w.index].key, plans[r].objects[w.index].global_offset)
            for r, ws in sp.writes.items() for w in ws]
    assert sorted(o[1:] for o in objs) == [("cfg", ()), ("rng", (0,)), ("rng", (1,))]
    assert sp.bytes_per_rank == {0: 20, 1: 10} or sp.bytes_per_rank == {0: 10, 1: 20}
    # missing grid element
    with pytest.raises(ShardingError, match=r"object rng: grid \[3\] has 1 element"):
        plan_save([LocalPlan(rank=0, objects=(ob("rng", (3,), (0,), 0), ob("rng", (3,), (2,), 0)))])
    # conflicting grids
    with pytest.raises(ShardingError, match=r"object rng: rank 0 declares grid \[2\], rank 1 declares \[4\]"):
        plan_save([LocalPlan(rank=0, objects=(ob("rng", (2,), (0,), 0),)),
                   LocalPlan(rank=1, objects=(ob("rng", (4,), (1,), 0),))])
    # same element, different values
    with pytest.raises(ShardingError, match=r"element \[\] is held by ranks \[0, 1\] with different"):
        plan_save([LocalPlan(rank=0, objects=(ob("cfg", (), (), 0, "a"),)),
                   LocalPlan(rank=1, objects=(ob("cfg", (), (), 1, "b"),))])


def _mixed_t(fqn: str, gshape: Shape, off: Shape, shape: Shape, rid: int, fr: tuple[int, int] | None = None,
             dtype: str = "float32", isz: int = 4) -> LocalTensorItem:
    n = numel(shape) if fr is None else fr[1] - fr[0]
    return LocalTensorItem(fqn=fqn, dtype=dtype, global_shape=gshape, global_offset=off, local_shape=shape,
                           flattened_range=fr, replica_id=rid, nbytes=n * isz, digest=f"{fqn}@{off}{fr}")


def _mixed_o(key: str, grid: Shape, off: Shape, rid: int, nbytes: int) -> LocalObjectItem:
    return LocalObjectItem(key=key, global_shape=grid, global_offset=off, replica_id=rid, nbytes=nbytes,
                           digest=f"{key}@{off}")


def mixed_plans() -> list[LocalPlan]:
    """Three ranks, items in no particular local order: row slabs (one writer each), a bias replicated
    on every rank, FSDP flat ranges of one box each held by two ranks, a 256-byte chunk replicated on
    ranks 1 and 2, a 0-dim int64, a per-rank object grid, an object replicated everywhere and an
    object grid whose element 0 has two holders."""
    w, t, o = "layers.0.w", _mixed_t, _mixed_o
    return [
        LocalPlan(rank=0, tensors=(
            t("emb", (8, 4), (0, 0), (8, 4), 0, (0, 16)), t(w, (6, 4), (0, 0), (2, 4), 0),
            t("layers.0.b", (4,), (0,), (4,), 0), t("step", (), (), (), 0, dtype="int64", isz=8),
        ), objects=(o("cfg", (), (), 0, 40), o("rng", (3,), (0,), 0, 20), o("sched", (2,), (0,), 0, 12))),
        LocalPlan(rank=1, tensors=(
            t("big", (64,), (0,), (64,), 0), t("layers.0.b", (4,), (0,), (4,), 1),
            t(w, (6, 4), (2, 0), (2, 4), 0), t("emb", (8, 4), (0, 0), (8, 4), 1, (0, 16)),
            t("emb", (8, 4), (0, 0), (8, 4), 0, (16, 32)),
        ), objects=(o("rng", (3,), (1,), 0, 21), o("sched", (2,), (0,), 1, 12), o("cfg", (), (), 1, 40))),
        LocalPlan(rank=2, tensors=(
            t(w, (6, 4), (4, 0), (2, 4), 0), t("emb", (8, 4), (0, 0), (8, 4), 1, (16, 32)),
            t("big", (64,), (0,), (64,), 1), t("layers.0.b", (4,), (0,), (4,), 2),
        ), objects=(o("sched", (2,), (1,), 0, 12), o("cfg", (), (), 2, 40), o("rng", (3,), (2,), 0, 22))),
    ]


def _f(r: int, k: int) -> str:
    return data_file_name(r, k)


# the plan of mixed_plans() as plan_save made it before it was split into steps (pins the
# writer choice, the replica groups and their order, the file spread and the order within files)
MIXED_BYTES = {0: 176, 1: 309, 2: 146}
MIXED_REPLICAS = (
    ("tensor", [(0, 0), (1, 3)]), ("tensor", [(0, 2), (1, 1), (2, 3)]), ("tensor", [(1, 0), (2, 2)]),
    ("tensor", [(1, 4), (2, 1)]), ("object", [(0, 0), (1, 2), (2, 1)]), ("object", [(0, 2), (1, 1)]),
)


def test_mixed_state_plan_is_pinned() -> None:
    """Tensors, objects and replicas of both together: the exact writes, files, bytes and replicas."""
    plans = mixed_plans()
    sp = plan_save(plans)
    assert {r: [(w.kind, w.index, w.file) for w in ws] for r, ws in sp.writes.items()} == {
        0: [("tensor", 0, _f(0, 0)), ("tensor", 1, _f(0, 0)), ("tensor", 3, _f(0, 0)),
            ("object", 0, _f(0, 0)), ("object", 1, _f(0, 0)), ("object", 2, _f(0, 0))],
        1: [("tensor", 0, _f(1, 0)), ("tensor", 2, _f(1, 0)), ("object", 0, _f(1, 0))],
        2: [("tensor", 0, _f(2, 0)), ("tensor", 1, _f(2, 0)), ("tensor", 3, _f(2, 0)),
            ("object", 0, _f(2, 0)), ("object", 2, _f(2, 0))],
    }
    assert sp.files == {r: (_f(r, 0),) for r in range(3)}
    assert sp.bytes_per_rank == MIXED_BYTES and list(sp.bytes_per_rank) == [0, 1, 2]
    assert sp.replicas == MIXED_REPLICAS

    own = chunk_file_name(plans[1].tensors[0])  # "big" (256 bytes): a file of its own
    sp = plan_save(plans, files_per_rank=2, own_file_bytes=128)
    assert {r: [(w.kind, w.index, w.file) for w in ws] for r, ws in sp.writes.items()} == {
        0: [("tensor", 0, _f(0, 0)), ("tensor", 3, _f(0, 0)), ("object", 1, _f(0, 0)),
            ("tensor", 1, _f(0, 1)), ("object", 0, _f(0, 1)), ("object", 2, _f(0, 1))],
        1: [("tensor", 2, _f(1, 0)), ("object", 0, _f(1, 1)), ("tensor", 0, own)],
        2: [("tensor", 1, _f(2, 0)), ("object", 0, _f(2, 0)), ("tensor", 0, _f(2, 1)),
            ("tensor", 3, _f(2, 1)), ("object", 2, _f(2, 1))],
    }
    assert sp.files == {0: (_f(0, 0), _f(0, 1)), 1: (_f(1, 0), _f(1, 1), own), 2: (_f(2, 0), _f(2, 1))}
    assert sp.bytes_per_rank == MIXED_BYTES
    assert sp.replicas == MIXED_REPLICAS


# ----------------------------------------------------------------------------- plan_reads


def entry_of(lay: Layout) -> TensorEntry:
    chunks, pos = [], 0
    for p in lay.pieces:
        chunks.append(Chunk(global_offset=p.offset, local_shape=p.shape, file="f", offset=pos,
                            length=p.numel * ISZ, flattened_range=p.fr))
        pos += p.numel * ISZ
    return TensorEntry(dtype="float32", global_shape=lay.gshape, chunks=tuple(chunks))


def flat_ids(gshape: Shape, off: Shape, shape: Shape) -> np.ndarray:
    """Global flat indices of a box, in the box's row-major order."""
    g = np.arange(numel(gshape)).reshape(gshape)
    return g[tuple(slice(o, o + s) for o, s in zip(off, shape))].reshape(-1)


def simulate(entry: TensorEntry, req: Request) -> np.ndarray:
    """Execute plan_reads with NumPy on a global arange: returns the request's flat
    destination (-1 where nothing was written) and checks each item's byte range."""
    gshape = entry.global_shape
    r_ids = flat_ids(gshape, req.global_offset, req.local_shape)
    ra, rb = req.flattened_range or (0, len(r_ids))
    dst = np.full(rb - ra, -1, dtype=np.int64)
    writes = np.zeros(rb - ra, dtype=np.int64)
    for item in plan_reads(entry, req):
        c = entry.chunks[item.chunk_index]
        c_ids = flat_ids(gshape, c.global_offset, c.local_shape)
        ca, cb = c.flattened_range or (0, len(c_ids))
        box = set(flat_ids(gshape, item.box_offset, item.box_shape).tolist())
        # chunk elements this item covers (by position in the chunk's data)
        if item.kind == "flat":
            assert c.global_offset == req.global_offset and c.local_shape == req.local_shape
            positions = range(item.flat_start, item.flat_stop)
        else:
            positions = [k for k in range(ca, cb) if c_ids[k] in box]
        for k in positions:
            gid = c_ids[k]
            hits = np.nonzero(r_ids == gid)[0]
            assert len(hits) == 1
            j = int(hits[0])
            if not ra <= j < rb:
                assert item.kind == "gather"
                continue
            assert ca <= k < cb
            byte = (k - ca) * ISZ
            assert item.byte_start <= byte and byte + ISZ <= item.byte_stop
            assert 0 <= item.byte_start <= item.byte_stop <= c.length
            dst[j - ra] = gid
            writes[j - ra] += 1
    assert (writes <= 1).all(), "an element was written twice"
    return dst


@st.composite
def read_cases(draw):
    lay = draw(layouts(nranks=2))
    gshape = lay.gshape
    off = tuple(draw(st.integers(0, g)) for g in gshape)
    shape = tuple(draw(st.integers(0, g - o)) for o, g in zip(off, gshape))
    n = numel(shape)
    fr = None
    if n and draw(st.booleans()):
        a = draw(st.integers(0, n - 1))
        fr = (a, draw(st.integers(a + 1, n)))
    return lay, Request(fqn=lay.fqn, global_offset=off, local_shape=shape, flattened_range=fr)


@FEW
@given(read_cases())
def test_plan_reads_reproduces_the_requested_region(case) -> None:
    lay, req = case
    entry = entry_of(lay)
    dst = simulate(entry, req)
    want = flat_ids(lay.gshape, req.global_offset, req.local_shape)
    if req.flattened_range is not None:
        want = want[req.flattened_range[0]:req.flattened_range[1]]
    assert dst.tolist() == want.tolist()


def covered(entry: TensorEntry, req: Request, item) -> int:
    """Elements of the request one read item fills (box ∩ chunk range ∩ request range)."""
    if item.kind == "flat":
        return item.flat_stop - item.flat_start
    if item.kind == "box":
        return numel(item.box_shape)
    gshape = entry.global_shape
    c = entry.chunks[item.chunk_index]
    # a sub-box's global flat ids, in row-major order, are increasing: searchsorted finds
    # each element's position in the chunk's and in the request's flattening
    box = flat_ids(gshape, item.box_offset, item.box_shape)
    c_ids = flat_ids(gshape, c.global_offset, c.local_shape)
    r_ids = flat_ids(gshape, req.global_offset, req.local_shape)
    k, j = np.searchsorted(c_ids, box), np.searchsorted(r_ids, box)
    ca, cb = c.flattened_range or (0, len(c_ids))
    ra, rb = req.flattened_range or (0, len(r_ids))
    return int(((k >= ca) & (k < cb) & (j >= ra) & (j < rb)).sum())


@FEW
@given(read_cases())
def test_read_items_element_counts_sum_to_request_numel(case) -> None:
    lay, req = case
    entry = entry_of(lay)
    items = plan_reads(entry, req)
    assert sum(covered(entry, req, i) for i in items) == req.numel
    # no useless box/flat reads (a gather item may read a few elements it then masks out)
    assert all(covered(entry, req, i) > 0 for i in items if i.kind != "gather")
    for item in items:
        c = entry.chunks[item.chunk_index]
        assert 0 <= item.byte_start < item.byte_stop <= c.length
        if item.kind == "box":
            assert c.flattened_range is None and req.flattened_range is None
    if req.flattened_range is None and all(c.flattened_range is None for c in entry.chunks):
        assert all(i.kind == "box" for i in items)


@FEW
@given(layouts(nranks=1))
def test_chunk_request_reads_exactly_its_chunk(lay: Layout) -> None:
    entry = entry_of(lay)
    for ci, c in enumerate(entry.chunks):
        items = plan_reads(entry, chunk_request(c, lay.fqn))
        if c.numel == 0:
            assert items == []
            continue
        mine = [i for i in items if i.chunk_index == ci]
        assert len(mine) == 1
        assert (mine[0].byte_start, mine[0].byte_stop) == (0, c.length)


def test_plan_reads_exact_items() -> None:
    # [4, 6] saved as two row blocks; request rows 1..3, cols 2..5
    entry = TensorEntry(dtype="float32", global_shape=(4, 6), chunks=(
        Chunk(global_offset=(0, 0), local_shape=(2, 6), file="f", offset=0, length=48),
        Chunk(global_offset=(2, 0), local_shape=(2, 6), file="f", offset=48, length=48),
    ))
    items = plan_reads(entry, Request(fqn="w", global_offset=(1, 2), local_shape=(2, 3)))
    assert [(i.kind, i.chunk_index, i.box_offset, i.box_shape, i.byte_start, i.byte_stop) for i in items] == [
        ("box", 0, (1, 2), (1, 3), (6 + 2) * 4, (6 + 5) * 4),
        ("box", 1, (2, 2), (1, 3), 2 * 4, 5 * 4),
    ]
    assert plan_reads(entry, Request(fqn="w", global_offset=(4, 0), local_shape=(0, 6))) == []
    with pytest.raises(ShardingError, match=r"w: requested box at \[3, 0\] shape \[2, 6\] lies outside"):
        plan_reads(entry, Request(fqn="w", global_offset=(3, 0), local_shape=(2, 6)))
    with pytest.raises(ShardingError, match="lies outside"):
        plan_reads(entry, Request(fqn="w", global_offset=(0,), local_shape=(4,)))


def test_plan_reads_zero_dim() -> None:
    entry = TensorEntry(dtype="int64", global_shape=(), chunks=(
        Chunk(global_offset=(), local_shape=(), file="f", offset=0, length=8),))
    items = plan_reads(entry, Request(fqn="step", global_offset=(), local_shape=()))
    assert [(i.kind, i.chunk_index, i.byte_start, i.byte_stop) for i in items] == [("box", 0, 0, 8)]


@pytest.mark.parametrize(("rows", "error"), [
    ([(0, 2), (2, 2)], None),  # FSDP's row slabs
    ([(2, 2), (0, 2)], None),  # in any order
    ([(0, 4)], None),  # one whole chunk
    ([(0, 2), (2, 0), (2, 2)], None),  # an empty slab (uneven sharding) takes the general check
    ([(0, 1), (2, 2)], "hole"),
    ([(0, 3), (2, 2)], "overlapping"),
    ([(0, 2), (0, 2), (2, 2)], "recorded twice"),
    ([(0, 2), (2, 1)], "hole"),
    ([(0, 2), (2, 3)], "cover 30 of the 24"),  # past the end
])
def test_row_slab_coverage(rows: list[tuple[int, int]], error: str | None) -> None:
    """Row slabs of full trailing dims (the fast path) tile ``[4, 6]`` only
    when they follow one another from row 0 to row 4; anything else is
    decided by the general check, with its own message."""
    chunks = tuple(Chunk(global_offset=(r, 0), local_shape=(n, 6), file="f", offset=0, length=24 * n)
                   for r, n in rows)
    entry = TensorEntry(dtype="float32", global_shape=(4, 6), chunks=chunks)
    if error is None:
        check_entry_coverage("w", entry)
    else:
        with pytest.raises(ShardingError, match=error):
            check_entry_coverage("w", entry)
    # a slab that does not span the trailing dims is never taken for a tiling
    half = TensorEntry(dtype="float32", global_shape=(4, 6), chunks=(
        Chunk(global_offset=(0, 0), local_shape=(4, 3), file="f", offset=0, length=48),))
    with pytest.raises(ShardingError, match="hole"):
        check_entry_coverage("w", half)
