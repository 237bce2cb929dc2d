"""Core benchmark of reshard against baselines measured in the same run.

Not a test. Usage::

    python benchmarks/bench_core.py [--gib 1.0] [--repeat 3] [--dir DIR] [--json PATH] [--verify-first]

``--gib`` GiB of float32 state is split over 2 real gloo ranks (spawned
:class:`reshard.testing.pool.WorkerPool` workers); each rank holds half, as
tensors of ``--tensor-mib`` MiB, row-sharded tensors of the logical state.

Measured (median of ``--repeat`` runs; GB = 1e9 bytes of logical state):

* save, fsync on everywhere: a plain baseline (each rank ``os.write`` of the
  same bytes to one file + ``os.fsync``), ``reshard.save`` (default options:
  checksums, fsync, manifest-last publish), ``torch.distributed.checkpoint.save``
  (FileSystemWriter defaults: one file per rank, ``sync_files=True``) of the
  same state as DTensors sharded on dim 0;
* warm load (every file read once before timing, so the page cache holds it)
  into preallocated targets: ``os.preadv`` of the baseline file, ``reshard.load``
  (checksums on, the default, and off), ``torch.distributed.checkpoint.load``;
* the peak extra memory of a ``reshard.load`` (and, for reference, a DCP load):
  process RSS sampled by a psutil thread during the call, minus RSS before
  (page cache is not RSS), and the kernel's VmHWM high-water mark where it can
  be reset; target: at most 10% of the loaded bytes + 64 MiB;
* ``decode_manifest`` (parse + validate) of a synthetic 100k-chunk manifest.

The rank functions live in this module, which the workers import by name
(``bench_core``): run it as a script from anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

import reshard
from reshard.testing.memory import PeakRSS

MiB = 1 << 20
WIDTH = 1024  # columns of every benchmark tensor

# per-worker state, kept between tasks of the persistent pool workers
_W: dict[str, Any] = {}


# --------------------------------------------------------------------------------- rank side
def _tensors(nbytes: int, tensor_bytes: int) -> list[int]:
    sizes = [tensor_bytes] * (nbytes // tensor_bytes)
    if nbytes % tensor_bytes:
        sizes.append(nbytes % tensor_bytes)
    return [s // (4 * WIDTH) for s in sizes]  # rows of each [rows, WIDTH] float32 tensor


def setup(per_rank_bytes: int, tensor_bytes: int) -> int:
    """Build this rank's half of the state (random float32) and touched targets."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    rows = _tensors(per_rank_bytes, tensor_bytes)
    _W["src"] = [torch.empty(r, WIDTH).uniform_(-1, 1, generator=g) for r in rows]
    _W["dst"] = [torch.empty(r, WIDTH).fill_(0) for r in rows]
    _W["tiny_src"] = [torch.full((4, WIDTH), float(rank))]
    _W["tiny_dst"] = [torch.zeros(4, WIDTH)]
    return sum(t.numel() * 4 for t in _W["src"])


def _mesh() -> Any:
    if "mesh" not in _W:
        from torch.distributed.device_mesh import init_device_mesh

        _W["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    return _W["mesh"]


def _reshard_state(ts: list[torch.Tensor]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {f"t{i}": reshard.ShardedTensor(f"t{i}", t, global_shape=(t.shape[0] * world, WIDTH),
                                           global_offset=(t.shape[0] * rank, 0))
            for i, t in enumerate(ts)}


def _dcp_state(ts: list[torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh()
    return {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
            for i, t in enumerate(ts)}


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _write_plain(path: str, ts: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in ts:
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_plain(path: str, ts: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for t in ts:
            mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < len(mv):
                n = os.preadv(fd, [mv[got:]], off + got)
                if n == 0:
                    raise EOFError(path)
                got += n
            off += got
    finally:
        os.close(fd)


def save(method: str, path: str, tiny: bool = False) -> float:
    """Save this rank's half with ``method``; seconds between barriers."""
    ts = _W["tiny_src" if tiny else "src"]
    if method == "baseline":
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        return _timed(lambda: _write_plain(os.path.join(path, f"r{dist.get_rank()}.bin"), ts))
    if method == "reshard":
        state = _reshard_state(ts)
        out: list[Any] = []
        secs = _timed(lambda: out.append(reshard.save(state, path, step=1)))
        _W["last_timings"] = out[0].timings
        return secs
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        state = _dcp_state(ts)
        return _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path)))
    raise ValueError(method)


def last_timings() -> dict[str, float]:
    """Per-phase seconds of this rank's last reshard.save."""
    return _W.get("last_timings", {})


def _loader(method: str, path: str, ts: list[torch.Tensor]) -> Any:
    if method == "baseline":
        return lambda: _read_plain(os.path.join(path, f"r{dist.get_rank()}.bin"), ts)
    if method.startswith("reshard"):
        state = _reshard_state(ts)
        opts = reshard.LoadOptions(checksums=method != "reshard-nocheck",
                                   verify_first=method == "reshard-verify-first")
        return lambda: reshard.load(state, path, options=opts)
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        state = _dcp_state(ts)
        return lambda: dcp.load(state, checkpoint_id=path)
    raise ValueError(method)


def load(method: str, path: str, repeat: int, tiny: bool = False) -> dict[str, Any]:
    """Warm load: one untimed read, then ``repeat`` timed ones; checks the bytes."""
    src, dst = (_W["tiny_src"], _W["tiny_dst"]) if tiny else (_W["src"], _W["dst"])
    fn = _loader(method, path, dst)
    fn()  # page cache warm (and first-call imports done)
    secs = []
    for _ in range(repeat):
        for t in dst:
            t.fill_(0)
        secs.append(_timed(fn))
    ok = all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
    return {"seconds": secs, "ok": ok}


def memory(method: str, path: str) -> dict[str, Any]:
    """Peak extra RSS of one warm load with ``method`` (bytes)."""
    dst = _W["dst"]
    fn = _loader(method, path, dst)
    fn()
    dist.barrier()
    with PeakRSS() as m:
        fn()
    return {"rss_before": m.before, "sampled_extra": m.sampled_extra, "hwm_extra": m.hwm_extra,
            "loaded_bytes": sum(t.numel() * t.element_size() for t in dst)}


# ------------------------------------------------------------------------------- parent side
def manifest_bench(n_chunks: int = 100_000, per_tensor: int = 100, repeat: int = 5) -> dict[str, Any]:
    """Encode and time decode_manifest of a synthetic manifest of ``n_chunks`` chunks."""
    from reshard.manifest import (
        Chunk,
        FileEntry,
        Manifest,
        TensorEntry,
        decode_manifest,
        encode_manifest,
    )

    ranks = per_tensor
    files = [f"data-r{r:05d}-0.safetensors" for r in range(ranks)]
    pos = [64] * ranks
    rows, isz = 64, 4
    tensors = {}
    for t in range(n_chunks // per_tensor):
        chunks = []
        for k in range(per_tensor):
            length = rows * 64 * isz
            chunks.append(Chunk(global_offset=(k * rows, 0), local_shape=(rows, 64), file=files[k],
                                offset=pos[k], length=length, checksums=(f"{(t * 131 + k):016x}",)))
            pos[k] += length
        tensors[f"model.layers.{t // 10}.mlp.w{t % 10}.weight"] = TensorEntry(
            dtype="float32", global_shape=(per_tensor * rows, 64), chunks=tuple(chunks))
    m = Manifest(attempt_id="bench", created_at=time.time(), world_size=ranks,
                 checksum_block_bytes=MiB, step=1, tensors=tensors,
                 files={f: FileEntry(size=pos[i], checksum=f"{i:016x}") for i, f in enumerate(files)})
    t0 = time.perf_counter()
    raw = encode_manifest(m)
    enc = time.perf_counter() - t0
    secs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        decode_manifest(raw)
        secs.append(time.perf_counter() - t0)
    return {"chunks": sum(len(te.chunks) for te in tensors.values()), "tensors": len(tensors),
            "json_bytes": len(raw), "encode_s": enc, "decode_validate_s": secs,
            "decode_validate_median_s": statistics.median(secs)}


def _dir_bytes(p: str) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(p) for f in fs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of float32 state over 2 ranks")
    ap.add_argument("--tensor-mib", type=int, default=64, help="MiB per tensor")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per method (median)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait after os.sync() before each timed save")
    ap.add_argument("--skip-dcp", action="store_true", help="do not run torch.distributed.checkpoint")
    ap.add_argument("--verify-first", action="store_true",
                    help="also time (and measure the memory of) LoadOptions(verify_first=True)")
    a = ap.parse_args(argv)
    world = 2
    total = int(a.gib * (1 << 30)) // (world * 4 * WIDTH) * (world * 4 * WIDTH)
    if total <= 0:
        ap.error("--gib too small")
    per_rank = total // world
    tensor_bytes = min(a.tensor_mib * MiB, per_rank) // (4 * WIDTH) * (4 * WIDTH)
    mod = importlib.import_module("bench_core") if __name__ == "__main__" else sys.modules[__name__]
    from reshard.testing.pool import WorkerPool

    scratch = tempfile.mkdtemp(prefix="reshard-bench-", dir=a.dir)
    methods = ["baseline", "reshard"] + ([] if a.skip_dcp else ["dcp"])
    res: dict[str, Any] = {
        "config": {"gib": a.gib, "bytes": total, "ranks": world, "tensor_bytes": tensor_bytes,
                   "tensors_per_rank": len(_tensors(per_rank, tensor_bytes)), "repeat": a.repeat,
                   "scratch": scratch, "cpus": os.cpu_count(),
                   "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
                   "torch": torch.__version__, "reshard": reshard.__version__,
                   "loadavg_start": os.getloadavg()},
    }
    pool = WorkerPool(pg_timeout=600.0, grace=30.0, max_groups=1)
    try:
        t0 = time.perf_counter()
        pool.run(world, mod.setup, per_rank, tensor_bytes, timeout=600)
        print(f"setup: {total / (1 << 30):.2f} GiB float32 over {world} ranks, "
              f"{res['config']['tensors_per_rank']} x {tensor_bytes / MiB:.0f} MiB tensors per rank "
              f"({time.perf_counter() - t0:.1f} s); scratch {scratch}", flush=True)
        # warm-up: first-call imports and process-group setup of every method, on a tiny state
        for m in methods:
            p = os.path.join(scratch, f"warm-{m}")
            pool.run(world, mod.save, m, p, True, timeout=600)
            pool.run(world, mod.load, m, p, 1, True, timeout=600)
            shutil.rmtree(p)
        # saves: rotate the order each round; keep the last round's files for the loads
        samples: dict[str, list[float]] = {m: [] for m in methods}
        paths: dict[str, str] = {}
        phases: list[list[dict[str, float]]] = []
        for r in range(a.repeat):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                p = os.path.join(scratch, f"{m}-{r}")
                os.sync()  # start every save from a quiet disk (no pending writeback)
                time.sleep(a.settle)
                samples[m].append(max(pool.run(world, mod.save, m, p, timeout=600)))
                if m == "reshard":
                    phases.append(pool.run(world, mod.last_timings, timeout=600))
                if m in paths:
                    shutil.rmtree(paths[m])
                paths[m] = p
            print(f"  save round {r + 1}/{a.repeat}: " + ", ".join(
                f"{m} {samples[m][-1]:.2f} s" for m in methods), flush=True)
        res["save"] = {m: {"seconds": s, "median_s": statistics.median(s),
                           "gb_per_s": total / 1e9 / statistics.median(s),
                           "best_s": min(s), "file_bytes": _dir_bytes(paths[m])}
                       for m, s in samples.items()}
        res["save"]["reshard"]["phases_s"] = {  # per phase, slowest rank, median over rounds
            k: statistics.median(max(t.get(k, 0.0) for t in rnd) for rnd in phases)
            for k in ("stage", "plan", "write", "commit")}
        # warm loads
        lmethods = (["baseline", "reshard", "reshard-nocheck"] + ([] if a.skip_dcp else ["dcp"])
                    + (["reshard-verify-first"] if a.verify_first else []))
        res["load"] = {}
        for m in lmethods:
            p = paths["reshard" if m.startswith("reshard") else m]
            out = pool.run(world, mod.load, m, p, a.repeat, timeout=600)
            secs = [max(x) for x in zip(*(o["seconds"] for o in out), strict=True)]
            med = statistics.median(secs)
            res["load"][m] = {"seconds": secs, "median_s": med, "gb_per_s": total / 1e9 / med,
                              "bytes_equal": all(o["ok"] for o in out)}
            print(f"  warm load {m}: {med:.3f} s, bytes equal: {res['load'][m]['bytes_equal']}",
                  flush=True)
        # memory
        res["memory"] = {}
        for m in (["reshard"] + ([] if a.skip_dcp else ["dcp"])
                  + (["reshard-verify-first"] if a.verify_first else [])):
            out = pool.run(world, mod.memory, m, paths["reshard" if m.startswith("reshard") else m],
                           timeout=600)
            loaded = out[0]["loaded_bytes"]
            sampled = max(o["sampled_extra"] for o in out)
            hwms = [o["hwm_extra"] for o in out]
            hwm = None if None in hwms else max(hwms)
            worst = max(sampled, hwm or 0)
            limit = 0.10 * loaded + 64 * MiB
            res["memory"][m] = {"per_rank": out, "loaded_bytes_per_rank": loaded,
                                "sampled_extra_max": sampled, "hwm_extra_max": hwm,
                                "fraction": worst / loaded, "limit_bytes": limit,
                                "within_target": worst <= limit}
    finally:
        pool.close()
        shutil.rmtree(scratch, ignore_errors=True)
    res["manifest"] = manifest_bench()
    res["config"]["loadavg_end"] = os.getloadavg()
    _print(res)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {a.json_path}")
    ok = (all(v["bytes_equal"] for v in res["load"].values())
          and res["memory"]["reshard"]["within_target"])
    return 0 if ok else 1


def _print(res: dict[str, Any]) -> None:
    c = res["config"]
    print(f"\nreshard core benchmark: {c['bytes'] / (1 << 30):.2f} GiB float32 over {c['ranks']} "
          f"gloo ranks ({c['tensors_per_rank']} x {c['tensor_bytes'] / MiB:.0f} MiB per rank), "
          f"median of {c['repeat']}, {c['cpus']} CPUs, torch {c['torch']}; GB = 1e9 B; "
          f"load average {c['loadavg_start'][0]:.1f} -> {c['loadavg_end'][0]:.1f}")
    sv, ld = res["save"], res["load"]
    rows = [("save (fsync)", "", "", "")]
    names = {"baseline": "os.write+fsync", "reshard": "reshard.save", "dcp": "DCP save",
             "reshard-nocheck": "reshard.load no checksums"}
    for m, v in sv.items():
        rows.append((f"  {names[m]}", f"{v['median_s']:.3f}", f"{v['gb_per_s']:.2f}",
                     "" if m == "baseline" else f"{v['median_s'] / sv['baseline']['median_s']:.2f}x base"))
    lnames = {"baseline": "preadv (page cache)", "reshard": "reshard.load",
              "reshard-nocheck": "reshard.load -checksums", "dcp": "DCP load",
              "reshard-verify-first": "reshard.load verify_first"}
    rows.append(("warm load", "", "", ""))
    for m, v in ld.items():
        rows.append((f"  {lnames[m]}", f"{v['median_s']:.3f}", f"{v['gb_per_s']:.2f}",
                     "" if m == "baseline" else f"{v['median_s'] / ld['baseline']['median_s']:.2f}x base"))
    w0 = max(len(r[0]) for r in rows)
    print(f"{'':{w0}}  {'s':>7}  {'GB/s':>6}  time ratio")
    for r in rows:
        print(f"{r[0]:{w0}}  {r[1]:>7}  {r[2]:>6}  {r[3]}")
    ph = sv["reshard"].get("phases_s")
    if ph:
        print("reshard.save phases (s, slowest rank): "
              + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    if "dcp" in sv:
        print(f"reshard/DCP time ratio: save {sv['reshard']['median_s'] / sv['dcp']['median_s']:.2f}, "
              f"warm load {ld['reshard']['median_s'] / ld['dcp']['median_s']:.2f}")
    if "reshard-verify-first" in ld:
        print(f"verify_first/default warm load time ratio: "
              f"{ld['reshard-verify-first']['median_s'] / ld['reshard']['median_s']:.2f}")
    for m, v in res["memory"].items():
        hwm = "n/a" if v["hwm_extra_max"] is None else f"{v['hwm_extra_max'] / MiB:.1f} MiB"
        print(f"peak extra RSS of {m} load per rank: sampled {v['sampled_extra_max'] / MiB:.1f} MiB, "
              f"VmHWM {hwm} = {100 * v['fraction']:.1f}% of {v['loaded_bytes_per_rank'] / MiB:.0f} MiB "
              f"loaded (target <= 10% + 64 MiB = {v['limit_bytes'] / MiB:.0f} MiB: "
              f"{'met' if v['within_target'] else 'MISSED'})")
    mb = res["manifest"]
    print(f"manifest: {mb['chunks']} chunks / {mb['tensors']} tensors, "
          f"{mb['json_bytes'] / 1e6:.1f} MB JSON; decode+validate {mb['decode_validate_median_s'] * 1e3:.0f} ms "
          f"(target < 1 s), encode {mb['encode_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
