"""The ``reshard bench`` commands (registered on the group in :mod:`reshard.cli`):
``scale`` simulates the coordination of a save and a load at scale in this
process (:mod:`reshard.bench.scale_sim`); ``io`` measures checkpoint I/O of a
model state on real gloo ranks (the engine is :mod:`reshard.bench`); and
``reshard advise``, the checkpoint cadence from a failure log and a bench's
save time.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from .support import CHECK_FAILED, USAGE, OutputPath, fail, finite, json_option, write_json


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: `scale` simulates the coordination in this process (no data
    written); `io` measures checkpoint I/O of a model state on real gloo ranks;
    `incremental` measures incremental checkpoints of fine-tuning runs."""


@bench_group.command("incremental")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False), default=None,
              help="Where the checkpoints go (emptied first; default: a temporary directory, removed after).")
@click.option("--lora-saves", type=click.IntRange(2, 1000), default=20, show_default=True,
              help="Managed saves of the LoRA run (one training step each).")
@click.option("--keep-last", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Retention of every system's root.")
@click.option("--peer-every", type=click.IntRange(1, 1000), default=5, show_default=True,
              help="reshard full, DCP and torch_checkpointing save the LoRA state every this many steps.")
@click.option("--ft-saves", type=click.IntRange(2, 100), default=4, show_default=True,
              help="Saves of the full fine-tune with frozen embeddings (every system, every step).")
@click.option("--seq-len", type=click.IntRange(2, 512), default=32, show_default=True,
              help="Tokens of the one training batch a step.")
@json_option
def incremental_cmd(scratch_dir: str | None, lora_saves: int, keep_last: int, peer_every: int, ft_saves: int,
                    seq_len: int, json_path: str | None) -> None:
    """Incremental checkpoints of a LoRA run (rank 16 on all seven projections
    of a 134M-parameter Llama-style model built from a config) and of a full
    fine-tune with frozen embeddings, beside reshard full saves, PyTorch DCP
    and torch_checkpointing, in one run on one gloo rank: per save the bytes
    written, the seconds and the files; then the issue's targets with their
    verdicts, the LoRA root's stored bytes against the base's, verify and a
    bit-exact load of every kept checkpoint in a row split, and `reshard ls`.
    Exits 1 when a target is missed. Needs peft, transformers and
    torch_checkpointing; about 6 GiB of disk and 4 GiB of memory."""
    import tempfile

    from ..bench.incremental import TARGETS, run, table

    for mod in ("peft", "transformers", "torch_checkpointing"):
        import importlib.util

        if importlib.util.find_spec(mod) is None:
            fail(USAGE, f"bench incremental needs {mod} (pip install {mod.replace('_', '-')})")
    own = scratch_dir is None
    where = scratch_dir or tempfile.mkdtemp(prefix="reshard-bench-inc-")
    try:
        rep = run(where, lora_saves=lora_saves, keep_last=keep_last, peer_every=peer_every, ft_saves=ft_saves,
                  seq_len=seq_len, say=lambda m: click.echo(m, err=True))
    finally:
        if own:
            import shutil

            shutil.rmtree(where, ignore_errors=True)
    click.echo(table(rep))
    lc, fc, hc = rep.checks["lora"], rep.checks["full-ft"], rep.checks["hash"]
    verdicts = [
        ("LoRA save after the first: bytes <= 1.1x trainable + optimizer + non-tensor state",
         lc["bytes_ratio"], TARGETS["lora_bytes_ratio"]),
        ("LoRA save after the first: time <= 15% of a full save (the medians of every incremental "
         "save after the first and of every full save, save phases)",
         lc["time_ratio"], TARGETS["lora_time_ratio"]),
        ("full fine-tune, frozen embedding: embedding bytes written after the first save",
         fc["after_first_max"], TARGETS["ft_embedding_bytes"]),
        ("hashing overhead on a save where every byte is new (the xxh3_128 of the first full-ft "
         "state on every CPU, as a share of that incremental save's time)",
         hc.get("hash_share_of_save"), TARGETS["hash_overhead"]),
    ]
    missed = 0
    for what, got, bound in verdicts:
        ok = got is not None and got <= bound
        missed += not ok
        click.echo(f"{'MET ' if ok else 'MISSED'} {what}: {'-' if got is None else f'{got:.4g}'} "
                   f"(target <= {bound})")
    stored_ok = lc["base_stored_once"] and all(v["verify"] and v["bit_exact_in_row_split"]
                                               for v in lc["loads"].values())
    missed += not stored_ok
    click.echo(f"{'MET ' if stored_ok else 'MISSED'} {lora_saves} saves, keep_last={keep_last}: the root stores "
               f"{lc['stored_bytes'] / 2**20:.1f} MiB for a base of {lc['base_bytes'] / 2**20:.1f} MiB "
               f"({lc['logical_bytes'] / 2**20:.1f} MiB named by {len(lc['kept'])} checkpoints); every kept "
               "checkpoint verifies and loads bit-exact in a row split")
    if hc.get("overhead") is not None:
        click.echo(f"first full-ft save (every byte new): incremental {hc['first_save_incremental_s']:.2f} s, "
                   f"full {hc['first_save_full_s']:.2f} s (incremental {100 * hc['overhead']:+.0f}%: its "
                   "chunks' files are written in parallel); the state's xxh3_128: "
                   f"{hc['one_thread_s']:.2f} s on one thread, {hc['all_cpus_s']:.2f} s on {hc['cpus']}")
    click.echo(f"load averages: {rep.load_avg}")
    click.echo(lc["ls"])
    write_json(json_path, rep.to_json())
    if missed:
        sys.exit(CHECK_FAILED)


@bench_group.command("scale")
@click.option("--tp", type=click.IntRange(min=1), default=8, show_default=True, help="tensor-parallel size")
@click.option("--pp", type=click.IntRange(min=1), default=16, show_default=True, help="pipeline-parallel size")
@click.option("--dp", type=click.IntRange(min=1), default=128, show_default=True, help="data-parallel size")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True, help="expert-parallel size (MoE; divides DP)")
@click.option("--model", default="llama-405b", show_default=True,
              help="llama-8b, llama-70b, llama-405b, moe-8x7b or moe-8x22b")
@click.option("--optimizer", type=click.Choice(["adam", "none"]), default="adam", show_default=True)
@click.option("--zero", type=click.Choice(["1"]), default="1", show_default=True,
              help="ZeRO stage of the optimizer state (1: sharded over DP)")
@click.option("--zero-split", type=click.Choice(["flat", "per-param"]), default="flat", show_default=True,
              help="flat: Megatron's flat buffer split into DP ranges; per-param: every parameter split")
@click.option("--reshard-to", "target", default=None,
              help="load layout, e.g. tp4,pp8,dp512 (default: TP/2, PP/2, DP*4)")
@click.option("--smallest", type=click.IntRange(min=1), default=8, show_default=True, help="smallest world size of the sweep")
@click.option("--only-largest", is_flag=True, help="simulate only the given layout")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="write the rows (a JSON list, one per world size)")
@click.option("--plot", "plot_path", type=OutputPath(), default=None,
              help="write a log-log PNG of time and bytes against world size")
def bench_scale_cmd(tp: int, pp: int, dp: int, ep: int, model: str, optimizer: str, zero: str,
                    zero_split: str, target: str | None, smallest: int, only_largest: bool,
                    json_path: str | None, plot_path: str | None) -> None:
    """Simulate save planning, cached re-save, manifest and load planning at scale.

    The real coordinator and rank code runs over N simulated ranks in this
    process (see reshard.bench.scale_sim), for world sizes from --smallest
    up to TP*PP*DP (the layout scaled down along DP, then PP). Seconds are
    CPU seconds of each rank's own steps; bytes are what each rank receives.
    """
    from ..bench.scale_layout import MODELS, Layout, parse_layout
    from ..bench.scale_sim import (
        HEADER,
        format_row,
        plot,
        scaling_exponent,
        simulate,
        simulate_one,
    )

    if model not in MODELS:
        fail(USAGE, f"unknown model {model!r} (one of {sorted(MODELS)})")
    if plot_path:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            fail(USAGE, "--plot needs matplotlib (pip install 'reshard[demo]')")
    if ep > 1 and (dp % ep or not MODELS[model]["experts"]):
        fail(USAGE, "--ep needs a moe-* model and must divide --dp")
    lay = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
    try:
        tgt = parse_layout(target) if target else None
    except ValueError as e:
        fail(USAGE, str(e))
    from ..bench.scale_sim import default_target

    layers = MODELS[model]["layers"]
    for what, x in (("--pp", lay), ("--reshard-to", tgt)):
        if x is not None and x.pp > layers:  # stages without a layer: a layout nobody can run
            fail(USAGE, f"{what}: pp{x.pp} splits {model}'s {layers} layers into more stages than layers")
    opt = "adam" if optimizer == "adam" else "none"
    click.echo(f"{model}, {opt}, ZeRO-{zero} ({zero_split} split): {lay} = {lay.world} ranks; "
               f"loaded into {tgt or default_target(lay)}")
    click.echo(HEADER)
    if only_largest:
        rows = [simulate_one(model, lay, tgt or default_target(lay), optimizer=opt, zero_split=zero_split)]
        click.echo(format_row(rows[0]))
    else:
        rows = simulate(model, lay, tgt, optimizer=opt, zero_split=zero_split, smallest=smallest,
                        log=click.echo)
    k = scaling_exponent(rows, "coordinator_s")
    if k is not None:
        click.echo(f"coordinator time scaling exponent 1,024 -> 16,384 ranks: {k:.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        click.echo(f"rows written to {json_path}")
    if plot_path:
        plot(rows, plot_path)
        click.echo(f"plot written to {plot_path}")



def _methods() -> set[str]:
    """Every name ``--skip`` may give: the methods (the peers, the limits and
    reshard's own) and the phases :mod:`reshard.bench.io` checks for."""
    from ..bench import ranks, ranks_overlap

    return {*ranks.SAVE_METHODS, *ranks.ASYNC_METHODS, *ranks.LOAD_METHODS, *ranks_overlap.OVERLAP_METHODS,
            "save", "load", "async", "async-save", "rss", "rss-growth", "train", "overlap"}


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated integers (e.g. 1,2,4)",
                                 param_hint="--world") from None
    if not out or min(out) < 1 or max(out) > 8:
        raise click.BadParameter(f"{text!r}: world sizes from 1 to 8", param_hint="--world")
    return list(dict.fromkeys(out))  # a size given twice ran twice, its records merged into one summary


@bench_group.command("io")
@click.option("--model", type=click.Choice(["synthetic", "gpt2-small", "llama-tiny", "bert-minilm"]),
              default="synthetic", show_default=True,
              help="Workload (real nn.Module state with AdamW moments).")
@click.option("--world", "world", default=None,
              help="World sizes, e.g. 1,2,4 (default 1,2; a TP/PP layout: its own world size).")
@click.option("--layout", default="fsdp", show_default=True,
              help="'fsdp' (FSDP2 fully_shard over the world), 'dpN' (replicated) or the demo's syntax "
                   "with TP/PP ('dp2,tp2', 'tp1,pp2,dp2': the demo trainer's state; llama-tiny, bert-minilm).")
@click.option("--reshard-to", "reshard_to", multiple=True,
              help="Also load each world's checkpoint into this layout (e.g. fsdp1, fsdp4, dp2, "
                   "tp1,pp2,dp2), the state checked bit for bit; repeatable.")
@click.option("--backend", default="local", show_default=True,
              help="Comma-separated: local, memory (world 1 only), s3 (moto on 127.0.0.1 or --s3-endpoint).")
@click.option("--s3-endpoint", default=None, metavar="URL",
              help="S3 endpoint for --backend s3 (credentials from the AWS variables); default: start "
                   "moto's server on 127.0.0.1 (needs moto[server]).")
@click.option("--repeat", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Timed runs per method (min and median reported).")
@click.option("--synthetic-mib", type=float, default=256.0, show_default=True,
              callback=finite(0.0, open_low=True),
              help="MiB of parameters of the synthetic model (state: 3x with the moments).")
@click.option("--seq-len", type=click.IntRange(2, 1024), default=16, show_default=True,
              help="Tokens per sample of the training step.")
@click.option("--steps", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Training steps with no save in flight before each background save.")
@click.option("--settle", type=float, default=0.5, show_default=True,
              callback=finite(0.0, open_low=False),
              help="Seconds of rest after os.sync() before each timed save.")
@click.option("--skip", default="", help="Comma-separated methods (e.g. dcp-async-process, reshard-nocheck) "
              "or phases (rss, train, overlap, async, save, load; no save: no load either) to leave out.")
@click.option("--dir", "scratch_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Scratch directory on the disk to measure (default: a temporary one).")
@click.option("--json", "json_path", type=OutputPath(), default=None,
              help="Write every record (one per phase measurement) and the summary here.")
@click.option("--plot", "plot_path", type=OutputPath(), default=None,
              help="Write a PNG: per-rank timelines of save and load, and the scaling over world sizes.")
@click.option("--timeout", type=float, default=1800.0, show_default=True,
              callback=finite(0.0, open_low=True),
              help="Seconds one phase may take on the ranks.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None,
              help="Profile every timed reshard save and load with pyinstrument (a dev dependency) "
                   "on every rank; text reports written to this directory.")
@click.option("--demo-report", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A `reshard demo` report.txt: its save and restore times beside this run's for the "
                   "same state (run with the demo's --layout and --reshard-to).")
@click.option("--cold", is_flag=True,
              help="Also time, in freshly started processes with no warm-up call, the first save, then a "
                   "CheckpointManager.save, and a CheckpointManager.restore of it into each --reshard-to "
                   "layout, as the demo does.")
@click.option("--rss-saves", type=click.IntRange(0, 10000), default=100, show_default=True,
              help="Consecutive async saves of a small state (4 MiB of parameters, the run's layout) whose "
                   "resident memory is reported after each: its growth (0: not measured).")
@click.option("--overlap-k", type=click.IntRange(1, 1000), default=None,
              help="Checkpoint cadence of the overlap phase's training loop, in steps (default: the "
                   "smallest K whose K steps outlast an overlapped save's background write, measured).")
@click.option("--overlap-cycles", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Checkpoints per method in the overlap phase's loop (K steps each).")
@click.option("--no-progress", is_flag=True,
              help="No progress bar (shown when stderr is a terminal or RESHARD_PROGRESS=1).")
def io_cmd(model: str, world: str | None, layout: str, reshard_to: tuple[str, ...], backend: str,
           s3_endpoint: str | None, repeat: int, synthetic_mib: float, seq_len: int, steps: int,
           settle: float, skip: str, scratch_dir: str | None, json_path: str | None,
           plot_path: str | None, timeout: float, profile_dir: str | None, demo_report: str | None,
           cold: bool, rss_saves: int, overlap_k: int | None, overlap_cycles: int, no_progress: bool) -> None:
    """Measure save, async save, load and reshard of a model state, with DCP,
    torch.save, safetensors and the machine's limits in the same run.

    Every load is checked bit for bit against the saved state: exit 1 when
    one differs (or a phase failed on the ranks), after the report."""
    from ..bench import report
    from ..bench.io import BenchError, check_layouts, run
    from ..progress import interactive, wanted

    try:
        worlds = check_layouts(model, layout, list(reshard_to), _ints(world))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    import psutil

    from ..bench.io import memory_needed
    from ..bench.models import parse_layout

    need, avail = memory_needed(model, layout, worlds, list(reshard_to), synthetic_mib), \
        psutil.virtual_memory().available
    if need > avail:
        raise click.UsageError(f"--model {model}" + (f" --synthetic-mib {synthetic_mib:g}" if model == "synthetic"
                                                     else "") +
                               f": the run needs about {need / 1e9:.1f} GB of memory (the state and its copies "
                               f"on every rank), {avail / 1e9:.1f} GB is available; use a smaller state or "
                               "fewer ranks")
    fixed = parse_layout(layout)
    if fixed.kind != "grid" and fixed.world is not None and any(w != fixed.world for w in worlds):
        raise click.BadParameter(f"layout {layout!r} names {fixed.world} ranks, but the runs are at "
                                 f"world {', '.join(map(str, worlds))}: give the layout without a "
                                 "degree (its world is then each run's)", param_hint="--layout")
    unknown = sorted({m.strip() for m in skip.split(",") if m.strip()} - _methods())
    if unknown:
        raise click.BadParameter(f"unknown method(s) {', '.join(unknown)}; one of "
                                 f"{', '.join(sorted(_methods()))}", param_hint="--skip")
    skipped = {m.strip() for m in skip.split(",") if m.strip()} & {"save", "load"}
    if skipped and (reshard_to or demo_report):
        what = "--reshard-to" if reshard_to else "--demo-report"
        raise click.BadParameter(f"{', '.join(sorted(skipped))} skipped: {what} loads the reshard save's "
                                 "checkpoint, which is then not written or not loaded", param_hint="--skip")
    backends = list(dict.fromkeys(b.strip() for b in backend.split(",") if b.strip()))
    seen: dict[str, str] = {}  # one load per target layout (a target given twice was measured twice)
    for t in reshard_to:
        seen.setdefault(str(parse_layout(t)), t)
    reshard_to = tuple(seen.values())
    from ..storage import get_scheme, schemes

    known = [s.backend for s in schemes() if s.test_store is not None]
    for b in backends:
        if b not in known:
            raise click.BadParameter(f"backend {b!r}: one of {', '.join(known)}", param_hint="--backend")
    if all(not get_scheme(b).shared for b in backends) and max(worlds) > 1:
        shared = ", ".join(s.backend for s in schemes() if s.shared and s.test_store is not None)
        raise click.UsageError(f"--backend {backend} at world {max(worlds)}: {get_scheme(backends[0]).name}:// "
                               "lives in one process and the ranks are separate processes, so no rank would "
                               f"see another's objects; use --world 1, or --backend {shared}")
    if "s3" in backends and s3_endpoint is None:
        import importlib.util

        if importlib.util.find_spec("moto") is None:
            fail(USAGE, "--backend s3 starts moto's S3 server on 127.0.0.1: pip install 'moto[server]' "
                        "(or give --s3-endpoint URL)")
    demo = None
    if demo_report:
        try:
            with open(demo_report, encoding="utf-8") as f:
                demo = report.parse_demo_report(f.read())
        except ValueError as e:
            raise click.BadParameter(f"{demo_report}: {e}", param_hint="--demo-report") from None
    if plot_path:  # checked now, not after a run of minutes
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise click.UsageError("--plot needs matplotlib (pip install 'reshard[demo]')")
    if profile_dir:
        try:
            import pyinstrument  # noqa: F401
        except ImportError:
            raise click.UsageError("--profile needs pyinstrument (pip install -r requirements-dev.txt)") from None
        os.makedirs(profile_dir, exist_ok=True)
    cfg: dict[str, Any] = {
        "model": model, "worlds": worlds, "layout": layout, "reshard_to": list(reshard_to),
        "backends": backends, "s3_endpoint": s3_endpoint, "repeat": repeat,
        "synthetic_mib": synthetic_mib, "seq_len": seq_len, "steps": steps, "settle": settle,
        "skip": {s.strip() for s in skip.split(",") if s.strip()}, "timeout": timeout, "layout_of": {},
        "argv": sys.argv[1:], "cpus": os.cpu_count(),
        "profile": os.path.abspath(profile_dir) if profile_dir else None, "cold": cold,
        "rss_growth": rss_saves, "overlap_k": overlap_k, "overlap_cycles": overlap_cycles,
    }
    try:
        doc = run(cfg, progress=not no_progress and (interactive() or wanted(None)), json_path=json_path,
                  scratch_dir=scratch_dir)
    except BenchError as e:
        if os.environ.get("RESHARD_TRACEBACK"):
            raise
        fail(USAGE if e.phase == "s3 endpoint" else CHECK_FAILED,
             f"bench io: {e}" + (f"; the worlds measured before it are in {e.partial_json}"
                                 if e.partial_json else ""))
    if demo is not None:
        doc["demo"] = report.demo_compare(doc, demo)
    click.echo(report.table(doc))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        click.echo(f"records written to {json_path}")
    if plot_path:
        report.plot(doc, plot_path)
        click.echo(f"plot written to {plot_path}")
    bad = report.state_mismatches(doc)
    if bad:  # a load that did not give back the saved state is a failed check, never a figure
        fail(CHECK_FAILED, f"bench io: the loaded state differs from the saved one after: {', '.join(bad)}")


@click.command("advise")
@click.option("--failures", "failures_log", type=click.Path(dir_okay=False, exists=True), required=True,
              help="Failure log: one failure time per line (seconds since the epoch or ISO 8601).")
@click.option("--bench", "bench_json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="JSON from benchmarks/bench_core.py or `reshard bench io` (its reshard save time is the cost C).")
@click.option("--cost-s", type=float, default=None, callback=finite(0.0, open_low=False),
              help="Foreground cost of one checkpoint, seconds.")
@click.option("--step-time-s", type=float, required=True, callback=finite(0.0, open_low=True),
              help="Seconds per training step.")
@click.option("--every-steps", type=click.IntRange(min=1), required=True,
              help="Current cadence: checkpoint every N steps.")
@click.option("--tokens-per-step", type=click.IntRange(min=0), default=0, help="Tokens per step (for tokens lost).")
@click.option("--restart-s", type=float, default=0.0, callback=finite(0.0, open_low=False),
              help="Fixed restart cost per failure, seconds.")
@json_option
def advise_cmd(failures_log: str, bench_json: str | None, cost_s: float | None, step_time_s: float,
               every_steps: int, tokens_per_step: int, restart_s: float, json_path: str | None) -> None:
    """Checkpoint cadence from a failure log and a save benchmark: the MTBF,
    the Young/Daly interval sqrt(2*C*MTBF), and the work lost per failure at
    the current cadence and at the optimum."""
    from ..manager.manager import young_daly_interval

    times = []
    with open(failures_log, encoding="utf-8", errors="replace") as f:
        for no, line in enumerate(f, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    times.append(_parse_time(line))
                except ValueError:
                    raise click.BadParameter(f"{failures_log}:{no}: {line.strip()[:80]!r} is neither seconds "
                                             "since the epoch nor an ISO 8601 time",
                                             param_hint="--failures") from None
    times.sort()
    if len(times) < 2:
        fail(2, f"{failures_log}: need at least two failure times")
    mtbf = (times[-1] - times[0]) / (len(times) - 1)
    if not mtbf > 0:
        fail(2, f"{failures_log}: the {len(times)} failure times are all the same instant (no MTBF)")
    source = "--cost-s"
    if cost_s is None:
        if bench_json is None:
            fail(2, "give --cost-s or --bench")
        cost_s, source = _bench_cost(bench_json)
    t_opt = young_daly_interval(cost_s, mtbf)
    cur = every_steps * step_time_s
    click.echo(f"failures       : {len(times)} over {(times[-1] - times[0]) / 3600:.1f} h")
    click.echo(f"MTBF           : {mtbf:.0f} s ({mtbf / 3600:.2f} h)")
    click.echo(f"checkpoint cost: {cost_s:.3f} s (foreground; {source})")
    click.echo(f"optimal interval (Young/Daly sqrt(2*C*MTBF)): {t_opt:.0f} s = "
               f"{max(1, round(t_opt / step_time_s))} steps")
    figures: dict[str, Any] = {"failures": len(times), "mtbf_s": mtbf, "cost_s": cost_s,
                               "optimal_interval_s": t_opt,
                               "optimal_every_steps": max(1, round(t_opt / step_time_s))}
    for label, interval in (("current", cur), ("optimal", t_opt)):
        lost_s = interval / 2 + restart_s  # expected: half an interval of work, plus the restart
        steps = lost_s / step_time_s
        overhead = cost_s / interval if interval > 0 else float("inf")
        figures[label] = {"interval_s": interval, "loss_per_failure_s": lost_s,
                          "loss_per_failure_steps": steps, "overhead": overhead}
        line = (f"{label:<8}: every {interval:.0f} s -> expected loss per failure {lost_s:.0f} s = "
                f"{steps:.1f} steps")
        if tokens_per_step:
            line += f" = {steps * tokens_per_step:,.0f} tokens"
        click.echo(line + f"; checkpoint overhead {100 * overhead:.2f}% of run time")
    write_json(json_path, figures)


def _parse_time(text: str) -> float:
    from datetime import datetime

    t = text.strip().split()[0]
    try:
        return float(t)
    except ValueError:
        return datetime.fromisoformat(t).timestamp()


def _bench_cost(path: str) -> tuple[float, str]:
    """The median reshard save time of a ``benchmarks/bench_core.py --json``
    file, or of a ``reshard bench io --json`` file (its largest world size,
    on a real store: local or s3 before ``memory://``, which lives in the
    process), and where it was taken from."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        where = f"reshard.save median of {path}"
        if "save" not in doc and "summary" in doc:
            summ = doc["summary"]
            runs = sorted((k for k, s in summ.items() if "reshard" in s["save"]),
                          key=lambda k: (not k.startswith("memory/"), len(summ[k]["local_bytes_per_rank"]),
                                         k.startswith("local/")))
            where = f"reshard.save median of {runs[-1]} in {path}"
            doc = summ[runs[-1]]
        cost = float(doc["save"]["reshard"]["median_s"])
    except (KeyError, TypeError, ValueError, IndexError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"{path}: no save.reshard.median_s ({e})", param_hint="--bench") from None
    if not (cost >= 0 and cost != float("inf")):
        raise click.BadParameter(f"{path}: save.reshard.median_s is {cost}", param_hint="--bench")
    return cost, where
