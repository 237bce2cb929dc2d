"""``reshard fuzz`` and ``reshard faults``: hostile inputs and the fault
matrix (engines in :mod:`reshard.fuzz.runner` and
:mod:`reshard.faults.matrix`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import click

from .support import OutputPath, fail, table


@click.command("fuzz")
@click.option("--count", type=click.IntRange(1, None), default=100_000, show_default=True,
              help="Hostile inputs to run.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the input generator.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Scratch directory (default: a temporary one, removed after).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1, None), default=10.0,
              show_default=True, help="Seconds one input may take before it counts as a hang.")
@click.option("--jobs", type=click.IntRange(1, 64), default=None,
              help="Worker processes (default: the CPUs this process may use, at most 8).")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Write the counts as JSON here.")
def fuzz_cmd(count: int, seed: int, workdir: str | None, timeout_s: float, jobs: int | None,
             json_path: str | None) -> None:
    """Load COUNT hostile checkpoints (mutated manifests, shard files, DCP
    .metadata, safetensors headers) derived from small valid ones.

    Exits 0 when every outcome was a valid load or a CheckpointError, 1 on any
    other outcome (another exception, a hang, an allocation past the 1 GiB
    ceiling, wrong data loaded), 2 on a usage error.
    """
    from ..fuzz.runner import fuzz

    tmp = None
    if workdir is None:
        tmp = workdir = tempfile.mkdtemp(prefix="reshard-fuzz-")

    def progress(rep: Any) -> None:
        click.echo(f"  {rep.inputs} inputs, {len(rep.crashes)} crashes, {rep.rate:.0f}/s", err=True)

    try:
        if jobs is None:
            jobs = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else (os.cpu_count() or 1))
        rep = fuzz(count, seed=seed, workdir=workdir, timeout_s=timeout_s, jobs=jobs,
                   progress=progress if count >= 5000 else None)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    click.echo(f"fuzz: {rep.inputs} inputs (seed {seed}) in {rep.duration_s:.1f} s "
               f"({rep.rate:.0f}/s, {rep.jobs} job(s)), crashes: {len(rep.crashes)}, slowest input "
               f"{rep.slowest_s * 1e3:.1f} ms ({rep.slowest_cpu_s * 1e3:.1f} ms CPU; {rep.slowest[:80]}), "
               f"most CPU {rep.most_cpu_s * 1e3:.1f} ms ({rep.most_cpu[:80]})")
    table(["input: outcome", "count"], sorted(rep.outcomes.items()), right=[1])
    table(["slowest families", "inputs", "total s", "CPU s", "mean ms", "max ms", "slowest input"],
           [[k, f.inputs, f"{f.total_s:.2f}", f"{f.cpu_s:.2f}", f"{f.total_s / max(f.inputs, 1) * 1e3:.2f}",
             f"{f.max_s * 1e3:.1f}", f.slowest[:60]] for k, f in rep.slowest_families(8)],
           right=[1, 2, 3, 4, 5])
    for desc, typ, msg in rep.crashes[:20]:
        click.echo(f"  CRASH {typ}: {msg[:200]}  <- {desc[:120]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"seed": seed, **rep.to_json()}, f, indent=1)
    sys.exit(0 if rep.ok else 1)


def fault_row(r: Any) -> list[Any]:
    """One row of the ``reshard faults`` table."""
    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    if r.skipped:
        return [f"{r.cell.backend}:{r.cell.name}", "skipped", r.skipped[:40], "-", "-", "-", "-", "-", "-", "-"]
    errs = sorted({v.split(":", 1)[0] for v in r.ranks.values()})
    verdict = ("safe" if r.safe else "UNSAFE") + ("" if r.live else ", NOT LIVE")
    return [f"{r.cell.backend}:{r.cell.name}", verdict, "/".join(errs),
            os.path.basename(r.latest) if r.latest else "-", "yes" if r.previous_loads else "NO",
            sec(r.detect_s), "-" if r.next_commits is None else "yes" if r.next_commits else "NO",
            sec(r.exit_s), r.space_back or "-", ",".join(r.left_behind)[:60] or "-"]


@click.command("faults")
@click.option("--quick", is_flag=True, help="One cell per fault class (a few minutes).")
@click.option("--backend", default="local", show_default=True,
              help="local, s3 (a moto server started on 127.0.0.1), or both: local,s3.")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Write every cell's outcome as JSON here.")
@click.option("--only", default=None, help="Run only cells whose name contains this text.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Scratch directory (default: a temporary one, removed after).")
def faults_cmd(quick: bool, backend: str, json_path: str | None, only: str | None,
               workdir: str | None) -> None:
    """Run the fault matrix: every fault x phase x mode on 2 real gloo ranks
    (storage errors, SIGKILL at each phase of a save and during a load, a rank
    that never arrives or is SIGSTOPped, corrupted committed checkpoints, a
    real full disk, gc beside the saves, SIGTERM while unwinding; many hands
    on one root: two jobs, a reader beside retention, gc at 0 bytes free, a
    FIFO or socket at each opened path, a mis-signed checkpoint with a key)
    and judge each cell. --backend s3 runs the S3 rows on a moto server started on
    127.0.0.1 behind a fault-injecting proxy (HTTP 500/503, resets, bodies
    cut short).

    A cell is safe when nothing half-written is listed as committed or loaded,
    every surviving rank raised a CheckpointError, the previous checkpoint
    still loads bit-exact and gc leaves no stray attempt; live when the next
    save commits (a restarted job's, where a rank was lost), every rank saw
    the fault within its bound ("detect s": seconds after the fault), every
    process exited within 5 s of that ("exit s") and the failed attempt's
    space came back ("space back": yes, or after the restart). Cells that
    need a tmpfs are skipped where mount is refused. Exits 0 when every cell
    run is safe and live, 1 otherwise, 2 on a usage error.
    """
    from ..faults.matrix import cells, fault_backends, run_matrix
    from ..faults.ranks import rank_backend

    backends = [b.strip() for b in backend.split(",")]
    known = fault_backends()
    bad = [b for b in backends if b not in known] or (
        [backend] if len(set(backends)) != len(backends) else [])
    if bad:
        fail(2, f"--backend {backend!r}: expected {', '.join(known)} or several of them, comma-separated")
    for b in backends:
        try:
            getattr(rank_backend(b), "check_installed", lambda: None)()
        except RuntimeError as e:
            fail(2, f"--backend {b}: {e}")
    chosen = [c for c in cells(quick=quick, backend=",".join(backends))
              if only is None or only in f"{c.backend}:{c.name}"]
    if not chosen:
        fail(2, f"no cell matches {only!r}")
    tmp = None
    if workdir is None:
        tmp = workdir = tempfile.mkdtemp(prefix="reshard-faults-")
    t0 = time.perf_counter()

    def progress(r: Any) -> None:
        v = "skip  " if r.skipped else ("safe  " if r.safe else "UNSAFE") + (" live" if r.live else " STUCK")
        click.echo(f"  {v} {r.seconds:5.1f}s {r.cell.backend}:{r.cell.name}", err=True)

    try:
        results = run_matrix(chosen, workdir=workdir, progress=progress)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = [fault_row(r) for r in results]
    table(["cell", "verdict", "rank outcomes", "latest", "prev bit-exact", "detect s", "next save commits",
           "exit s", "space back", "left behind (gc'd)"], rows, right=[5, 7])
    unsafe = [r for r in results if not r.safe]
    stuck = [r for r in results if r.safe and not r.live and not r.skipped]
    skipped = [r for r in results if r.skipped]
    for r in unsafe + stuck:
        click.echo(f"{'UNSAFE' if not r.safe else 'NOT LIVE'} {r.cell.backend}:{r.cell.name}:")
        for p in r.problems + r.liveness:
            click.echo(f"    {p[:300]}")
    for r in skipped:
        click.echo(f"skipped {r.cell.backend}:{r.cell.name}: {r.skipped}")
    ran = len(results) - len(skipped)
    click.echo(f"faults: {ran} cells run, {ran - len(unsafe)} safe, {len(unsafe)} unsafe, "
               f"{ran - len(unsafe) - len(stuck)} live, {len(stuck)} not live"
               + (f", {len(skipped)} skipped" if skipped else "")
               + f" ({time.perf_counter() - t0:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"backend": backend, "quick": quick, "cells": ran,
                       "safe": ran - len(unsafe), "unsafe": len(unsafe), "live": ran - len(unsafe) - len(stuck),
                       "not_live": len(stuck), "skipped": len(skipped),
                       "results": [r.to_json() for r in results]}, f, indent=1)
    sys.exit(1 if unsafe or stuck else 0)


