"""Asynchronous-save benchmark of reshard against baselines measured in the same run.

Not a test. Usage::

    python benchmarks/bench_async.py [--gib 1.0] [--ranks 1] [--rounds 5] [--rss-saves 10]
                                     [--bg-saves 5] [--steps 6] [--json PATH] [--skip-dcp]

A thin caller of the ``reshard bench io`` engine (:mod:`reshard.bench.io`),
its async phases only, on its ``synthetic`` workload: square ``Linear``
layers of ``--tensor-mib`` MiB with their two AdamW moments (``--gib`` GiB of
state in all), FSDP2 over ``--ranks`` real gloo ranks (DCP's background
collectives on a gloo group of their own). Measured there:

1. peak extra RSS over ``--rss-saves`` consecutive ``reshard.async_save``
   calls (each committed before the next): the first allocates the staging
   pool, later ones must stay flat;
2. foreground stall (min and median of ``--rounds``, order rotated, disk
   quiet before each): ``memcpy`` of the state into preallocated, touched
   tensors (the limit), ``reshard.async_save`` until it returns, DCP
   ``async_save`` (thread) and DCP's process mode with its ``DefaultStager``
   where this torch has it, and each save's time from return to commit;
   targets: reshard <= 1.3x the memcpy, <= 0.5x DCP's stall;
3. training-step slowdown: the workload's real forward/backward/AdamW step,
   ``--steps`` steps with no save in flight before each of ``--bg-saves``
   background saves per method (reshard, DCP), then steps until it commits.

With several ranks, each stall is the slowest rank's, each ratio the worst rank's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of state (parameters + 2 AdamW moments)")
    ap.add_argument("--ranks", type=int, default=1, help="gloo ranks (spawned)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="MiB per parameter tensor")
    ap.add_argument("--rounds", type=int, default=5, help="timed stall rounds (min and median)")
    ap.add_argument("--rss-saves", type=int, default=10, help="consecutive saves of the RSS phase")
    ap.add_argument("--steps", type=int, default=6,
                    help="steps with no save in flight before each background save")
    ap.add_argument("--bg-saves", type=int, default=5, help="background saves per method while training")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds to wait after os.sync() before each timed measurement")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--skip-dcp", action="store_true", help="do not run torch.distributed.checkpoint")
    a = ap.parse_args(argv)
    if not 1 <= a.ranks <= 8 or a.rss_saves < 1 or a.rounds < 1 or a.bg_saves < 1 or a.gib <= 0:
        ap.error("--ranks from 1 to 8; --rss-saves, --rounds, --bg-saves >= 1; --gib > 0")
    from reshard.bench import io, report

    skip = {"save", "load", "limit-write", "reshard-nocheck", "torch-save", "safetensors"}
    if a.skip_dcp:
        skip |= {"dcp", "dcp-async", "dcp-async-process"}
    cfg: dict[str, Any] = {
        "model": "synthetic", "worlds": [a.ranks], "layout": "fsdp", "reshard_to": [], "backends": ["local"],
        "s3_endpoint": None, "repeat": a.rounds, "synthetic_mib": a.gib * 1024 / 3,
        "synthetic_width": max(16, int(math.isqrt(a.tensor_mib * MiB // 4))), "seq_len": 16,
        "steps": a.steps, "settle": a.settle, "skip": skip, "timeout": 1800.0, "layout_of": {},
        "argv": sys.argv[1:], "cpus": os.cpu_count(), "profile": None, "rss_saves": a.rss_saves,
        "bg_saves": a.bg_saves,
    }
    doc = io.run(cfg, progress=sys.stderr.isatty(), scratch_dir=a.dir)
    print(report.table(doc))
    s = doc["summary"][f"local/w{a.ranks}"]
    ex = s["rss"]["async-save"]["extra_per_rank"]
    print(f"peak extra RSS of {a.rss_saves} consecutive async saves per rank (MiB): "
          + "; ".join("[" + ", ".join(f"{x / MiB:.0f}" for x in e) + "]" for e in ex)
          + f"; flat after the first (<= 32 MiB each): {'yes' if s['ratios'].get('async_rss_flat') else 'NO'}")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"results written to {a.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
