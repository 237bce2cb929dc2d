"""``reshard bench io``: checkpoint I/O of a real model state, with its peers
and the machine's limits measured in the same run on the same state.

Per world size and backend, on real gloo ranks (:class:`reshard.testing.pool.WorkerPool`):

1. setup: the workload (:mod:`reshard.bench.models`) in its layout, one
   training step (the AdamW moments exist); first-call costs of every
   method paid on a tiny state;
2. training-step slowdown: step times with no save in flight, then while a
   reshard / DCP async save is in flight;
3. saves (fsync'd, the disk quiet before each, order rotated per repeat):
   ``limit-write`` (each rank ``os.write`` + ``fsync`` of the bytes reshard
   makes it write, one writer per rank), ``reshard.save`` with and without
   checksums, DCP ``save``, ``torch.save`` and safetensors ``save_file`` of
   each rank's share (each + ``fsync``);
4. async saves: ``memcpy`` of the state into preallocated memory (the stall's
   limit), ``reshard.async_save``, DCP ``async_save`` (thread) and DCP's
   process mode with its ``DefaultStager``: the foreground stall and the time
   from return to commit;
5. peak extra RSS per rank of a save, two consecutive async saves, a load
   (and DCP's save and load);
6. warm loads (page cache warm; one untimed call first): ``limit-read``
   (single-thread sequential ``preadv`` of the checkpoint's own files into
   preallocated memory; ``memcpy`` is the figure of step 4), ``reshard.load`` with and without
   checksums, DCP ``load`` (+ ``set_state_dict``) at 1 torch thread and at
   the machine's core count, ``torch.load(weights_only=True)`` and
   safetensors ``load_file`` (each + copy into the state); then the first
   training step after the load;
7. ``--reshard-to``: the checkpoint of this world loaded into another layout
   / world size (reshard and DCP), the state's fingerprint checked, and the
   first step there.

The memory backend keeps objects in each process: the other ranks cannot
see them (a save refuses such a location), so it runs at world 1 only. Outputs: a table (ratios beside figures), ``--json`` (one record
per phase measurement, every rank's timings, the load average), ``--plot``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import click

from ..cli_support import OutputPath
from ..plan_store import PLAN_FILE
from .models import MODELS, parse_layout

GB = 1e9


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated integers (e.g. 1,2,4)") from None
    if not out or min(out) < 1 or max(out) > 8:
        raise click.BadParameter(f"{text!r}: world sizes from 1 to 8")
    return out


def _finite(low: float, *, open_low: bool) -> Any:
    """A click callback: a finite number ``> low`` (``open_low``) or ``>= low``."""
    def check(ctx: click.Context, param: click.Parameter, value: float) -> float:
        if not math.isfinite(value) or value < low or (open_low and value == low):
            raise click.BadParameter(f"{value}: a finite number {'>' if open_low else '>='} {low:g}")
        return value
    return check


#: every method name ``--skip`` may name (the peers, the limits and reshard's own)
def _methods() -> set[str]:
    from . import ranks

    return {*ranks.SAVE_METHODS, *ranks.ASYNC_METHODS, *ranks.LOAD_METHODS}


class Runner:
    """Runs the phases on the pool and collects one record per measurement."""

    def __init__(self, cfg: dict[str, Any], progress: bool):
        from ..testing.pool import WorkerPool

        self.cfg = cfg
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.pool = WorkerPool(pg_timeout=900.0, grace=60.0, max_groups=1)
        self.progress = progress
        self.bar: Any = None
        self.info: dict[int, list[dict[str, Any]]] = {}

    # -- helpers
    def run(self, world: int, fn: Any, *args: Any) -> list[Any]:
        return self.pool.run(world, fn, *args, timeout=self.cfg["timeout"])

    def setup(self, world: int, layout: str) -> list[dict[str, Any]]:
        from . import ranks

        c = self.cfg
        return self.run(world, ranks.setup, c["model"], layout, c["synthetic_mib"], c["seq_len"], c["profile"])

    def tick(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    def record(self, phase: str, method: str, world: int, backend: str, per_rank: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
        rec = {"phase": phase, "method": method, "world": world, "backend": backend,
               "model": self.cfg["model"], "layout": self.cfg["layout_of"][world],
               "loadavg": list(os.getloadavg()), "time": time.time(), "per_rank": per_rank,
               "rss_after": self.worker_rss(extra.get("target_world", world)), **extra}
        self.records.append(rec)
        return rec

    def worker_rss(self, world: int) -> list[int | None]:
        """Resident bytes of each rank's process now (after the phase)."""
        import psutil

        group = self.pool._groups.get(world)
        out: list[int | None] = []
        for p in group.procs if group is not None else []:
            try:
                out.append(psutil.Process(p.pid).memory_info().rss)
            except (psutil.Error, TypeError):
                out.append(None)
        return out

    def url(self, backend: str, scratch: str, name: str) -> str:
        if backend == "memory":
            return f"memory://bench-{os.getpid()}/{name}"
        return os.path.join(scratch, name)

    # -- one world size on one backend
    def world_run(self, world: int, backend: str, scratch: str) -> None:
        from . import ranks

        cfg = self.cfg
        rep, settle = cfg["repeat"], cfg["settle"]
        local = backend == "local"
        info = self.setup(world, cfg["layout"])
        self.info[world] = info
        cfg["layout_of"][world] = info[0]["layout"]
        self.record("setup", "build", world, backend, info, logical_bytes=info[0]["logical_bytes"])
        self.tick(f"w{world} {backend}: setup")
        fp = info[0]["fingerprint"]
        base = self.url(backend, scratch, f"w{world}")
        warm = ["reshard", "reshard-async"] + (["dcp", "dcp-async", "dcp-async-process"] if local else [])
        warm = [m for m in warm if m not in cfg["skip"]]
        self.run(world, ranks.warm, base + "-warm", warm)
        # peak RSS of the first save and of the first two async saves (the staging pool's growth)
        for m in ("save", "async-save"):
            p = self.url(backend, scratch, f"w{world}-rss-{m}")
            self.record("rss", m, world, backend, self.run(world, ranks.rss, m, p))
            if m == "save":
                self.run(world, ranks.drop, p)
        # training-step slowdown while a background save is in flight
        tm = ["reshard-async"] + (["dcp-async"] if local and "dcp-async" not in cfg["skip"] else [])
        out = self.run(world, ranks.train, tm, base + "-train", cfg["steps"], settle)
        self.record("train", "step", world, backend, out)
        self.tick(f"w{world} {backend}: training")
        fp = self.run(world, ranks.fingerprint)[0]
        # saves
        methods = [m for m in ranks.SAVE_METHODS if (local or m.startswith("reshard")) and m not in cfg["skip"]]
        keep: dict[str, str] = {}
        limit_bytes: list[int] = [0] * world
        methods = ["reshard"] + [m for m in methods if m != "reshard"]  # bytes per rank first
        for r in range(rep):
            order = methods if r == 0 else methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                p = self.url(backend, scratch, f"w{world}-save-{m}-{r}")
                self.run(world, ranks.quiet, settle)
                out = self.run(world, ranks.save, m, p, limit_bytes)
                if m == "reshard":  # the limit writes the bytes reshard wrote, per rank
                    limit_bytes = [o["bytes"] for o in out]
                extra: dict[str, Any] = {"repeat_index": r}
                if local and os.path.isdir(p):
                    extra["stored_bytes"] = _dir_bytes(p)
                    extra["files"] = len([f for f in os.listdir(p) if not f.startswith(".")])
                    mf = os.path.join(p, "manifest.json")
                    if os.path.exists(mf):
                        extra["manifest_bytes"] = os.path.getsize(mf)
                    pf = os.path.join(p, PLAN_FILE)  # the cached save plan (reshard.plan_store)
                    extra["plan_bytes"] = os.path.getsize(pf) if os.path.exists(pf) else 0
                self.record("save", m, world, backend, out, **extra)
                if m in keep:
                    self.run(world, ranks.drop, keep[m])
                keep[m] = p
                self.tick(f"w{world} {backend}: save {m}")
        # async saves
        amethods = [m for m in ranks.ASYNC_METHODS if (local or m in ("memcpy", "reshard-async"))
                    and m not in cfg["skip"]]
        for r in range(rep):
            order = amethods[r % len(amethods):] + amethods[:r % len(amethods)]
            for m in order:
                p = self.url(backend, scratch, f"w{world}-async-{m}-{r}")
                self.run(world, ranks.quiet, settle)
                try:
                    out = self.run(world, ranks.async_save, m, p)
                except Exception as e:  # noqa: BLE001 - a peer's mode this torch lacks: reported
                    if m == "dcp-async-process":
                        why = [ln for ln in str(e).splitlines() if "raised" in ln][:1] or [str(e)[:200]]
                        self.notes.append(f"{m} not measured (world {world}): {why[0].strip()[:300]}")
                        amethods.remove(m)
                        self.pool.restart(world)
                        self.setup(world, cfg["layout"])
                        continue
                    raise
                self.record("async", m, world, backend, out, repeat_index=r)
                if m != "memcpy":
                    self.run(world, ranks.drop, p)
                self.tick(f"w{world} {backend}: async {m}")
        self.run(world, ranks.trim)  # the async phases' buffers, before the loads allocate theirs
        # peak RSS
        ckpt = keep["reshard"]
        rm = ["load"] + (["dcp-save", "dcp-load"] if local and "dcp" in keep else [])
        for m in rm:
            p = ckpt if m == "load" else keep.get("dcp", "") if m == "dcp-load" else \
                self.url(backend, scratch, f"w{world}-rss-{m}")
            out = self.run(world, ranks.rss, m, p)
            self.record("rss", m, world, backend, out)
            if m == "dcp-save":
                self.run(world, ranks.drop, p)
        self.tick(f"w{world} {backend}: rss")
        # warm loads
        src = {"limit-read": keep.get("reshard"), "reshard": keep["reshard"],
               "reshard-nocheck": keep["reshard"], "dcp": keep.get("dcp"),
               "dcp-threads": keep.get("dcp"), "torch-load": keep.get("torch-save"),
               "safetensors": keep.get("safetensors")}
        lm = [m for m in ranks.LOAD_METHODS if src.get(m) is not None and m not in cfg["skip"]
              and (local or m in ("reshard", "reshard-nocheck"))]
        for m in lm:
            out = self.run(world, ranks.load, m, src[m], rep,
                           fp if m.startswith("reshard") or m.startswith("dcp") else None)
            self.record("load", m, world, backend, out)
            self.tick(f"w{world} {backend}: load {m}")
        self.run(world, ranks.load, "reshard", keep["reshard"], 1, None)
        out = self.run(world, ranks.step_time)
        self.record("load", "first-step", world, backend, [{"rank": i, "own_s": [s], "total_s": [s]}
                                                          for i, s in enumerate(out)])
        for p in [p for p in keep.values() if p.startswith("memory://")]:
            self.run(world, ranks.drop, p)  # objects held in the workers' memory
        self.run(world, ranks.release)
        # reshard to other layouts / world sizes (the source world's state released first)
        if local:
            for target in cfg["reshard_to"]:
                self.reshard_to(world, backend, target, keep, fp)
        for p in keep.values():
            if p.startswith("memory://"):
                continue
            shutil.rmtree(p, ignore_errors=True)

    def reshard_to(self, world: int, backend: str, target: str, keep: dict[str, str], fp: float) -> None:
        from . import ranks

        cfg = self.cfg
        spec = parse_layout(target)
        tw = spec.world or world
        info = self.setup(tw, target)
        tag = f"{info[0]['layout']}<-{cfg['layout_of'][world]}"
        for m, p in (("reshard", keep["reshard"]), ("reshard-nocheck", keep["reshard"]),
                     ("dcp", keep.get("dcp"))):
            if p is None or m in cfg["skip"]:
                continue
            out = self.run(tw, ranks.load, m, p, cfg["repeat"], fp)
            self.record("reshard", m, world, backend, out, target=tag, target_world=tw)
            self.tick(f"w{world}->{tag}: {m}")
        out = self.run(tw, ranks.step_time)
        self.record("reshard", "first-step", world, backend,
                    [{"rank": i, "own_s": [s], "total_s": [s]} for i, s in enumerate(out)],
                    target=tag, target_world=tw)
        self.run(tw, ranks.release)

    def close(self) -> None:
        self.pool.close()


def _dir_bytes(p: str) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(p) for f in fs)


def _phase_count(cfg: dict[str, Any]) -> int:
    per = 4 + 6 * cfg["repeat"] + 4 * cfg["repeat"] + 8 + 4 * len(cfg["reshard_to"])
    return per * len(cfg["worlds"]) * len(cfg["backends"])


@click.command("io")
@click.option("--model", type=click.Choice(list(MODELS)), default="synthetic", show_default=True,
              help="Workload (real nn.Module state with AdamW moments).")
@click.option("--world", "world", default="1,2", show_default=True, help="World sizes, e.g. 1,2,4.")
@click.option("--layout", default="fsdp", show_default=True,
              help="'fsdp' (FSDP2 fully_shard over the world) or the demo's syntax 'dpN' (replicated).")
@click.option("--reshard-to", "reshard_to", multiple=True,
              help="Also load each world's checkpoint into this layout (e.g. fsdp1, fsdp4, dp2); repeatable.")
@click.option("--backend", default="local", show_default=True,
              help="Comma-separated: local, memory, s3.")
@click.option("--repeat", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Timed runs per method (min and median reported).")
@click.option("--synthetic-mib", type=float, default=256.0, show_default=True,
              callback=_finite(0.0, open_low=True),
              help="MiB of parameters of the synthetic model (state: 3x with the moments).")
@click.option("--seq-len", type=click.IntRange(2, 1024), default=16, show_default=True,
              help="Tokens per sample of the training step.")
@click.option("--steps", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Training steps with no save in flight before each background save.")
@click.option("--settle", type=float, default=0.5, show_default=True, callback=_finite(0.0, open_low=False),
              help="Seconds of rest after os.sync() before each timed save.")
@click.option("--skip", default="", help="Comma-separated methods to leave out (e.g. dcp-async-process).")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None,
              help="Scratch directory on the disk to measure (default: a temporary one).")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Write every record and the summary here.")
@click.option("--plot", "plot_path", type=OutputPath(), default=None,
              help="Write a PNG: per-rank timelines of save and load, and the scaling over world sizes.")
@click.option("--timeout", type=float, default=1800.0, show_default=True,
              callback=_finite(0.0, open_low=True),
              help="Seconds one phase may take on the ranks.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None,
              help="Profile every timed reshard save and load with pyinstrument (a dev dependency) "
                   "on every rank; text reports written to this directory.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def io_cmd(model: str, world: str, layout: str, reshard_to: tuple[str, ...], backend: str, repeat: int,
           synthetic_mib: float, seq_len: int, steps: int, settle: float, skip: str,
           scratch_dir: str | None, json_path: str | None, plot_path: str | None, timeout: float,
           profile_dir: str | None, no_progress: bool) -> None:
    """Measure save, async save, load and reshard of a model state, with DCP,
    torch.save, safetensors and the machine's limits in the same run."""
    from . import report

    worlds = _ints(world)
    try:
        parse_layout(layout)
        for t in reshard_to:
            parse_layout(t)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    fixed = parse_layout(layout).world
    if fixed is not None and any(w != fixed for w in worlds):
        raise click.BadParameter(f"layout {layout!r} names {fixed} ranks, but --world {world} runs "
                                 f"{', '.join(map(str, worlds))}: give the layout without a degree "
                                 "(its world is then each run's)", param_hint="--layout")
    unknown = sorted({s.strip() for s in skip.split(",") if s.strip()} - _methods())
    if unknown:
        raise click.BadParameter(f"unknown method(s) {', '.join(unknown)}; one of "
                                 f"{', '.join(sorted(_methods()))}", param_hint="--skip")
    backends = [b.strip() for b in backend.split(",") if b.strip()]
    for b in backends:
        if b not in ("local", "memory", "s3"):
            raise click.BadParameter(f"backend {b!r}: one of local, memory, s3", param_hint="--backend")
        if b == "s3":
            raise click.UsageError("--backend s3: not available yet (needs the S3 backend and its "
                                   "loopback endpoint); use local or memory")
    cfg: dict[str, Any] = {
        "model": model, "worlds": worlds, "layout": layout, "reshard_to": list(reshard_to),
        "backends": backends, "repeat": repeat, "synthetic_mib": synthetic_mib, "seq_len": seq_len,
        "steps": steps, "settle": settle, "skip": {s.strip() for s in skip.split(",") if s.strip()},
        "timeout": timeout, "layout_of": {}, "argv": sys.argv[1:], "cpus": os.cpu_count(),
        "profile": os.path.abspath(profile_dir) if profile_dir else None,
    }
    if profile_dir:
        try:
            import pyinstrument  # noqa: F401
        except ImportError:
            raise click.UsageError("--profile needs pyinstrument (pip install -r requirements-dev.txt)") from None
        os.makedirs(profile_dir, exist_ok=True)
    import psutil
    import torch

    import reshard

    meta = {"torch": torch.__version__, "reshard": reshard.__version__, "cpus": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "cuda": torch.cuda.is_available(), "loadavg_start": list(os.getloadavg())}
    scratch = tempfile.mkdtemp(prefix="reshard-bench-io-", dir=scratch_dir)
    progress = not no_progress and sys.stderr.isatty()
    runner = Runner(cfg, progress)
    t0 = time.perf_counter()
    try:
        if progress:
            from tqdm import tqdm

            runner.bar = tqdm(total=_phase_count(cfg), desc="bench io", unit="phase", leave=False)
        for b in backends:
            for w in worlds:
                if b == "memory" and w > 1:  # reshard refuses storage the ranks do not share
                    runner.notes.append(f"memory://, world {w}: not measured (memory:// is per "
                                        "process; every rank must see the same checkpoint)")
                    continue
                runner.world_run(w, b, scratch)
                if json_path:  # what is measured so far survives a later failure
                    with open(json_path, "w") as f:
                        json.dump({"config": {**cfg, "skip": sorted(cfg["skip"])}, "meta": meta,
                                   "notes": runner.notes, "partial": True, "records": runner.records},
                                  f, indent=1, default=str)
    finally:
        if runner.bar is not None:
            runner.bar.close()
        runner.close()
        shutil.rmtree(scratch, ignore_errors=True)
    meta["loadavg_end"] = list(os.getloadavg())
    meta["wall_s"] = time.perf_counter() - t0
    cfg["skip"] = sorted(cfg["skip"])
    summary = report.summarise(runner.records, cfg)
    doc = {"config": cfg, "meta": meta, "notes": runner.notes, "summary": summary,
           "records": runner.records}
    click.echo(report.table(doc))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        click.echo(f"records written to {json_path}")
    if plot_path:
        report.plot(doc, plot_path)
        click.echo(f"plot written to {plot_path}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
