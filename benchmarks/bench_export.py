"""Benchmark of ``reshard.formats.hf_export.export_hf``: peak memory and throughput.

Not a test. Usage::

    python benchmarks/bench_export.py [--mib 512] [--tensor-mib 32] [--shard-mib 128]
                                      [--optim] [--settle S] [--dir DIR] [--json PATH]

A checkpoint of ``--mib`` MiB of float32 model tensors ([rows, 1024] tensors
of ``--tensor-mib`` MiB; even ones row-sharded, odd ones column-sharded) is
saved by 2 real gloo ranks (:class:`reshard.testing.pool.WorkerPool`); with
``--optim`` each tensor also gets two AdamW-like moments (``optim.state.*``),
which the export must skip without reading. The parent process, which holds
none of the state, then exports it to a Hugging Face directory with
``max_shard_bytes = --shard-mib`` MiB, as saved (fp32) and cast to bf16.

Measured per export (each in a fresh interpreter): the peak extra RSS of the process during the call (a
psutil thread sampling every 0.5 ms, minus RSS before; page cache is not RSS,
but pages of a shard mmap'ed by the safetensors validation are), the kernel's
VmHWM high-water mark (reset before the call where the kernel allows), the
target "largest output shard + 64 MiB", and throughput: logical bytes read
from the checkpoint per second and bytes written per second (fsync included,
read back and validated). The checkpoint was just written, so its reads are
served from the page cache (a warm export); ``os.sync()`` and ``--settle``
seconds of rest precede each export so that earlier writeback does not
overlap it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import reshard
from reshard.testing.memory import PeakRSS

MiB = 1 << 20
WIDTH = 1024


# --------------------------------------------------------------------------------- rank side
def save_rank(path: str, rows: list[int], optim: bool) -> int:
    """Save this rank's shards of every tensor; returns the bytes it held."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {}
    held = 0
    for i, r in enumerate(rows):
        g = torch.Generator().manual_seed(1000 + i)
        full = torch.empty(r, WIDTH).uniform_(-1, 1, generator=g)
        if i % 2 == 0:  # row-sharded
            a, b = r * rank // world, r * (rank + 1) // world
            local, off = full[a:b].clone(), (a, 0)
        else:  # column-sharded
            a, b = WIDTH * rank // world, WIDTH * (rank + 1) // world
            local, off = full[:, a:b].clone(), (0, a)
        del full
        name = f"model.layers.{i:03d}.weight"
        state[f"w{i}"] = reshard.ShardedTensor(name, local, global_shape=(r, WIDTH), global_offset=off)
        held += local.nbytes
        if optim:
            for k in ("exp_avg", "exp_avg_sq"):
                state[f"{k}{i}"] = reshard.ShardedTensor(f"optim.state.{name}.{k}", local * 0.5,
                                                         global_shape=(r, WIDTH), global_offset=off)
    reshard.save(state, path, step=1)
    return held


# ------------------------------------------------------------------------------- parent side
def measure(ckpt: str, out: str, shard_bytes: int, dtype: str | None) -> dict[str, Any]:
    from reshard.formats.hf_export import export_hf

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res = export_hf(ckpt, out, dtype=dtype, max_shard_bytes=shard_bytes)
        secs = time.perf_counter() - t0
    before, peak, hwm_extra = mem.before, mem.peak, mem.hwm_extra
    largest = max(os.path.getsize(os.path.join(out, f)) for f in res.files)
    target = largest + 64 * MiB
    return {
        "dtype": dtype or "as saved",
        "files": len(res.files),
        "largest_shard_bytes": largest,
        "tensor_bytes_out": res.total_size,
        "bytes_read": res.bytes_read,
        "bytes_written": res.bytes_written,
        "seconds": secs,
        "read_MBps": res.bytes_read / 1e6 / secs,
        "write_MBps": res.bytes_written / 1e6 / secs,
        "rss_before": before,
        "peak_extra_rss": peak - before,
        "hwm_extra": hwm_extra,
        "target_bytes": target,
        "within_target": peak - before <= target,
        "skipped": len(res.skipped),
    }


def _measure_in_child(ckpt: str, out: str, shard_bytes: int, dtype: str | None) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter, so that no export's memory
    (the allocator keeps freed blocks) counts in another's baseline."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", ckpt, out, str(shard_bytes),
           dtype or ""]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        ckpt, out, shard_bytes, dtype = argv[1:5]
        print(json.dumps(measure(ckpt, out, int(shard_bytes), dtype or None)))
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB of float32 model tensors")
    ap.add_argument("--tensor-mib", type=int, default=32, help="MiB per tensor")
    ap.add_argument("--shard-mib", type=int, default=128, help="max_shard_bytes, in MiB")
    ap.add_argument("--optim", action="store_true", help="also save two moments per tensor")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait after os.sync() before each export")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    a = ap.parse_args(argv)
    per = a.tensor_mib * MiB // (4 * WIDTH)
    n = max(1, a.mib // a.tensor_mib)
    rows = [per] * n
    mod = importlib.import_module("bench_export") if __name__ == "__main__" else sys.modules[__name__]
    from reshard.testing.pool import WorkerPool

    scratch = a.dir or tempfile.mkdtemp(prefix="reshard-bench-export-")
    ckpt = os.path.join(scratch, "ckpt", "step-00000001")
    shutil.rmtree(os.path.join(scratch, "ckpt"), ignore_errors=True)
    pool = WorkerPool(pg_timeout=600.0, grace=30.0, max_groups=1)
    try:
        t0 = time.perf_counter()
        pool.run(2, mod.save_rank, ckpt, rows, a.optim, timeout=1800.0)
        save_s = time.perf_counter() - t0
    finally:
        pool.close()
    m = reshard.inspect(ckpt)
    print(f"checkpoint: {len(m.tensors)} tensors, {m.total_bytes / MiB:.0f} MiB on disk "
          f"({n} x {a.tensor_mib} MiB model tensors, half row- and half column-sharded over 2 ranks"
          f"{', + 2 moments each' if a.optim else ''}); saved in {save_s:.2f} s")
    results = []
    try:
        for dtype in (None, "bf16"):
            out = os.path.join(scratch, f"hf-{dtype or 'fp32'}")
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # the checkpoint's (and the last export's) writeback does not overlap the timing
            time.sleep(a.settle)
            r = _measure_in_child(ckpt, out, a.shard_mib * MiB, dtype)
            results.append(r)
            hwm = "-" if r["hwm_extra"] is None else f"{r['hwm_extra'] / MiB:.1f} MiB"
            print(f"export ({r['dtype']}): {r['files']} files, largest {r['largest_shard_bytes'] / MiB:.1f} MiB, "
                  f"{r['seconds']:.2f} s; read {r['read_MBps']:.0f} MB/s, write {r['write_MBps']:.0f} MB/s "
                  f"(fsync + validation included)")
            print(f"  peak extra RSS {r['peak_extra_rss'] / MiB:.1f} MiB (VmHWM {hwm}); target "
                  f"largest shard + 64 MiB = {r['target_bytes'] / MiB:.1f} MiB: "
                  f"{'OK' if r['within_target'] else 'OVER'}")
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump({"args": vars(a), "save_s": save_s, "exports": results}, f, indent=2)
    return 0 if all(r["within_target"] for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
