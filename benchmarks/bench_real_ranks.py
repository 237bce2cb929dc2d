"""The scale simulator checked by real gloo processes.

Not a test. Usage::

    python benchmarks/bench_real_ranks.py --world 16,32 [--json out.json]

For each world size N, N real processes (gloo over loopback, one torch
thread each) build the state the simulator describes for a TP x PP x DP
layout of ``llama-micro`` (tiny tensors: the structure, not the bytes, is
what coordination costs), run the real planned save, cached save and load
into another layout of the same size (replicas read once, then again with
``read_once=False``), and count the bytes every rank receives through the
real collectives (:mod:`reshard.bench.real_ranks`). Each figure is
printed beside ``reshard bench scale``'s prediction for the same layout and
path (:func:`reshard.bench.scale_sim.simulate_one`), with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

#: world size -> (save layout, load layout), (tp, pp, dp)
LAYOUTS = {8: ((2, 2, 2), (1, 2, 4)), 16: ((2, 2, 4), (1, 2, 8)), 32: ((2, 2, 8), (1, 2, 16)),
           64: ((2, 2, 16), (1, 2, 32))}


def _worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from reshard.bench import real_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    layout, target = LAYOUTS[world]
    res = real_ranks.r_measure(root, real_ranks.MICRO, layout, target, True, True)
    with open(os.path.join(out, f"r{rank:03d}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from reshard.bench import real_ranks

    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        mp.start_processes(_worker, args=(world, _port(), root, out), nprocs=world, start_method="spawn")
        wall = time.perf_counter() - t0
        rows = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        layout, target = LAYOUTS[world]
        measured = real_ranks.summarise(rows)
        predicted = real_ranks.predict(real_ranks.MICRO, layout, target, root)
    return {"world": world, "layout": layout, "target": target, "wall_s": wall, "measured": measured,
            "compare": real_ranks.compare(measured, predicted),
            "predicted": {k: v for k, v in predicted.items() if not isinstance(v, (list, dict))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="16,32", help="comma-separated world sizes (8, 16, 32, 64)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = []
    for w in [int(x) for x in a.world.split(",")]:
        if w not in LAYOUTS:
            sys.exit(f"--world: one of {sorted(LAYOUTS)}")
        r = run(w)
        results.append(r)
        m = r["measured"]
        lay = "tp{},pp{},dp{}".format(*r["layout"])
        tgt = "tp{},pp{},dp{}".format(*r["target"])
        print(f"== {w} real gloo processes: {lay} saved, loaded into {tgt} (llama-micro); "
              f"max RSS per process {m['max_rss_bytes'] / 2**20:.0f} MiB; {r['wall_s']:.0f} s in all")
        print(f"  {'figure':42} {'measured':>12} {'bench scale':>12} {'ratio':>7}")
        for c in r["compare"]:
            fmt = "{:>12.4f}" if isinstance(c["measured"], float) else "{:>12d}"
            ratio = "" if c["ratio"] is None else f"{c['ratio']:.2f}"
            print(f"  {c['what']:42} " + fmt.format(c["measured"]) + " " + fmt.format(
                type(c["measured"])(c["predicted"])) + f" {ratio:>7}")
        for k, what in (("load", "default (ranges >= 64 KiB read once)"),
                        ("load_all_once", "every shared range read once"), ("load_alone", "read_once=False")):
            print(f"  load, {what:38} {m[k + '_wall_s']:.3f} s (best of 3, slowest rank), storage chunk bytes "
                  f"{m[k + '_chunk_bytes_read']}, handed over {m[k + '_data_recv']}, exact {m[k + '_exact']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
