"""One-GPU check of reshard's CUDA staging and loading (issue 29, point 3).

Not a test. Usage::

    python benchmarks/gpu_check.py [--mib 512] [--repeat 3] [--json PATH]   # on one GPU, < 5 minutes
    python benchmarks/gpu_check.py --self-check                            # CPU only, < 30 s (CI)

Needs only torch and reshard's own dependencies (msgspec, xxhash, psutil):
run it with ``PYTHONPATH=src`` from the repository on a machine with its
own Python and torch. What it checks and measures, each in the same run:

1. **Mutation right after ``staged``**, for a bf16 state, an fp32 state and
   a DTensor on a 1-GPU mesh, in the default mode (``staged`` on the side
   stream's CUDA events; the loop mutates on its current stream right after
   ``async_save`` returns, and again right after ``staged`` completes) and
   in the overlap mode (the loop mutates right after
   ``reshard.wait_for_staging()``): the checkpoint must be the state at the
   call, bit for bit; one more overlap save whose loop mutates before the
   wait must fail (the guard), nothing published.
2. **The visible stall against the pinned D2H floor**: ``async_save``'s
   return (the default mode's visible stall: the loop may queue work at
   once) and the time until ``staged`` completes, against the measured
   floor: one device-to-host copy of the same bytes into preallocated pinned
   memory (CUDA events). Also whether any device-wide
   ``torch.cuda.synchronize()`` ran inside ``async_save`` (it must not).
3. **The load's H2D against its floor**: a warm ``reshard.load`` into CUDA
   targets against the page-cache read of the same bytes plus one pinned
   host-to-device copy of them.
4. **Pinned bytes held** by the staging pool and the load's bounce buffers
   after the runs.

``--self-check`` runs the same code on CPU tensors (a 1-process gloo group
for the DTensor mesh) with a few MiB, checks everything that does not need
a device, prints the same table with the GPU rows marked "no device", and
exits 0 only if every check passed (``tests/test_gpu_check.py`` runs it).
Exit 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import reshard  # noqa: E402

MiB = 1 << 20


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _SyncCounter:
    """Counts device-wide ``torch.cuda.synchronize`` calls while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = torch.cuda.synchronize

    def __enter__(self) -> _SyncCounter:
        def counted(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return self._orig(*a, **k)

        torch.cuda.synchronize = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize = self._orig


def _state(kind: str, nbytes: int, dev: torch.device, mesh: Any) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(hash(kind) & 0xFFFF)
    if kind == "bf16":
        n = nbytes // 2
        return {"w": torch.randn(n // 1024, 1024, generator=g).to(torch.bfloat16).to(dev),
                "b": torch.randn(4096, generator=g).to(torch.bfloat16).to(dev)}
    if kind == "fp32":
        n = nbytes // 4
        return {"w": torch.randn(n // 1024, 1024, generator=g).to(dev), "step": torch.tensor(3.0, device=dev)}
    from torch.distributed.tensor import Shard, distribute_tensor

    n = nbytes // 4
    full = torch.randn(n // 1024, 1024, generator=g).to(dev)
    return {"d": distribute_tensor(full, mesh, [Shard(0)])}


def _host(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        t = v.to_local() if hasattr(v, "to_local") else v
        out[k] = t.detach().cpu().clone()
    return out


def _mutate(state: dict[str, Any]) -> None:
    for v in state.values():
        t = v.to_local() if hasattr(v, "to_local") else v
        t.add_(1)


def _targets(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if hasattr(v, "to_local"):
            from torch.distributed.tensor import distribute_tensor

            out[k] = distribute_tensor(torch.zeros(v.shape, dtype=v.dtype, device=v.to_local().device),
                                       v.device_mesh, v.placements)
        else:
            out[k] = torch.zeros_like(v)
    return out


def check_mutation(kind: str, nbytes: int, dev: torch.device, mesh: Any, root: Path) -> dict[str, Any]:
    """The mutation checks of one state kind; returns the rows' facts."""
    res: dict[str, Any] = {"kind": kind}
    for mode in ("default", "default-after-staged", "overlap"):
        state = _state(kind, nbytes, dev, mesh)
        want = _host(state)
        opts = reshard.SaveOptions(overlap_staging=mode == "overlap", durable=False)
        p = root / f"{kind}-{mode}"
        h = reshard.async_save(state, p, step=1, options=opts)
        if mode == "default-after-staged":
            h.staged.result()
        elif mode == "overlap":
            reshard.wait_for_staging(timeout=120)
        _mutate(state)  # right after: on the current stream (CUDA) or at once (CPU)
        h.wait(timeout=300)
        tgt = _targets(state)
        reshard.load(tgt, p)
        res[mode] = all(torch.equal(_host(tgt)[k], want[k]) for k in want)
        _sync(dev)
    # the guard: a loop that mutates before the wait (writes held back by a small budget)
    state = _state(kind, nbytes, dev, mesh)
    opts = reshard.SaveOptions(overlap_staging=True, durable=False, staging_budget_bytes=max(64 << 10, nbytes // 8))
    p = root / f"{kind}-early"
    h = reshard.async_save(state, p, step=1, options=opts)
    _mutate(state)
    try:
        h.wait(timeout=300)
        res["guard"] = False
    except reshard.CheckpointError as e:
        res["guard"] = "was modified before it was staged" in str(e) and not p.exists()
    return res


def measure_stall(nbytes: int, dev: torch.device, repeat: int, root: Path) -> dict[str, Any]:
    """async_save's return and staged latency against the pinned D2H floor."""
    state = _state("fp32", nbytes, dev, None)
    total = sum(t.numel() * t.element_size() for t in state.values())
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    floors, returns, stageds, syncs = [], [], [], 0
    for _ in range(repeat):
        _sync(dev)
        t0 = time.perf_counter()
        k = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            pinned[k:k + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            k += n
        _sync(dev)
        floors.append(time.perf_counter() - t0)
    reshard.prewarm_staging(state)  # the first save pays no pinned allocation
    for i in range(repeat):
        _sync(dev)
        with _SyncCounter() as sc:
            t0 = time.perf_counter()
            h = reshard.async_save(state, root / f"stall-{i}", step=i, options=reshard.SaveOptions(durable=False))
            t1 = time.perf_counter()
            h.staged.result()
            t2 = time.perf_counter()
        syncs += sc.calls
        h.wait(timeout=300)
        returns.append(t1 - t0)
        stageds.append(t2 - t0)
    from reshard.saving.staging import _saver

    f, r, s = min(floors), min(returns), min(stageds)
    return {"bytes": total, "d2h_floor_s": f, "return_s": r, "staged_s": s, "staged_vs_floor": s / f,
            "device_syncs_in_async_save": syncs, "pinned_pool_bytes": _saver(None).pool.pinned_bytes,
            "return_median_s": statistics.median(returns), "staged_median_s": statistics.median(stageds)}


def measure_load(nbytes: int, dev: torch.device, repeat: int, root: Path) -> dict[str, Any]:
    """A warm load into device targets against page-cache read + pinned H2D."""
    src = {"w": torch.randn(nbytes // 4 // 1024, 1024)}
    p = root / "load"
    reshard.save(src, p, options=reshard.SaveOptions(durable=False))
    files = sorted(p.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst_raw = torch.empty(total, dtype=torch.uint8, device=dev)
    reads, h2ds, loads = [], [], []
    tgt = {"w": torch.zeros(src["w"].shape, device=dev)}
    reshard.load(tgt, p)  # warm the page cache
    for _ in range(repeat):
        t0 = time.perf_counter()
        k = 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                mv = memoryview(pinned.numpy().data)[k:k + f.stat().st_size]
                while mv:
                    n = fh.readinto(mv)
                    if not n:
                        break
                    mv = mv[n:]
            k += f.stat().st_size
        reads.append(time.perf_counter() - t0)
        _sync(dev)
        t0 = time.perf_counter()
        dst_raw.copy_(pinned, non_blocking=True)
        _sync(dev)
        h2ds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reshard.load(tgt, p)
        _sync(dev)
        loads.append(time.perf_counter() - t0)
    ok = torch.equal(tgt["w"].cpu(), src["w"])
    from reshard.loading import bounce

    floor = min(reads) + min(h2ds)
    return {"bytes": total, "read_floor_s": min(reads), "h2d_floor_s": min(h2ds), "load_s": min(loads),
            "load_vs_floor": floor / min(loads), "equal": ok,
            "pinned_bounce_bytes": sum(b.numel() for b in bounce._POOL)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB per measured state (GPU mode)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--self-check", action="store_true", help="CPU only, small sizes (CI)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    gpu = torch.cuda.is_available() and not a.self_check
    if not gpu and not a.self_check:
        print("gpu_check: no CUDA device here; run with --self-check for the CPU-only check", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    nbytes = (a.mib if gpu else 4) * MiB
    repeat = a.repeat if gpu else 2
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo" if not gpu else "cpu:gloo,cuda:nccl", store=dist.HashStore(),
                                rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (1,))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if gpu else "cpu (self-check)",
                           "torch": torch.__version__, "mib": nbytes // MiB, "repeat": repeat}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        out["mutation"] = [check_mutation(k, nbytes, dev, mesh, root) for k in ("bf16", "fp32", "dtensor")]
        out["stall"] = measure_stall(nbytes, dev, repeat, root)
        out["load"] = measure_load(nbytes, dev, repeat, root)
    out["seconds"] = time.perf_counter() - t_start
    fails = []
    print(f"gpu_check on {out['device']}, torch {out['torch']}, {out['mib']} MiB per state, "
          f"best of {repeat}")
    print("mutation right after staged (checkpoint == state at the call, bit for bit):")
    for m in out["mutation"]:
        print(f"  {m['kind']:8s} default {m['default']}  after-staged {m['default-after-staged']}  "
              f"overlap {m['overlap']}  guard-caught-early-mutation {m['guard']}")
        fails += [f"{m['kind']} {k}" for k in ("default", "default-after-staged", "overlap", "guard") if not m[k]]
    s = out["stall"]
    floor_name = "pinned D2H floor" if gpu else "memcpy floor (no device)"
    print(f"stall: async_save returns in {s['return_s'] * 1e3:.1f} ms, staged after {s['staged_s'] * 1e3:.1f} ms; "
          f"{floor_name} {s['d2h_floor_s'] * 1e3:.1f} ms for {s['bytes'] / MiB:.0f} MiB: staged "
          f"{s['staged_vs_floor']:.2f}x the floor; device-wide synchronize calls in async_save: "
          f"{s['device_syncs_in_async_save']}")
    if s["device_syncs_in_async_save"]:
        fails.append("a device-wide synchronize ran in async_save")
    ld = out["load"]
    print(f"load: {ld['load_s'] * 1e3:.1f} ms for {ld['bytes'] / MiB:.0f} MiB into {dev.type} targets; floor "
          f"page-cache read {ld['read_floor_s'] * 1e3:.1f} ms + {'pinned H2D' if gpu else 'copy'} "
          f"{ld['h2d_floor_s'] * 1e3:.1f} ms: {ld['load_vs_floor']:.2f}x the floor; equal {ld['equal']}")
    if not ld["equal"]:
        fails.append("the load into device targets differs")
    print(f"pinned bytes held: staging pool {s['pinned_pool_bytes'] / MiB:.0f} MiB, load bounce buffers "
          f"{ld['pinned_bounce_bytes'] / MiB:.0f} MiB" + ("" if gpu else " (no device: nothing is pinned)"))
    print(f"{'all checks passed' if not fails else 'FAILED: ' + '; '.join(fails)} in {out['seconds']:.1f} s")
    out["failed"] = fails
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    dist.destroy_process_group()
    return 1 if fails else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
