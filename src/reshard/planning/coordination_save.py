"""One rank's side of a coordinated save (DESIGN.md section 4): the steps of
:func:`save_steps`, a generator driven by :func:`reshard.collectives.drive` over the
coordinator's plan (:mod:`reshard.planning.coordination`), with its space check, byte reports and
the check of an assignment against the rank's own plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..collectives import Request, agree_steps
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


@dataclass
class RankSave:
    """One rank's inputs to :func:`save_steps`.

    ``begin()`` (coordinator only): check the target, create the attempt and
    return what every rank needs to find it (JSON-safe, with at least
    ``"attempt"``, the attempt id); broadcast to every rank as ``info``.
    ``check_location(info)`` (every rank, before writing): this rank sees it.
    ``persist(info, assignment) -> (report bytes, bytes written)``.
    ``publish(info, manifest)``, ``discard(info)``: coordinator only.
    ``write_plan(info, raw)`` (coordinator, before publish; optional): keep
    the plan (``plan.bin``, :mod:`reshard.planning.plan_store`) in the attempt.
    ``check_space(info, needed)`` (coordinator, once the plan is known and
    before any rank writes; optional): raise when ``needed`` bytes (an
    estimate of the data files' total) will not fit.
    """

    rank: int
    world_size: int
    plan: LocalPlan | None
    value_digests: dict[str, str]
    err: BaseException | None
    files_per_rank: int
    begin: Callable[[], dict[str, Any]]
    check_location: Callable[[dict[str, Any]], None]
    persist: Callable[[dict[str, Any], Assignment], tuple[bytes, int]]
    publish: Callable[[dict[str, Any], Manifest], None]
    discard: Callable[[dict[str, Any]], None]
    manifest_args: Callable[[], dict[str, Any]]
    cache: CacheEntry | None = None
    write_plan: Callable[[dict[str, Any], bytes], None] | None = None
    check_space: Callable[[dict[str, Any], int], None] | None = None
    #: tensor chunks of at least this many bytes get files of their own
    #: (incremental saves, :func:`reshard.planning.planner.plan_save`); 0: none
    own_file_bytes: int = 0
    #: (coordinator, incremental saves) ``linkable(info, layout) -> bytes`` of
    #: the planned files expected to be linked from the parent, not written:
    #: the space check counts only the rest
    linkable: Callable[[dict[str, Any], Layout], int] | None = None
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


def _check_space(ctx: RankSave, info: dict[str, Any], layout: Layout) -> BaseException | None:
    if ctx.check_space is None:
        return None
    try:
        need = planned_bytes(layout)
        if ctx.linkable is not None:
            need = max(0, need - ctx.linkable(info, layout))
        ctx.check_space(info, need)
    except Exception as e:  # noqa: BLE001 - agreed by the caller, before any data is written
        return e
    return None


def save_steps(ctx: RankSave) -> Generator[Request, Any, SaveOutcome]:
    """The save protocol of one rank (see the module docstring); yields
    collective requests, returns the outcome; raises the agreed error on
    every rank when any rank failed. On success ``ctx.new_cache`` holds the
    entry to cache (None when the save failed)."""
    rank, err = ctx.rank, ctx.err
    info: dict[str, Any] | None = None
    sh = vh = 0
    if err is None:
        try:
            assert ctx.plan is not None
            sh = structure_hash(ctx.plan, world_size=ctx.world_size, files_per_rank=ctx.files_per_rank,
                                own_file_bytes=ctx.own_file_bytes)
            vh = values_hash(ctx.value_digests)
            if rank == 0:
                info = ctx.begin()
        except Exception as e:  # noqa: BLE001 - agreed below
            err = e
    c = ctx.cache
    changed = 0 if c is not None and c.struct_hash == sh else 1
    pid = c.plan_id if c is not None else 0

    def discard() -> None:
        if rank == 0 and info is not None:
            ctx.discard(info)

    try:
        red = yield from agree_steps(rank, "save", err, [changed, pid, -pid, vh, -vh])
    except CheckpointError:
        discard()
        raise
    cached = red[0] == 0 and red[1] == -red[2] != 0 and red[3] == -red[4]
    assert ctx.plan is not None
    t0 = time.perf_counter()
    raw = yield ("broadcast_bytes", msgspec.json.encode(info) if rank == 0 else None)
    info = msgspec.json.decode(raw)
    assert info is not None
    layout: Layout | None = None
    err = None
    try:
        ctx.check_location(info)
    except Exception as e:  # noqa: BLE001 - agreed below, before any data is written
        err = e
    try:
        if cached:
            assert c is not None
            assignment = c.assignment
            layout = c.layout
            if rank == 0 and err is None and layout is not None:
                err = _check_space(ctx, info, layout)
            yield from agree_steps(rank, "save (attempt location)", err)
        else:
            got = yield ("gather_bytes", encode_plan(ctx.plan, sh, ctx.value_digests))
            parts: list[bytes] | None = None
            if got is not None and err is None:
                tc = time.thread_time()  # this thread's CPU (writer or gloo threads not counted)
                try:
                    with paused_gc():
                        parts, layout = coordinate(got, files_per_rank=ctx.files_per_rank,
                                                   own_file_bytes=ctx.own_file_bytes)
                except Exception as e:  # noqa: BLE001
                    err = e
                if err is None and layout is not None:
                    err = _check_space(ctx, info, layout)
                ctx.timings["coordinate_cpu"] = time.thread_time() - tc
            yield from agree_steps(rank, "save", err)
            assignment = _DEC_ASSIGN.decode((yield ("scatter_bytes", parts)))
    except CheckpointError:
        discard()
        raise
    ctx.timings["plan"] = time.perf_counter() - t0  # wall clock, waiting included
    t1 = time.perf_counter()
    err = None
    report, mine = b"", 0
    ctx.phase = "write"
    try:
        report, mine = ctx.persist(info, assignment)
    except Exception as e:  # noqa: BLE001
        err = e
    ctx.timings["write"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    try:
        yield from agree_steps(rank, "save", err)
    except CheckpointError:
        discard()
        raise
    ctx.phase = "publish"
    reports = yield ("gather_bytes", report)
    err = None
    manifest = None
    totals = [0, 0]
    if reports is not None:
        tm = time.thread_time()
        try:
            assert layout is not None
            pidx = None
            if ctx.write_plan is not None:
                if layout.encoded is None:
                    layout.encoded = encode_plan_file(layout, files_per_rank=ctx.files_per_rank)
                pidx = layout.encoded[1]
            with paused_gc():
                manifest = build_manifest(layout, reports, attempt_id=str(info["attempt"]), plan=pidx,
                                          **ctx.manifest_args())
            ctx.timings["manifest_build_cpu"] = time.thread_time() - tm
            if ctx.write_plan is not None:
                assert layout.encoded is not None
                ctx.write_plan(info, layout.encoded[0])
            ctx.publish(info, manifest)
            totals = [manifest.total_bytes, len(manifest.files)]
        except Exception as e:  # noqa: BLE001
            err = e
    try:
        totals = yield from agree_steps(rank, "save (publish)", err, totals)
    except CheckpointError:
        discard()
        raise
    ctx.timings["commit"] = time.perf_counter() - t2
    ctx.new_cache = CacheEntry(struct_hash=sh, plan_id=assignment.plan_id, assignment=assignment,
                               layout=layout if rank == 0 else None)
    return SaveOutcome(attempt_id=str(info["attempt"]), cached=cached, bytes_written=mine,
                       total_bytes=totals[0], num_files=totals[1], manifest=manifest)


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
