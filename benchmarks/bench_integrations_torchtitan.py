"""The TorchTitan row of the integration matrix: an uninterrupted run against the
same run stopped after step k and resumed with reshard as TorchTitan's checkpoint
component, on the same layout and on another number of ranks; both curves printed.

TorchTitan's own components on gloo ranks (tests/integrations/_torchtitan_fns.py: a Llama 3
debugmodel made smaller, FSDP2 by TorchTitan's code, OptimizersContainer,
LRSchedulersContainer, the Trainer's loop and hooks). Cells:

* ``same layout`` (2 ranks -> 2 ranks, TorchTitan's HuggingFaceTextDataLoader,
  async saves): losses, LR and global batches must be bitwise equal;
* ``2 -> 1`` (a dataloader that is a reshard.DataCursor, so the data position
  reshards; the global batch is kept): the same global batches, losses within
  1e-5 relative;
* ``DCP -> reshard`` (stopped under TorchTitan's DCP CheckpointManager, resumed
  by reshard's): bitwise.

    python benchmarks/bench_integrations_torchtitan.py --steps 12 --interval 4 --stop-after 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests", "integrations")]


def _cell(pool: Any, d: str, name: str, ranks: tuple[int, int], steps: int, interval: int, stop: int,
          **kw: Any) -> dict[str, Any]:
    import _torchtitan_fns as F

    first, resumed_on = ranks
    ckpt = kw.pop("ckpt", {})
    manager = kw.pop("stop_manager", "reshard")
    t0 = time.perf_counter()
    ref = pool.run(first, F.r_run, d, f"{name}-ref", steps, interval, fresh=True, timeout=600,
                   ckpt=ckpt, **kw)[0]["curve"]
    t_ref = time.perf_counter() - t0
    pool.run(first, F.r_run, d, name, steps, interval, fresh=True, stop_after=stop, timeout=600,
             manager=manager, ckpt={**ckpt, "async_mode": "async"} if manager == "reshard" else {}, **kw)
    t0 = time.perf_counter()
    res = pool.run(resumed_on, F.r_run, d, name, steps, interval, timeout=600, ckpt=ckpt, **kw)[0]["curve"]
    t_res = time.perf_counter() - t0
    by_step = {r["step"]: r for r in ref}
    rows, worst, bitwise, same_batches = [], 0.0, True, True
    for r in res:
        a = by_step[r["step"]]
        d_rel = abs(a["loss"] - r["loss"]) / max(abs(a["loss"]), 1e-12)
        worst = max(worst, d_rel)
        bitwise &= a["loss"] == r["loss"] and a["lr"] == r["lr"]
        same_batches &= a["batch"] == r["batch"]
        rows.append((r["step"], a["loss"], r["loss"], d_rel, a["batch"] == r["batch"]))
    return {"name": name, "ranks": f"{first} -> {resumed_on}", "resumed_at": res[0]["step"] - 1,
            "rows": rows, "max_rel": worst, "bitwise": bitwise, "same_batches": same_batches,
            "ref_curve": [(r["step"], r["loss"]) for r in ref], "t_ref_s": t_ref, "t_resumed_s": t_res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--stop-after", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from reshard.testing.pool import WorkerPool

    d = tempfile.mkdtemp(prefix="bench-titan-")
    pool = WorkerPool(pg_timeout=120.0, grace=10.0)
    cells = []
    try:
        keep = {"last_save_model_only": False}
        cells.append(_cell(pool, d, "same layout", (2, 2), a.steps, a.interval, a.stop_after, ckpt=keep))
        cells.append(_cell(pool, d, "2 -> 1 (DataCursor loader)", (2, 1), a.steps, a.interval,
                           a.stop_after, ckpt=keep, cursor=True))
        cells.append(_cell(pool, d, "DCP -> reshard", (2, 2), a.steps, a.interval, a.stop_after,
                           ckpt=keep, stop_manager="dcp"))
    finally:
        pool.close()
        shutil.rmtree(d, ignore_errors=True)
    for c in cells:
        print(f"\n== TorchTitan, {c['name']} ({c['ranks']} ranks), stopped after step {a.stop_after}, "
              f"resumed at step {c['resumed_at']}")
        print(f"{'step':>5} {'uninterrupted':>15} {'resumed':>15} {'rel |d|':>9}  same global batch")
        for step, ref, res, d_rel, same in c["rows"]:
            print(f"{step:>5} {ref:>15.9f} {res:>15.9f} {d_rel:>9.1e}  {same}")
    print("\ncell                          ranks   resumed  losses          batches  uninterrupted  resumed")
    for c in cells:
        how = "bitwise" if c["bitwise"] else f"max {c['max_rel']:.1e}"
        print(f"{c['name']:<29} {c['ranks']:<7} {c['resumed_at']:>7}  {how:<15} "
              f"{'same' if c['same_batches'] else 'DIFFER':<8} {c['t_ref_s']:>12.1f}s {c['t_resumed_s']:>7.1f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
