"""The ``reshard demo`` and ``reshard smoke`` commands (end-to-end runs on
gloo ranks; registered on the group in :mod:`reshard.cli`)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import click

from .support import CHECK_FAILED, USAGE, fail, finite, human_bytes, json_option, write_json


@click.command("demo")
@click.option("--out", "out", type=click.Path(file_okay=False), default="out/demo", show_default=True,
              help="Directory for checkpoints, the Hugging Face export, report.txt and loss.png.")
@click.option("--layout-a", default="dp2,tp2", show_default=True, help="Layout of the first run.")
@click.option("--layout-b", default="tp1,pp2,dp2", show_default=True, help="Layout after the restart.")
@click.option("--preset", type=click.Choice(["bert", "llama"]), default="bert", show_default=True)
@click.option("--size", type=click.Choice(["full", "tiny", "small"]), default="full", show_default=True,
              help="full bert = the real all-MiniLM-L6-v2 weights.")
@click.option("--data", type=click.Choice(["stdlib", "random"]), default="stdlib", show_default=True)
@click.option("--steps", type=click.IntRange(3, None), default=16, show_default=True)
@click.option("--every", type=click.IntRange(1, None), default=4, show_default=True,
              help="Checkpoint every K steps.")
@click.option("--kill-at", type=click.IntRange(2, None), default=12, show_default=True,
              help="Step whose save loses a rank to SIGKILL.")
@click.option("--seq-len", type=click.IntRange(4, 512), default=32, show_default=True)
@click.option("--global-batch", type=click.IntRange(1, None), default=8, show_default=True)
@click.option("--lr", type=float, default=1e-4, show_default=True, callback=finite(0.0, open_low=False),
              help="AdamW learning rate (a finite number >= 0).")
@click.option("--max-files", type=click.IntRange(1, None), default=None,
              help="Standard-library files read for text (default: all).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def demo_cmd(out: str, layout_a: str, layout_b: str, preset: str, size: str, data: str, steps: int,
             every: int, kill_at: int, seq_len: int, global_batch: int, lr: float,
             max_files: int | None, no_progress: bool) -> None:
    """The main job: fine-tune the real MiniLM weights in layout A on gloo
    ranks with checkpoints, SIGKILL a rank mid-save, restart in layout B from
    the newest committed checkpoint, check next-step parity against an
    uninterrupted run, export to Hugging Face safetensors; report + loss.png.
    Exits 0 only when every check passed."""
    from pathlib import Path

    from .support import missing_demo_packages

    missing = missing_demo_packages(preset=preset, size=size, data=data)
    if missing:
        fail(USAGE, "demo needs " + "; and ".join(missing))
    from ..demo.job import DemoConfig, run_demo

    try:
        cfg = DemoConfig(out=Path(out).resolve(), layout_a=layout_a, layout_b=layout_b, preset=preset,
                         size=size, data=data, steps=steps, every=every, kill_at=kill_at,
                         seq_len=seq_len, global_batch=global_batch, lr=lr, max_files=max_files,
                         progress=not no_progress)
        sys.exit(run_demo(cfg))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("smoke")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Directory for the checkpoint (default: a temporary one, removed after).")
@click.option("--save-ranks", type=click.IntRange(1, 8), default=4, show_default=True)
@click.option("--load-ranks", type=click.IntRange(1, 8), default=3, show_default=True)
@click.option("--rows", type=click.IntRange(1, None), default=4096, show_default=True,
              help="Rows of the row-sharded [rows, 64] weight.")
@json_option
def smoke_cmd(out: str | None, save_ranks: int, load_ranks: int, rows: int,
              json_path: str | None) -> None:
    """A quick end-to-end check: save a synthetic state on N gloo ranks, verify it, load it on M ranks
    into another layout and check every element bit-exactly."""
    from ..catalog.verify import verify
    from ..demo import ranks as dc
    from ..testing.pool import WorkerError, WorkerPool

    if rows > dc.MAX_ROWS:
        raise click.BadParameter(f"at most {dc.MAX_ROWS} (float32 must hold every index exactly)",
                                 param_hint="--rows")
    tmp = None
    if out is None:
        tmp = out = tempfile.mkdtemp(prefix="reshard-smoke-")
    path = os.path.join(os.path.abspath(out), "ckpt", "step-00000001")
    pool = WorkerPool(pg_timeout=300.0, grace=10.0, max_groups=1)
    try:
        click.echo(f"reshard smoke: save on {save_ranks} gloo ranks -> load on {load_ranks}, "
                   f"rows={rows}")
        click.echo(f"  save layout : {dc.save_layout(rows, save_ranks)}")
        click.echo(f"  load layout : {dc.load_layout(rows, load_ranks)}")
        saved = pool.run(save_ranks, dc.save_rank, path, rows, timeout=600.0)
        s_secs = max(r["seconds"] for r in saved)
        total, nfiles = saved[0]["total_bytes"], saved[0]["num_files"]
        click.echo(f"  checkpoint  : {path}  {human_bytes(total)} in {nfiles} files"
                   + ("  (temporary)" if tmp else ""))
        click.echo(f"  save        : {s_secs:.3f} s  {total / 1e6 / max(s_secs, 1e-9):.1f} MB/s")
        rep = verify(path)
        click.echo("  verify      : " + (f"OK ({human_bytes(rep.bytes_checked)} checksummed)"
                                        if rep.ok else "FAILED: " + "; ".join(rep.problems)))
        loaded = pool.run(load_ranks, dc.load_rank, path, rows, timeout=600.0)
    except WorkerError as e:
        click.echo("SMOKE FAILED")
        fail(CHECK_FAILED, str(e))
    finally:
        pool.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    l_secs = max(r["seconds"] for r in loaded)
    nread = sum(r["bytes_read"] for r in loaded)
    click.echo(f"  load        : {l_secs:.3f} s  {nread / 1e6 / max(l_secs, 1e-9):.1f} MB/s "
               f"({human_bytes(nread)} read by {load_ranks} ranks)")
    elements = sum(r["elements"] for r in loaded)
    bad = sum(r["mismatched"] for r in loaded)
    diff = max(r["max_abs_diff"] for r in loaded)
    steps = {r["step"] for r in loaded}
    ok = rep.ok and bad == 0 and steps == {1}
    click.echo(f"  check       : {elements} elements on {load_ranks} ranks, {bad} mismatched, "
               f"step value {sorted(steps, key=repr)}")
    click.echo(f"max abs difference = {diff:g}")
    write_json(json_path, {"save_ranks": save_ranks, "load_ranks": load_ranks, "rows": rows,
                           "total_bytes": total, "files": nfiles, "save_s": s_secs, "load_s": l_secs,
                           "bytes_read": nread, "elements": elements, "mismatched": bad,
                           "max_abs_diff": diff, "verified": rep.ok, "ok": ok})
    click.echo("SMOKE OK" if ok else "SMOKE FAILED")
    if not ok:
        sys.exit(CHECK_FAILED)
