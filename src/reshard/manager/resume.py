"""The collective resume of :meth:`reshard.CheckpointManager.restore`.

Every rank tries the same checkpoints in the same order
(:func:`reshard.commit.lineage.resume_order`) and reaches the same outcome for each:
the ranks' findings are agreed (an all-reduce of status counters; the
failing ranks' details are gathered to the coordinator only when some rank
failed) before anything is decided, so all ranks fall back, quarantine or
raise together.

* ``torn``: it is unloadable (the coordinator found a file missing, short or
  a symbolic link; a rank found the manifest invalid; the load found a
  checksum mismatch or a file it needs missing: ``IntegrityError`` /
  ``ManifestError`` on any rank): the coordinator quarantines it
  (:func:`reshard.commit.protocol.quarantine`) and every rank tries the next one.
* ``gone``: it vanished meanwhile (``CheckpointNotFoundError``): the next one.
* ``storage``: the store failed (``StorageError``): raised on every rank; a
  failure that may be transient is never a reason to quarantine or to fall
  back past a good checkpoint.
* only ranks other than the coordinator found it unloadable, and the
  coordinator's :func:`reshard.verify` (every checksum) finds it intact:
  those ranks see another copy (node-local storage, a partial sync); raised
  on every rank, never quarantined (it would set aside every good
  checkpoint of the shared root).
* ``key``: with ``LoadOptions(hmac_key=...)``, the manifest's signature does
  not verify (another key, a manifest not signed, or tampering): raised on
  every rank, never quarantined (a wrong key would otherwise set aside every
  checkpoint of the root).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..catalog.records import record_path
from ..catalog.verify import verify
from ..collectives import Collectives, Tries
from ..commit.lineage import Head, lineage_of, resume_order
from ..commit.listing import committed, read_head_tagged, scan, write_head
from ..commit.protocol import quarantine
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StorageError,
    rank_ranges,
)
from ..loading.load import LoadResult, load
from ..ondisk.committed import (
    HEAD_NAME,
    check_signature,
    read_manifest,
    read_manifest_bytes,
    torn_files,
)
from ..ondisk.manifest import FORMAT, FORMAT_VERSION, KNOWN_FEATURES, MANIFEST_NAME, Manifest
from ..options import hmac_key_of
from ..storage import Storage


class Managed(Protocol):
    """What the resume reads of its :class:`reshard.CheckpointManager` (a protocol, so the
    resume sits below the manager it serves): the root, the group and the manager's
    record of the lineage it resumed."""

    @property
    def storage(self) -> Storage: ...

    @property
    def root(self) -> str: ...

    @property
    def coll(self) -> Collectives: ...

    @property
    def group(self) -> Any: ...

    def _resumed(self, head: Head) -> None: ...

    def _check_owner(self, hmac_key: bytes | None) -> None: ...

    def _owner_lease(self) -> str | None: ...


def _probe(mgr: Managed, path: str,
           hmac_key: bytes | None = None) -> tuple[str, str, BaseException | None]:
    """This rank's structural check of one checkpoint (no checksums): every
    rank reads the manifest (as its load would); the coordinator alone stats
    every file (one stat per file in all, not per rank). With ``hmac_key``,
    the manifest's signature is checked apart: a signature that does not
    verify ("key") says the reader's key is not the writer's (or the
    manifest was tampered with), not that the checkpoint is damaged."""
    try:
        m = read_manifest(mgr.storage, path)
        problems = torn_files(mgr.storage, path, m) if mgr.coll.rank == 0 else {}
    except StorageError as e:
        return "storage", str(e), e
    except CheckpointNotFoundError as e:
        return "gone", str(e), None
    except (IntegrityError, ManifestError) as e:
        return "torn", f"{type(e).__name__}: {e}", None
    if hmac_key is not None:
        try:
            check_signature(m, hmac_key, where=mgr.storage.join(path, MANIFEST_NAME))
        except IntegrityError as e:
            return "key", str(e), e
    if problems:
        return "torn", "; ".join(list(problems.values())[:3]), None
    return "ok", "", None


def _plan(mgr: Managed, step: int | None, name: str | None,
          accept: Callable[[Manifest], bool] | None = None) -> dict[str, Any]:
    """Coordinator: quarantine damaged manifests, list the committed
    checkpoints and order them (:func:`resume_order`), keeping those of
    ``step`` / ``name`` whose manifest ``accept`` (if given) accepts."""
    st, root = mgr.storage, mgr.root
    listed_at = time.time()  # HEAD's time: what is committed after the listing descends
    notes, aside = _quarantine_invalid(mgr)
    entries = committed(st, root)
    head, head_tag = read_head_tagged(st, root)
    lin = lineage_of(entries, Head.from_record(head))
    order = resume_order(entries, lin)
    if step is not None:
        order = [e for e in order if e.step == step]
    if name is not None:
        order = [e for e in order if e.name == name]
    if accept is not None:  # e.g. a TorchTitan model-only save is never resumed as a full state
        order = [e for e in order if e.manifest is not None and accept(e.manifest)]
    return {"notes": notes, "aside": aside, "order": [e.name for e in order], "listed_at": listed_at,
            "other": [e.name for e in order if lin.head is not None and e.name not in lin.current],
            "head": lin.head.name if lin.head is not None else None,
            "head_tag": head_tag,
            "attempt": {e.name: e.manifest.attempt_id for e in order if e.manifest is not None},
            "step": {e.name: e.step for e in order}}


def _rest(mgr: Managed) -> dict[str, Any]:
    """Coordinator: what is left under the root when nothing loaded."""
    es = scan(mgr.storage, mgr.root)
    return {"quarantined": [q.name for q in es if q.quarantined],
            "abandoned": [a.name for a in es if a.abandoned]}


def _coordinated(mgr: Managed, what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on the coordinator, its JSON result on every rank (its
    failure raised on every rank)."""
    coll = mgr.coll
    out = None
    tries = Tries()
    if coll.rank == 0:
        with tries:
            out = fn(*args)
    tries.agree(coll, what)
    return json.loads(coll.broadcast_bytes(json.dumps(out).encode() if coll.rank == 0 else None))


_STATUSES = ("storage", "torn", "gone", "key")


def _census(coll: Any, status: str) -> dict[str, int]:
    """How many ranks found each failure status: one all-reduce of small
    counters (no per-rank payload reaches any rank)."""
    flags = [int(status == s) for s in _STATUSES]
    red = coll.all_reduce_ints([*flags, int(status != "ok"), int(status == "torn" and coll.rank == 0)], "sum")
    n = len(_STATUSES)
    return {**dict(zip(_STATUSES, red[:n], strict=True)), "bad": red[n], "torn_coordinator": red[n + 1]}


def _unloadable(coll: Any, path: str, status: str, detail: str,
                failed: list[int] | None = None) -> str:
    """The agreed message for a checkpoint some rank could not load: the
    failing ranks' status and detail gathered to the coordinator only (run
    only when some rank failed), summarized there (rank ranges, the first
    detail, bounded) and broadcast. ``failed`` (the coordinator's): the ranks
    that actually failed, when every rank's status is the agreed outcome of
    one collective load (every rank raised it, only these ranks caused it)."""
    got = coll.gather_bytes(json.dumps([status, detail[:2000]] if status != "ok" else None).encode())
    msg = None
    if got is not None:
        rows = [(r, json.loads(b)) for r, b in enumerate(got)]
        bad = failed or [r for r, x in rows if x is not None]
        why = next((x[1] for _, x in rows if x is not None and x[1]), "")
        msg = f"{path}: unloadable ({why}{' ' if why else ''}on rank(s) {rank_ranges(bad)})"
    return coll.broadcast_bytes(msg.encode() if msg is not None else None).decode()


def restore_collective(mgr: Managed, state: Mapping[str, Any], *, step: int | None,
                       name: str | None, allow_fresh_start: bool,
                       load_kwargs: dict[str, Any], record_head: bool = True,
                       accept: Callable[[Manifest], bool] | None = None) -> LoadResult | None:
    """:meth:`reshard.CheckpointManager.restore` on every rank of ``mgr``'s
    group: the agreed plan (:func:`_agreed_plan`), then each checkpoint of
    its order in turn (:func:`_attempt`) until one loads; its HEAD is
    written when ``record_head``. Returns its result, or None for a fresh
    start (nothing committed, and ``allow_fresh_start`` where something was
    left behind: :func:`_refuse_fresh_start`).

    Raises:
        CheckpointNotFoundError: the ``step`` / ``name`` asked for is not committed.
        CheckpointError: as the module docstring says; the same on every rank.
    """
    root = mgr.root
    opts = load_kwargs.get("options")
    hmac_key = hmac_key_of(getattr(opts, "hmac_key", None))  # the caller's, else the environment's
    plan = _agreed_plan(mgr, hmac_key, step, name, accept, record_head)
    for note in plan["notes"]:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    if (step is not None or name is not None) and not plan["order"]:
        _raise_not_found(root, plan, step, name)
    failures: list[str] = list(plan["notes"])
    for cname in plan["order"]:
        res, msg = _attempt(mgr, state, cname, plan["attempt"].get(cname), hmac_key, load_kwargs)
        if res is None:
            failures.append(msg)
            warnings.warn(f"{msg}; falling back to an older checkpoint", RuntimeWarning, stacklevel=3)
            continue
        if cname in plan["other"]:
            warnings.warn(f"{root}: no checkpoint of the current lineage (HEAD: "
                          f"{plan['head']}) loads; resuming {cname} of another lineage",
                          RuntimeWarning, stacklevel=3)
        if record_head:  # (an evaluation reading a live root leaves its lineage alone)
            _write_head(mgr, cname, plan["attempt"].get(cname), plan["step"].get(cname),
                        plan["listed_at"], plan["head_tag"])
        if failures:
            res.notes["fallback"] = failures
        return res
    _refuse_fresh_start(mgr, failures, allow_fresh_start)
    return None


def _agreed_plan(mgr: Managed, hmac_key: bytes | None, step: int | None, name: str | None,
                 accept: Callable[[Manifest], bool] | None, record_head: bool) -> dict[str, Any]:
    """The checks before any checkpoint is tried, then the coordinator's
    :func:`_plan`, on every rank: this job still owns the root (a root that
    requires signing is resumed with a key only) and, when ``record_head``,
    the store can replace HEAD conditionally (a store that cannot is refused
    first). Raises the coordinator's failure of any of them on every rank."""
    st, root = mgr.storage, mgr.root
    _coordinated(mgr, f"restore {root} (owner)", mgr._check_owner, hmac_key)
    if record_head:
        _coordinated(mgr, f"restore {root} (store check)", st.check_publish, st.join(root, HEAD_NAME))
    return dict(_coordinated(mgr, f"restore {root} (listing)", _plan, mgr, step, name, accept))


def _raise_not_found(root: str, plan: dict[str, Any], step: int | None, name: str | None) -> None:
    """Raise for the checkpoint of ``step`` / ``name`` that the plan does not
    order. One committed whose manifest is damaged (set aside just now by
    :func:`_plan`) is unloadable, not "not found", which a caller may take
    for "start fresh".

    Raises:
        CheckpointError: it was set aside (the plan's notes on it).
        CheckpointNotFoundError: no committed checkpoint of ``step`` / named ``name``.
    """
    hit = [a["note"] for a in plan["aside"]
           if (step is None or a["step"] == step) and (name is None or a["name"] == name)]
    what = f"of step {step}" if step is not None else f"named {name!r}"
    if hit:
        raise CheckpointError(f"{root}: the checkpoint {what} is unloadable: " + "; ".join(hit))
    if step is not None:
        raise CheckpointNotFoundError(f"{root}: no committed checkpoint of step {step}")
    raise CheckpointNotFoundError(f"{root}: no committed checkpoint named {name!r}")


def _attempt(mgr: Managed, state: Mapping[str, Any], cname: str, attempt_id: str | None,
             hmac_key: bytes | None, load_kwargs: dict[str, Any]) -> tuple[LoadResult | None, str]:
    """Every rank tries the checkpoint ``cname``: the probe (:func:`_probe`),
    agreed by :func:`_census`, then the load. Returns ``(result, "")`` when
    it loaded on every rank, else ``(None, message)``: the agreed message of
    why it is unloadable (a torn one quarantined, the outcome appended), the
    same on every rank.

    Raises:
        CheckpointError: on every rank: some rank's store failed (``storage``),
            the HMAC key does not verify its manifest (``key``), or only other
            ranks than the coordinator found it torn and the coordinator finds
            it intact (nothing quarantined).
    """
    coll, path = mgr.coll, mgr.storage.join(mgr.root, cname)
    status, detail, exc = _probe(mgr, path, hmac_key)
    counts = _census(coll, status)
    if counts["storage"]:
        Tries(exc).agree(coll, f"restore {path}")
    if counts["key"]:  # never a reason to quarantine, nor to fall back (older ones too)
        Tries(exc).agree(coll, f"restore {path} (the HMAC key given does not verify its manifest; "
                         "nothing was quarantined)")
    torn_coord = counts["torn_coordinator"]  # from the probe: did rank 0 itself find it torn
    failed: list[int] | None = None  # the load's failing ranks (the coordinator knows all)
    if not counts["torn"] and not counts["gone"]:
        try:
            res = load(state, path, group=mgr.group, storage=mgr.storage, **load_kwargs)
        except (IntegrityError, ManifestError) as le:
            status, detail = "torn", f"load failed: {le}"
            torn_coord = int(0 in (sorted(le.failures) or [0]))  # agreed: same on every rank
            failed = sorted(le.failures) or None
        except CheckpointNotFoundError as le:
            status, detail = "gone", str(le)
            failed = sorted(le.failures) or None
        else:
            status = "ok"
        counts = _census(coll, status)  # load agrees its errors; confirm anyway
    if not counts["bad"]:
        return res, ""
    msg = _unloadable(coll, path, status, detail, failed)
    if counts["torn"] and not torn_coord \
            and not _coordinated(mgr, f"restore {path} (re-checking)", _damaged, mgr, path):
        # only other ranks failed, and the coordinator finds every byte
        # intact: those ranks see another copy (node-local storage, a
        # partial sync), never a reason to quarantine or to fall back
        raise CheckpointError(
            f"{msg}, but the coordinator (rank 0) finds it intact (every file and checksum): "
            "those rank(s) do not see the same storage as rank 0; nothing was quarantined")
    if counts["torn"]:
        msg += _quarantine(mgr, cname, attempt_id, msg)
    return None, msg


def _refuse_fresh_start(mgr: Managed, failures: list[str], allow_fresh_start: bool) -> None:
    """Nothing loaded: return when a fresh start is safe (nothing committed
    failed; nothing quarantined or abandoned is left, or
    ``allow_fresh_start``), else raise on every rank.

    Raises:
        CheckpointError: some checkpoint failed to load (``failures``, this
            restore's messages), or some is quarantined (without ``allow_fresh_start``).
        CheckpointNotFoundError: only abandoned attempts are left (without
            ``allow_fresh_start``).
    """
    root = mgr.root
    rest = _coordinated(mgr, f"restore {root} (listing)", _rest, mgr)
    quarantined = rest["quarantined"]
    if failures or (quarantined and not allow_fresh_start):
        listed = "\n  ".join(failures) if failures else "(none committed)"
        raise CheckpointError(
            f"{root}: checkpoint(s) exist but none loads:\n  {listed}"
            + (f"\nquarantined: {', '.join(quarantined)} (never deleted; inspect them with "
               "`reshard verify`)" if quarantined else ""))
    abandoned = rest["abandoned"]
    if abandoned and not allow_fresh_start:
        raise CheckpointNotFoundError(
            f"{root}: no committed checkpoint, but {len(abandoned)} abandoned attempt(s) "
            f"{abandoned[:3]}; refusing a silent fresh start (pass allow_fresh_start=True)")


def _damaged(mgr: Managed, path: str) -> bool:
    """Coordinator: whether its own view of ``path`` is damaged
    (:func:`reshard.verify` with every checksum; run only when other ranks
    alone failed to load it)."""
    return not verify(path, storage=mgr.storage).ok


def _quarantine_invalid(mgr: Managed) -> tuple[list[str], list[dict[str, Any]]]:
    """Coordinator: quarantine the checkpoints whose manifest is present but
    invalid (unparsable, failing the schema or its own consistency checks:
    ``ManifestError`` / ``IntegrityError``), which can never load. A manifest
    of a newer format version, with an unknown required feature, or of
    another format is left alone: a newer reader may load it. Returns the
    notes and, for each checkpoint set aside, its name and the step its
    damaged manifest names (None when it names none)."""
    st, root = mgr.storage, mgr.root
    out = []
    aside: list[dict[str, Any]] = []
    for e in scan(st, root):
        if e.manifest is not None or e.abandoned or e.quarantined or not e.problem:
            continue
        try:
            raw = json.loads(read_manifest_bytes(st, e.path))
        except (CheckpointError, ValueError):
            raw = None
        if isinstance(raw, dict) and (
                raw.get("format") != FORMAT
                or not isinstance(raw.get("format_version"), int) or raw["format_version"] > FORMAT_VERSION
                or set(raw.get("required_features") or ()) - KNOWN_FEATURES):
            continue
        why = f"{e.path}: unloadable (invalid manifest: {e.problem})"
        try:
            new = quarantine(st, root, e.name, reason=why, attempt_id=None)
            st.delete_tree(record_path(st, root, e.name))
            out.append(f"{why}; quarantined as {new}")
            step = raw.get("step") if isinstance(raw, dict) else None
            aside.append({"name": e.name, "step": step if type(step) is int else None, "note": out[-1]})
        except CheckpointError as qe:
            out.append(f"{why}; could not be quarantined ({type(qe).__name__}: {qe})")
    return out, aside


def _quarantine(mgr: Managed, name: str, attempt_id: str | None, reason: str) -> str:
    """Coordinator: set ``name`` aside; every rank learns the outcome."""
    coll, st = mgr.coll, mgr.storage
    note = ""
    if coll.rank == 0:
        try:
            new = quarantine(st, mgr.root, name, reason=reason, attempt_id=attempt_id)
            st.delete_tree(record_path(st, mgr.root, name))
            note = f"; quarantined as {new}"
        except Exception as qe:  # noqa: BLE001 - it stays skipped by this restore all the same
            note = f"; could not be quarantined ({type(qe).__name__}: {qe})"
    return coll.broadcast_bytes(note.encode() if coll.rank == 0 else None).decode()


def _write_head(mgr: Managed, name: str | None, attempt_id: str | None,
                step: int | None, listed_at: float, expect: str | None,
                what: str = "") -> None:
    """Coordinator writes HEAD naming ``name``; every rank adopts it, or
    every rank raises the lost race (compare-and-swap on the HEAD the plan
    read, tag ``expect``, where the store swaps conditionally). Its
    time is when the coordinator listed the root (``listed_at``), not when
    the load ended: a checkpoint the source's run committed while this
    restore was loading (another job resuming for an evaluation, say) is
    a descendant, not an abandoned branch. ``name`` None: a fresh start
    (:func:`start_lineage`); ``what`` names the call in an error."""
    coll = mgr.coll
    head = Head(name=name, id=f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-"
                f"{os.urandom(4).hex()}", time=listed_at, attempt_id=attempt_id, step=step,
                owner=mgr._owner_lease() if coll.rank == 0 else None)
    tries = Tries()
    if coll.rank == 0:
        with tries:
            write_head(mgr.storage, mgr.root, head.to_record(), expect=expect)
    tries.agree(coll, what or f"restore {mgr.root} (writing HEAD)")
    raw = coll.broadcast_bytes(json.dumps(head.to_record()).encode() if coll.rank == 0 else None)
    agreed = Head.from_record(json.loads(raw))
    assert agreed is not None
    mgr._resumed(agreed)


def start_lineage(mgr: Managed, what: str) -> None:
    """A run that did not resume starts a lineage of its own, before its
    first save: the coordinator writes a ``HEAD`` naming no checkpoint (a
    fresh start: name None) with a new id, by compare-and-swap on the HEAD
    it read; every rank adopts it. The checkpoints already in the root (a
    finished job's, an earlier run's this one did not resume from) are then
    another lineage: this run's retention never deletes them, its own
    newest is never taken for older than theirs, and a restart of this run
    resumes its own saves first (the breaker's two sequential jobs: job B's
    first checkpoint, step 1, was deleted at once for job A's step 2, and a
    restart of B resumed A's state).

    Raises:
        CheckpointError: on every rank, when HEAD could not be written
            (``what`` names the call).
    """
    tag = read_head_tagged(mgr.storage, mgr.root)[1] if mgr.coll.rank == 0 else None
    _write_head(mgr, None, None, None, time.time(), tag, what=what)
