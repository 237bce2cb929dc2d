"""Cost of ``LoadOptions(verify_first=True)`` against the default load.

Not a test. Usage::

    python benchmarks/bench_verify_first.py [--mib 256] [--repeat 7] [--dir DIR]

One process saves ``--mib`` MiB of float32 state (tensors of ``--tensor-mib``
MiB; default options: checksums on) and loads it into preallocated targets,
warm (the page cache holds every file: one untimed load first), alternating
default and verify-first loads ``--repeat`` times each. Prints the median and
best seconds of each and their ratio (verify-first / default); checks the
loaded bytes. Also reports the peak extra RSS of one load of each kind.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

import reshard
from reshard.testing.memory import PeakRSS

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    n = a.mib // a.tensor_mib
    cols = 1024
    rows = a.tensor_mib * MiB // (4 * cols)
    g = torch.Generator().manual_seed(0)
    src = {f"t{i}": torch.randn(rows, cols, generator=g) for i in range(n)}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    scratch = tempfile.mkdtemp(prefix="reshard-vf-", dir=a.dir)
    try:
        path = f"{scratch}/ck"
        reshard.save(src, path)
        modes = {"default": reshard.LoadOptions(threads=a.threads),
                 "verify_first": reshard.LoadOptions(threads=a.threads, verify_first=True)}
        for o in modes.values():
            reshard.load(dst, path, options=o)  # warm cache, first-call costs
        secs: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(a.repeat):
            for m, o in modes.items():
                for t in dst.values():
                    t.zero_()
                t0 = time.perf_counter()
                reshard.load(dst, path, options=o)
                secs[m].append(time.perf_counter() - t0)
                assert all(torch.equal(src[k], dst[k]) for k in src)
        rss = {}
        for m, o in modes.items():
            with PeakRSS() as pk:
                reshard.load(dst, path, options=o)
            rss[m] = max(pk.sampled_extra, pk.hwm_extra or 0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {m: statistics.median(s) for m, s in secs.items()}
    best = {m: min(s) for m, s in secs.items()}
    print(f"warm load of {n * a.tensor_mib} MiB float32 ({n} x {a.tensor_mib} MiB), "
          f"{a.threads} reader threads, {a.repeat} runs each:")
    for m in modes:
        print(f"  {m:13s} median {med[m]:.3f} s  best {best[m]:.3f} s  "
              f"({n * a.tensor_mib / 1024 / med[m]:.2f} GiB/s)  peak extra RSS {rss[m] / MiB:.1f} MiB")
    print(f"verify_first / default: median {med['verify_first'] / med['default']:.2f}x, "
          f"best {best['verify_first'] / best['default']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
