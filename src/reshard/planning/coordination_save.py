"""One rank's side of a coordinated save (DESIGN.md section 4): the steps of
:func:`save_steps`, a generator driven by :func:`reshard.collectives.drive` over the
coordinator's plan (:mod:`reshard.planning.coordination`), with its space check, byte reports and
the check of an assignment against the rank's own plan.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ..collectives import OnFail, Request, Tries
from ..errors import CheckpointError, IntegrityError
from ..ondisk.manifest import Manifest
from ..state.sharding import itemsize, numel
from .coordination import (
    _DEC_ASSIGN,
    _ENC,
    Assignment,
    CacheEntry,
    Layout,
    Report,
    build_manifest,
    coordinate,
    encode_plan,
    paused_gc,
    structure_hash,
    values_hash,
)
from .plan_store import encode_plan_file
from .planner import LocalObjectItem, LocalPlan, LocalTensorItem


@dataclass(frozen=True, kw_only=True)
class LinkSource:
    """The parent checkpoint an incremental save links unchanged chunks from
    (:func:`reshard.saving.incremental.link_source`): its canonical
    location and its attempt id (which names its files where attempts share
    a prefix)."""

    path: str
    attempt_id: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "attempt": self.attempt_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LinkSource:
        return cls(path=str(d["path"]), attempt_id=str(d["attempt"]))


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One save's attempt, as the coordinator opened it
    (:func:`reshard.saving.attempt.open_attempt`) and broadcast it to every
    rank: the canonical checkpoint location (``target``), the attempt id,
    where the attempt writes (``attempt_path``: its own directory where
    rename is atomic, else the final prefix), the nonce every rank reads
    back before writing, and the parent an incremental save links from.
    It travels as JSON (:meth:`to_json`: the keys ``target``, ``attempt``,
    ``attempt_path``, ``nonce`` and, with a parent, ``link_from``)."""

    target: str
    attempt_id: str
    attempt_path: str
    nonce: str
    link_from: LinkSource | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target, "attempt": self.attempt_id,
                               "attempt_path": self.attempt_path, "nonce": self.nonce}
        if self.link_from is not None:
            out["link_from"] = self.link_from.to_json()
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Attempt:
        link = d.get("link_from")
        return cls(target=str(d["target"]), attempt_id=str(d["attempt"]),
                   attempt_path=str(d["attempt_path"]), nonce=str(d["nonce"]),
                   link_from=LinkSource.from_json(link) if link is not None else None)


class SaveHooks(Protocol):
    """What one rank's save does at the steps of :func:`save_steps` (the
    I/O; the protocol itself does none), in call order:

    1. ``begin()`` (coordinator): check the target, create the attempt,
       return it; broadcast to every rank.
    2. ``check_location(attempt)`` (every rank, before writing): this rank
       names the same checkpoint and sees the attempt.
    3. ``check_space(attempt, needed)`` (coordinator, once the plan is
       known and before any rank writes; only where :attr:`checks_space`):
       raise when ``needed`` bytes (an estimate of the data files' total,
       less :meth:`linkable`) will not fit.
    4. ``persist(attempt, assignment) -> (report bytes, bytes written)``
       (every rank).
    5. ``manifest_args()``, ``write_plan(attempt, raw)`` (only where
       :attr:`keeps_plan`: the plan, ``plan.bin``, kept in the attempt, see
       :mod:`reshard.planning.plan_store`), ``publish(attempt, manifest)``
       (coordinator).

    ``discard(attempt)`` (coordinator) follows any agreed failure once the
    attempt exists. Every hook runs on the thread that drives the protocol;
    its exceptions are agreed by every rank."""

    #: whether ``check_space`` is called
    checks_space: bool
    #: whether ``write_plan`` is called
    keeps_plan: bool

    def begin(self) -> Attempt: ...

    def check_location(self, attempt: Attempt) -> None: ...

    def check_space(self, attempt: Attempt, needed: int) -> None: ...

    def linkable(self, attempt: Attempt, layout: Layout) -> int:
        """Bytes of the planned files expected to be linked from the parent,
        not written (incremental saves; else 0)."""
        ...

    def persist(self, attempt: Attempt, assignment: Assignment) -> tuple[bytes, int]: ...

    def manifest_args(self) -> dict[str, Any]: ...

    def write_plan(self, attempt: Attempt, raw: bytes) -> None: ...

    def publish(self, attempt: Attempt, manifest: Manifest) -> None: ...

    def discard(self, attempt: Attempt) -> None: ...


@dataclass
class RankSave:
    """One rank's inputs to :func:`save_steps` (and what it leaves behind:
    ``new_cache``, ``phase``, ``timings``); the I/O is ``hooks``'."""

    rank: int
    world_size: int
    plan: LocalPlan | None
    value_digests: dict[str, str]
    err: BaseException | None
    files_per_rank: int
    hooks: SaveHooks
    cache: CacheEntry | None = None
    #: tensor chunks of at least this many bytes get files of their own
    #: (incremental saves, :func:`reshard.planning.planner.plan_save`); 0: none
    own_file_bytes: int = 0
    new_cache: CacheEntry | None = None
    #: the phase this rank is in ("plan", "write": writing and waiting for the
    #: others to finish theirs, "publish"), named by a collective's failure
    phase: str = "plan"
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SaveOutcome:
    attempt_id: str
    cached: bool
    bytes_written: int
    total_bytes: int
    num_files: int
    manifest: Manifest | None


def planned_bytes(layout: Layout) -> int:
    """The bytes a save of ``layout`` writes: every assigned item's bytes,
    plus a bound on the shard files' headers and block tables (4 KiB per
    file and 16 bytes per MiB of data). Known before anything is written."""
    data = files = 0
    for r, a in enumerate(layout.assignments):
        files += len(a.files)
        data += sum(_item_bytes(it) for it in layout.written_items(r))
    return data + 4096 * files + 16 * (data >> 20)


def _item_bytes(it: LocalTensorItem | LocalObjectItem) -> int:
    """An item's bytes; a layout rebuilt from plan.bin keeps no sizes, so a
    tensor's come from its dtype and shape (or flattened range), an object's
    encoded size is then unknown (counted 0: small beside the tensors)."""
    if it.nbytes or isinstance(it, LocalObjectItem):
        return it.nbytes
    n = it.flattened_range[1] - it.flattened_range[0] if it.flattened_range else numel(it.local_shape)
    return n * itemsize(it.dtype)


def _check_space(ctx: RankSave, attempt: Attempt, layout: Layout) -> None:
    hooks = ctx.hooks
    if hooks.checks_space:
        hooks.check_space(attempt, max(0, planned_bytes(layout) - hooks.linkable(attempt, layout)))


@dataclass(frozen=True, kw_only=True)
class _Planned:
    """What the plan step of :func:`save_steps` hands the write step."""

    attempt: Attempt
    assignment: Assignment
    layout: Layout | None
    cached: bool


def save_steps(ctx: RankSave) -> Generator[Request, Any, SaveOutcome]:
    """The save protocol of one rank (see the module docstring); yields
    collective requests, returns the outcome; raises the agreed error on
    every rank when any rank failed (the coordinator discards the attempt
    once it exists). On success ``ctx.new_cache`` holds the entry to cache
    (None when the save failed)."""
    tries = Tries(ctx.err)
    opened: list[Attempt] = []  # the coordinator's attempt, once it exists

    def discard(agreed: CheckpointError, mine: BaseException | None) -> None:
        if ctx.rank == 0 and opened:
            ctx.hooks.discard(opened[0])

    sh = vh = 0
    if tries.ok:
        with tries:
            assert ctx.plan is not None
            sh = structure_hash(ctx.plan, world_size=ctx.world_size, files_per_rank=ctx.files_per_rank,
                                own_file_bytes=ctx.own_file_bytes)
            vh = values_hash(ctx.value_digests)
            if ctx.rank == 0:
                opened.append(ctx.hooks.begin())
    c = ctx.cache
    changed = 0 if c is not None and c.struct_hash == sh else 1
    pid = c.plan_id if c is not None else 0
    red = yield from tries.agree_steps(ctx.rank, "save", [changed, pid, -pid, vh, -vh], on_fail=discard)
    cached = red[0] == 0 and red[1] == -red[2] != 0 and red[3] == -red[4]
    planned = yield from _plan_steps(ctx, tries, opened, sh, cached, discard)
    report, mine, t2 = yield from _write_steps(ctx, tries, planned, discard)
    manifest, totals = yield from _publish_steps(ctx, tries, planned, report, t2, discard)
    assignment = planned.assignment
    ctx.new_cache = CacheEntry(struct_hash=sh, plan_id=assignment.plan_id, assignment=assignment,
                               layout=planned.layout if ctx.rank == 0 else None)
    return SaveOutcome(attempt_id=planned.attempt.attempt_id, cached=cached, bytes_written=mine,
                       total_bytes=totals[0], num_files=totals[1], manifest=manifest)


def _plan_steps(ctx: RankSave, tries: Tries, opened: list[Attempt], sh: int, cached: bool,
                discard: OnFail) -> Generator[Request, Any, _Planned]:
    """The attempt broadcast and checked on every rank, then this rank's
    assignment: the cached one, or the coordinator's plan of every rank's
    local plan (gather, coordinate, scatter); the space check before any
    data is written. Agreed."""
    rank = ctx.rank
    assert ctx.plan is not None
    t0 = time.perf_counter()
    raw = yield ("broadcast_bytes", msgspec.json.encode(opened[0].to_json()) if rank == 0 else None)
    attempt = Attempt.from_json(msgspec.json.decode(raw))
    layout: Layout | None = None
    with tries:  # agreed below, before any data is written
        ctx.hooks.check_location(attempt)
    c = ctx.cache
    if cached:
        assert c is not None
        assignment = c.assignment
        layout = c.layout
        if rank == 0 and tries.ok and layout is not None:
            with tries:
                _check_space(ctx, attempt, layout)
        yield from tries.agree_steps(rank, "save (attempt location)", on_fail=discard)
    else:
        got = yield ("gather_bytes", encode_plan(ctx.plan, sh, ctx.value_digests))
        parts: list[bytes] | None = None
        if got is not None and tries.ok:
            tc = time.thread_time()  # this thread's CPU (writer or gloo threads not counted)
            with tries, paused_gc():
                parts, layout = coordinate(got, files_per_rank=ctx.files_per_rank,
                                           own_file_bytes=ctx.own_file_bytes)
            if tries.ok and layout is not None:
                with tries:
                    _check_space(ctx, attempt, layout)
            ctx.timings["coordinate_cpu"] = time.thread_time() - tc
        yield from tries.agree_steps(rank, "save", on_fail=discard)
        assignment = _DEC_ASSIGN.decode((yield ("scatter_bytes", parts)))
    ctx.timings["plan"] = time.perf_counter() - t0  # wall clock, waiting included
    return _Planned(attempt=attempt, assignment=assignment, layout=layout, cached=cached)


def _write_steps(ctx: RankSave, tries: Tries, planned: _Planned,
                 discard: OnFail) -> Generator[Request, Any, tuple[bytes, int, float]]:
    """Every rank writes its files of the assignment; agreed. Returns the
    write report for the coordinator, the bytes written and when the
    agreement began (the commit phase's start)."""
    t1 = time.perf_counter()
    report, mine = b"", 0
    ctx.phase = "write"
    with tries:
        report, mine = ctx.hooks.persist(planned.attempt, planned.assignment)
    ctx.timings["write"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    yield from tries.agree_steps(ctx.rank, "save", on_fail=discard)
    return report, mine, t2


def _publish_steps(ctx: RankSave, tries: Tries, planned: _Planned, report: bytes, t2: float,
                   discard: OnFail) -> Generator[Request, Any, tuple[Manifest | None, list[int]]]:
    """The reports gathered; the coordinator builds the manifest, keeps the
    plan and publishes; agreed. Returns the manifest (coordinator) and the
    checkpoint's total bytes and file count (every rank)."""
    ctx.phase = "publish"
    reports = yield ("gather_bytes", report)
    manifest = None
    totals = [0, 0]
    if reports is not None:
        with tries:
            manifest = _build_and_publish(ctx, planned, reports)
            totals = [manifest.total_bytes, len(manifest.files)]
    totals = yield from tries.agree_steps(ctx.rank, "save (publish)", totals, on_fail=discard)
    ctx.timings["commit"] = time.perf_counter() - t2
    return manifest, totals


def _build_and_publish(ctx: RankSave, planned: _Planned, reports: list[bytes]) -> Manifest:
    """Coordinator: the manifest from the layout and the reports, the plan
    kept in the attempt, the manifest published."""
    tm = time.thread_time()
    layout = planned.layout
    assert layout is not None
    pidx = None
    if ctx.hooks.keeps_plan:
        if layout.encoded is None:
            layout.encoded = encode_plan_file(layout, files_per_rank=ctx.files_per_rank)
        pidx = layout.encoded[1]
    with paused_gc():
        manifest = build_manifest(layout, reports, attempt_id=planned.attempt.attempt_id, plan=pidx,
                                  **ctx.hooks.manifest_args())
    ctx.timings["manifest_build_cpu"] = time.thread_time() - tm
    if ctx.hooks.keeps_plan:
        assert layout.encoded is not None
        ctx.hooks.write_plan(planned.attempt, layout.encoded[0])
    ctx.hooks.publish(planned.attempt, manifest)
    return manifest


def report_bytes(files: Sequence[tuple[int, str, int]], writes: Sequence[tuple[int, int, str, int]],
                 digests: Sequence[str], contents: Sequence[str] = (), linked: Sequence[int] = ()) -> bytes:
    return _ENC.encode(Report(files=list(files), writes=list(writes), digests=list(digests),
                              contents=list(contents), linked=list(linked)))


def integrity_check_assignment(a: Assignment, plan: LocalPlan) -> None:
    """A cached assignment must index this rank's current items (guards a
    stale cache that survived a structure change)."""
    nt, no = len(plan.tensors), len(plan.objects)
    for kind, i, _ in a.writes:
        if not 0 <= i < (nt if kind == 0 else no):
            raise IntegrityError("cached save plan does not match the local state (re-plan)")
