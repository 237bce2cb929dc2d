"""A/B of ``reshard.async_save`` on a ``reshard bench io`` workload, variants
alternated in one run (the machine is shared: compare within a run only).

Not a test. Usage::

    python benchmarks/ab_async_save.py --world 1 --what train --rounds 4 --variants nice0,nice10
    python benchmarks/ab_async_save.py --world 2 --what stall --rounds 6

``train``: per round and variant (order reversed every other round), 3
training steps with no save in flight (after ``os.sync`` and a rest), then
steps while an ``async_save`` with ``SaveOptions(background_nice=N)`` runs
(``niceN``); reports the median step time during / without the save, per
round and pooled. ``stall``: ``memcpy`` of the state into preallocated,
touched tensors (the stall's limit, as ``reshard bench io`` measures it)
against the ``async_save`` stall, alternated; wall and the caller's CPU
seconds (``time.thread_time``: less sensitive to other processes than wall).
The workload is built by :func:`reshard.bench.ranks.setup` (FSDP2, real gloo
ranks, one torch thread each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any


def train_ab(variants: list[str], rounds: int, base: str, steps: int = 3) -> dict[str, Any]:
    import torch.distributed as dist

    import reshard
    from reshard.bench import ranks

    w = ranks._w()
    out: dict[str, dict[str, list[float]]] = {
        v: {"base": [], "during": [], "ratio": [], "save_s": []} for v in variants}
    w.step()
    k = 0
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            ranks.quiet(0.5)
            b = []
            for _ in range(steps):
                t0 = time.perf_counter()
                w.step()
                b.append(time.perf_counter() - t0)
            dist.barrier()
            k += 1
            p = f"{base}-{k}"
            t_s = time.perf_counter()
            opts = reshard.SaveOptions(background_nice=int(v.removeprefix("nice")))
            h = reshard.async_save(w.reshard_state(), p, step=1, options=opts)
            d = []
            while not h.done():
                t0 = time.perf_counter()
                w.step()
                d.append(time.perf_counter() - t0)
            h.wait()
            o = out[v]
            o["save_s"].append(time.perf_counter() - t_s)
            o["base"] += b
            o["during"] += d
            o["ratio"].append(statistics.median(d) / statistics.median(b))
            ranks.drop(p)
    return {"rank": dist.get_rank(), "out": out}


def stall_ab(rounds: int, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    import reshard
    from reshard.bench import ranks

    ranks._memcpy_targets()
    res: dict[str, list[float]] = {"memcpy": [], "stall": [], "memcpy_cpu": [], "stall_cpu": []}
    for r in range(rounds):
        for m in ["memcpy", "stall"] if r % 2 == 0 else ["stall", "memcpy"]:
            ranks.quiet(0.3)
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            if m == "memcpy":
                ranks._memcpy()
            else:
                h = reshard.async_save(ranks._w().reshard_state(), f"{base}-s{r}", step=1)
            res[m].append(time.perf_counter() - t0)
            res[m + "_cpu"].append(time.thread_time() - c0)
            if m == "stall":
                h.wait()
                ranks.drop(f"{base}-s{r}")
    return {"rank": dist.get_rank(), "res": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--what", choices=["train", "stall"], default="train")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default="nice0,nice10", help="train: comma-separated niceN")
    ap.add_argument("--model", default="gpt2-small")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the workers import this module
    import ab_async_save as me

    from reshard.bench import ranks
    from reshard.testing.pool import WorkerPool

    md = statistics.median
    pool = WorkerPool(pg_timeout=900.0, grace=60.0, max_groups=1)
    scratch = tempfile.mkdtemp(prefix="reshard-ab-")
    try:
        pool.run(a.world, ranks.setup, a.model, "fsdp", 256.0, 16, None, timeout=1800)
        pool.run(a.world, ranks.warm, scratch + "/warm", ["reshard-async"], timeout=600)
        print("load average at start", os.getloadavg(), flush=True)
        if a.what == "train":
            for o in pool.run(a.world, me.train_ab, a.variants.split(","), a.rounds, scratch + "/t",
                              timeout=3600):
                for v, R in o["out"].items():
                    print(f"world {a.world} rank {o['rank']} {v}: step without save med {md(R['base']):.3f} s, "
                          f"during med {md(R['during']):.3f} s ({md(R['during']) / md(R['base']):.3f}x pooled); "
                          f"per round min {min(R['ratio']):.3f} med {md(R['ratio']):.3f}x "
                          f"{[round(x, 2) for x in R['ratio']]}; save med {md(R['save_s']):.1f} s")
        else:
            for o in pool.run(a.world, me.stall_ab, a.rounds, scratch + "/s", timeout=3600):
                R = o["res"]
                print(f"world {a.world} rank {o['rank']}: memcpy min {min(R['memcpy']):.3f} med "
                      f"{md(R['memcpy']):.3f} s, stall min {min(R['stall']):.3f} med {md(R['stall']):.3f} s "
                      f"({md(R['stall']) / md(R['memcpy']):.2f}x); caller CPU memcpy med {md(R['memcpy_cpu']):.3f}"
                      f" s, stall med {md(R['stall_cpu']):.3f} s ({md(R['stall_cpu']) / md(R['memcpy_cpu']):.2f}x)")
        print("load average at end", os.getloadavg())
    finally:
        pool.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
