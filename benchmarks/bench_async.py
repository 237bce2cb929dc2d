"""Asynchronous-save benchmark of reshard against baselines measured in the same run.

Not a test. Usage::

    python benchmarks/bench_async.py [--gib 1.0] [--ranks 1] [--rounds 5] [--json PATH]

``--gib`` GiB of CPU float32 state (tensors of ``--tensor-mib`` MiB; plain
tensors on one rank, row shards over ``--ranks`` spawned gloo ranks otherwise).
Every rank initialises a gloo process group (FileStore in the scratch
directory), as ``torch.distributed.checkpoint.async_save`` requires one; DCP's
background collectives run on a separate gloo group (as its docs recommend),
reshard's on the groups it creates itself. Measured, in this order:

1. peak RSS over ``--rss-saves`` consecutive ``reshard.async_save`` calls
   (each committed before the next): process RSS sampled by a psutil thread
   and the kernel's VmHWM; the first save allocates the staging pool, later
   ones must stay flat. The first save's stall (pool allocation, background
   group creation, first-call imports) is reported separately;
2. foreground stall, median of ``--rounds`` rounds (order rotated, disk quiet
   (``os.sync``) before each, every save committed before the next): the
   time to ``dst.copy_(src)`` the same tensors into preallocated, touched
   tensors; ``reshard.async_save`` until it returns (``handle.staged`` done);
   ``torch.distributed.checkpoint.async_save`` (FileSystemWriter defaults)
   until it returns, and, where it works (it pins memory: CUDA builds only),
   DCP with ``cache_staged_state_dict=True`` and one reused writer.
   Targets: reshard <= 1.3x the copy, <= 0.5x DCP's stall;
3. training-step slowdown: a CPU MLP (``--threads`` torch threads, batch
   calibrated to ``--step-ms``); median step time with no save in flight
   (``--steps`` steps right before each save, after the same quiet period) vs
   while an async save of the state is in flight (``--bg-saves`` saves per
   method, order rotated, steps until each commits), reshard and DCP.

With several ranks, each stall is the slowest rank's, each ratio the worst rank's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

import reshard

MiB = 1 << 20
WIDTH = 1024  # columns of every state tensor


# ------------------------------------------------------------------------------------ helpers
class RssSampler:
    """Samples this process's RSS in a thread; ``peak`` since the last ``reset``."""

    def __init__(self, interval: float = 0.002):
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = self.rss()
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def reset(self) -> None:
        self.peak = self.rss()

    def __enter__(self) -> RssSampler:
        self._th.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._th.join()
        self.peak = max(self.peak, self.rss())


def _reset_hwm() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rows(nbytes: int, tensor_bytes: int) -> list[int]:
    sizes = [tensor_bytes] * (nbytes // tensor_bytes)
    if nbytes % tensor_bytes:
        sizes.append(nbytes % tensor_bytes)
    return [s // (4 * WIDTH) for s in sizes]


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------- rank side
class _Rank:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]):
        self.rank, self.world, self.cfg = rank, world, cfg
        self.ckpt = os.path.join(cfg["scratch"], "ckpt")
        g = torch.Generator().manual_seed(1234 + rank)
        self.ts = [torch.empty(r, WIDTH).uniform_(-1, 1, generator=g)
                   for r in _rows(cfg["per_rank"], cfg["tensor_bytes"])]
        self.nbytes = sum(t.numel() * 4 for t in self.ts)
        self.dcp_group = dist.new_group(backend="gloo")  # DCP's background collectives
        self.n = 0

    # states ---------------------------------------------------------------------------
    def reshard_state(self, ts: list[torch.Tensor]) -> dict[str, Any]:
        if self.world == 1:
            return {f"t{i}": t for i, t in enumerate(ts)}
        return {f"t{i}": reshard.ShardedTensor(f"t{i}", t, global_shape=(t.shape[0] * self.world, WIDTH),
                                               global_offset=(t.shape[0] * self.rank, 0))
                for i, t in enumerate(ts)}

    def dcp_state(self) -> dict[str, Any]:
        if self.world == 1:
            return {f"t{i}": t for i, t in enumerate(self.ts)}
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (self.world,))
        return {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                for i, t in enumerate(self.ts)}

    # paths / sync ---------------------------------------------------------------------
    def new_path(self, tag: str) -> str:
        self.n += 1
        return os.path.join(self.ckpt, f"{tag}-{self.n}")

    def drop(self, path: str) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def quiet(self) -> None:
        os.sync()  # no pending writeback from the previous save
        time.sleep(self.cfg["settle"])
        dist.barrier()

    # the saves, each returning (stall seconds, a wait() for the commit) ----------------
    def start(self, method: str, path: str) -> tuple[float, Any]:
        if method == "reshard":
            t0 = time.perf_counter()
            h = reshard.async_save(self.rstate, path, step=self.n)
            s = time.perf_counter() - t0
            assert h.staged.done(), "async_save returned before staging was done"
            return s, h
        import torch.distributed.checkpoint as dcp

        if method == "dcp":
            t0 = time.perf_counter()
            f = dcp.async_save(self.dstate, storage_writer=dcp.FileSystemWriter(path),
                               process_group=self.dcp_group)
            return time.perf_counter() - t0, f
        if method == "dcp-cached":
            if not hasattr(self, "cached_writer"):
                self.cached_writer = dcp.FileSystemWriter(path, cache_staged_state_dict=True)
            t0 = time.perf_counter()
            f = dcp.async_save(self.dstate, checkpoint_id=path, storage_writer=self.cached_writer,
                               process_group=self.dcp_group)
            return time.perf_counter() - t0, f
        raise ValueError(method)

    @staticmethod
    def done(h: Any) -> bool:
        return h.done()

    @staticmethod
    def wait(h: Any) -> None:
        if isinstance(h, reshard.SaveHandle):
            h.wait()
        else:
            h.result()

    # phase 1: RSS over consecutive saves ----------------------------------------------
    def rss_phase(self) -> dict[str, Any]:
        self.rstate = self.reshard_state(self.ts)
        gc.collect()
        hwm_ok = _reset_hwm()
        out: dict[str, Any] = {"stall_s": [], "peak_rss": [], "rss_after": [], "pool_bytes": []}
        prev = None
        with RssSampler() as smp:
            out["rss_before"] = smp.rss()
            for _ in range(self.cfg["rss_saves"]):
                p = self.new_path("rss")
                dist.barrier()
                smp.reset()
                s, h = self.start("reshard", p)
                self.wait(h)
                out["stall_s"].append(s)
                out["peak_rss"].append(max(smp.peak, smp.rss()))
                out["rss_after"].append(smp.rss())
                out["pool_bytes"].append(_pool_bytes())
                if prev is not None:
                    self.drop(prev)
                prev = p
        out["hwm"] = _hwm_bytes() if hwm_ok else None
        # the last checkpoint holds the state's bytes
        dst = [torch.zeros_like(t) for t in self.ts]
        reshard.load(self.reshard_state(dst), prev)
        out["bytes_equal"] = all(torch.equal(a, b) for a, b in zip(self.ts, dst, strict=True))
        del dst
        self.drop(prev)
        return out

    # phase 2: foreground stall --------------------------------------------------------
    def stall_phase(self) -> dict[str, Any]:
        self.dstate = self.dcp_state()
        dst = [torch.empty_like(t).fill_(0) for t in self.ts]  # preallocated and touched

        def copy() -> float:
            t0 = time.perf_counter()
            for s, d in zip(self.ts, dst, strict=True):
                d.copy_(s)
            return time.perf_counter() - t0

        methods = ["copy", "reshard"] + ([] if self.cfg["skip_dcp"] else ["dcp", "dcp-cached"])
        first: dict[str, float] = {}
        unavailable: dict[str, str] = {}
        for m in methods[2:]:  # DCP's first saves (imports, planner, cache allocation)
            p = self.new_path(m)
            self.quiet()
            try:
                s, h = self.start(m, p)
                self.wait(h)
                first[m] = s
            except Exception as e:  # noqa: BLE001 - e.g. pinned memory on a CPU-only build
                unavailable[m] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            self.drop(p)
        methods = [m for m in methods if m not in unavailable]
        copy()
        samples: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(self.cfg["rounds"]):
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                self.quiet()
                if m == "copy":
                    samples[m].append(copy())
                    continue
                p = self.new_path(m)
                s, h = self.start(m, p)
                self.wait(h)
                del h
                samples[m].append(s)
                self.drop(p)
                gc.collect()
        dst.clear()
        if hasattr(self, "cached_writer"):
            del self.cached_writer
        gc.collect()
        return {"samples": samples, "first": first, "unavailable": unavailable}

    # phase 3: training-step slowdown --------------------------------------------------
    def train_phase(self) -> dict[str, Any]:
        cfg = self.cfg
        threads_before = torch.get_num_threads()
        torch.set_num_threads(cfg["threads"])
        try:
            return self._train(cfg)
        finally:
            torch.set_num_threads(threads_before)

    def _train(self, cfg: dict[str, Any]) -> dict[str, Any]:
        torch.manual_seed(0)
        width, depth = cfg["mlp_width"], cfg["mlp_depth"]
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        batch = 64

        def make(b: int) -> Any:
            x = torch.randn(b, width)

            def step() -> float:
                t0 = time.perf_counter()
                loss = model(x).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return time.perf_counter() - t0

            return step

        step = make(batch)
        for _ in range(3):
            step()
        for _ in range(3):  # calibrate the batch to about --step-ms per step
            t = _med([step() for _ in range(3)])
            batch = max(8, min(8192, int(batch * cfg["step_ms"] / 1e3 / t)))
            step = make(batch)
            step()

        # each save is preceded by a window of steps with no save in flight (after the
        # same quiet period), so that drift in the machine's load affects both alike
        quiet: list[float] = []
        during: dict[str, list[float]] = {}
        commit: dict[str, list[float]] = {}
        bg_stall: dict[str, list[float]] = {}
        methods = ["reshard"] + ([] if cfg["skip_dcp"] else ["dcp"])
        for m in methods:
            during[m], commit[m], bg_stall[m] = [], [], []
        for r in range(cfg["bg_saves"]):
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                p = self.new_path(f"train-{m}")
                self.quiet()
                quiet.extend(step() for _ in range(cfg["steps"]))
                s, h = self.start(m, p)
                t0 = time.perf_counter()
                while not self.done(h):
                    during[m].append(step())
                t1 = time.perf_counter()
                self.wait(h)
                commit[m].append(t1 - t0)
                bg_stall[m].append(s)
                del h
                self.drop(p)
                gc.collect()
        return {"batch": batch, "width": width, "depth": depth, "threads": cfg["threads"],
                "no_save": quiet, "during": during, "save_s": commit,
                "stall_s": bg_stall}

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "bytes": self.nbytes}
        out["rss"] = self.rss_phase()
        if self.rank == 0:
            print(f"  rss: {len(out['rss']['stall_s'])} saves done", flush=True)
        out["stall"] = self.stall_phase()
        if self.rank == 0:
            print("  stall: done", flush=True)
        out["train"] = self.train_phase()
        if self.rank == 0:
            print("  training: done", flush=True)
        return out


def _pool_bytes() -> int | None:
    try:
        from reshard.staging import _SAVERS

        return sum(s.pool.allocated_bytes for s in _SAVERS.values())
    except Exception:  # noqa: BLE001 - internal; informative only
        return None


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    store = dist.FileStore(os.path.join(cfg["scratch"], "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        res = _Rank(rank, world, cfg).run()
        reshard.staging.wait_all()
        with open(os.path.join(cfg["scratch"], f"result-{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------- parent side
def _summarise(per_rank: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    worst = lambda xs: [max(v) for v in zip(*xs, strict=True)]  # noqa: E731 - per round, slowest rank
    st = {m: worst([r["stall"]["samples"][m] for r in per_rank]) for m in per_rank[0]["stall"]["samples"]}
    stall = {m: {"seconds": s, "median_s": _med(s), "min_s": min(s)} for m, s in st.items()}
    copy = stall["copy"]["median_s"]
    rs = stall["reshard"]["median_s"]
    res: dict[str, Any] = {"stall": stall}
    res["stall_ratio"] = {"reshard_over_copy": rs / copy, "target_reshard_over_copy": 1.3}
    if "dcp" in stall:
        res["stall_ratio"]["reshard_over_dcp"] = rs / stall["dcp"]["median_s"]
        res["stall_ratio"]["target_reshard_over_dcp"] = 0.5
    if "dcp-cached" in stall:
        res["stall_ratio"]["reshard_over_dcp_cached"] = rs / stall["dcp-cached"]["median_s"]
    res["first_stall_s"] = {"reshard": max(r["rss"]["stall_s"][0] for r in per_rank)}
    for m in per_rank[0]["stall"]["first"]:
        res["first_stall_s"][m] = max(r["stall"]["first"][m] for r in per_rank)
    res["dcp_unavailable"] = per_rank[0]["stall"]["unavailable"]
    # training
    tr: dict[str, Any] = {"per_rank": []}
    for r in per_rank:
        t = r["train"]
        base = _med(t["no_save"])
        row = {"batch": t["batch"], "no_save_median_s": base, "no_save_steps": len(t["no_save"])}
        for m, xs in t["during"].items():
            row[m] = {"median_s": _med(xs), "ratio": _med(xs) / base, "steps": len(xs),
                      "mean_ratio": (statistics.fmean(xs) / statistics.fmean(t["no_save"])) if xs else float("nan"),
                      "save_s_median": _med(t["save_s"][m]), "stall_s_median": _med(t["stall_s"][m])}
        tr["per_rank"].append(row)
    t0 = per_rank[0]["train"]
    tr.update({"threads": t0["threads"], "mlp": f"{t0['depth']} x Linear({t0['width']}) + GELU"})
    for m in t0["during"]:
        tr[m + "_ratio"] = max(row[m]["ratio"] for row in tr["per_rank"])
    res["train"] = tr
    # RSS
    rss: dict[str, Any] = {"per_rank": []}
    for r in per_rank:
        x = r["rss"]
        b = x["rss_before"]
        extra = [p - b for p in x["peak_rss"]]
        row = {"rss_before": b, "peak_extra": extra, "after_extra": [a - b for a in x["rss_after"]],
               "hwm_extra": None if x["hwm"] is None else x["hwm"] - b, "pool_bytes": x["pool_bytes"],
               "state_bytes": r["bytes"], "bytes_equal": x["bytes_equal"],
               # flat: no later save peaks more than 32 MiB above the first one
               "growth_after_first": max(extra[1:], default=extra[0]) - extra[0]}
        row["flat"] = row["growth_after_first"] <= 32 * MiB
        rss["per_rank"].append(row)
    rss["flat"] = all(r["flat"] for r in rss["per_rank"])
    rss["bytes_equal"] = all(r["bytes_equal"] for r in rss["per_rank"])
    res["rss"] = rss
    res["warm_stalls_rss_phase_s"] = worst([r["rss"]["stall_s"] for r in per_rank])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of float32 state (over all ranks)")
    ap.add_argument("--ranks", type=int, default=1, help="gloo ranks (1: this process; more: spawned)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="MiB per tensor")
    ap.add_argument("--rounds", type=int, default=5, help="timed stall rounds (median)")
    ap.add_argument("--rss-saves", type=int, default=10, help="consecutive saves of the RSS phase")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    ap.add_argument("--step-ms", type=float, default=100.0, help="target training-step time (ms)")
    ap.add_argument("--mlp-width", type=int, default=1024)
    ap.add_argument("--mlp-depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6,
                    help="steps with no save in flight before each background save")
    ap.add_argument("--bg-saves", type=int, default=5, help="background saves per method while training")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds to wait after os.sync() before each timed measurement")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--skip-dcp", action="store_true", help="do not run torch.distributed.checkpoint")
    a = ap.parse_args(argv)
    world = a.ranks
    if world < 1 or a.rss_saves < 1 or a.rounds < 1:
        ap.error("--ranks, --rss-saves and --rounds must be >= 1")
    quantum = world * 4 * WIDTH
    total = int(a.gib * (1 << 30)) // quantum * quantum
    if total <= 0:
        ap.error("--gib too small")
    per_rank = total // world
    tensor_bytes = max(4 * WIDTH, min(a.tensor_mib * MiB, per_rank) // (4 * WIDTH) * (4 * WIDTH))
    scratch = tempfile.mkdtemp(prefix="reshard-bench-async-", dir=a.dir)
    cfg = {"scratch": scratch, "per_rank": per_rank, "tensor_bytes": tensor_bytes,
           "rounds": a.rounds, "rss_saves": a.rss_saves, "threads": a.threads, "step_ms": a.step_ms,
           "mlp_width": a.mlp_width, "mlp_depth": a.mlp_depth, "steps": a.steps,
           "bg_saves": a.bg_saves, "settle": a.settle, "skip_dcp": a.skip_dcp}
    res: dict[str, Any] = {"config": {
        "gib": a.gib, "bytes": total, "ranks": world, "tensor_bytes": tensor_bytes,
        "tensors_per_rank": len(_rows(per_rank, tensor_bytes)), "rounds": a.rounds,
        "rss_saves": a.rss_saves, "scratch": scratch, "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "torch": torch.__version__, "reshard": reshard.__version__,
        "loadavg_start": os.getloadavg(), "argv": sys.argv[1:] if argv is None else argv}}
    print(f"bench_async: {total / (1 << 30):.2f} GiB float32 on {world} rank(s), scratch {scratch}; "
          f"load average {res['config']['loadavg_start'][0]:.2f}", flush=True)
    try:
        if world == 1:
            _rank_main(0, 1, cfg)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_rank_main, args=(world, cfg), nprocs=world, join=True)
        per = []
        for r in range(world):
            with open(os.path.join(scratch, f"result-{r}.json")) as f:
                per.append(json.load(f))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res.update(_summarise(per, cfg))
    res["per_rank_raw"] = per
    res["config"]["loadavg_end"] = os.getloadavg()
    _print(res)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {a.json_path}")
    return 0 if res["rss"]["bytes_equal"] else 1


def _print(res: dict[str, Any]) -> None:
    c = res["config"]
    la0, la1 = c["loadavg_start"], c["loadavg_end"]
    print(f"\nreshard async-save benchmark: {c['bytes'] / (1 << 30):.2f} GiB float32, {c['ranks']} gloo "
          f"rank(s), {c['tensors_per_rank']} x {c['tensor_bytes'] / MiB:.0f} MiB tensors per rank, "
          f"median of {c['rounds']} rounds; {c['cpus']} CPUs, {c['torch_threads']} torch threads, "
          f"torch {c['torch']}; load average (1/5/15 min) {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f} -> "
          f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f}")
    st, sr = res["stall"], res["stall_ratio"]
    names = {"copy": "dst.copy_(src), preallocated", "reshard": "reshard.async_save (warm pool)",
             "dcp": "DCP async_save", "dcp-cached": "DCP async_save, cached stager"}
    rows = []
    for m, v in st.items():
        ratio = "" if m == "copy" else f"{v['median_s'] / st['copy']['median_s']:.2f}x copy"
        rows.append((names[m], f"{v['median_s']:.3f}", f"{v['min_s']:.3f}",
                     f"{c['bytes'] / c['ranks'] / 1e9 / v['median_s']:.2f}", ratio))
    w0 = max(len(r[0]) for r in rows) + 2
    print(f"{'foreground stall':{w0}}  {'median s':>8}  {'min s':>6}  {'GB/s':>5}  ratio")
    for r in rows:
        print(f"  {r[0]:{w0 - 2}}  {r[1]:>8}  {r[2]:>6}  {r[3]:>5}  {r[4]}")
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    line = (f"reshard stall / copy {sr['reshard_over_copy']:.2f} (target <= 1.3: "
            f"{met(sr['reshard_over_copy'] <= 1.3)})")
    if "reshard_over_dcp" in sr:
        line += (f"; reshard / DCP {sr['reshard_over_dcp']:.2f} (target <= 0.5: "
                 f"{met(sr['reshard_over_dcp'] <= 0.5)})")
    if "reshard_over_dcp_cached" in sr:
        line += f"; reshard / DCP cached {sr['reshard_over_dcp_cached']:.2f}"
    print(line)
    print("first save's stall: " + ", ".join(f"{m} {s:.3f} s" for m, s in res["first_stall_s"].items())
          + " (reshard: pool allocation, background groups, imports)")
    for m, why in res["dcp_unavailable"].items():
        print(f"  {m} not measured: {why}")
    tr = res["train"]
    r0 = tr["per_rank"][0]
    parts = [f"no save {r0['no_save_median_s'] * 1e3:.1f} ms"]
    for m in ("reshard", "dcp"):
        if m in r0:
            parts.append(f"during {names[m].split(' (')[0]} {r0[m]['median_s'] * 1e3:.1f} ms "
                         f"(x{tr[m + '_ratio']:.2f} median, x{r0[m]['mean_ratio']:.2f} mean, "
                         f"{r0[m]['steps']} steps, save {r0[m]['save_s_median']:.2f} s)")
    who = "" if c["ranks"] == 1 else " (rank 0's steps; ratios: the worst rank's)"
    print(f"training step ({tr['mlp']}, batch {r0['batch']}, {tr['threads']} thread(s)){who}: "
          + "; ".join(parts))
    rs = res["rss"]
    for i, r in enumerate(rs["per_rank"]):
        ex = ", ".join(f"{e / MiB:.0f}" for e in r["peak_extra"])
        hwm = "n/a" if r["hwm_extra"] is None else f"{r['hwm_extra'] / MiB:.0f} MiB"
        print(f"peak extra RSS over {len(r['peak_extra'])} async saves (rank {i}, MiB over "
              f"{r['rss_before'] / MiB:.0f} MiB before; state {r['state_bytes'] / MiB:.0f} MiB): [{ex}]; "
              f"VmHWM {hwm}; pool {(r['pool_bytes'][-1] or 0) / MiB:.0f} MiB; growth after the first "
              f"{r['growth_after_first'] / MiB:.1f} MiB ({'flat' if r['flat'] else 'NOT flat'}); "
              f"last checkpoint bytes equal: {r['bytes_equal']}")
    ws = res["warm_stalls_rss_phase_s"]
    print("stalls of the consecutive saves (s): " + ", ".join(f"{s:.3f}" for s in ws))


if __name__ == "__main__":
    sys.exit(main())
