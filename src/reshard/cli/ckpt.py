"""``reshard ls / gc / inspect / verify``: the commands that list, collect, inspect and verify
the checkpoints of a root (registered on the root group in :mod:`reshard.cli`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from ..commit.listing import committed, scan
from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from ..ondisk.committed import INCOMPLETE, RETIRED, read_manifest
from ..ondisk.manifest import encode_manifest
from ..storage import resolve
from .support import (
    CHECK_FAILED,
    USAGE,
    _fail,
    _manifest,
    _progress,
    _shape,
    _url,
    _when,
    hmac_option,
    human_bytes,
    json_option,
    one_line,
    table,
    write_json,
)

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
                 metric_mode: str, grace: float = 3600.0, collect_other_lineages: bool = False) -> Any:
    """A manager that reads, lists and collects ROOT for a person: it takes
    no ownership of the root (``writer=False``) and never saves."""
    from ..manager.manager import CheckpointManager

    return CheckpointManager(root, keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                             metric_mode=metric_mode, gc_grace_s=grace, preempt_signals=(),
                             writer=False, collect_other_lineages=collect_other_lineages)


def _owner_lines(st: Any, key: str) -> tuple[dict[str, Any] | None, bool, list[str]]:
    """The root's owner record, whether it is live, and what ``ls``/``gc`` say of it."""
    from ..commit.ownership import describe, is_live, read_owner

    rec, _ = read_owner(st, key)
    if rec is None:
        return None, False, []
    live = is_live(rec)
    state = "live" if live else "released" if rec.get("released") else "expired"
    try:
        if live and float(rec.get("expires") or 0) <= time.time():
            state = "live: its lease lapsed (renewals failing), its process is alive on this host"
    except (TypeError, ValueError):
        pass
    lines = [f"owner: {describe(rec)} ({state})"]
    if rec.get("require_signed"):
        lines.append("owner: the root requires signed checkpoints (HMAC)")
    return rec, live, lines


def _strange_children(st: Any, key: str) -> list[str]:
    """One line per child of a local root that is neither a regular file, a
    directory nor a symbolic link (a FIFO, a socket, a device): skipped by
    every listing, never opened."""
    import os
    import stat

    from ..storage.local import LocalStorage, file_kind

    if not isinstance(st, LocalStorage):
        return []
    out = []
    try:
        names = sorted(os.listdir(key))
    except OSError:
        return []
    for n in names:
        try:
            mode = os.lstat(os.path.join(key, n)).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.append(f"skipped {n}: {file_kind(mode)}, not a checkpoint (never opened)")
    return out


def _signature_problems(st: Any, done: list[Any]) -> dict[str, str]:
    """With an HMAC key (``--hmac-key-file`` or the environment): name ->
    why the checkpoint's manifest is refused (unsigned or mis-signed)."""
    from ..errors import IntegrityError
    from ..ondisk.committed import check_signature
    from ..ondisk.manifest import MANIFEST_NAME
    from ..options import hmac_key_of

    key = hmac_key_of(None)
    if key is None:
        return {}
    out = {}
    for e in done:
        try:
            check_signature(e.manifest, key, where=st.join(e.path, MANIFEST_NAME))
        except IntegrityError as err:
            out[e.name] = "unsigned" if "not signed" in str(err) else "bad signature"
    return out


def _root_view(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
               metric_mode: str) -> Any:
    """What ``ls`` asks of a root (retention's view of its checkpoints, the
    attempts in progress), without a CheckpointManager, which would join the
    process group and import torch: ``ls`` only reads."""
    from ..catalog.records import record_holds
    from ..commit.retention import Policy
    from ..manager.retention import RetentionMixin

    class RootView(RetentionMixin):
        def __init__(self) -> None:
            self.storage, self.root = resolve(root)
            self.policy = Policy(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                                 mode=metric_mode)
            self._pending = []

        def is_verified(self, name: str, entry: Any = None) -> bool:  # as CheckpointManager's
            return record_holds(self.storage, self.root, name, entry)

    return RootView()


@click.command("ls")
@click.argument("root")
@_retention_opts
@hmac_option
def ls_cmd(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
           metric_mode: str) -> None:
    """List committed checkpoints under ROOT by step (never by name) with
    their size (the bytes of every file the manifest names), the bytes each
    holds alone ("own": what deleting it alone frees; the rest it shares
    with other checkpoints, whose incremental saves linked unchanged files)
    and status (verified: a verification record that still matches;
    torn: a file missing or not of its declared size), lineage (parent,
    branch, HEAD: the checkpoint the current lineage resumed from) and what
    retention would do with the given policy; then quarantined, abandoned
    and invalid ones, the root's owner (the job that saves there) and
    anything that is not a checkpoint (a FIFO, never opened). With an HMAC
    key, unsigned or mis-signed checkpoints are marked so and the command
    exits 1."""
    from ..catalog.records import record_failed
    from ..commit.lineage import Head, lineage_of
    from ..commit.listing import read_head
    from ..ondisk.committed import torn_files

    try:
        st, key = resolve(root)
        if not st.exists(key):
            _fail(2, f"{st.url(key)}: no such directory")
        done = committed(st, key)
        others = [e for e in scan(st, key) if e.manifest is None or e.quarantined]
        head = Head.from_record(read_head(st, key))
        torn = {e.name: torn_files(st, e.path, e.manifest) for e in done if e.manifest is not None}
        unsigned = _signature_problems(st, done)
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
        from ..commit.retention import decide

        mgr = _root_view(root, keep_last, keep_every, keep_best, metric_mode)
        cands = {c.name: c for c in mgr.candidates(done)}
        decision = decide(list(cands.values()), mgr.policy)
        lin = lineage_of(done, head)
        from ..commit.sharing import census, holding, stored_bytes

        held = {e.name: holding(st, e.path, e.manifest) for e in done if e.manifest is not None}
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
            status = (unsigned[e.name] if e.name in unsigned else "torn" if torn[e.name]
                      else "verified" if c.verified else "failed" if bad is not None else "unverified")
            branch = lin.branch(e.name) + (" HEAD" if e.name == lin.source else "")
            rows.append(["-" if e.step is None else e.step, human_bytes(em.total_bytes),
                         human_bytes(held[e.name].own), len(em.files),
                         _when(em.created_at), status, em.parent or "-", branch,
                         "-" if c.metric is None else f"{c.metric:.4g}", fate, e.name])
        table(["step", "size", "own", "files", "committed", "status", "parent", "branch", "metric",
                "retention", "name"], rows, right=(0, 1, 2, 3))
        logical = sum(h.logical for h in held.values())
        stored = stored_bytes(census(st, [e.path for e in done],
                                     {e.path: e.manifest for e in done if e.manifest is not None}))
        click.echo(f"bytes: {human_bytes(logical)} named by {len(done)} checkpoint(s), "
                   f"{human_bytes(stored)} stored (a file several checkpoints share is stored once; "
                   "own: what deleting that checkpoint alone frees)")
        for name, why in failed:
            click.echo(f"failed: {name} failed its last verification: {one_line(why)[:300]}")
        if head is not None and lin.source is None:
            click.echo(_head_line(head, lin, others))
        for e in done:
            for problem in list(torn[e.name].values())[:3]:
                click.echo(f"  torn {e.name}: {problem}")
    else:
        click.echo(f"no committed checkpoint under {st.url(key)}")
    live = _root_view(root, None, None, 0, "min").attempts_in_progress()
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
    from ..ondisk.committed import linked_children

    for name in linked_children(st, key):
        click.echo(f"link {name} ignored: a symbolic link inside a root is not one of its checkpoints "
                   "(latest, restore, retention and gc skip it; load its target by its own path)")
    for line in _strange_children(st, key):
        click.echo(line)
    _ls_dcp(st, key)
    for line in _owner_lines(st, key)[2]:
        click.echo(line)
    if unsigned:
        _fail(1, f"{len(unsigned)} checkpoint(s) under {st.url(key)} are refused with the HMAC key "
                 f"given: {', '.join(f'{n} ({why})' for n, why in sorted(unsigned.items())[:5])}")


def _this_process(rec: dict[str, Any]) -> bool:
    import os
    import socket

    return rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname()


def _owner_allows(root: str, owner: dict[str, Any]) -> set[str]:
    """What the live owner's own retention would delete (its policy, as its
    owner record states it), on the checkpoints as they are now: ``reshard
    gc`` beside a live job deletes no more than that."""
    from ..commit.retention import decide

    pol = owner.get("policy") or {}
    kw = {k: pol.get(k) for k in ("keep_last", "keep_every")}
    om = _manager_for(root, kw["keep_last"], kw["keep_every"], int(pol.get("keep_best") or 0),
                      str(pol.get("mode") or "min"),
                      collect_other_lineages=bool(pol.get("collect_other_lineages")))
    return set(decide(om.candidates(), om.policy).delete)


def _ls_dcp(st: Any, key: str) -> None:
    from ..ondisk.dcp_metadata import dcp_checkpoints

    found = dcp_checkpoints(st, key)
    if found:
        click.echo(f"DCP checkpoints ({len(found)}; reshard.load reads them, `reshard convert "
                   "--from dcp` converts them; never deleted by gc):")
        table(["name", "modified"], [[n, _when(t)] for n, t in found])


@click.command("gc")
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
@click.option("--collect-other-lineages", is_flag=True,
              help="Also delete checkpoints of other lineages (a rollback's abandoned branch, a "
                   "finished job's) once the current lineage passed them; by default they are kept.")
@hmac_option
def gc_cmd(root: str, keep_last: int | None, keep_every: int | None, keep_best: int,
           metric_mode: str, grace: float, dry_run: bool, no_checksums: bool,
           collect_other_lineages: bool) -> None:
    """Apply retention under ROOT, following the lineage: first run the
    restore smoke test on checkpoints newer than the newest verified one
    (nothing is deleted before a newer checkpoint passed it); before the last
    older verified checkpoint goes, verify the one kept in its place again
    (every checksum unless --no-checksums; if it fails, nothing it would
    replace is deleted); then delete what the policy does not keep and
    abandoned attempts older than --grace. Checkpoints in use by readers
    (their leases), HEAD's checkpoint, other lineages (unless
    --collect-other-lineages) and quarantined checkpoints are never deleted;
    beside a live owner (a job saving into ROOT) nothing its own retention
    keeps is deleted either. Deleting writes nothing first, so gc frees a
    full disk; a checkpoint another deleter removed first is reported as
    already removed. --dry-run runs the same checks and predicts exactly
    what would be deleted. Exits 1 when a check failed or a checkpoint's
    manifest is invalid (damaged, or of a newer format): those are kept and
    named; the rest of retention still applies."""
    try:
        st, key = resolve(root)
        if not st.exists(key):
            _fail(2, f"{st.url(key)}: no such directory")
        mgr = _manager_for(root, keep_last, keep_every, keep_best, metric_mode, grace,
                           collect_other_lineages)
        owner, live_owner, owner_lines = _owner_lines(st, key)
        # beside a live owner in another process (a job saving here), delete no more than its
        # own retention would; an owner in this very process is the caller itself
        foreign = live_owner and owner is not None and not _this_process(owner)
        allowed = _owner_allows(root, owner) if foreign and owner is not None else None
        from ..commit.sharing import census, freed

        # what every child names before anything is deleted: the bytes freed are
        # those whose every name was deleted (files incremental saves link are kept)
        before = census(st, [st.join(key, n) for n in (st.list_dir(key) if st.exists(key) else [])],
                        {e.path: e.manifest for e in committed(st, key) if e.manifest is not None})
        decision = mgr.apply_retention(dry_run=dry_run, checksums=not no_checksums, smoke_newer=True,
                                       allowed=allowed)
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
    outcomes = mgr.last_outcomes
    deleted = []
    for name in decision.delete:
        if allowed is not None and name not in allowed:
            click.echo(f"kept {name} (the live owner's retention keeps it: "
                       f"{(owner or {}).get('job') or 'an unnamed job'} saves here)")
            continue
        out = outcomes.get(name, "deleted")
        if dry_run or out == "deleted":
            click.echo(f"{verb} {name}")
            deleted.append(name)
        elif out == "already removed":
            click.echo(f"already removed {name} (another deleter got there first)")
        else:
            click.echo(f"kept {name} ({out}; deleted once released)")
    for name in gone:
        click.echo(f"{verb} abandoned attempt {name}")
    for name in getattr(mgr, "last_litter", []):
        click.echo(f"{'would remove' if dry_run else 'removed'} {name} (left by an interrupted "
                   "deletion, an expired reader lease, or a checkpoint already gone)")
    for line in owner_lines + _strange_children(st, key):
        click.echo(line)
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
    if not deleted and not gone:
        click.echo("nothing to delete")
    else:
        free, named = freed(before, [st.join(key, n) for n in [*deleted, *gone]])
        click.echo(f"{'would free' if dry_run else 'freed'} {human_bytes(free)} "
                   f"(of {human_bytes(named)} named by what {'would be' if dry_run else 'was'} deleted; "
                   "the rest is shared with kept checkpoints)")
    for note in mgr.storage.notes:  # what the store could not do (e.g. list multipart uploads)
        click.echo(f"note: {note}")
    failed = [f"{name} ({what})" for name, what, ok in mgr.last_plan.checks if not ok]
    failed += [f"{e.name} (invalid manifest)" for e in invalid]
    if failed:  # retention kept what it had to; the run still has a checkpoint that does not load
        _fail(1, f"{len(failed)} check(s) failed under {root}: {', '.join(failed)} (kept, not deleted)")


@click.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@hmac_option
def inspect_cmd(ckpt: str, as_json: bool) -> None:
    """Describe the checkpoint CKPT: metadata, tensors, objects, values,
    aliases. A checkpoint that load and verify refuse (structure, signature
    with a key) is refused here too (exit 2)."""
    m = _manifest(ckpt)
    if as_json:
        click.echo(json.dumps(json.loads(encode_manifest(m)), indent=2))
        return
    na = "-"
    click.echo(f"{_url(ckpt)}")
    if m.extra.get("source") == "dcp":  # a PyTorch DCP folder, described as DCP describes itself
        nfiles = int(m.extra.get("dcp_files") or 0)  # its own files (not the chunks served)
        version = m.extra.get("dcp_version")
        click.echo("  PyTorch DCP checkpoint (torch.distributed.checkpoint; its .metadata read through "
                   "restricted unpicklers; values listed by their DCP keys)")
        click.echo(f"  format dcp{f' (metadata version {version})' if version else ''}  "
                   f"step {na if m.step is None else m.step}  world_size {m.world_size}")
        click.echo(f"  .metadata written {_when(m.created_at)} (complete as DCP counts it: its "
                   "coordinator writes .metadata after every rank's files; nothing checks them against it)  "
                   f"{nfiles} file{'' if nfiles == 1 else 's'}, {human_bytes(m.total_bytes)} of tensors  "
                   "no checksums (DCP records none)")
    else:
        click.echo(f"  format {m.format} v{m.format_version}  step {na if m.step is None else m.step}  "
                   f"schema_version {m.schema_version or na}  world_size {m.world_size}  "
                   f"mesh {json.dumps(m.mesh) if m.mesh else na}")
        click.echo(f"  committed {_when(m.created_at)}  attempt {m.attempt_id}  "
                   f"{len(m.files)} file{'' if len(m.files) == 1 else 's'}, {human_bytes(m.total_bytes)}  "
                   f"checksums {m.checksum_algorithm}/{human_bytes(m.checksum_block_bytes)} blocks"
                   + ("  signed" if "hmac_sha256" in m.extra else ""))
        if m.extra.get("converted_from") == "dcp":
            click.echo("  converted from a PyTorch DCP checkpoint (reshard convert --from dcp)")
        linked = [fe for fe in m.files.values() if fe.origin]
        if linked:
            origins = sorted({fe.origin for fe in linked})
            click.echo(f"  {len(linked)} file{'' if len(linked) == 1 else 's'} "
                       f"({human_bytes(sum(fe.size for fe in linked))}) unchanged since an earlier checkpoint, "
                       f"linked by the incremental save (written by attempt{'' if len(origins) == 1 else 's'} "
                       f"{', '.join(origins[:3])}{' ...' if len(origins) > 3 else ''}); every file is in this checkpoint")
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


@click.command("verify")
@click.argument("ckpt")
@click.option("--no-checksums", is_flag=True, help="Check structure and sizes only.")
@click.option("--accept-unchecked", is_flag=True,
              help="Exit 0 for a checkpoint whose chunks or files carry no checksum (saved with "
                   "checksums=False): reported NOT CHECKED and exit 1 otherwise.")
@hmac_option
@json_option
def verify_cmd(ckpt: str, no_checksums: bool, accept_unchecked: bool, json_path: str | None) -> None:
    """Check CKPT's manifest, coverage, files and (by default) every checksum.

    The outcome (passed or failed) is recorded in CKPT's verification record
    beside it (``<name>.verified.json``, bound to the manifest checked), so
    ``reshard ls``, retention and the manager see a failed checkpoint as
    failed; nothing is renamed or deleted. An unsigned or mis-signed
    manifest (with an HMAC key) fails the command but is not recorded: it
    says the key is not the writer's, not that CKPT is damaged (only other
    problems found are recorded). A checkpoint whose chunks carry
    no checksum (saved with checksums=False, or edited to drop them) or
    whose files have empty checksums is reported NOT CHECKED: its bytes
    could not be compared (without an HMAC key that is honesty, not
    security). Exits 1 if any problem is found or something was NOT CHECKED
    (unless --accept-unchecked), 2 if there is no checkpoint at CKPT.
    """
    from ..catalog.verify import verify
    from ..ondisk.committed import read_manifest_bytes

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
    from ..catalog.verify import DCP_NOTE

    secs = time.perf_counter() - t0
    dcp = DCP_NOTE in rep.notes  # DCP records no checksums: none were compared
    if raw is not None and (rep.integrity_problems or not rep.key_problems):
        _record_verification(st, key, raw, rep, "structure" if no_checksums else "checksums")
    unchecked = list(rep.unchecked) if not no_checksums else []
    write_json(json_path, {"path": rep.path, "ok": rep.ok, "problems": list(rep.problems),
                           "notes": list(rep.notes), "unchecked": unchecked,
                           "bytes_checked": rep.bytes_checked, "checksums": not no_checksums and not dcp,
                           "seconds": round(secs, 6)})
    if rep.ok and unchecked:
        head = "OK (NOT CHECKED accepted)" if accept_unchecked else "NOT CHECKED"
        click.echo(f"{head} {rep.path}: structure and sizes passed, but these bytes carry no "
                   f"checksum and were not checked ({human_bytes(rep.bytes_checked)} checksummed, "
                   f"{secs:.2f} s):")
        for u in unchecked:
            click.echo(f"  {u}")
        click.echo("  note: saved with checksums=False, or its manifest was edited to drop them; "
                   "without an HMAC key the two look alike (pass --accept-unchecked to accept)")
        if not accept_unchecked:
            sys.exit(CHECK_FAILED)
        return
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


def _head_line(head: Any, lin: Any, others: list[Any]) -> str:
    """What ``reshard ls`` says of a HEAD whose checkpoint is not among the
    committed ones: information when nothing is wrong (a fresh start; a
    source that is gone while the lineage has newer checkpoints, as
    retention leaves it), else the problem (the source is quarantined,
    invalid, replaced, or gone with nothing newer to resume from)."""
    if head.name is None:
        return "HEAD: a fresh start (the current lineage resumed from no checkpoint)"
    from ..ondisk.committed import QUARANTINED

    there = next((e for e in others if e.name == head.name
                  or (e.quarantined and e.name.startswith(head.name + QUARANTINED))), None)
    if there is not None and there.quarantined:
        return (f"HEAD names {head.name}, which is quarantined (as {there.name}, see below): "
                "not committed here")
    if there is None and lin.descendants:
        return (f"HEAD: resumed from {head.name} (since deleted, as retention does once newer "
                "checkpoints of this lineage are committed)")
    return f"HEAD names {head.name}, which is not committed here"


def _record_verification(st: Any, key: str, raw: bytes, rep: Any, how: str) -> None:
    """Write the verification record of the checkpoint ``key`` (a note on
    stderr when it cannot be written: the check's outcome stands)."""
    from ..catalog.records import write_outcome
    from ..ondisk.committed import manifest_digest
    from ..ondisk.manifest import MANIFEST_NAME, decode_manifest

    root, name = st.parent(key), st.basename(key)
    try:
        try:
            files = {f: fe.size for f, fe in
                     decode_manifest(raw, where=st.join(key, MANIFEST_NAME)).files.items()}
        except CheckpointError:
            files = {}
        bad = list(rep.integrity_problems)  # a key that is not the writer's is no verdict on it
        write_outcome(st, root, name, ok=not bad, problems=bad, how=how,
                      digest=manifest_digest(raw), files=files)
    except (CheckpointError, OSError) as e:
        click.echo(f"note: the verification record of {key} could not be written: {e}", err=True)
