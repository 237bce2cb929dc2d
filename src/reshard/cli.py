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
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from .cli_support import (
    CHECK_FAILED,
    USAGE,
    Main,
    fail,
    human_bytes,
    json_option,
    one_line,
    table,
    write_json,
)
from .commit import INCOMPLETE, RETIRED, committed, read_manifest, scan
from .errors import CheckpointError, CheckpointNotFoundError, StorageError
from .manifest import Manifest, encode_manifest
from .storage import resolve


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _shape(s: Sequence[int]) -> str:
    return "[" + ",".join(map(str, s)) + "]"


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


def _url(path: str) -> str:
    """``path`` as :func:`reshard.storage.resolve` reads it, in the caller's form
    (``s3://``, ``memory://``, ``file://`` kept; a local path made absolute)."""
    st, key = resolve(path)
    return st.url(key)


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
            _fail(2, f"{st.url(key)}: no such directory")
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
            click.echo(f"{st.url(key)} is itself a committed checkpoint:")
            table(["step", "size", "files", "committed"],
                   [["-" if m.step is None else m.step, human_bytes(m.total_bytes), len(m.files),
                     _when(m.created_at)]], right=(0, 1, 2))
            return
    if done:
        from .retention import decide

        mgr = _manager_for(root, keep_last, keep_every, keep_best, metric_mode)
        cands = {c.name: c for c in mgr.candidates(done)}
        decision = decide(list(cands.values()), mgr.policy)
        lin = lineage_of(done, head)
        click.echo(f"committed ({len(done)}) under {st.url(key)}:")
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
        table(["step", "size", "files", "committed", "status", "parent", "branch", "metric",
                "retention", "name"], rows, right=(0, 1, 2))
        for name, why in failed:
            click.echo(f"failed: {name} failed its last verification: {one_line(why)[:300]}")
        if head is not None and lin.source is None:
            click.echo(f"HEAD names {head.name or 'a fresh start'}, which is not committed here")
        for e in done:
            for problem in list(torn[e.name].values())[:3]:
                click.echo(f"  torn {e.name}: {problem}")
    else:
        click.echo(f"no committed checkpoint under {st.url(key)}")
    live = _manager_for(root, None, None, 0, "min").attempts_in_progress()
    quarantined = [e for e in others if e.quarantined]
    abandoned = [e for e in others if e.abandoned and not e.quarantined and e.name not in live]
    if live:
        click.echo(f"in progress ({len(live)}; a save holds each, never deleted by gc):")
        table(["name", "status"], [[n, f"in progress (lease renewed {a:.0f} s ago)"]
                                   for n, a in sorted(live.items())])
    invalid = [e for e in others if not e.abandoned and not e.quarantined]
    if quarantined:
        click.echo(f"quarantined ({len(quarantined)}; found unloadable by a restore, never loaded "
                   "or deleted automatically):")
        table(["step", "name", "since", "why"],
               [["-" if e.step is None else e.step, e.name, _when(e.mtime),
                 (e.problem or "").splitlines()[0][:160]] for e in quarantined], right=(0,))
    if abandoned:
        click.echo(f"abandoned ({len(abandoned)}, never committed; ignored by load):")
        table(["name", "modified", "why"],
               [[e.name, _when(e.mtime), e.problem or ("retired by an overwrite" if RETIRED in e.name
                                                       else "incomplete attempt")]
                for e in abandoned])
    if invalid:
        click.echo(f"invalid ({len(invalid)}; ignored by load):")
        for e in invalid:
            click.echo(f"  {e.name}: {e.problem}")
    from .commit import linked_children

    for name in linked_children(st, key):
        click.echo(f"link {name} ignored: a symbolic link inside a root is not one of its checkpoints "
                   "(latest, restore, retention and gc skip it; load its target by its own path)")
    _ls_dcp(st, key)


def _ls_dcp(st: Any, key: str) -> None:
    from .formats.dcp import dcp_checkpoints

    found = dcp_checkpoints(st, key)
    if found:
        click.echo(f"DCP checkpoints ({len(found)}; reshard.load reads them, `reshard convert "
                   "--from dcp` converts them; never deleted by gc):")
        table(["name", "modified"], [[n, _when(t)] for n, t in found])


@main.command("gc")
@click.argument("root")
@_retention_opts
@click.option("--grace", type=float, default=3600.0, show_default=True,
              help="Abandoned attempts older than this many seconds are deleted (never one "
                   "whose lease a running save renews: reported as in progress).")
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
    and predicts exactly what would be deleted. Exits 1 when a check failed
    or a checkpoint's manifest is invalid (damaged, or of a newer format):
    those are kept and named; the rest of retention still applies."""
    try:
        st, key = resolve(root)
        if not st.exists(key):
            _fail(2, f"{st.url(key)}: no such directory")
        mgr = _manager_for(root, keep_last, keep_every, keep_best, metric_mode, grace)
        decision = mgr.apply_retention(dry_run=dry_run, checksums=not no_checksums, smoke_newer=True)
        gone = mgr.gc_abandoned(dry_run=dry_run)
        live = mgr.last_in_progress
        entries = scan(st, key)
        quarantined = [e.name for e in entries if e.quarantined]
        invalid = [e for e in entries if e.manifest is None and not e.abandoned and not e.quarantined]
        young = [e.name for e in entries if e.abandoned and not e.quarantined and e.name not in live
                 and e.name not in gone and (INCOMPLETE in e.name or RETIRED in e.name)]
    except ValueError as err:
        _fail(2, str(err))
    except StorageError as err:  # the store failed: an environment error, not a failed check
        _fail(USAGE, f"{type(err).__name__}: {err}")
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
    for e in invalid:
        click.echo(f"kept {e.name} (invalid manifest, never deleted automatically: "
                   f"{one_line(e.problem or '')[:200]})")
    for name, age in sorted(live.items()):
        click.echo(f"kept attempt {name}: in progress (lease renewed {age:.0f} s ago)")
    for name in young:
        click.echo(f"kept abandoned attempt {name} (younger than --grace {grace:g} s: it may be "
                   "a save still running; pass --grace 0 once no job writes here)")
    if not decision.delete and not gone:
        click.echo("nothing to delete")
    for note in mgr.storage.notes:  # what the store could not do (e.g. list multipart uploads)
        click.echo(f"note: {note}")
    failed = [f"{name} ({what})" for name, what, ok in mgr.last_plan.checks if not ok]
    failed += [f"{e.name} (invalid manifest)" for e in invalid]
    if failed:  # retention kept what it had to; the run still has a checkpoint that does not load
        _fail(1, f"{len(failed)} check(s) failed under {root}: {', '.join(failed)} (kept, not deleted)")


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
    click.echo(f"{_url(ckpt)}")
    if m.extra.get("source") == "dcp":
        click.echo("  DCP checkpoint (torch.distributed.checkpoint, read through restricted "
                   "unpicklers; no checksums; values listed by their DCP keys)")
    click.echo(f"  format {m.format} v{m.format_version}  step {na if m.step is None else m.step}  "
               f"schema_version {m.schema_version or na}  world_size {m.world_size}  "
               f"mesh {json.dumps(m.mesh) if m.mesh else na}")
    dcp = m.extra.get("source") == "dcp"
    nfiles = int(m.extra.get("dcp_files") or 0) if dcp else len(m.files)  # DCP: its own files
    sums = ("no checksums (DCP records none)" if dcp else
            f"checksums {m.checksum_algorithm}/{human_bytes(m.checksum_block_bytes)} blocks")
    click.echo(f"  committed {_when(m.created_at)}  attempt {m.attempt_id}  "
               f"{nfiles} file{'' if nfiles == 1 else 's'}, {human_bytes(m.total_bytes)}  {sums}"
               + ("  signed" if "hmac_sha256" in m.extra else ""))
    if m.required_features:
        click.echo(f"  required features: {', '.join(m.required_features)}")
    click.echo(f"tensors ({len(m.tensors)}):")
    if m.tensors:
        table(["fqn", "dtype", "global shape", "chunks", "bytes"],
               [[fqn, te.dtype, _shape(te.global_shape), len(te.chunks),
                 human_bytes(sum(c.length for c in te.chunks))] for fqn, te in m.tensors.items()],
               right=(3, 4))
    if m.objects:
        click.echo(f"objects ({len(m.objects)}):")
        table(["key", "grid", "elements"],
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

    The outcome (passed or failed) is recorded in CKPT's verification record
    beside it (``<name>.verified.json``, bound to the manifest checked), so
    ``reshard ls``, retention and the manager see a failed checkpoint as
    failed; nothing is renamed or deleted. Exits 1 if any problem is found,
    2 if there is no checkpoint at CKPT.
    """
    from .commit import read_manifest_bytes
    from .verify import verify

    t0 = time.perf_counter()
    try:
        st, key = resolve(ckpt)
        try:  # the manifest the record is bound to (read before the check)
            raw: bytes | None = read_manifest_bytes(st, key)
        except CheckpointError:
            raw = None
        rep = verify(key, checksums=not no_checksums, progress=_progress(), storage=st)
    except (CheckpointNotFoundError, ValueError) as e:
        _fail(USAGE, str(e))
    except CheckpointError as e:
        _fail(CHECK_FAILED, f"{type(e).__name__}: {e}")
    from .verify import DCP_NOTE

    secs = time.perf_counter() - t0
    dcp = DCP_NOTE in rep.notes  # DCP records no checksums: none were compared
    if raw is not None:
        _record_verification(st, key, raw, rep, "structure" if no_checksums else "checksums")
    write_json(json_path, {"path": rep.path, "ok": rep.ok, "problems": list(rep.problems),
                           "notes": list(rep.notes),
                           "bytes_checked": rep.bytes_checked, "checksums": not no_checksums and not dcp,
                           "seconds": round(secs, 6)})
    if rep.ok:
        what = ("structure and sizes only" if no_checksums
                else f"{human_bytes(rep.bytes_checked)} decoded, no checksums" if dcp
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


def _record_verification(st: Any, key: str, raw: bytes, rep: Any, how: str) -> None:
    """Write the verification record of the checkpoint ``key`` (a note on
    stderr when it cannot be written: the check's outcome stands)."""
    from .commit import manifest_digest
    from .manifest import MANIFEST_NAME, decode_manifest
    from .records import write_outcome

    root, name = st.parent(key), st.basename(key)
    try:
        try:
            files = {f: fe.size for f, fe in
                     decode_manifest(raw, where=st.join(key, MANIFEST_NAME)).files.items()}
        except CheckpointError:
            files = {}
        write_outcome(st, root, name, ok=rep.ok, problems=list(rep.problems), how=how,
                      digest=manifest_digest(raw), files=files)
    except (CheckpointError, OSError) as e:
        click.echo(f"note: the verification record of {key} could not be written: {e}", err=True)


@main.command("export")
@click.argument("ckpt")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="Output format: hf = Hugging Face safetensors directory.")
@click.option("--dtype", default=None, help="Cast floating-point tensors (bf16, fp16, fp32).")
@click.option("--max-shard-size", default="2GiB", show_default=True,
              help="Tensor bytes per shard file at most (2GB = 2e9 as in Hugging Face, 2GiB = 2**31).")
@click.option("--copy", "copies", multiple=True, metavar="FILE",
              help="A file to copy alongside (config.json, tokenizer files); repeatable.")
@click.option("--include", "includes", multiple=True,
              help="Glob over fqns (relative to --subtree) to export (repeatable; default: all but optim.*).")
@click.option("--subtree", default=None, metavar="PATH",
              help="Tree path of the model to export, written under its own parameter names "
                   "(default: the model the checkpoint records: a ModelState, TorchState's model, "
                   "a saved model.state_dict(); exit 2 naming the candidates when it holds several; "
                   "'' = every name as saved).")
@click.option("--overwrite", is_flag=True, help="Replace model files already in OUT.")
@json_option
def export_cmd(ckpt: str, out: str, fmt: str, dtype: str | None, max_shard_size: str,
               copies: tuple[str, ...], includes: tuple[str, ...], subtree: str | None,
               overwrite: bool, json_path: str | None) -> None:
    """Export the model tensors of checkpoint CKPT (or a DCP folder) to the directory OUT
    (streaming, one tensor in memory at a time) under the model's own
    parameter names; optimizer, RNG and data state and objects are never
    written. With --dtype, a copied config.json names the new dtype."""
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
    except FileNotFoundError as e:  # a --copy file
        _fail(USAGE, str(e))
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
        msg = str(e).replace("pass skip_unsafe_values=True", "pass --skip-unsafe-values")  # the CLI's flag
        _fail(USAGE, msg if isinstance(e, CheckpointNotFoundError) else f"{type(e).__name__}: {msg}")
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
    state: dict[str, Any] = {}
    for i, (fqn, te) in enumerate(m.tensors.items()):
        state[f"t{i:09d}"] = ShardedTensor(fqn, torch.empty(tuple(te.global_shape), dtype=torch_dtype(te.dtype)),
                                           global_shape=tuple(te.global_shape),
                                           global_offset=(0,) * len(te.global_shape))
    # the ties hf_manifest found (an export's record, or config.json's tie_word_embeddings for a
    # save_pretrained directory): each alias is requested as its target's own memory, so the load
    # fills it and the save records the tie (manifest.aliases) as a model with tied weights would
    by_fqn = {st.fqn: st for st in state.values()}
    for i, (alias, target) in enumerate(m.aliases.items()):
        t = by_fqn[target]
        state[f"~tied{i:09d}"] = ShardedTensor(alias, t.data, global_shape=t.global_shape,
                                               global_offset=t.global_offset)
    from .options import LoadOptions

    import_hf(state, src, group=SingleProcess(), options=LoadOptions(progress=opts.progress))
    return save(state, dst, step=step, group=SingleProcess(), options=opts)


@main.command("diff")
@click.argument("a")
@click.argument("b")
@json_option
def diff_cmd(a: str, b: str, json_path: str | None) -> None:
    """Compare checkpoints A and B (reshard checkpoints or DCP folders) by
    logical content, whatever their layouts: keys added and removed (grouped
    by subtree with counts; --json lists them all), shape/dtype changes, which
    tensors' values differ (by chunk digest first, then by reading both: the
    maximum absolute difference), and which values and objects differ (by
    decoded content: a per-rank grid of equal elements is one value).

    Exits 0 if they hold the same state, 1 if they differ, 2 if either cannot
    be read.
    """
    from .diff import by_subtree, diff

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
        if keys:  # by subtree with counts (--json lists every key)
            click.echo(f"{title} ({len(keys)}):")
            for head, n in by_subtree(keys).items():
                one = [k for k in keys if k == head or k.startswith(head + ".")]
                click.echo(f"  {one[0]}" if n == 1 else f"  {head}.* ({n} keys)")
    if r.changed:
        click.echo(f"shape/dtype changed ({len(r.changed)}):")
        for k, what in r.changed.items():
            click.echo(f"  {k}: {what}")
    if r.differ:
        click.echo(f"values differ ({len(r.differ)}):")
        table(["key", "max |a-b|"], [[k, f"{v:.6g}"] for k, v in r.differ.items()], right=(1,))
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


from .cli_bench import advise_cmd, bench_group  # noqa: E402 - commands defined beside
from .cli_demo import demo_cmd, smoke_cmd  # noqa: E402
from .cli_faults import faults_cmd, fuzz_cmd  # noqa: E402
from .cli_plan import plan_cmd  # noqa: E402

main.add_command(demo_cmd)
main.add_command(smoke_cmd)
main.add_command(bench_group)
main.add_command(advise_cmd)
main.add_command(fuzz_cmd)
main.add_command(faults_cmd)
main.add_command(plan_cmd)
__all__ = ["human_bytes", "main"]


if __name__ == "__main__":  # pragma: no cover
    main()
