"""Replicas read once, measured on real gloo processes.

Not a test. Usage::

    python benchmarks/bench_read_once.py --world 8,16,32 [--tensors 32] [--mib 1]

TP4 x DP (world / 4) ranks: ``--tensors`` tensors of ``--mib`` MiB each,
row-split over TP (DP ranks hold replicas), saved once; then loaded into the
same layout with replicas read once (``read_once=True``; the default
``"auto"`` takes it for remote storage only) and with ``read_once=False``, three times each in rotating order (best of 3, slowest
rank), with the chunk bytes the ranks read from storage and received.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from typing import Any


def _state(rank: int, tensors: int, mib: float, fill: bool) -> dict[str, Any]:
    import torch

    from reshard import ShardedTensor

    tp, dp = rank % 4, rank // 4
    rows = int(mib * (1 << 20)) // (4 * 256)
    h = rows // 4
    out = {}
    for i in range(tensors):
        data = (torch.arange(h * 256, dtype=torch.float32).reshape(h, 256) + i + tp * 1e6) if fill \
            else torch.zeros(h, 256)
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, global_shape=(rows, 256), global_offset=(tp * h, 0),
                                     replica_id=dp)
    return out


def _worker(rank: int, world: int, port: int, root: str, out: str, tensors: int, mib: float) -> None:
    import torch
    import torch.distributed as dist

    import reshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    path = os.path.join(root, "ck")
    reshard.save(_state(rank, tensors, mib, True), path, step=1)
    want = _state(rank, tensors, mib, True)
    variants = [("read_once", reshard.LoadOptions(read_once=True)), ("alone", reshard.LoadOptions(read_once=False))]
    res: dict[str, Any] = {}
    for rep in range(4):  # the first round warms the process and the page cache (not kept)
        for key, opts in variants[rep % 2:] + variants[:rep % 2]:
            tgt = _state(rank, tensors, mib, False)
            dist.barrier()
            t0 = time.perf_counter()
            lr = reshard.load(tgt, path, options=opts)
            wall = time.perf_counter() - t0
            ok = all(bool((tgt[k].data == want[k].data).all()) for k in want)
            if rep and (key not in res or wall < res[key]["wall_s"]):
                res[key] = {"wall_s": wall, "chunk_bytes_read": lr.chunk_bytes_read,
                            "received": lr.bytes_received, "exact": ok}
    with open(os.path.join(out, f"r{rank:03d}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="8,16,32")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    results = []
    for w in [int(x) for x in a.world.split(",")]:
        with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(_worker, args=(w, port, root, out, a.tensors, a.mib), nprocs=w,
                               start_method="spawn")
            rows = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        r = {"world": w}
        for k in ("read_once", "alone"):
            r[k] = {"wall_s": max(x[k]["wall_s"] for x in rows),
                    "chunk_bytes_read": sum(x[k]["chunk_bytes_read"] for x in rows),
                    "received": sum(x[k]["received"] for x in rows), "exact": all(x[k]["exact"] for x in rows)}
        results.append(r)
        print(f"{w:3d} ranks (tp4,dp{w // 4}, {a.tensors} x {a.mib:g} MiB): read once {r['read_once']['wall_s']:.3f} s "
              f"(storage {r['read_once']['chunk_bytes_read'] / 2**20:.0f} MiB, received "
              f"{r['read_once']['received'] / 2**20:.0f} MiB); read_once=False {r['alone']['wall_s']:.3f} s "
              f"(storage {r['alone']['chunk_bytes_read'] / 2**20:.0f} MiB); exact "
              f"{r['read_once']['exact'] and r['alone']['exact']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
