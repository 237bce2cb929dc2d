"""The whole fault matrix (every fault x phase x mode), as a report.

Not a test. Usage::

    python benchmarks/fault_matrix.py [--quick] [--backend local|s3|local,s3] [--only TEXT] [--json PATH]

Runs :func:`reshard.faults.matrix.cells` on 2 real gloo ranks per cell
(the same runner as ``reshard faults``; the S3 rows on a moto server started
on 127.0.0.1 behind the fault proxy), prints one line per cell (verdict,
seconds, every rank's outcome, ``latest``, whether the previous checkpoint
loads bit-exact, seconds until every rank saw the fault, whether the next
save commits, seconds until every process exited, whether the failed
attempt's space came back, what was left behind before ``gc``) and the
counts, and writes them as JSON. Exits 1 if any cell is unsafe or not live.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one cell per fault class (and a few more)")
    ap.add_argument("--backend", choices=["local", "s3", "local,s3"], default="local")
    ap.add_argument("--only", default=None, help="only cells whose name contains this text")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from reshard.faults.matrix import cells, run_matrix

    chosen = [c for c in cells(quick=args.quick, backend=args.backend)
              if args.only is None or args.only in f"{c.backend}:{c.name}"]
    if not chosen:
        print(f"no cell matches {args.only!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def show(r):  # type: ignore[no-untyped-def]
        if r.skipped:
            print(f"skip   {r.cell.backend + ':' + r.cell.name:61s} {r.skipped}", flush=True)
            return
        ranks = "; ".join(f"r{k}={v.split(':', 1)[0]}" for k, v in sorted(r.ranks.items()))
        verdict = ("safe  " if r.safe else "UNSAFE") + (" live " if r.live else " STUCK")
        print(f"{verdict} {r.seconds:5.1f}s {r.cell.backend + ':' + r.cell.name:61s} {ranks:42s} "
              f"latest={os.path.basename(r.latest) if r.latest else '-'} "
              f"prev_bit_exact={r.previous_loads} detect_s={_s(r.detect_s)} next={r.next_commits} "
              f"exit_s={_s(r.exit_s)} space_back={r.space_back} left={','.join(r.left_behind) or '-'}", flush=True)
        for p in r.problems + r.liveness:
            print(f"        {p[:300]}")

    with tempfile.TemporaryDirectory(prefix="reshard-faults-") as d:
        results = run_matrix(chosen, workdir=d, progress=show)
    unsafe = [r for r in results if not r.safe or not (r.live or r.skipped)]
    secs = time.perf_counter() - t0
    print(f"cells run: {len(results)}, safe and live: {len(results) - len(unsafe)}, not: {len(unsafe)} "
          f"({secs:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "cells": len(results), "safe": len(results) - len(unsafe),
                       "unsafe": len(unsafe), "seconds": round(secs, 1),
                       "results": [r.to_json() for r in results]}, f, indent=1)
    return 1 if unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
