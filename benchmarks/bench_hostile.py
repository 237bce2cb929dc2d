"""Cost of hostile checkpoints: peak RSS and time of reading each, against
the limits of :class:`reshard.ReadLimits` (issue 28 point 5).

Not a test. Usage::

    python benchmarks/bench_hostile.py [--dir DIR] [--real-manifest FILE] [--json OUT]

Builds, from one small valid checkpoint (:mod:`reshard.fuzz.hostile`), the
issue's hostile inputs at full size (a 200 MiB tensor name, a 500 MiB value
string, 3M extra keys, a 1M-entry safetensors header for ``convert --from
hf``) and the largest hostile inputs the default limits still let through
(free-form fields just under ``field_bytes``, a manifest of empty tensors
just under ``manifest_bytes``, a safetensors header just under
``header_bytes``), plus a real manifest (``--real-manifest``: the scale
simulator's Llama-3 405B at 16,384 ranks, 17 MB). Each is read in a fresh
process (``reshard.load`` of a manifest, ``hf_manifest`` of a Hugging Face
directory, ``reshard.inspect`` of the real manifest), timing the call and
sampling its peak RSS above the process's RSS before it
(:class:`reshard.testing.memory.PeakRSS`). Prints one row per input: its
size, outcome, seconds, seconds per MiB, peak extra MiB and MiB per input MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MiB = 1 << 20

_CHILD = r"""
import json, os, sys, time
import torch, reshard
from reshard.testing.memory import PeakRSS
kind, path = sys.argv[1], sys.argv[2]
out = {}
with PeakRSS() as m:
    t0 = time.perf_counter()
    try:
        if kind == "hf":
            from reshard.formats.hf_import import hf_manifest
            hf_manifest(path)
        elif kind == "inspect":
            reshard.inspect(path)
        else:
            reshard.load({"w": torch.zeros(4, 6), "meta": {"lr": 0.0}}, path)
        out["outcome"] = "ok"
    except reshard.CheckpointError as e:
        out["outcome"] = type(e).__name__ + ": " + str(e)[:160]
    out["seconds"] = time.perf_counter() - t0
out["extra_rss"] = max(m.sampled_extra, m.hwm_extra or 0)
print(json.dumps(out))
"""


def _run(kind: str, path: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", _CHILD, kind, path], capture_output=True, text=True,
                       env=env, timeout=900)
    if p.returncode != 0:
        return {"outcome": f"CRASH {p.returncode}: {p.stderr[-300:]}", "seconds": None, "extra_rss": None}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--real-manifest", default=None, help="a real manifest.json to inspect")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the limit-sized inputs only")
    a = ap.parse_args(argv)
    from reshard.fuzz.hostile import base_checkpoint, hf_header_bomb, write_bomb
    from reshard.ondisk.limits import ReadLimits

    lim = ReadLimits()
    work = a.dir or tempfile.mkdtemp(prefix="reshard-hostile-")
    base_dir = os.path.join(work, "base")
    base = base_checkpoint(base_dir)
    files = {n: open(os.path.join(base_dir, n), "rb").read() for n in os.listdir(base_dir)
             if n != "manifest.json"}
    cases: list[tuple[str, str, str, int]] = []  # (label, kind, field, size)
    if not a.quick:
        cases += [("issue: 200 MiB tensor name", "load", "tensor-name", 200 * MiB),
                  ("issue: 500 MiB value string", "load", "value-string", 500 * MiB),
                  ("issue: 3M extra keys", "load", "extra-keys", 3_000_000 * 13),
                  ("issue: 1M-entry safetensors header", "hf", "", 1_000_000)]
    cases += [("limit: extra keys just under field_bytes", "load", "extra-keys", lim.field_bytes - 64 * 1024),
              ("limit: value string just under field_bytes", "load", "value-string", lim.field_bytes - 64 * 1024),
              ("limit: empty tensors just under manifest_bytes", "load", "empty-tensors",
               lim.manifest_bytes - 2 * MiB),
              ("limit: safetensors header just under header_bytes", "hf", "", 150_000)]
    rows = []
    for label, kind, field, size in cases:
        d = os.path.join(work, "case")
        if kind == "hf":
            import shutil

            shutil.rmtree(d, ignore_errors=True)
            nbytes = hf_header_bomb(d, size)
        else:
            write_bomb(d, base, files, field, size, exact=label.startswith("issue"))
            nbytes = os.path.getsize(os.path.join(d, "manifest.json"))
        r = _run(kind, d)
        rows.append({"input": label, "bytes": nbytes, **r})
        print(_fmt(rows[-1]), flush=True)
    if a.real_manifest:
        d = os.path.join(work, "real")
        os.makedirs(d, exist_ok=True)
        import shutil

        shutil.copyfile(a.real_manifest, os.path.join(d, "manifest.json"))
        r = _run("inspect", d)
        rows.append({"input": "real: Llama-3 405B, 16,384 ranks (inspect)", "bytes": os.path.getsize(a.real_manifest), **r})
        print(_fmt(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limits": vars(lim) if hasattr(lim, "__dict__") else str(lim), "rows": rows,
                       "loadavg": os.getloadavg()}, f, indent=1)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _fmt(r: dict) -> str:
    mib = r["bytes"] / MiB
    s = r["seconds"]
    x = r["extra_rss"]
    n = max(r["bytes"], 1)
    return (f"{r['input']:<52} {mib:9.1f} MiB  {('-' if s is None else f'{s:7.3f} s')}  "
            f"{('-' if s is None else f'{s / max(mib, 1e-9):.4f} s/MiB')}  "
            f"{('-' if x is None else f'{x / MiB:8.1f} MiB')}  "
            f"{('-' if x is None else f'{x / n:.2f}x')}  {r['outcome'][:90]}")


if __name__ == "__main__":
    sys.exit(main())
