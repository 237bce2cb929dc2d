"""The ``reshard`` command: list, inspect, verify, compare, convert and export
checkpoints; run a demo.

Exit codes (:mod:`reshard.cli_support`): 0 success; 1 a check failed
(``verify`` found a problem, ``diff`` a difference, ``smoke``/``demo`` a
check); 2 a usage or environment error (bad option, missing optional package
or weights, missing path, unreadable checkpoint, refused overwrite). Errors
are one line on stderr, without a traceback. Commands that report figures
take ``--json PATH``. Progress bars (stderr) appear only on a terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from .cli_support import (
    CHECK_FAILED,
    USAGE,
    Main,
    OutputPath,
    fail,
    finite,
    human_bytes,
    json_option,
    one_line,
    write_json,
)
from .commit import INCOMPLETE, RETIRED, committed, read_manifest, scan
from .errors import CheckpointError, CheckpointNotFoundError
from .manifest import Manifest, encode_manifest
from .storage import resolve


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _shape(s: Sequence[int]) -> str:
    return "[" + ",".join(map(str, s)) + "]"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = (),
           indent: str = "  ") -> None:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        click.echo((indent + "  ".join(parts)).rstrip())


def _fail(code: int, msg: str) -> NoReturn:
    fail(code, msg)


def _manifest(path: str) -> Manifest:
    """The validated manifest at ``path``; exits 2 if none or unreadable."""
    from .verify import inspect

    try:
        return inspect(path)  # a DCP checkpoint too
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except ValueError as e:  # unsupported URL scheme
        _fail(USAGE, str(e))
    except CheckpointError as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    raise AssertionError("unreachable")


def _progress() -> bool:
    from .progress import interactive

    return interactive()


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reshard")
def main() -> None:
    """Distributed training checkpoints that reshard."""


_RETENTION_OPTS = [
    click.option("--keep-last", type=click.IntRange(0, None), default=None,
                 help="Retention: keep the newest K (default: keep all)."),
    click.option("--keep-every", type=click.IntRange(1, None), default=None,
                 help="Retention: also keep steps that are multiples of M."),
    click.option("--keep-best", type=click.IntRange(0, None), default=0,
                 help="Retention: also keep the best N by the metric recorded at save."),
    click.option("--metric-mode", type=click.Choice(["min", "max"]), default="min"),
]


def _retention_opts(f: Any) -> Any:
    for opt in reversed(_RETENTION_OPTS):
        f = opt(f)
    return f


def _manager_for(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
                 metric_mode: str, grace: float = 3600.0) -> Any:
    from .manager import CheckpointManager

    return CheckpointManager(root, keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                             metric_mode=metric_mode, gc_grace_s=grace, preempt_signals=())


@main.command("ls")
@click.argument("root")
@_retention_opts
def ls_cmd(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
           metric_mode: str) -> None:
    """List committed checkpoints under ROOT by step (never by name) with
    their status (verified: a verification record that still matches;
    torn: a file missing or not of its declared size), lineage (parent,
    branch, HEAD: the checkpoint the current lineage resumed from) and what
    retention would do with the given policy; then quarantined, abandoned
    and invalid ones."""
    from .commit import read_head, torn_files
    from .lineage import Head, lineage_of
    from .records import record_failed

    try:
        st, key = resolve(root)
        if not st.exists(key):
            _fail(2, f"{key}: no such directory")
        done = committed(st, key)
        others = [e for e in scan(st, key) if e.manifest is None or e.quarantined]
        head = Head.from_record(read_head(st, key))
        torn = {e.name: torn_files(st, e.path, e.manifest) for e in done if e.manifest is not None}
    except ValueError as err:
        _fail(2, str(err))
    except CheckpointError as err:
        _fail(1, f"{type(err).__name__}: {err}")
    if not done:
        try:  # ROOT may itself be a checkpoint
            m = read_manifest(st, key)
        except CheckpointError:
            pass
        else:
            click.echo(f"{key} is itself a committed checkpoint:")
            _table(["step", "size", "files", "committed"],
                   [["-" if m.step is None else m.step, human_bytes(m.total_bytes), len(m.files),
                     _when(m.created_at)]], right=(0, 1, 2))
            return
    if done:
        from .retention import decide

        mgr = _manager_for(root, keep_last, keep_every, keep_best, metric_mode)
        cands = {c.name: c for c in mgr.candidates(done)}
        decision = decide(list(cands.values()), mgr.policy)
        lin = lineage_of(done, head)
        click.echo(f"committed ({len(done)}) under {key}:")
        rows = []
        failed: list[tuple[str, str]] = []
        for e in done:
            em = e.manifest
            assert em is not None
            c = cands[e.name]
            fate = f"keep: {decision.keep[e.name]}" if e.name in decision.keep else "delete"
            bad = None if torn[e.name] or c.verified else record_failed(st, key, e.name, e)
            if bad is not None:
                failed.append((e.name, bad))
            status = ("torn" if torn[e.name] else "verified" if c.verified
                      else "failed" if bad is not None else "unverified")
            branch = lin.branch(e.name) + (" HEAD" if e.name == lin.source else "")
            rows.append(["-" if e.step is None else e.step, human_bytes(em.total_bytes), len(em.files),
                         _when(em.created_at), status, em.parent or "-", branch,
                         "-" if c.metric is None else f"{c.metric:.4g}", fate, e.name])
        _table(["step", "size", "files", "committed", "status", "parent", "branch", "metric",
                "retention", "name"], rows, right=(0, 1, 2))
        for name, why in failed:
            click.echo(f"failed: {name} failed its last verification: {one_line(why)[:300]}")
        if head is not None and lin.source is None:
            click.echo(f"HEAD names {head.name or 'a fresh start'}, which is not committed here")
        for e in done:
            for problem in list(torn[e.name].values())[:3]:
                click.echo(f"  torn {e.name}: {problem}")
    else:
        click.echo(f"no committed checkpoint under {key}")
    quarantined = [e for e in others if e.quarantined]
    abandoned = [e for e in others if e.abandoned and not e.quarantined]
    invalid = [e for e in others if not e.abandoned and not e.quarantined]
    if quarantined:
        click.echo(f"quarantined ({len(quarantined)}; found unloadable by a restore, never loaded "
                   "or deleted automatically):")
        _table(["step", "name", "since", "why"],
               [["-" if e.step is None else e.step, e.name, _when(e.mtime),
                 (e.problem or "").splitlines()[0][:160]] for e in quarantined], right=(0,))
    if abandoned:
        click.echo(f"abandoned ({len(abandoned)}, never committed; ignored by load):")
        _table(["name", "modified", "why"],
               [[e.name, _when(e.mtime), e.problem or ("retired by an overwrite" if RETIRED in e.name
                                                       else "incomplete attempt")]
                for e in abandoned])
    if invalid:
        click.echo(f"invalid ({len(invalid)}; ignored by load):")
        for e in invalid:
            click.echo(f"  {e.name}: {e.problem}")
    _ls_dcp(st, key)


def _ls_dcp(st: Any, key: str) -> None:
    from .formats.dcp import dcp_checkpoints

    found = dcp_checkpoints(st, key)
    if found:
        click.echo(f"DCP checkpoints ({len(found)}; reshard.load reads them, `reshard convert "
                   "--from dcp` converts them; never deleted by gc):")
        _table(["name", "modified"], [[n, _when(t)] for n, t in found])


@main.command("gc")
@click.argument("root")
@_retention_opts
@click.option("--grace", type=float, default=3600.0, show_default=True,
              help="Abandoned attempts older than this many seconds are deleted.")
@click.option("--dry-run", is_flag=True,
              help="Say what would be deleted (after the same checks); change nothing.")
@click.option("--no-checksums", is_flag=True,
              help="Re-verify the checkpoint kept in place of deleted ones by structure and sizes "
                   "only (default: every checksum).")
def gc_cmd(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
           metric_mode: str, grace: float, dry_run: bool, no_checksums: bool) -> None:
    """Apply retention under ROOT, following the lineage: first run the
    restore smoke test on checkpoints newer than the newest verified one
    (nothing is deleted before a newer checkpoint passed it); before the last
    older verified checkpoint goes, verify the one kept in its place again
    (every checksum unless --no-checksums; if it fails, nothing it would
    replace is deleted); then delete what the policy does not keep and
    abandoned attempts older than --grace. Leases, HEAD's checkpoint and
    quarantined checkpoints are never deleted. --dry-run runs the same checks
    and predicts exactly what would be deleted."""
    try:
        st, key = resolve(root)
        if not st.exists(key):
            _fail(2, f"{key}: no such directory")
        mgr = _manager_for(root, keep_last, keep_every, keep_best, metric_mode, grace)
        decision = mgr.apply_retention(dry_run=dry_run, checksums=not no_checksums, smoke_newer=True)
        gone = mgr.gc_abandoned(dry_run=dry_run)
        entries = scan(st, key)
        quarantined = [e.name for e in entries if e.quarantined]
        young = [e.name for e in entries if e.abandoned and not e.quarantined
                 and e.name not in gone and (INCOMPLETE in e.name or RETIRED in e.name)]
    except ValueError as err:
        _fail(2, str(err))
    except CheckpointError as err:
        _fail(1, f"{type(err).__name__}: {err}")
    assert mgr.last_plan is not None
    for name, what, ok in mgr.last_plan.checks:
        click.echo(f"{what} {name}: {'passed' if ok else 'FAILED'}")
    verb = "would delete" if dry_run else "deleted"
    for name in decision.delete:
        click.echo(f"{verb} {name}")
    for name in gone:
        click.echo(f"{verb} abandoned attempt {name}")
    for name, why in sorted(decision.keep.items()):
        click.echo(f"kept {name} ({why})")
    for name in quarantined:
        click.echo(f"kept {name} (quarantined: never deleted automatically)")
    for name in young:
        click.echo(f"kept abandoned attempt {name} (younger than --grace {grace:g} s: it may be "
                   "a save still running; pass --grace 0 once no job writes here)")
    if not decision.delete and not gone:
        click.echo("nothing to delete")


@main.command("advise")
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
    from .manager import young_daly_interval

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
        _fail(2, f"{failures_log}: need at least two failure times")
    mtbf = (times[-1] - times[0]) / (len(times) - 1)
    if not mtbf > 0:
        _fail(2, f"{failures_log}: the {len(times)} failure times are all the same instant (no MTBF)")
    source = "--cost-s"
    if cost_s is None:
        if bench_json is None:
            _fail(2, "give --cost-s or --bench")
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


@main.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect_cmd(ckpt: str, as_json: bool) -> None:
    """Describe the checkpoint CKPT: metadata, tensors, objects, values, aliases."""
    m = _manifest(ckpt)
    if as_json:
        click.echo(json.dumps(json.loads(encode_manifest(m)), indent=2))
        return
    na = "-"
    click.echo(f"{resolve(ckpt)[1]}")
    if m.extra.get("source") == "dcp":
        click.echo("  DCP checkpoint (torch.distributed.checkpoint, read through restricted "
                   "unpicklers; no checksums; values listed by their DCP keys)")
    click.echo(f"  format {m.format} v{m.format_version}  step {na if m.step is None else m.step}  "
               f"schema_version {m.schema_version or na}  world_size {m.world_size}  "
               f"mesh {json.dumps(m.mesh) if m.mesh else na}")
    click.echo(f"  committed {_when(m.created_at)}  attempt {m.attempt_id}  "
               f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}, {human_bytes(m.total_bytes)}  "
               f"checksums {m.checksum_algorithm}/{human_bytes(m.checksum_block_bytes)} blocks"
               + ("  signed" if "hmac_sha256" in m.extra else ""))
    if m.required_features:
        click.echo(f"  required features: {', '.join(m.required_features)}")
    click.echo(f"tensors ({len(m.tensors)}):")
    if m.tensors:
        _table(["fqn", "dtype", "global shape", "chunks", "bytes"],
               [[fqn, te.dtype, _shape(te.global_shape), len(te.chunks),
                 human_bytes(sum(c.length for c in te.chunks))] for fqn, te in m.tensors.items()],
               right=(3, 4))
    if m.objects:
        click.echo(f"objects ({len(m.objects)}):")
        _table(["key", "grid", "elements"],
               [[k, _shape(oe.global_shape), len(oe.chunks)] for k, oe in m.objects.items()],
               right=(2,))
    values = sorted((m.values or {}).keys()) if isinstance(m.values, dict) else []
    if values:
        click.echo(f"values ({len(values)}): {', '.join(values)}")
    if m.aliases:
        click.echo(f"aliases ({len(m.aliases)}):")
        for a, t in m.aliases.items():
            click.echo(f"  {a} -> {t}")


@main.command("verify")
@click.argument("ckpt")
@click.option("--no-checksums", is_flag=True, help="Check structure and sizes only.")
@json_option
def verify_cmd(ckpt: str, no_checksums: bool, json_path: str | None) -> None:
    """Check CKPT's manifest, coverage, files and (by default) every checksum.

    Exits 1 if any problem is found, 2 if there is no checkpoint at CKPT.
    """
    from .verify import verify

    t0 = time.perf_counter()
    try:
        rep = verify(ckpt, checksums=not no_checksums, progress=_progress())
    except (CheckpointNotFoundError, ValueError) as e:
        _fail(USAGE, str(e))
    except CheckpointError as e:
        _fail(CHECK_FAILED, f"{type(e).__name__}: {e}")
    secs = time.perf_counter() - t0
    write_json(json_path, {"path": rep.path, "ok": rep.ok, "problems": list(rep.problems),
                           "notes": list(rep.notes),
                           "bytes_checked": rep.bytes_checked, "checksums": not no_checksums,
                           "seconds": round(secs, 6)})
    if rep.ok:
        what = ("structure and sizes only" if no_checksums
                else f"{human_bytes(rep.bytes_checked)} checksummed")
        click.echo(f"OK {rep.path} ({what}, {secs:.2f} s)")
        for note in rep.notes:
            click.echo(f"  note: {note}")
        return
    click.echo(f"FAILED {rep.path}: {len(rep.problems)} problem(s)")
    for p in rep.problems:
        click.echo(f"  {p}")
    for note in rep.notes:
        click.echo(f"  note: {note}")
    sys.exit(CHECK_FAILED)


@main.command("export")
@click.argument("ckpt")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="Output format: hf = Hugging Face safetensors directory.")
@click.option("--dtype", default=None, help="Cast floating-point tensors (bf16, fp16, fp32).")
@click.option("--max-shard-size", default="2GiB", show_default=True,
              help="Tensor bytes per shard file at most (2GB = 2e9 as in Hugging Face, 2GiB = 2**31).")
@click.option("--copy", "copies", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A file to copy alongside (config.json, tokenizer files); repeatable.")
@click.option("--include", "includes", multiple=True,
              help="Glob over fqns (relative to --subtree) to export (repeatable; default: all but optim.*).")
@click.option("--subtree", default=None, metavar="PATH",
              help="Tree path of the model to export, written under its own parameter names "
                   "(default: model when the checkpoint has one; '' = every name as saved).")
@click.option("--overwrite", is_flag=True, help="Replace model files already in OUT.")
@json_option
def export_cmd(ckpt: str, out: str, fmt: str, dtype: str | None, max_shard_size: str,
               copies: tuple[str, ...], includes: tuple[str, ...], subtree: str | None,
               overwrite: bool, json_path: str | None) -> None:
    """Export the model tensors of checkpoint CKPT to the directory OUT
    (streaming, one tensor in memory at a time; optimizer state dropped)."""
    from .formats.hf_export import export_hf, parse_dtype, parse_size

    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-shard-size") from None
    try:
        cast = None if dtype is None else parse_dtype(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype") from None
    try:
        res = export_hf(ckpt, out, dtype=cast, max_shard_bytes=limit, copy_files=copies,
                        include=list(includes) or None, subtree=subtree, overwrite=overwrite,
                        progress=_progress())
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except FileExistsError as e:
        _fail(USAGE, str(e).replace("(pass overwrite=True)", "(pass --overwrite to replace them)"))
    except CheckpointError as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    except ValueError as e:  # a bad argument (a ShardingError is a CheckpointError, above)
        _fail(USAGE, str(e))
    mb = res.total_size / 1e6 / max(res.duration_s, 1e-9)
    write_json(json_path, {"out_dir": res.out_dir, "files": list(res.files), "index": res.index_file,
                           "tensors": len(res.weight_map), "total_bytes": res.total_size,
                           "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
                           "seconds": res.duration_s, "mb_per_s": mb, "skipped": list(res.skipped)})
    click.echo(f"exported {len(res.weight_map)} tensors ({human_bytes(res.total_size)}) to "
               f"{res.out_dir} in {len(res.files)} file{'' if len(res.files) == 1 else 's'}, "
               f"{res.duration_s:.2f} s, {mb:.1f} MB/s")
    for f in (*res.files, *((res.index_file,) if res.index_file else ()), *res.copied):
        click.echo(f"  {f}")
    if res.skipped:
        click.echo(f"  skipped {len(res.skipped)} (optimizer state, tied aliases, excluded): "
                   + ", ".join(res.skipped[:5]) + (" ..." if len(res.skipped) > 5 else ""))


@main.command("convert")
@click.option("--from", "src_format", type=click.Choice(["dcp", "hf"]), required=True,
              help="Format of SRC: dcp = a torch.distributed.checkpoint directory; hf = a Hugging "
                   "Face safetensors directory (model.safetensors or an index over shards).")
@click.argument("src")
@click.argument("dst")
@click.option("--step", type=int, default=None, help="Step to record in the new manifest.")
@click.option("--overwrite", is_flag=True, help="Replace a committed checkpoint at DST.")
@click.option("--skip-unsafe-values", is_flag=True,
              help="dcp: leave out values that cannot be decoded with weights_only (default: refuse SRC).")
@json_option
def convert_cmd(src_format: str, src: str, dst: str, step: int | None, overwrite: bool,
                skip_unsafe_values: bool, json_path: str | None) -> None:
    """Convert the checkpoint SRC (another format) into a committed reshard
    checkpoint DST; nothing of SRC is unpickled except through restricted
    unpicklers. dcp streams chunk by chunk; hf (an import of Hugging Face
    weights) holds the model in memory once.

    Exits 2 if there is no checkpoint at SRC, SRC is refused or unreadable, or
    DST already holds a checkpoint (without --overwrite).
    """
    from .commit import check_target
    from .options import SaveOptions

    t0 = time.perf_counter()
    try:
        dst_st, dst_key = resolve(dst)
        check_target(dst_st, dst_key, overwrite=overwrite)
    except FileExistsError as e:
        _fail(USAGE, str(e).replace("(pass SaveOptions(overwrite=True) to replace it)",
                                    "(pass --overwrite to replace it)"))
    except (CheckpointError, ValueError) as e:
        _fail(USAGE, str(e))
    opts = SaveOptions(overwrite=overwrite, progress=_progress())
    try:
        if src_format == "dcp":
            from .formats.dcp_convert import convert_dcp

            res = convert_dcp(src, dst, step=step, options=opts, skip_unsafe_values=skip_unsafe_values)
        else:
            res = _convert_hf(src, dst, step, opts)
    except CheckpointError as e:
        _fail(USAGE, str(e) if isinstance(e, CheckpointNotFoundError) else f"{type(e).__name__}: {e}")
    except ValueError as e:  # unsupported URL scheme
        _fail(USAGE, str(e))
    m = res.manifest
    assert m is not None
    secs = time.perf_counter() - t0
    write_json(json_path, {"src": src, "format": src_format, "path": res.path, "tensors": len(m.tensors),
                           "values": len(m.values or {}), "total_bytes": res.total_bytes,
                           "files": res.num_files, "seconds": secs})
    click.echo(f"converted {src} ({src_format}) -> {res.path}: {len(m.tensors)} tensors, "
               f"{len(m.values or {})} values, {human_bytes(res.total_bytes)} in {res.num_files} "
               f"file{'' if res.num_files == 1 else 's'}, {secs:.2f} s")
    skipped = m.extra.get("dcp_skipped_values") or {}
    if skipped:
        click.echo(f"  skipped {len(skipped)} value(s) that cannot be decoded safely:")
        for k, why in skipped.items():
            click.echo(f"    {k}: {why}")


def _convert_hf(src: str, dst: str, step: int | None, opts: Any) -> Any:
    """A Hugging Face directory as a committed reshard checkpoint (one process)."""
    import torch

    from .collectives import SingleProcess
    from .formats.hf_import import hf_manifest, import_hf
    from .save import save
    from .sharding import ShardedTensor, torch_dtype

    _, _, m = hf_manifest(src)
    state = {f"t{i}": ShardedTensor(fqn, torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype)),
                                    global_shape=tuple(te.global_shape),
                                    global_offset=(0,) * len(te.global_shape))
             for i, (fqn, te) in enumerate(m.tensors.items())}
    from .options import LoadOptions

    import_hf(state, src, group=SingleProcess(), options=LoadOptions(progress=opts.progress))
    return save(state, dst, step=step, group=SingleProcess(), options=opts)


@main.command("diff")
@click.argument("a")
@click.argument("b")
@json_option
def diff_cmd(a: str, b: str, json_path: str | None) -> None:
    """Compare checkpoints A and B: keys added and removed, shape/dtype
    changes, and which tensors' values differ (by chunk digest first, then by
    reading both: the maximum absolute difference).

    Exits 0 if they hold the same state, 1 if they differ, 2 if either cannot
    be read.
    """
    from .diff import diff

    try:
        r = diff(a, b)
    except CheckpointNotFoundError as e:
        _fail(USAGE, str(e))
    except (CheckpointError, ValueError) as e:
        _fail(USAGE, f"{type(e).__name__}: {e}")
    write_json(json_path, r.to_json())
    click.echo(f"a: {r.a}")
    click.echo(f"b: {r.b}")
    for title, keys in (("added in b", r.added), ("removed in b", r.removed)):
        if keys:
            click.echo(f"{title} ({len(keys)}): " + ", ".join(keys))
    if r.changed:
        click.echo(f"shape/dtype changed ({len(r.changed)}):")
        for k, what in r.changed.items():
            click.echo(f"  {k}: {what}")
    if r.differ:
        click.echo(f"values differ ({len(r.differ)}):")
        _table(["key", "max |a-b|"], [[k, f"{v:.6g}"] for k, v in r.differ.items()], right=(1,))
    if r.unreadable:
        click.echo(f"not compared ({len(r.unreadable)}, unreadable):")
        for k, why in r.unreadable.items():
            click.echo(f"  {k}: {why}")
    if r.values_differ:
        click.echo(f"values/objects differ ({len(r.values_differ)}): " + ", ".join(r.values_differ))
    click.echo(f"same: {r.same_by_digest + r.same_by_value} tensors ({r.same_by_digest} by chunk "
               f"digest, {r.same_by_value} by value)")
    click.echo("IDENTICAL" if r.identical else "DIFFERENT")
    if not r.identical:
        sys.exit(CHECK_FAILED)


# --------------------------------------------------------------------------- fuzz and faults


@main.command("fuzz")
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
    from .testing.fuzz import fuzz

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
    _table(["input: outcome", "count"], sorted(rep.outcomes.items()), right=[1])
    _table(["slowest families", "inputs", "total s", "CPU s", "mean ms", "max ms", "slowest input"],
           [[k, f.inputs, f"{f.total_s:.2f}", f"{f.cpu_s:.2f}", f"{f.total_s / max(f.inputs, 1) * 1e3:.2f}",
             f"{f.max_s * 1e3:.1f}", f.slowest[:60]] for k, f in rep.slowest_families(8)],
           right=[1, 2, 3, 4, 5])
    for desc, typ, msg in rep.crashes[:20]:
        click.echo(f"  CRASH {typ}: {msg[:200]}  <- {desc[:120]}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"seed": seed, **rep.to_json()}, f, indent=1)
    sys.exit(0 if rep.ok else 1)


@main.command("faults")
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
    that never arrives, corrupted committed checkpoints) and judge each cell.
    --backend s3 runs the S3 rows on a moto server started on 127.0.0.1
    behind a fault-injecting proxy (HTTP 500/503, resets, bodies cut short).

    A cell is safe when nothing half-written is listed as committed or loaded,
    every surviving rank raised a CheckpointError, the previous checkpoint
    still loads bit-exact and gc leaves no stray attempt. Exits 0 when every
    cell is safe, 1 otherwise, 2 on a usage error.
    """
    from .testing.fault_matrix import cells, run_matrix

    backends = [b.strip() for b in backend.split(",")]
    bad = [b for b in backends if b not in ("local", "s3")] or (
        [backend] if len(set(backends)) != len(backends) else [])
    if bad:
        _fail(2, f"--backend {backend!r}: expected local, s3 or local,s3")
    if "s3" in backends:
        try:
            import boto3  # noqa: F401
            import moto.server  # noqa: F401
        except ImportError as e:
            _fail(2, f"--backend s3 needs boto3 and moto[server] (the dev set): {e}")
    chosen = [c for c in cells(quick=quick, backend=",".join(backends))
              if only is None or only in f"{c.backend}:{c.name}"]
    if not chosen:
        _fail(2, f"no cell matches {only!r}")
    tmp = None
    if workdir is None:
        tmp = workdir = tempfile.mkdtemp(prefix="reshard-faults-")
    t0 = time.perf_counter()

    def progress(r: Any) -> None:
        click.echo(f"  {'safe  ' if r.safe else 'UNSAFE'} {r.seconds:5.1f}s {r.cell.backend}:{r.cell.name}",
                   err=True)

    try:
        results = run_matrix(chosen, workdir=workdir, progress=progress)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for r in results:
        errs = sorted({v.split(":", 1)[0] for v in r.ranks.values()})
        rows.append([f"{r.cell.backend}:{r.cell.name}", "safe" if r.safe else "UNSAFE", "/".join(errs),
                     os.path.basename(r.latest) if r.latest else "-",
                     "yes" if r.previous_loads else "NO", ",".join(r.left_behind) or "-"])
    _table(["cell", "verdict", "rank outcomes", "latest", "prev bit-exact", "left behind (gc'd)"], rows)
    unsafe = [r for r in results if not r.safe]
    for r in unsafe:
        click.echo(f"UNSAFE {r.cell.backend}:{r.cell.name}:")
        for p in r.problems:
            click.echo(f"    {p[:300]}")
    click.echo(f"faults: {len(results)} cells run, {len(results) - len(unsafe)} safe, {len(unsafe)} "
               f"unsafe ({time.perf_counter() - t0:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"backend": backend, "quick": quick, "cells": len(results),
                       "safe": len(results) - len(unsafe), "unsafe": len(unsafe),
                       "results": [r.to_json() for r in results]}, f, indent=1)
    sys.exit(1 if unsafe else 0)


from .cli_bench import bench_group  # noqa: E402 - commands defined beside
from .cli_demo import demo_cmd, smoke_cmd  # noqa: E402

main.add_command(demo_cmd)
main.add_command(smoke_cmd)
main.add_command(bench_group)
__all__ = ["human_bytes", "main"]


if __name__ == "__main__":  # pragma: no cover
    main()
