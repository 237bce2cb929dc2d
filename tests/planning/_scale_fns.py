"""Rank functions for tests/planning/test_coordination_scale.py (coordination at 4, 8 and 16 gloo ranks)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.collectives import Counting, TorchCollectives
from reshard.planning.coordination import PLAN_CACHE

COLS = 16


def _value(rows: int) -> torch.Tensor:
    i = torch.arange(rows, dtype=torch.float32).reshape(-1, 1)
    return i * 1000 + torch.arange(COLS, dtype=torch.float32)


def state(*, extra: int = 0, half: bool = False, bad_replica: bool = False, step: int = 1) -> dict[str, Any]:
    """A tiny training-style state: ``w`` row-sharded (2 rows per rank), its Adam
    moment as ZeRO flat ranges of the whole tensor, a replicated plain tensor,
    a per-rank object and a common value. The flags change one rank's
    structure (rank 2) or one replica (rank 3)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 2 * world
    full = _value(rows)
    w = full[2 * rank:2 * rank + 2].clone() + step
    n = rows * COLS
    a, b = n * rank // world, n * (rank + 1) // world
    moment = (full.reshape(-1)[a:b] * 0.5 + step).clone()
    emb = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    if bad_replica and rank == 3:
        emb = emb.clone()
        emb[0, 0] += 1
    out: dict[str, Any] = {
        "w": reshard.ShardedTensor("w", w, global_shape=(rows, COLS), global_offset=(2 * rank, 0)),
        "emb": emb,
        "w_exp_avg": reshard.ShardedTensor("w_exp_avg", moment, global_shape=(rows, COLS),
                                           global_offset=(0, 0), local_shape=(rows, COLS),
                                           flattened_range=slice(a, b)),
        "rng": reshard.ShardedObject("rng", {"rank": rank, "step": step}, global_shape=(world,),
                                     global_offset=(rank,)),
        "step": step,
    }
    if extra and rank == 2:  # a tensor only rank 2 holds, of ``extra`` elements
        out["extra"] = reshard.ShardedTensor("extra", torch.ones(extra), global_shape=(extra,),
                                                      global_offset=(0,))
    if half and rank == 2:
        out["w"] = reshard.ShardedTensor("w", w.to(torch.float64), global_shape=(rows, COLS),
                                                  global_offset=(2 * rank, 0))
    return out


def _files(path: str) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))
            if n != "manifest.json"}


def _check_load(path: str) -> bool:
    """Load ``w`` column-split and its moment as each rank's row box: bit-exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = 2 * world
    full = _value(rows)
    c0, c1 = COLS * rank // world, COLS * (rank + 1) // world
    wt = torch.zeros(rows, c1 - c0)
    mt = torch.zeros(2, COLS)
    st = {"w": reshard.ShardedTensor("w", wt, global_shape=(rows, COLS), global_offset=(0, c0)),
          "emb": torch.zeros(4, 6),
          "w_exp_avg": reshard.ShardedTensor("w_exp_avg", mt, global_shape=(rows, COLS),
                                             global_offset=(2 * rank, 0)),
          "rng": reshard.ShardedObject("rng", None, global_shape=(world,), global_offset=(rank,)),
          "step": 0}
    res = reshard.load(st, path)
    ok = torch.equal(wt, full[:, c0:c1] + 1) and torch.equal(mt, full[2 * rank:2 * rank + 2] * 0.5 + 1)
    ok = ok and torch.equal(st["emb"], torch.arange(24.0).reshape(4, 6) + 1)
    return bool(ok and res.values["rng"] == {"rank": rank, "step": 1})


def _err(fn: Any) -> dict[str, Any] | None:
    try:
        fn()
    except reshard.CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "failures": sorted(e.failures),
                "tb_chars": sum(len(f.traceback) for f in e.failures.values())}
    return None


def r_scale(root: str, full: bool = True) -> dict[str, Any]:
    """The scale checks on one world size (every rank returns what it saw).

    The first two saves go through the real torch.distributed collectives
    wrapped in :class:`Counting`: ``recv`` holds the bytes this rank received
    during the planned and the cached save. ``full=False`` stops after the
    first invalidation (for the 16-rank run)."""
    rank = dist.get_rank()
    PLAN_CACHE.clear()
    out: dict[str, Any] = {"rank": rank}
    p1, p2, p3 = (os.path.join(root, n) for n in ("planned", "cached", "fresh"))
    c1, c2 = Counting(TorchCollectives()), Counting(TorchCollectives())
    r1 = reshard.save(state(), p1, step=1, group=c1)
    r2 = reshard.save(state(), p2, step=1, group=c2)
    out["recv"] = [c1.recv, c2.recv]
    out["calls"] = [dict(c1.calls), dict(c2.calls)]
    out["cached"] = [r1.timings["cached_plan"], r2.timings["cached_plan"]]
    PLAN_CACHE.clear()
    r3 = reshard.save(state(), p3, step=1)
    out["fresh_cached"] = r3.timings["cached_plan"]
    dist.barrier()
    if rank == 0:
        out["identical"] = _files(p1) == _files(p2) == _files(p3)
        m1, m2 = reshard.inspect(p1), reshard.inspect(p2)
        out["manifests_equal"] = (m1.tensors == m2.tensors and m1.objects == m2.objects
                                  and m1.files == m2.files and m1.values == m2.values)
        out["emb_chunks"] = len(m1.tensors["emb"].chunks)
        out["bytes"] = m1.total_bytes
    out["load_ok"] = _check_load(p2)
    # invalidation: a new tensor on one rank, then its shape changed, then a dtype change on one rank
    p4, p5 = os.path.join(root, "extra"), os.path.join(root, "dtype")
    r4 = reshard.save(state(extra=3), p4, step=1)
    out["extra_cached"] = r4.timings["cached_plan"]
    out["extra_shape"] = rank != 0 or reshard.inspect(p4).tensors["extra"].global_shape == (3,)
    if not full:
        return out
    r5 = reshard.save(state(extra=3), os.path.join(root, "extra2"), step=1)
    out["extra2_cached"] = r5.timings["cached_plan"]
    p6 = os.path.join(root, "extra5")
    r6 = reshard.save(state(extra=5), p6, step=1)
    out["shape_cached"] = r6.timings["cached_plan"]
    if rank == 0:
        m6 = reshard.inspect(p6)
        out["shape_ok"] = (m6.tensors["extra"].global_shape == (5,)
                           and m6.tensors["extra"].chunks[0].length == 20 and reshard.verify(p6).ok)
    out["dtype_error"] = _err(lambda: reshard.save(state(extra=5, half=True), p5, step=1))
    out["dtype_cache_dropped"] = not PLAN_CACHE
    out["dtype_published"] = os.path.exists(p5)
    # replica digests compared on a cached save too
    reshard.save(state(), os.path.join(root, "base"), step=1)
    out["bad_replica"] = _err(lambda: reshard.save(state(bad_replica=True), os.path.join(root, "bad"),
                                                   step=1))
    out["bad_published"] = os.path.exists(os.path.join(root, "bad"))
    return out


def r_collectives() -> dict[str, Any]:
    """gather / scatter / broadcast / all_reduce on the default group and on a
    sub-group whose group ranks differ from the global ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    sub = dist.new_group(ranks=list(range(1, world)))
    groups: list[tuple[str, Any]] = [("world", None)]
    if rank > 0:
        groups.append(("sub", sub))
    for name, g in groups:
        c = TorchCollectives(g)
        mine = bytes([c.rank]) * (c.rank + 1)
        got = c.gather_bytes(mine)
        parts = [bytes([r, 7]) * r for r in range(c.world_size)] if c.rank == 0 else None
        out[name] = {"gather": got, "scatter": c.scatter_bytes(parts),
                     "bcast": c.broadcast_bytes(b"hello" if c.rank == 0 else None),
                     "sum": c.all_reduce_ints([c.rank, 1]), "max": c.all_reduce_ints([c.rank], "max"),
                     "min": c.all_reduce_ints([c.rank + 5], "min"), "rank": c.rank}
    dist.barrier()
    return out


def r_agree_failures() -> dict[str, Any]:
    """Every rank but 0 fails (ranks 1..n-2 with one message, the last with
    another): every rank raises one bounded error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c = TorchCollectives()
    exc: BaseException | None = None
    if rank:
        try:
            raise reshard.ShardingError("the same fault" if rank < world - 1 else "another fault")
        except reshard.ShardingError as e:
            exc = e
    try:
        c.agree("test step", exc)
    except reshard.CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "failures": sorted(e.failures),
                "tb": all("r_agree_failures" in f.traceback for f in e.failures.values())}
    return {"type": None, "tb": traceback.format_stack()[-1]}
