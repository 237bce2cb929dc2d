"""Many hands on one root, measured (issue 28): two jobs on one root, a reader
beside retention, gc at 0 bytes free, a FIFO anywhere.

Not a test. Usage::

    python benchmarks/bench_shared_root.py [--saves 100] [--loads 500] [--json OUT]

* two jobs: job A (a process of its own, ``keep_last=2``) saves ``--saves``
  steps; beside it job B (another process, another job id) tries as many
  times to build a ``CheckpointManager`` on the same root and save. Counts
  what each was told (saved / refused) and, at the end, what is lost: a
  checkpoint A was told was committed and that is gone without A's own
  retention having deleted it, or one B was told was saved and that is gone.
* the fault matrix's shared-root cells with ``--loads`` loads by the reader
  beside retention (``RESHARD_FAULTS_READER_LOADS``), gc at 0 bytes free,
  and a FIFO or socket at each opened path (every command's answer time).

Prints the figures and the load average; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_A = r"""
import json, sys, torch, reshard
root, n = sys.argv[1], int(sys.argv[2])
mgr = reshard.CheckpointManager(root, keep_last=2, job_id="job-A", preempt_signals=())
told = []
for s in range(1, n + 1):
    r = mgr.save(s, {"w": torch.full((1024,), float(s))})
    told.append(r.path)
mgr.close()
print(json.dumps(told))
"""

_B = r"""
import json, sys, time, torch, reshard
root, n = sys.argv[1], int(sys.argv[2])
saved, refused, other = [], 0, []
for s in range(1, n + 1):
    try:
        m = reshard.CheckpointManager(root, keep_last=1, job_id="job-B", preempt_signals=())
        saved.append(m.save(1000 + s, {"w": torch.full((1024,), -float(s))}).path)
        m.close()
    except reshard.RootOwnedError:
        refused += 1
    except reshard.CheckpointError as e:
        other.append(f"{type(e).__name__}: {e}"[:200])
    time.sleep(0.02)
print(json.dumps({"saved": saved, "refused": refused, "other": other}))
"""


def two_jobs(work: str, saves: int) -> dict:
    import torch

    import reshard

    root = os.path.join(work, "two-jobs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    a = subprocess.Popen([sys.executable, "-c", _A, root, str(saves)], stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(root, "OWNER")) and time.monotonic() < deadline:
        time.sleep(0.05)
    b = subprocess.Popen([sys.executable, "-c", _B, root, str(saves)], stdout=subprocess.PIPE, text=True, env=env)
    a_out, b_out = a.communicate(timeout=3600)[0], b.communicate(timeout=3600)[0]
    secs = time.perf_counter() - t0
    told_a = json.loads(a_out.strip().splitlines()[-1])
    got_b = json.loads(b_out.strip().splitlines()[-1])
    present = sorted(n for n in os.listdir(root) if n.startswith("step-") and "." not in n[5:])
    kept_by_a = {os.path.basename(p) for p in told_a[-2:]}  # A's own retention keeps its newest 2
    lost_a = sorted(kept_by_a - set(present))
    lost_b = sorted(os.path.basename(p) for p in got_b["saved"] if os.path.basename(p) not in present)
    exact = True
    for name in present:
        w = torch.zeros(1024)
        res = reshard.load({"w": w}, os.path.join(root, name))
        exact &= bool(torch.equal(w, torch.full((1024,), float(res.step))))
    return {"saves_each": saves, "a_told_saved": len(told_a), "b_told_saved": len(got_b["saved"]),
            "b_refused": got_b["refused"], "b_other_errors": got_b["other"][:3],
            "lost_of_a": lost_a, "lost_of_b": lost_b, "present": present, "bit_exact": exact,
            "seconds": round(secs, 1)}


def cells(work: str, loads: int) -> list[dict]:
    os.environ["RESHARD_FAULTS_READER_LOADS"] = str(loads)
    from reshard.faults.matrix import cells as all_cells
    from reshard.faults.matrix import run_matrix

    chosen = [c for c in all_cells(backend="local") if c.fault_class in ("reader-retention", "gc-full-disk", "fifo")]
    out = []
    for r in run_matrix(chosen, workdir=os.path.join(work, "cells")):
        out.append({"cell": r.cell.name, "safe": r.safe, "live": r.live, "skipped": r.skipped,
                    "notes": r.notes, "answers": r.ranks, "seconds": round(r.seconds, 1),
                    "bytes_under_root_before": r.bytes_before, "bytes_under_root_after": r.bytes_after,
                    "problems": r.problems, "liveness": r.liveness})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--loads", type=int, default=500)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = a.dir or tempfile.mkdtemp(prefix="reshard-shared-")
    load0 = os.getloadavg()
    tj = two_jobs(work, a.saves)
    print(f"two jobs, {a.saves} saves each: A told saved {tj['a_told_saved']}, B told saved "
          f"{tj['b_told_saved']} (refused {tj['b_refused']}); lost of A {len(tj['lost_of_a'])}, of B "
          f"{len(tj['lost_of_b'])}; left {tj['present']} bit-exact {tj['bit_exact']} ({tj['seconds']} s)")
    cs = cells(work, a.loads)
    for c in cs:
        print(f"{c['cell']}: {'safe' if c['safe'] else 'UNSAFE'} {'live' if c['live'] else 'NOT LIVE'} "
              f"{c['seconds']} s {c['notes'][:1]} {list(c['answers'].values())[:7]}")
    load1 = os.getloadavg()
    print(f"load average before {' '.join(f'{x:.2f}' for x in load0)}, after {' '.join(f'{x:.2f}' for x in load1)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"two_jobs": tj, "cells": cs, "loadavg_before": load0, "loadavg_after": load1}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
