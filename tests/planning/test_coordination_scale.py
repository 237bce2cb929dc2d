"""Coordination at scale on real gloo ranks (4, 8 and 16 processes, tiny states).

Covered: the collectives (gather / scatter / broadcast / all-reduce on the default
group and a sub-group), a failure on most ranks agreed as one bounded error, and on
8 and 16 ranks: a save resharded on load bit-exact, replicas written once, a cached
re-save bit-identical to a planned one, invalidation (a tensor added on one rank, its
shape changed, a dtype changed: re-planned, never a wrong manifest), replica digests
compared on a cached save, and the bytes a non-coordinator rank receives during a save
not growing from 4 to 16 ranks.
"""

from __future__ import annotations

import pytest

import _scale_fns as fns
from reshard.testing.pool import WorkerPool


def test_collectives_on_world_and_subgroup(pool: WorkerPool) -> None:
    out = pool.run(4, fns.r_collectives)
    for rank, o in enumerate(out):
        w = o["world"]
        assert w["gather"] == ([bytes([r]) * (r + 1) for r in range(4)] if rank == 0 else None)
        assert w["scatter"] == bytes([rank, 7]) * rank
        assert w["bcast"] == b"hello"
        assert w["sum"] == [6, 4] and w["max"] == [3] and w["min"] == [5]
        if rank:
            s = o["sub"]  # group ranks 0..2 are global ranks 1..3
            assert s["rank"] == rank - 1
            assert s["gather"] == ([bytes([r]) * (r + 1) for r in range(3)] if rank == 1 else None)
            assert s["scatter"] == bytes([rank - 1, 7]) * (rank - 1)
            assert s["bcast"] == b"hello" and s["sum"] == [3, 3] and s["max"] == [2]


def test_failures_agreed_bounded(pool: WorkerPool) -> None:
    out = pool.run(8, fns.r_agree_failures)
    for rank, o in enumerate(out):
        assert o["type"] == "ShardingError", o
        assert "failed on 7 rank(s)" in o["message"]
        assert "ranks 1-6 (6 ranks): ShardingError: the same fault" in o["message"], o["message"]
        assert "rank 7: ShardingError: another fault" in o["message"]
        assert o["tb"]
        # the coordinator keeps every failure, the others one per distinct failure
        assert o["failures"] == (list(range(1, 8)) if rank == 0 else [1, 7]), o["failures"]


def _common(out: list[dict], world: int) -> None:
    head = out[0]
    assert head["identical"] and head["manifests_equal"]
    assert head["emb_chunks"] == 1  # the replicated tensor is written once
    rows = 2 * world
    assert head["bytes"] < 2 * (rows * fns.COLS * 4) + 24 * 4 + 4096 * world  # each element once
    for o in out:
        assert o["cached"] == [0.0, 1.0] and o["fresh_cached"] == 0.0, o
        assert o["load_ok"], o
        assert o["extra_cached"] == 0.0 and o["extra_shape"], o
        assert "all_gather" not in o["calls"][0] and "all_gather" not in o["calls"][1]


def test_scale_8_ranks(pool: WorkerPool, tmp_path) -> None:
    out = pool.run(8, fns.r_scale, str(tmp_path), timeout=110)
    _common(out, 8)
    assert out[0]["shape_ok"]
    for o in out:
        assert o["extra2_cached"] == 1.0, o
        assert o["shape_cached"] == 0.0, o
        e = o["dtype_error"]
        assert e is not None and e["type"] == "ShardingError" and "w: rank" in e["message"], e
        assert o["dtype_cache_dropped"] and not o["dtype_published"]
        b = o["bad_replica"]
        assert b is not None and b["type"] == "ShardingError", b
        assert "emb at" in b["message"] and "replicas differ" in b["message"], b
        assert not o["bad_published"]


@pytest.mark.timeout(300)
def test_scale_16_ranks_and_bytes_received(pool: WorkerPool, tmp_path) -> None:
    small = pool.run(4, fns.r_scale, str(tmp_path / "w04"), False)  # paths of equal length
    large = pool.run(16, fns.r_scale, str(tmp_path / "w16"), False, timeout=280)
    _common(large, 16)
    for i, what in enumerate(("planned", "cached")):
        m4 = max(o["recv"][i] for o in small[1:])
        m16 = max(o["recv"][i] for o in large[1:])
        assert m16 <= m4, (what, m4, m16, [o["recv"][i] for o in large])
    assert max(o["recv"][1] for o in large[1:]) <= 1024
    assert large[1]["calls"][1].get("gather", 0) == 1  # the write reports only


def test_block_digests_beside_the_data(tmp_path) -> None:
    """The manifest holds one digest per chunk; the per-block digests live in the
    shard file's block table, checked against it on every read."""
    import torch

    import reshard
    from reshard.options import SaveOptions

    w = torch.arange(4096, dtype=torch.float32)
    ck = tmp_path / "ck"
    reshard.save({"w": w, "n": 3}, ck, options=SaveOptions(checksum_block_bytes=1024))
    m = reshard.inspect(ck)
    (c,) = m.tensors["w"].chunks
    assert c.checksums == () and len(c.digest) == 16 and c.block_index == 0
    fe = m.files[c.file]
    assert fe.blocks == 16 and c.offset + c.length == fe.size - 8 * 16
    assert reshard.verify(ck).ok
    raw = bytearray((ck / c.file).read_bytes())
    raw[-3] ^= 1  # a digest in the table
    (ck / c.file).write_bytes(bytes(raw))
    rep = reshard.verify(ck)
    assert not rep.ok and any("block table" in p for p in rep.problems), rep.problems
    with pytest.raises(reshard.IntegrityError, match="block table was altered"):
        reshard.load({"w": torch.zeros(4096)}, ck, strict=False)
    raw[-3] ^= 1
    raw[c.offset + 5000] ^= 1  # a data byte of block 4
    (ck / c.file).write_bytes(bytes(raw))
    with pytest.raises(reshard.IntegrityError, match=r"checksum mismatch in 'w' .*block 4"):
        reshard.load({"w": torch.zeros(4096)}, ck, strict=False)
