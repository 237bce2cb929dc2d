"""Warm loads of one model state, A/B in one run: ``reshard.load`` variants
beside the single-thread page-cache read of the same bytes (the ``limit-read``
of ``reshard bench io``), alternated (forward, then backward order) so that a
shared machine's load falls on every variant alike. Per variant: the slowest
rank's wall seconds (min, median, every repeat), the ratio of the limit to it,
each rank's CPU seconds (``time.process_time``, all threads: less sensitive to
other processes than wall time) and the load phases.

    python benchmarks/bench_load.py --model gpt2-small --world 2 --repeat 8
    python benchmarks/bench_load.py --world 2 --to 4 --methods 'limit;check;{"threads": 1}'
    python benchmarks/bench_load.py --world 1 --methods 'limit;check;nocheck' --rss

``--methods``: ``;``-separated; ``limit``, ``check`` (the default options),
``nocheck`` (``checksums=False``), or a JSON object of ``LoadOptions`` fields
with an optional ``"swap": {"module.attr": "module:function"}`` that replaces
an attribute for that variant's calls only (e.g. an earlier version of a
function, for an A/B of a change). The checkpoint is saved once by ``--world``
ranks (FSDP2) under ``--dir`` and reused; ``--to`` loads it into another world
size. Ranks are real gloo processes (:class:`reshard.testing.pool.WorkerPool`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this module, in the workers too

_S: dict[str, Any] = {}


# ------------------------------------------------------------------ rank side
def _resolve(dotted: str) -> tuple[Any, str]:
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:-1]:
            obj = getattr(obj, p)
        return obj, parts[-1]
    raise KeyError(dotted)


def _swapped(swap: dict[str, str], fn: Any) -> Any:
    def run() -> Any:
        old = {}
        for k, v in swap.items():
            obj, attr = _resolve(k)
            mod, _, name = v.partition(":")
            old[k] = getattr(obj, attr)
            setattr(obj, attr, getattr(importlib.import_module(mod), name))
        try:
            return fn()
        finally:
            for k, o in old.items():
                obj, attr = _resolve(k)
                setattr(obj, attr, o)
    return run


def setup(model: str) -> dict[str, Any]:
    from reshard.bench import ranks

    return ranks.setup(model, "fsdp", 64.0, 64)


def save(path: str) -> Any:
    from reshard.bench import ranks

    ranks.save("reshard", path, [0])
    return ranks.fingerprint()


def fingerprint() -> Any:
    from reshard.bench import ranks

    return ranks.fingerprint()


def release() -> None:
    from reshard.bench import ranks

    _S.clear()
    ranks.release()


def _fn(method: str, path: str, files: list[str]) -> Any:
    import torch

    import reshard
    from reshard.bench.ranks import _read_limit
    from reshard.bench.ranks_base import _nbytes, _w

    w = _w()
    if method == "limit":
        if "buf" not in _S:  # preallocated, touched
            _S["buf"] = torch.empty(_nbytes(w.tensors()), dtype=torch.uint8).fill_(0)
        mv = memoryview(_S["buf"].numpy().data)
        return lambda: _read_limit(files, mv)
    spec: dict[str, Any] = json.loads(method) if method.startswith("{") else {"checksums": method != "nocheck"}
    swap = spec.pop("swap", {})
    opts = reshard.LoadOptions(**spec)
    return _swapped(swap, lambda: reshard.load(w.reshard_state(), path, options=opts))


def loads(path: str, methods: list[str], repeat: int, profile_dir: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    fns = {m: _fn(m, path, files) for m in methods}
    out: dict[str, Any] = {"rank": rank, "wall": {m: [] for m in methods}, "cpu": {m: [] for m in methods},
                           "timings": {m: [] for m in methods}}
    for m in methods:
        fns[m]()  # warm: page cache, first-call costs
    for r in range(repeat):
        for m in (methods if r % 2 == 0 else methods[::-1]):
            prof = None
            if profile_dir and r == 0:
                from pyinstrument import Profiler

                prof = Profiler(interval=0.0005)
            dist.barrier()
            if prof is not None:
                prof.start()
            c0, t0 = time.process_time(), time.perf_counter()
            res = fns[m]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if prof is not None:
                prof.stop()
                tag = "".join(ch if ch.isalnum() else "_" for ch in m)[:48]
                with open(os.path.join(profile_dir, f"{tag}-w{dist.get_world_size()}-r{rank}.txt"), "w") as f:
                    f.write(prof.output_text(unicode=False, color=False, show_all=False))
            dist.barrier()
            out["wall"][m].append(wall)
            out["cpu"][m].append(cpu)
            if hasattr(res, "timings"):
                out["timings"][m].append(res.timings)
    return out


def rss(path: str, methods: list[str]) -> dict[str, float]:
    """Peak extra resident MiB of one (warm) load per variant."""
    import torch.distributed as dist

    from reshard.testing.memory import PeakRSS

    got = {}
    for m in methods:
        if m == "limit":
            continue
        fn = _fn(m, path, [])
        fn()
        dist.barrier()
        with PeakRSS() as p:
            fn()
        dist.barrier()
        got[m] = max(p.sampled_extra, p.hwm_extra or 0) / 2**20
    return got


# ---------------------------------------------------------------- parent side
def main() -> None:
    import bench_load as me  # the rank functions, importable by the workers

    from reshard.testing.pool import WorkerPool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--world", type=int, default=1, help="ranks that save (and load, without --to)")
    ap.add_argument("--to", type=int, default=None, help="ranks that load (a reshard)")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--methods", default="limit;check;nocheck")
    ap.add_argument("--profile", default=None, help="directory: pyinstrument text per variant and rank")
    ap.add_argument("--rss", action="store_true", help="also the peak extra RSS of one load per variant")
    ap.add_argument("--dir", default="/tmp/reshard-bench-load")
    a = ap.parse_args()
    methods = a.methods.split(";")
    path = f"{a.dir}-w{a.world}-{a.model}"
    pool = WorkerPool(pg_timeout=600)
    try:
        la0 = os.getloadavg()
        if not os.path.exists(os.path.join(path, "manifest.json")):
            shutil.rmtree(path, ignore_errors=True)
            pool.run(a.world, me.setup, a.model, timeout=900)
            fp = pool.run(a.world, me.save, path, timeout=900)[0]
            with open(path + ".fingerprint", "w") as f:
                json.dump(fp, f)
            pool.run(a.world, me.release, timeout=600)
        tw = a.to or a.world
        pool.run(tw, me.setup, a.model, timeout=900)
        if a.profile:
            os.makedirs(a.profile, exist_ok=True)
        out = pool.run(tw, me.loads, path, methods, a.repeat, a.profile, timeout=1800)
        with open(path + ".fingerprint") as f:
            fp0 = json.load(f)
        fp1 = pool.run(tw, me.fingerprint, timeout=600)[0]
        ok = fp1 == fp0 if isinstance(fp0, str) else abs(fp1 - fp0) <= 1e-9 * max(1.0, abs(fp0))
        print(f"{a.model}: world {a.world} -> {tw}, load average {la0[0]:.1f} -> {os.getloadavg()[0]:.1f}, "
              f"state after the loads {'equals' if ok else 'DIFFERS FROM'} the saved one")
        lim = [max(o["wall"]["limit"][i] for o in out) for i in range(a.repeat)] if "limit" in methods else None
        for m in methods:
            wall = [max(o["wall"][m][i] for o in out) for i in range(a.repeat)]
            line = f"{m[:60]:60s} wall min {min(wall):.3f} med {statistics.median(wall):.3f} s"
            if lim:
                line += f"  limit/x min {min(lim) / min(wall):.2f} med {statistics.median(lim) / statistics.median(wall):.2f}"
            line += "  cpu/rank med " + ",".join(f"{statistics.median(o['cpu'][m]):.3f}" for o in out)
            print(line, " all", [round(x, 3) for x in wall])
            for o in out:
                ts = o["timings"][m]
                if ts:
                    print(f"    rank {o['rank']} phases (median s):",
                          {k: round(statistics.median(t[k] for t in ts), 3) for k in ts[0]})
        if a.rss:
            for o, r in zip(out, pool.run(tw, me.rss, path, methods, timeout=900), strict=True):
                print(f"rank {o['rank']} peak extra RSS MiB:", {k[:40]: round(v, 1) for k, v in r.items()})
    finally:
        pool.close()


if __name__ == "__main__":
    main()
