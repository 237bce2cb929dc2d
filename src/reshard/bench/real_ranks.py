"""The scale simulator checked by real gloo ranks (``benchmarks/bench_real_ranks.py``,
``tests/bench/test_real_ranks.py``).

Every rank builds the state the simulator describes for its layout
(:func:`reshard.bench.scale_layout.rank_items` of a tiny Llama,
``llama-micro``: the same fqns, boxes, flat ranges and replicas, with real
tensors of a few KiB), then runs the real ``reshard.save`` (planned), the
same save again (cached plan) and ``reshard.load`` into the target layout,
each over :class:`reshard.collectives.Counting`, which counts the bytes this
rank receives through the real ``torch.distributed`` collectives. The
coordinator's planning and manifest-building CPU seconds come from the
save's own timings (``coordinate_cpu``, ``manifest_build_cpu``).
:func:`compare` puts each figure beside :func:`reshard.bench.scale_sim.simulate_one`'s
prediction for the same layout.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch
import xxhash

from ..state.sharding import ShardedTensor, torch_dtype
from .scale_layout import MODELS, Layout, rank_items

#: a Llama small enough for 32 processes on one machine, with every kind of tensor
MICRO = "llama-micro"
MODELS.setdefault(MICRO, dict(layers=4, hidden=64, ffn=128, heads=4, kv=2, vocab=256, experts=0))


def _fill(fqn: str, gshape: tuple[int, ...], off: tuple[int, ...], shape: tuple[int, ...],
          fr: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """A piece of the logical tensor ``fqn``, whose every element is a
    function of its global index (so any layout's pieces agree)."""
    seed = xxhash.xxh3_64_intdigest(fqn.encode()) % 1000
    full = (torch.arange(int(torch.Size(gshape).numel()), dtype=torch.float32) % 251 + seed).reshape(gshape)
    box = full[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))].to(dtype)
    return box.reshape(-1)[fr[0]:fr[1]].clone() if fr is not None else box.clone()


def rank_state(model: str, layout: Layout, rank: int) -> dict[str, Any]:
    """The state rank ``rank`` of ``layout`` holds, as the simulator describes it."""
    out: dict[str, Any] = {}
    for it in rank_items(model, layout, rank):
        fr = it.flattened_range
        data = _fill(it.fqn, it.global_shape, it.global_offset, it.local_shape, fr, torch_dtype(it.dtype))
        st = ShardedTensor(it.fqn, data, global_shape=it.global_shape, global_offset=it.global_offset,
                           local_shape=it.local_shape,
                           flattened_range=slice(*fr) if fr is not None else None, replica_id=it.replica_id)
        out.setdefault(it.fqn, []).append(st)
    return {k: v[0] if len(v) == 1 else v for k, v in out.items()}


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    def one(s: ShardedTensor) -> ShardedTensor:
        import dataclasses

        return dataclasses.replace(s, data=torch.zeros_like(s.data))

    return {k: [one(x) for x in v] if isinstance(v, list) else one(v) for k, v in state.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def flat(d: dict[str, Any]) -> list[torch.Tensor]:
        return [x.data for v in d.values() for x in (v if isinstance(v, list) else [v])]

    return all(torch.equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))


def r_measure(root: str, model: str, layout: tuple[int, int, int], target: tuple[int, int, int],
              read_once: bool = True, also_alone: bool = False) -> dict[str, Any]:
    """On every rank of the default group: planned save, cached save and load
    into ``target`` (``(tp, pp, dp)``, the same world size), each counted;
    with ``also_alone`` three loads, three times each in rotating order (the
    fastest of each kept): as given (``"load"``), with ``read_once=False``
    (``"load_alone"``) and with every shared range handed over
    (``read_once_min_bytes=0``, ``"load_all_once"``)."""
    import torch.distributed as dist

    import reshard
    from reshard.collectives import Counting, TorchCollectives
    from reshard.planning.coordination import PLAN_CACHE

    rank, world = dist.get_rank(), dist.get_world_size()
    lay, tgt = Layout(tp=layout[0], pp=layout[1], dp=layout[2]), Layout(tp=target[0], pp=target[1], dp=target[2])
    if lay.world != world or tgt.world != world:
        raise ValueError(f"layouts {lay} and {tgt} need {world} ranks")
    # first-call costs (imports, decoders, the first collectives of each kind), untimed
    reshard.save({"w": torch.ones(4)}, f"{root}/warm-{world}", step=0)
    reshard.load({"w": torch.zeros(4)}, f"{root}/warm-{world}")
    PLAN_CACHE.clear()
    state = rank_state(model, lay, rank)
    out: dict[str, Any] = {"rank": rank}
    for phase, name in (("save", "save-1"), ("cached", "save-2")):  # paths of equal length
        c = Counting(TorchCollectives())
        dist.barrier()
        t0 = time.perf_counter()
        res = reshard.save(state, f"{root}/{name}", step=1, group=c)
        out[phase] = {"recv": c.recv, "sent": c.sent, "calls": dict(c.calls), "wall_s": time.perf_counter() - t0,
                      "coordinate_cpu_s": res.timings.get("coordinate_cpu", 0.0),
                      "manifest_build_cpu_s": res.timings.get("manifest_build_cpu", 0.0),
                      "cached": res.timings["cached_plan"], "bytes_written": res.bytes_written}
    want = rank_state(model, tgt, rank)
    variants = [("load", reshard.LoadOptions(read_once=read_once))]
    if also_alone:  # each rank reads all it needs; every shared range handed over (no size threshold)
        variants += [("load_alone", reshard.LoadOptions(read_once=False)),
                     ("load_all_once", reshard.LoadOptions(read_once=True, read_once_min_bytes=0))]
    for rep in range(3 if also_alone else 1):  # alternating order; each variant's best of the repeats
        for key, opts in variants[rep % len(variants):] + variants[:rep % len(variants)]:
            got = _empty_like(want)
            c = Counting(TorchCollectives())
            dist.barrier()
            t0 = time.perf_counter()
            lr = reshard.load(got, f"{root}/save-1", group=c, options=opts)
            wall = time.perf_counter() - t0
            if key in out and out[key]["wall_s"] <= wall:
                continue
            out[key] = {"recv": c.recv, "sent": c.sent, "data_recv": c.data_recv, "calls": dict(c.calls),
                        "wall_s": wall, "chunk_bytes_read": lr.chunk_bytes_read, "timings": lr.timings,
                        "bytes_received": lr.bytes_received, "exact": _equal(got, want)}
    out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured figures in the simulator's terms (max over the ranks other than the coordinator)."""
    others = rows[1:] or rows
    return {
        "world": len(rows),
        "max_rank_recv_bytes": max(r["save"]["recv"] for r in others),
        "cached_max_rank_recv_bytes": max(r["cached"]["recv"] for r in others),
        "coordinator_recv_bytes": rows[0]["save"]["recv"],
        "coordinator_cpu_s": rows[0]["save"]["coordinate_cpu_s"] + rows[0]["save"]["manifest_build_cpu_s"],
        "cached_all": all(r["cached"]["cached"] == 1.0 for r in rows),
        "load_max_rank_recv_bytes": max(r["load"]["recv"] for r in others),
        "load_chunk_bytes_read": sum(r["load"]["chunk_bytes_read"] for r in rows),
        "load_data_recv_bytes": sum(r["load"]["data_recv"] for r in rows),
        "load_data_recv": sum(r["load"]["data_recv"] for r in rows),
        "load_exact": all(r["load"]["exact"] for r in rows),
        "save_wall_s": max(r["save"]["wall_s"] for r in rows),
        "load_wall_s": max(r["load"]["wall_s"] for r in rows),
        **({f"{k}_{f}": agg(r[k][f] for r in rows) for k in ("load_alone", "load_all_once") if k in rows[0]
            for f, agg in (("wall_s", max), ("chunk_bytes_read", sum), ("data_recv", sum), ("exact", all))}),
        "max_rss_bytes": max(r["maxrss_bytes"] for r in rows),
    }


def predict(model: str, layout: tuple[int, int, int], target: tuple[int, int, int],
            root: str) -> dict[str, Any]:
    """The simulator's row for the same layout, load target and checkpoint
    path (``<root>/save-1``, whose length is in the attempt's broadcast)."""
    import os

    from .scale_sim import simulate_one

    lay, tgt = Layout(tp=layout[0], pp=layout[1], dp=layout[2]), Layout(tp=target[0], pp=target[1], dp=target[2])
    return simulate_one(model, lay, tgt, path=os.path.realpath(os.path.join(root, "save-1")))


#: (measured key, predicted key, what) compared by :func:`compare`
PAIRS = (
    ("max_rank_recv_bytes", "max_rank_recv_bytes", "save: bytes into a rank"),
    ("cached_max_rank_recv_bytes", "cached_max_rank_recv_bytes", "cached save: bytes into a rank"),
    ("coordinator_recv_bytes", "coordinator_recv_bytes", "save: bytes into the coordinator"),
    ("coordinator_cpu_s", "coordinator_plan_s+coordinator_manifest_build_s", "coordinator CPU s (plan + manifest)"),
    ("load_max_rank_recv_bytes", "load_census_max_rank_recv_bytes+load_manifest_broadcast_recv_bytes",
     "load: coordination bytes into a rank"),
)


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per figure: measured, predicted and their ratio."""
    out = []
    for mk, pk, what in PAIRS:
        p = sum(predicted[k] for k in pk.split("+"))
        m = measured[mk]
        out.append({"what": what, "measured": m, "predicted": p, "ratio": (m / p) if p else None})
    return out
