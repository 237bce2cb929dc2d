"""Real multi-rank save/load on gloo ranks (the ``pool`` fixture of conftest.py).

Rank functions (module-level, prefixed ``r_``) run inside the pool's workers; the tests
pass them a shared ``tmp_path`` and check what every rank returned.

Covered: the reshard matrix (row / column / 2-D block, uneven and zero-size shards,
0-dim and empty plain tensors, float32 / bfloat16 / float8_e4m3fn / bool, bit-exact),
replicas written once (and case 15: 10,000 replicated tensors on 8 ranks), replicas that
differ, a storage fault mid-write, a load failure on one rank, case 8 (latest skips a
step without manifest) and per-rank ShardedObject grids.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.ondisk.manifest import MANIFEST_NAME, decode_manifest, encode_manifest
from reshard.storage import LocalStorage
from reshard.storage.base import WriteStream

DTYPES = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f8": torch.float8_e4m3fn,
    "bool": torch.bool,
}

# name -> (global shape, layout at save, layout at a "rotated" load)
# A layout maps a dim to a split style: "even" = torch.tensor_split sizes (10 over 4 ->
# 3,3,2,2), "ceil" = torch.chunk sizes (10 over 4 -> 3,3,3,1; 6 over 4 -> 2,2,2,0).
# Two split dims form a grid (4 ranks -> 2x2).
SHARDED: dict[str, tuple[tuple[int, ...], dict[int, str], dict[int, str]]] = {
    "row": ((10, 3), {0: "even"}, {0: "even", 1: "ceil"}),
    "rowc": ((10, 3), {0: "ceil"}, {1: "ceil"}),
    "col": ((3, 10), {1: "ceil"}, {0: "ceil"}),
    "block": ((7, 5), {0: "even", 1: "ceil"}, {1: "even"}),
    "vec": ((6,), {0: "ceil"}, {0: "even"}),
}
# plain (replicated) tensors: name -> shape
PLAIN: dict[str, tuple[int, ...]] = {"scalar": (), "empty": (0, 3), "empty1": (0,), "rep": (2, 3)}
GRIDS = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}


# ----------------------------------------------------------------------------- geometry


def split(n: int, parts: int, style: str) -> list[tuple[int, int]]:
    """(offset, size) of each part of a dimension of ``n`` elements."""
    if style == "even":
        sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    else:
        c = -(-n // parts)
        sizes = [max(0, min(c, n - i * c)) for i in range(parts)]
    out, pos = [], 0
    for s in sizes:
        out.append((pos, s))
        pos += s
    return out


def box_of(
    gshape: tuple[int, ...], layout: dict[int, str], rank: int, world: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global_offset, local_shape) of ``rank``'s box."""
    dims = sorted(layout)
    grid = (world,) if len(dims) == 1 else GRIDS[world]
    coord = [rank] if len(dims) == 1 else [rank // grid[1], rank % grid[1]]
    off, shape = [0] * len(gshape), list(gshape)
    for d, parts, c in zip(dims, grid, coord):
        off[d], shape[d] = split(gshape[d], parts, layout[d])[c]
    return tuple(off), tuple(shape)


def encoded(gshape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """A global tensor whose every element's bits encode its global (row-major) index."""
    idx = torch.arange(math.prod(gshape), dtype=torch.int64) + salt
    if dtype == torch.float32:
        t = idx.to(torch.float32)
    elif dtype == torch.bfloat16:
        t = ((idx * 331 + 7) % 32768).to(torch.int16).view(torch.bfloat16)
    elif dtype == torch.float8_e4m3fn:
        t = ((idx * 37 + 3) % 256).to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        t = (idx * 7) % 3 == 0
    return t.reshape(gshape)


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype differing from ``t`` in every element."""
    if t.dtype == torch.bool:
        return ~t
    u8 = t.contiguous().reshape(-1).view(torch.uint8) ^ 0xFF
    return u8.view(t.dtype).reshape(t.shape).clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def sub(t: torch.Tensor, off: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(off, shape))]


# ----------------------------------------------------------------------------- rank functions


def r_matrix_save(path: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {"sharded": {}, "plain": {}}
    for name, (gshape, layout, _) in SHARDED.items():
        for dn, dt in DTYPES.items():
            off, shape = box_of(gshape, layout, rank, world)
            fqn = f"{name}_{dn}"
            state["sharded"][fqn] = reshard.ShardedTensor(
                fqn, sub(encoded(gshape, dt), off, shape), global_shape=gshape, global_offset=off
            )
    for name, shape in PLAIN.items():
        for dn, dt in DTYPES.items():
            state["plain"][f"{name}_{dn}"] = encoded(shape, dt, salt=5)
    res = reshard.save(state, path, step=7)
    return {"bytes_written": res.bytes_written, "total": res.total_bytes}


def r_matrix_load(path: str, rotated: bool) -> list[str]:
    """Load with this world's layout (the save layout, or the rotated one); returns the
    names of tensors that are not bit-exact (empty list: all good)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {"sharded": {}, "plain": {}}
    expect: dict[str, torch.Tensor] = {}
    targets: dict[str, torch.Tensor] = {}
    for name, (gshape, save_layout, rot_layout) in SHARDED.items():
        layout = rot_layout if rotated else save_layout
        for dn, dt in DTYPES.items():
            off, shape = box_of(gshape, layout, rank, world)
            fqn = f"{name}_{dn}"
            want = sub(encoded(gshape, dt), off, shape).clone()
            dst = sentinel_like(want)
            if name == "col" and dst.dim() == 2:  # a non-contiguous destination buffer
                dst = sentinel_like(want).t().contiguous().t()
            state["sharded"][fqn] = reshard.ShardedTensor(
                fqn, dst, global_shape=gshape, global_offset=off
            )
            expect[fqn], targets[fqn] = want, dst
    for name, shape in PLAIN.items():
        for dn, dt in DTYPES.items():
            key = f"{name}_{dn}"
            want = encoded(shape, dt, salt=5)
            dst = sentinel_like(want)
            state["plain"][key] = dst
            expect["plain." + key], targets["plain." + key] = want, dst
    res = reshard.load(state, path)
    assert res.step == 7, res.step
    bad = []
    for k, want in expect.items():
        got = targets[k]
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(
            bits(got), bits(want)
        ):
            bad.append(f"rank {rank}: {k}: got {got!r}, want {want!r}")
    return bad


def r_save_plain(path: str, n: int, shape: tuple[int, ...]) -> dict[str, Any]:
    """Save ``n`` replicated plain tensors (identical on every rank)."""
    state = {"t": {f"p{i}": torch.full(shape, float(i)) for i in range(n)}}
    res = reshard.save(state, path, step=1)
    return {"bytes_written": res.bytes_written, "total": res.total_bytes, "files": res.num_files}


def r_save_differing_replica(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    x = torch.arange(4, dtype=torch.float32)
    if rank == 1:
        x[2] = 100.0
    state = {"same": torch.ones(3), "model": {"x": x}}
    try:
        reshard.save(state, path, step=1)
    except reshard.CheckpointError as e:
        return {"type": type(e).__name__, "is_sharding": isinstance(e, reshard.ShardingError),
                "message": str(e)}
    return {"type": None}


class _FailingStream(WriteStream):
    """Passes the first write through, then fails (a partial file is really on disk)."""

    def __init__(self, inner: WriteStream):
        self.inner, self.writes = inner, 0

    def write(self, data: bytes | memoryview) -> None:
        self.writes += 1
        if self.writes > 1:
            raise OSError(28, "injected: no space left on device (rank 1 mid-write)")
        self.inner.write(data)

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage(LocalStorage):
    """Local storage whose data-file streams fail after their first write on ``fail_rank``."""

    def __init__(self, rank: int, fail_rank: int):
        super().__init__()
        self.rank, self.fail_rank = rank, fail_rank
        self.opened: list[str] = []

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        self.opened.append(os.path.basename(path))
        inner = super().open_write(path, durable=durable)
        if self.rank == self.fail_rank and path.endswith(".safetensors"):
            return _FailingStream(inner)
        return inner


def _sharded_rows(step_value: float) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 4 * world
    data = torch.full((4, 8), step_value) + rank
    return {
        "w": reshard.ShardedTensor("w", data, global_shape=(rows, 8), global_offset=(4 * rank, 0)),
        "bias": torch.full((8,), step_value),
    }


def r_fail_mid_write(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    p1, p2 = os.path.join(root, "step-00000001"), os.path.join(root, "step-00000002")
    reshard.save(_sharded_rows(1.0), p1, step=1)
    st = FaultyStorage(rank, fail_rank=1)
    out: dict[str, Any] = {"raised": None}
    try:
        reshard.save(_sharded_rows(2.0), p2, step=2, storage=st)
    except reshard.CheckpointError as e:
        out = {
            "raised": type(e).__name__,
            "message": str(e),
            "failures": {r: (f.type_name, f.message, f.traceback) for r, f in e.failures.items()},
        }
    out["bytes_written"] = st.bytes_written
    out["opened"] = st.opened
    dist.barrier()
    out["latest"] = reshard.latest(root)
    return out


def r_save_rows(path: str) -> None:
    reshard.save(_sharded_rows(3.0), path, step=3)


def r_load_mismatch(path: str, bad_rank: int, what: str) -> dict[str, Any]:
    """Load ``_sharded_rows`` state; ``bad_rank`` requests a wrong shape for ``what``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 4 * world
    gshape, lshape = (rows, 8), (4, 8)
    bias = torch.zeros(8)
    if rank == bad_rank and what == "sharded":
        gshape, lshape = (rows, 6), (4, 6)
    if rank == bad_rank and what == "plain":
        bias = torch.zeros(9)
    state = {
        "w": reshard.ShardedTensor("w", torch.zeros(lshape), global_shape=gshape,
                                   global_offset=(4 * rank, 0)),
        "bias": bias,
    }
    try:
        reshard.load(state, path)
    except reshard.CheckpointError as e:
        return {"type": type(e).__name__, "is_sharding": isinstance(e, reshard.ShardingError),
                "failures": sorted(e.failures), "message": str(e)}
    return {"type": None}


def r_case8(root: str, how: str) -> dict[str, Any]:
    rank = dist.get_rank()
    p100, p200 = os.path.join(root, "step-00000100"), os.path.join(root, "step-00000200")
    reshard.save(_sharded_rows(100.0), p100, step=100)
    reshard.save(_sharded_rows(200.0), p200, step=200)
    dist.barrier()
    if rank == 0:
        if how == "no-manifest":
            os.remove(os.path.join(p200, MANIFEST_NAME))
        else:  # an abandoned attempt directory of step 200 (data, no manifest)
            os.remove(os.path.join(p200, MANIFEST_NAME))
            os.rename(p200, p200 + ".incomplete-20240101T000000-deadbeef")
    dist.barrier()
    out: dict[str, Any] = {"latest": reshard.latest(root)}
    st = _sharded_rows(0.0)
    try:
        reshard.load(st, p200)
        out["load200"] = None
    except reshard.CheckpointError as e:
        out["load200"] = type(e).__name__
    dist.barrier()
    return out


def r_objects_save(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    value = {"rank": rank, "seed": 1000 + rank, "stream": [rank, rank * 2, "x" * rank]}
    state = {"rng": reshard.ShardedObject("rng", value, global_shape=(world,),
                                          global_offset=(rank,))}
    reshard.save(state, path, step=1)


def r_objects_load(path: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"rng": reshard.ShardedObject("rng", None, global_shape=(world,),
                                          global_offset=(rank,))}
    try:
        res = reshard.load(state, path)
    except reshard.CheckpointError as e:
        return {"type": type(e).__name__, "is_sharding": isinstance(e, reshard.ShardingError),
                "message": str(e)}
    return {"type": None, "value": res.values.get("rng")}


# ----------------------------------------------------------------------------- helpers (driver)


def _manifest(path: Path) -> tuple[bytes, reshard.Manifest]:
    raw = (path / MANIFEST_NAME).read_bytes()
    return raw, decode_manifest(raw)


def _normalised(m: reshard.Manifest) -> bytes:
    """The manifest with what legitimately differs between layouts blanked: attempt id,
    commit time, world size, file list, the save plan kept beside it, and where in which file each chunk lies (its byte
    offset and the index of its first block in the file's block table)."""
    tensors = {
        k: msgspec.structs.replace(
            e, chunks=tuple(msgspec.structs.replace(c, file="", offset=0, block_index=-1)
                            for c in e.chunks)
        )
        for k, e in m.tensors.items()
    }
    return encode_manifest(msgspec.structs.replace(
        m, attempt_id="", created_at=0.0, world_size=0, files={}, plan=None, tensors=tensors
    ))


def _tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*")) if p.is_file()
    }


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("rotated", [False, True], ids=["same-kind", "rotated-kind"])
@pytest.mark.parametrize(
    "save_world,load_world", [(1, 4), (4, 1), (2, 3), (3, 2), (4, 2)],
    ids=lambda v: str(v),
)
def test_reshard_matrix(pool, tmp_path, save_world, load_world, rotated):
    """Every element of every tensor lands where it belongs, bit-exact, across layouts."""
    path = str(tmp_path / "ckpt")
    saved = pool.run(save_world, r_matrix_save, path)
    assert sum(r["bytes_written"] for r in saved) == saved[0]["total"]
    bad = pool.run(load_world, r_matrix_load, path, rotated)
    assert [b for rank_bad in bad for b in rank_bad] == []
    m = reshard.inspect(path)
    assert m.world_size == save_world
    assert reshard.verify(path).ok
    # replicated plain tensors: one chunk each, whatever the save world
    for name in PLAIN:
        for dn in DTYPES:
            assert len(m.tensors[f"plain.{name}_{dn}"].chunks) == 1
    # sharded tensors: one chunk per rank that holds a box (zero-size boxes may be listed)
    for name, (gshape, layout, _) in SHARDED.items():
        want = {box_of(gshape, layout, r, save_world) for r in range(save_world)}
        got = {(c.global_offset, c.local_shape) for c in m.tensors[f"sharded.{name}_f32"].chunks}
        assert {b for b in got if math.prod(b[1])} == {b for b in want if math.prod(b[1])}


def test_split_geometry_is_what_the_matrix_claims():
    """The matrix really covers 3,3,2,2 / 3,3,3,1 / a zero-size shard / a 2x2 grid."""
    assert [s for _, s in split(10, 4, "even")] == [3, 3, 2, 2]
    assert [s for _, s in split(10, 4, "ceil")] == [3, 3, 3, 1]
    assert [s for _, s in split(6, 4, "ceil")] == [2, 2, 2, 0]
    assert box_of((7, 5), {0: "even", 1: "ceil"}, 3, 4) == ((4, 3), (3, 2))
    assert box_of((6,), {0: "ceil"}, 3, 4) == ((6,), (0,))


def test_replicated_written_once(pool, tmp_path):
    p1, p4 = tmp_path / "w1", tmp_path / "w4"
    pool.run(1, r_save_plain, str(p1), 1, (16,))
    res = pool.run(4, r_save_plain, str(p4), 1, (16,))
    raw1, m1 = _manifest(p1)
    raw4, m4 = _manifest(p4)
    assert len(m4.tensors["t.p0"].chunks) == 1
    assert sum(len(e.chunks) for e in m4.tensors.values()) == sum(
        len(e.chunks) for e in m1.tensors.values()
    )
    assert len(m4.files) == 1 and [r["files"] for r in res] == [1] * 4  # whole checkpoint
    assert sorted(r["bytes_written"] > 0 for r in res) == [False, False, False, True]
    # only the attempt id, commit time and world size may differ
    assert abs(len(raw4) - len(raw1)) <= 300, (len(raw1), len(raw4))
    assert _normalised(m4) == _normalised(m1)


def test_differing_replicas_raise_everywhere(pool, tmp_path):
    out = pool.run(4, r_save_differing_replica, str(tmp_path / "ckpt"))
    for r in out:
        assert r["type"] == "ShardingError" and r["is_sharding"], r
        assert "model.x" in r["message"], r["message"]
        assert re.search(r"ranks \[[^\]]*\b1\b[^\]]*\]", r["message"]), r["message"]
    assert not (tmp_path / "ckpt").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_failure_mid_write(pool, tmp_path):
    root = tmp_path / "root"
    out = pool.run(4, r_fail_mid_write, str(root))
    p1, p2 = root / "step-00000001", root / "step-00000002"
    for rank, r in enumerate(out):
        assert r["raised"] is not None, (rank, r)
        assert sorted(r["failures"]) == [1], (rank, r["failures"])
        type_name, message, tb = r["failures"][1]
        assert type_name in ("OSError", "StorageError"), type_name
        assert "injected" in message and "injected" in r["message"]
        assert "rank 1" in r["message"]
        assert tb  # the traceback text travelled
        assert r["latest"] == str(p1)
    # other ranks really wrote data files; rank 1 wrote its first chunk of bytes
    assert all(r["bytes_written"] > 0 for r in out)
    assert not p2.exists()
    leftovers = [p.name for p in root.iterdir() if p.name != p1.name]
    assert leftovers == [] or reshard.latest(str(root)) == str(p1), leftovers
    before = _tree_digest(p1)
    assert reshard.verify(str(p1)).ok
    assert reshard.inspect(str(p1)).step == 1
    assert _tree_digest(p1) == before
    assert reshard.latest(str(root)) == str(p1)


@pytest.mark.parametrize("what", ["sharded", "plain"])
def test_load_mismatch_on_one_rank_raises_everywhere(pool, tmp_path, what):
    path = str(tmp_path / "ckpt")
    pool.run(4, r_save_rows, path)
    out = pool.run(4, r_load_mismatch, path, 2, what)
    for r in out:
        assert r["type"] == "ShardingError" and r["is_sharding"], r
        assert r["failures"] == [2], r
        assert ("w" if what == "sharded" else "bias") in r["message"]


@pytest.mark.parametrize("how", ["no-manifest", "incomplete-dir"])
def test_case8_latest_skips_step_without_manifest(pool, tmp_path, how):
    root = tmp_path / "root"
    out = pool.run(2, r_case8, str(root), how)
    for r in out:
        assert r["latest"] == str(root / "step-00000100"), r
        assert r["load200"] == "CheckpointNotFoundError", r
    assert reshard.latest(str(root)) == str(root / "step-00000100")


def test_sharded_object_grid(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    pool.run(4, r_objects_save, path)
    m = reshard.inspect(path)
    assert m.objects["rng"].global_shape == (4,) and len(m.objects["rng"].chunks) == 4
    out = pool.run(4, r_objects_load, path)
    for rank, r in enumerate(out):
        assert r["type"] is None, r
        assert r["value"] == {"rank": rank, "seed": 1000 + rank,
                              "stream": [rank, rank * 2, "x" * rank]}, r
    out = pool.run(2, r_objects_load, path)
    for r in out:
        assert r["type"] == "ShardingError" and r["is_sharding"], r
        assert "rng" in r["message"]


def test_case15_many_replicated_tensors_on_8_ranks(pool, tmp_path):
    """Case 15: 10,000 small replicated tensors on 8 ranks: the manifest does not grow
    with replicas and the writes are balanced across the 8 holders."""
    n = 10_000
    p1, p8 = tmp_path / "w1", tmp_path / "w8"
    pool.run(1, r_save_plain, str(p1), n, (2,))
    res = pool.run(8, r_save_plain, str(p8), n, (2,), timeout=120.0)
    raw1, m1 = _manifest(p1)
    raw8, m8 = _manifest(p8)
    assert len(m8.tensors) == n
    assert sum(len(e.chunks) for e in m8.tensors.values()) == n
    # identical up to world size, file list, and chunk file/offset (8 files vs 1)
    assert _normalised(m8) == _normalised(m1)
    files_delta = len(msgspec.json.encode(m8.files)) - len(msgspec.json.encode(m1.files))
    assert abs(len(raw8) - len(raw1) - files_delta) <= 0.01 * len(raw1), (
        len(raw1), len(raw8), files_delta)
    # balanced: every writer holds 1/8 of the data bytes (1,250 tensors of 8 bytes each),
    # and SaveResult.bytes_written (file bytes: data + safetensors header) is even too
    per_file: dict[str, int] = {}
    for e in m8.tensors.values():
        for c in e.chunks:
            per_file[c.file] = per_file.get(c.file, 0) + c.length
    assert len(m8.files) == 8 and sorted(per_file.values()) == [n * 2 * 4 // 8] * 8, per_file
    written = [r["bytes_written"] for r in res]
    assert sum(written) == res[0]["total"] == m8.total_bytes
    assert max(written) - min(written) <= 0.05 * max(written), written
