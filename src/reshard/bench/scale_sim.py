"""The scale simulator behind ``reshard bench scale`` and ``benchmarks/bench_scale.py``.

For each world size (the given layout scaled down along DP, then PP), the
simulated ranks of :mod:`reshard.bench.scale_layout` run the real protocols
in lockstep (:class:`reshard.bench.simulate.SimWorld`):

1. a first save: :func:`reshard.planning.coordination.save_steps` (gather plans, coordinator
   planning, scatter assignments, gather write reports, manifest build); the
   write itself is replaced by a report of the offsets, lengths and per-block
   checksums the files would get (no data is written);
2. a cached re-save from the cache entries the first save left on every rank,
   and one after a simulated restart: every rank's entry rebuilt from the
   checkpoint's ``plan.bin`` (:mod:`reshard.planning.plan_store`; ``restart_*``,
   ``cached_after_restart_*``);
3. the manifest encoded as JSON (``manifest_bytes``) and decoded + validated
   (``manifest_parse_s``);
4. the load into the target layout: the manifest broadcast, the strictness
   census over every rank (:func:`reshard.planning.coordination_load.key_census_steps`),
   and each rank's own read plan (:func:`reshard.planning.planner.plan_reads` over its
   requests) for a sample of ranks (every PP stage, first/last TP and DP index).

Seconds are CPU seconds (``time.process_time``) spent in each rank's own steps
(the development machine is shared, so wall time would measure the other
tenants); bytes are what each rank sends / receives through the simulated
collectives.
"""

from __future__ import annotations

import gc
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import xxhash

from ..ondisk.manifest import Manifest, decode_manifest, encode_sealed
from ..planning.coordination import Assignment, CacheEntry
from ..planning.coordination_load import key_census_steps, saved_keys
from ..planning.coordination_save import Attempt, RankSave, report_bytes, save_steps
from ..planning.plan_store import restart_entry
from ..planning.planner import LocalPlan
from ..planning.read_plan import Request, plan_reads
from .scale_layout import Layout, item_digest, rank_items, rank_plan, scaled_layouts
from .simulate import SimWorld

BLOCK = 1 << 20


def default_target(layout: Layout) -> Layout:
    return Layout(tp=max(1, layout.tp // 2), pp=max(1, layout.pp // 2), dp=layout.dp * 4, ep=layout.ep)


def scale_target(top: Layout, top_target: Layout, layout: Layout) -> Layout:
    """The load layout for ``layout``: ``top_target``'s ratios to ``top`` applied to it."""
    def f(a: int, ta: int, x: int) -> int:
        return max(1, x * ta // a)
    return Layout(tp=f(top.tp, top_target.tp, layout.tp), pp=f(top.pp, top_target.pp, layout.pp),
                  dp=f(top.dp, top_target.dp, layout.dp), ep=layout.ep)


def _fake_persist(plan: LocalPlan, world: SimWorld) -> Callable[[Attempt, Assignment], tuple[bytes, int]]:
    def persist(info: Attempt, a: Assignment) -> tuple[bytes, int]:
        # stands in for the data I/O: left out of the rank's seconds, by the clock that counts them
        with world.uncounted():
            return _fake_report(plan, a)
    return persist


def _fake_report(plan: LocalPlan, a: Assignment) -> tuple[bytes, int]:
    """The write report of rank ``plan.rank`` as if it had written its assignment ``a``."""
    per_file = [8 + 128 * sum(1 for w in a.writes if w[2] == k) for k in range(len(a.files))]
    blocks = [0] * len(a.files)
    writes = []
    for kind, i, fi in a.writes:
        n = plan.tensors[i].nbytes if kind == 0 else plan.objects[i].nbytes
        off = per_file[fi]
        # the root of the item's blocks; the 8-byte block digests go into the file's table
        root = xxhash.xxh3_64_hexdigest(f"{plan.rank}:{i}".encode())
        writes.append((off, n, root, blocks[fi]))
        per_file[fi] = off + n
        blocks[fi] += -(-n // BLOCK)
    files = [(size + 8 * blocks[k], f"{plan.rank:08x}{k:08x}", blocks[k])
             for k, size in enumerate(per_file)]
    # the replicas' digests: computed while writing (a real save's plan carries none)
    digests = [item_digest(plan.tensors[i]) if kind == 0 else plan.objects[i].digest for kind, i in a.check]
    return report_bytes(files, writes, digests), sum(per_file)


#: the checkpoint path of the simulated saves (its length is in the attempt's broadcast)
SIM_TARGET = "/checkpoints/run/step-00000001"


def _attempt_info(target: str) -> Attempt:
    """What the coordinator broadcasts about a new attempt, shaped as a
    real save's (:func:`reshard.saving.save.open_attempt`: target, attempt id, path, nonce)."""
    from ..commit.protocol import new_attempt_id
    from ..ondisk.committed import INCOMPLETE

    aid = new_attempt_id()
    return Attempt(target=target, attempt_id=aid, attempt_path=f"{target}{INCOMPLETE}{aid}",
                   nonce=os.urandom(16).hex())


class _SimHooks:
    """The I/O of a simulated rank's save (:class:`SaveHooks`): nothing is
    written; the coordinator keeps the encoded manifest and plan in ``out``."""

    checks_space = False
    keeps_plan = True

    def __init__(self, plan: LocalPlan, world: SimWorld, target: str, out: dict[str, Any]) -> None:
        self.target, self.out = target, out
        self._persist = _fake_persist(plan, world)

    def begin(self) -> Attempt:
        return _attempt_info(self.target)

    def check_location(self, attempt: Attempt) -> None:
        pass

    def check_space(self, attempt: Attempt, needed: int) -> None:
        pass

    def linkable(self, attempt: Attempt, layout: Any) -> int:
        return 0

    def persist(self, attempt: Attempt, assignment: Any) -> tuple[bytes, int]:
        return self._persist(attempt, assignment)

    def manifest_args(self) -> dict[str, Any]:
        return dict(step=1, checksum_block_bytes=BLOCK, schema_version=None, mesh=None, values={}, extra={})

    def write_plan(self, attempt: Attempt, raw: bytes) -> None:
        self.out["plan"] = raw

    def publish(self, attempt: Attempt, m: Manifest) -> None:
        t0 = time.process_time()
        self.out["raw"] = encode_sealed(m)  # as commit.publish writes it
        self.out["encode_s"] = time.process_time() - t0

    def discard(self, attempt: Attempt) -> None:
        pass


def _save(plans: list[LocalPlan], caches: list[CacheEntry | None],
          target: str = SIM_TARGET) -> tuple[list[RankSave], Any, dict[str, Any]]:
    n = len(plans)
    out: dict[str, Any] = {}
    world = SimWorld(n)
    ctxs = [RankSave(rank=r, world_size=n, plan=plans[r], value_digests={"step": "1"}, err=None,
                     files_per_rank=1, hooks=_SimHooks(plans[r], world, target, out),
                     cache=caches[r]) for r in range(n)]
    results, stats = world.run([save_steps(c) for c in ctxs])
    bad = [x for x in results if isinstance(x, BaseException)]
    if bad:
        raise bad[0]
    out["cached"] = all(x.cached for x in results)
    return ctxs, stats, out


def _restart_caches(out: dict[str, Any], n: int) -> dict[str, Any]:
    """Every rank's plan-cache entry as a new process rebuilds it from the
    committed checkpoint (:func:`reshard.planning.plan_store.restart_entry`), with the
    CPU seconds and storage bytes each rank spends on it."""
    from ..storage import MemoryStorage, clear_memory_storage

    ns = "scale-sim-restart"
    clear_memory_storage(ns)
    st = MemoryStorage(ns)
    st.write_bytes("ck/manifest.json", out["raw"], durable=False)
    st.write_bytes("ck/plan.bin", out["plan"], durable=False)
    caches: list[CacheEntry | None] = []
    seconds, read = [], []
    for r in range(n):
        b0 = st.bytes_read
        t0 = time.process_time()
        caches.append(restart_entry(st, "ck", r, n, files_per_rank=1))
        seconds.append(time.process_time() - t0)
        read.append(st.bytes_read - b0)
    clear_memory_storage(ns)
    return {"caches": caches, "seconds": seconds, "read": read}


def _modulo_time(m: Manifest) -> Manifest:
    import msgspec

    return msgspec.structs.replace(m, created_at=0.0, extra={}, attempt_id="")


def _sample_ranks(lay: Layout, limit: int = 48) -> list[int]:
    picks = set()
    for pp in range(lay.pp):
        for tp in {0, lay.tp - 1}:
            for dp in {0, lay.dp - 1}:
                picks.add((pp * lay.dp + dp) * lay.tp + tp)
    ranks = sorted(picks)
    if len(ranks) > limit:
        step = len(ranks) / limit
        ranks = sorted({ranks[int(i * step)] for i in range(limit)} | {0, lay.world - 1})
    return ranks


def simulate_one(model: str, layout: Layout, target: Layout, *, optimizer: str = "adam",
                 zero_split: str = "flat", log: Callable[[str], None] = lambda s: None,
                 path: str = SIM_TARGET) -> dict[str, Any]:
    """One row of the table (see the module docstring for what each key
    measures); ``path``: the checkpoint path the simulated saves name."""
    n = layout.world
    plans = [rank_plan(model, layout, r, optimizer=optimizer, zero_split=zero_split) for r in range(n)]
    items = sum(len(p.tensors) for p in plans)
    gc.collect()
    gc.disable()
    try:
        ctxs, st1, out1 = _save(plans, [None] * n, path)
        t_plan0 = ctxs[0].timings.get("coordinate_cpu", 0.0)
        t_commit0 = ctxs[0].timings.get("manifest_build_cpu", 0.0)
        caches = [c.new_cache for c in ctxs]
        assert all(c is not None for c in caches)
        assignment0 = caches[1].assignment if n > 1 else caches[0].assignment  # type: ignore[union-attr]
        ctxs2, st2, out2 = _save(plans, caches, path)
        cached_ok = all(c.new_cache is not None for c in ctxs2)
        # a restart: every rank's cache rebuilt from the checkpoint's plan.bin (rank 0:
        # manifest + whole file, checked; others: three ranged reads of their own record)
        restart = _restart_caches(out1, n)
        ctxs3, st4, out4 = _save(plans, restart["caches"], path)
        restart_ok = out4["cached"] and all(c.new_cache is not None for c in ctxs3)
    finally:
        gc.enable()
    raw = out1["raw"]
    assert out2["raw"] and len(out2["raw"]) > 0 and cached_ok and out2["cached"] and not out1["cached"]
    assert restart_ok and all(c is not None for c in restart["caches"]), "restart cache"
    # the manifest of the cached save after the restart (layout rebuilt from plan.bin) is the first one
    from ..ondisk.manifest import decode_manifest as _decode

    restart_same = _modulo_time(_decode(out4["raw"])) == _modulo_time(_decode(raw))
    assert restart_same, "the manifest rebuilt after a restart differs"
    del ctxs, ctxs2, ctxs3, caches
    gc.collect()
    t0 = time.process_time()
    m = decode_manifest(raw)
    parse_s = time.process_time() - t0
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(raw)
    t0 = time.process_time()
    with open(f.name, "rb") as fh:
        fh.read()
    read_s = time.process_time() - t0
    os.unlink(f.name)
    # load: census over every target rank, local read plans for a sample
    nt = target.world
    saved = saved_keys(m)
    available = set(saved)
    requests = [[it for it in rank_items(model, target, r, optimizer=optimizer, zero_split=zero_split)]
                for r in range(nt)]
    results, st3 = SimWorld(nt).run([key_census_steps(r, saved, {it.fqn for it in requests[r]}, available)
                                     for r in range(nt)])
    assert all(not isinstance(x, BaseException) and not x.unexpected for x in results), "census"
    plan_s = []
    for r in _sample_ranks(target):
        t0 = time.process_time()
        nread = 0
        for it in requests[r]:
            nread += len(plan_reads(m.tensors[it.fqn], Request(
                fqn=it.fqn, global_offset=it.global_offset, local_shape=it.local_shape,
                flattened_range=it.flattened_range)))
        plan_s.append(time.process_time() - t0 + st3.seconds[r])
    a_bytes = len(__import__("msgspec").msgpack.encode(assignment0))
    row = {
        "world": n, "layout": str(layout), "target": str(target), "model": model,
        "zero_split": zero_split, "items": items, "chunks": sum(len(t.chunks) for t in m.tensors.values()),
        "coordinator_s": round(st1.seconds[0], 3),
        "coordinator_plan_s": round(t_plan0, 3),
        "coordinator_manifest_build_s": round(t_commit0, 3),
        "max_rank_s": round(st1.max_other("seconds"), 4),
        "max_rank_recv_bytes": int(st1.max_other("recv")),
        "assignment_bytes_rank1": a_bytes,
        "coordinator_recv_bytes": st1.recv[0],
        "manifest_bytes": len(raw),
        "manifest_encode_s": round(out1["encode_s"], 3),
        "manifest_parse_s": round(parse_s, 3),
        "manifest_read_s": round(read_s, 4),
        "cached_coordinator_s": round(st2.seconds[0], 3),
        "cached_max_rank_s": round(st2.max_other("seconds"), 4),
        "cached_max_rank_recv_bytes": int(st2.max_other("recv")),
        "plan_file_bytes": len(out1["plan"]),
        "plan_file_vs_manifest": round(len(out1["plan"]) / len(raw), 3),
        "restart_manifest_equal": restart_same,
        "restart_rebuild_coordinator_s": round(restart["seconds"][0], 3),
        "restart_rebuild_max_rank_s": round(max(restart["seconds"][1:], default=0.0), 5),
        "restart_max_rank_read_bytes": max(restart["read"][1:], default=0),
        "cached_after_restart_coordinator_s": round(restart["seconds"][0] + st4.seconds[0], 3),
        "cached_after_restart_max_rank_s": round(max(
            (restart["seconds"][r] + st4.seconds[r] for r in range(1, n)), default=0.0), 4),
        "cached_after_restart_max_rank_recv_bytes": int(st4.max_other("recv")),
        "load_world": nt,
        "load_plan_max_rank_s": round(max(plan_s), 4),
        "load_census_max_rank_recv_bytes": int(st3.max_other("recv")),
        "load_census_coordinator_s": round(st3.seconds[0], 3),
        "load_manifest_broadcast_recv_bytes": len(raw) + 8,
    }
    return row


def simulate(model: str, layout: Layout, target: Layout | None = None, *, optimizer: str = "adam",
             zero_split: str = "flat", smallest: int = 8,
             log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Rows for every world size from ``smallest`` up to ``layout.world``."""
    target = target or default_target(layout)
    rows = []
    for lay in scaled_layouts(layout, smallest):
        t = scale_target(layout, target, lay)
        rows.append(simulate_one(model, lay, t, optimizer=optimizer, zero_split=zero_split, log=log))
        log(format_row(rows[-1]))
    return rows


def scaling_exponent(rows: list[dict[str, Any]], key: str, lo: int = 1024, hi: int = 16384) -> float | None:
    """log(t_hi / t_lo) / log(hi / lo) of ``key``, or None when a size is missing."""
    by = {r["world"]: r[key] for r in rows}
    if lo not in by or hi not in by or by[lo] <= 0:
        return None
    return math.log(by[hi] / by[lo]) / math.log(hi / lo)


HEADER = (f"{'world':>6} {'coord s':>8} {'rank s':>7} {'rank recv':>10} {'coord recv':>11} "
          f"{'manifest':>10} {'parse s':>7} {'cached coord s':>14} {'cached rank s':>13} "
          f"{'cached recv':>11} {'restart coord s':>15} {'restart rank s':>14} {'restart recv':>12} "
          f"{'load plan s':>11} {'plan.bin':>10}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} B"


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['world']:>6} {r['coordinator_s']:>8.2f} {r['max_rank_s']:>7.3f} "
            f"{_mb(r['max_rank_recv_bytes']):>10} {_mb(r['coordinator_recv_bytes']):>11} "
            f"{_mb(r['manifest_bytes']):>10} {r['manifest_parse_s']:>7.2f} "
            f"{r['cached_coordinator_s']:>14.2f} {r['cached_max_rank_s']:>13.4f} "
            f"{_mb(r['cached_max_rank_recv_bytes']):>11} {r['cached_after_restart_coordinator_s']:>15.2f} "
            f"{r['cached_after_restart_max_rank_s']:>14.4f} "
            f"{_mb(r['cached_after_restart_max_rank_recv_bytes']):>12} {r['load_plan_max_rank_s']:>11.3f} "
            f"{_mb(r['plan_file_bytes']):>10}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Log-log PNG: seconds and bytes against world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = [r["world"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in [("coordinator_s", "coordinator (first save)"), ("max_rank_s", "max other rank"),
                       ("cached_coordinator_s", "coordinator (cached)"),
                       ("cached_max_rank_s", "max other rank (cached)"),
                       ("cached_after_restart_coordinator_s", "coordinator (cached, after restart)"),
                       ("manifest_parse_s", "manifest parse"), ("load_plan_max_rank_s", "load plan / rank")]:
        a.loglog(w, [max(r[key], 1e-5) for r in rows], marker="o", label=label)
    a.set_xlabel("world size (ranks)")
    a.set_ylabel("seconds")
    a.legend(fontsize=8)
    a.grid(True, which="both", alpha=0.3)
    for key, label in [("max_rank_recv_bytes", "max other rank recv"),
                       ("coordinator_recv_bytes", "coordinator recv"),
                       ("cached_max_rank_recv_bytes", "max other rank recv (cached)"),
                       ("manifest_bytes", "manifest JSON")]:
        b.loglog(w, [max(r[key], 1) for r in rows], marker="o", label=label)
    b.set_xlabel("world size (ranks)")
    b.set_ylabel("bytes")
    b.legend(fontsize=8)
    b.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"reshard coordination, {rows[-1]['model']} ({rows[-1]['zero_split']} ZeRO split)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
