"""Synchronous save: snapshot -> plan -> persist -> validate -> publish manifest last.

The entry :func:`save` and the orchestration every save shares
(:func:`run_save`: the coordinator protocol of
:func:`reshard.planning.coordination_save.save_steps` driven with this
rank's I/O: the attempt opened and checked, the manifest signed and
published). The collect phase lives in :mod:`reshard.saving.snapshot`, the
write phase in :mod:`reshard.saving.persist`; their names that other modules
import from here (``Snapshot``, ``collect``, ``finish_digests``,
``wants_digest``, ``persist``) are re-exported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..collectives import (
    Arrival,
    Collectives,
    drive,
    get_collectives,
    group_key,
    timed_collectives,
    timed_keys,
    watch,
)
from ..commit import attempts
from ..commit.protocol import (
    publish,
)
from ..commit.strategy import strategy_for
from ..errors import CheckpointError, StorageError
from ..ondisk.committed import sign_manifest
from ..ondisk.manifest import (
    Manifest,
)
from ..options import SaveOptions, hmac_key_of
from ..planning.coordination import PLAN_CACHE, Assignment
from ..planning.coordination_save import (
    Attempt,
    RankSave,
    integrity_check_assignment,
    save_steps,
)
from ..planning.plan_store import PLAN_FILE, parent_path, restart_entry
from ..planning.planner import LocalPlan
from ..storage import Storage, resolve
from .attempt import (
    _raise_removed,
    check_attempt_location,
    discard_attempt,
    open_attempt,
    removed_error,
)
from .persist import persist
from .snapshot import Snapshot, collect
from .snapshot import finish_digests as finish_digests  # re-exported: its old home
from .snapshot import wants_digest as wants_digest  # re-exported: its old home
from .staging_budget import PeakRss

log = logging.getLogger("reshard.save")


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What a save did (identical fields on every rank, except ``bytes_written``
    and ``manifest``, which only the coordinator holds).

    Attributes:
        path: the committed checkpoint.
        step: the step recorded in its manifest.
        attempt_id: the attempt that was published.
        bytes_written: data bytes this rank wrote.
        total_bytes: data bytes of the whole checkpoint.
        num_files: data files of the whole checkpoint.
        timings: seconds spent per phase on this rank ("stage", "plan", "write", "commit").
        manifest: the published manifest (coordinator only, else None).
        peak_rss_bytes: this rank's process's highest resident memory while
            the save ran (bytes; sampled every 5 ms, and whenever staging
            took a new slab, from the call to the commit).
        staging_peak_bytes: the most bytes of staging slabs (pinned
            included) this rank's save held at once (asynchronous saves;
            0 for a synchronous one, which stages nothing).
        staging_budget_bytes: the staging budget the save ran under
            (``SaveOptions.staging_budget_bytes`` or its default; 0 for a
            synchronous save).
    """

    path: str
    step: int | None
    attempt_id: str
    bytes_written: int
    total_bytes: int
    num_files: int
    timings: dict[str, float] = field(default_factory=dict)
    manifest: Manifest | None = None
    peak_rss_bytes: int = 0
    staging_peak_bytes: int = 0
    staging_budget_bytes: int = 0


def check_step(step: Any) -> int | None:
    """``step`` as an int (Python, NumPy or 0-dim torch integers), or None.

    Raises:
        TypeError: anything else (bool, float, str, ...), before any data is written.
    """
    import numbers

    if step is None:
        return None
    if hasattr(step, "item") and getattr(step, "shape", None) == () and not isinstance(step, bool):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")
    return int(step)


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    group: Any = None,
    options: SaveOptions | None = None,
    storage: Storage | None = None,
) -> SaveResult:
    """Save ``state`` as one committed checkpoint at ``path``.

    Every rank of ``group`` calls it with its own local state. Each rank writes
    its own shard files; one writer per logical element (replicas deduplicated,
    written bytes balanced); the coordinator (rank 0) writes ``manifest.json``
    last and publishes the attempt.

    One call saves one checkpoint: the coordinator decides its location
    (``path`` made canonical: absolute, symbolic links resolved) and creates
    the attempt with a random nonce in it; before any rank writes data, every
    rank checks that its own ``path`` names the same location and reads the
    nonce back through its own storage. Before publishing, the coordinator
    checks every data file is there at the size its writer reported.

    Args:
        state: the state tree (see DESIGN.md section 2); not mutated.
        path: the checkpoint (local path, ``file://`` or ``memory://`` URL),
            the same location on every rank (spellings may differ: relative
            or absolute, through symbolic links). Missing parent directories
            are created.
        step: recorded in the manifest; ``latest`` orders by it.
        group: process group (default: the default group, or single-process).
        options: :class:`SaveOptions`.
        storage: a backend to use instead of resolving ``path``.

    Returns:
        SaveResult on every rank.

    Raises:
        CheckpointError (or the common subclass of every rank's failure, e.g.
        ShardingError): on every rank when any rank failed (among them: ranks
        naming different checkpoints, a rank that cannot see the
        coordinator's attempt (node-local storage), an IntegrityError for a
        data file missing or short at publish); nothing is published, the
        attempt is discarded and no older checkpoint is touched. Never an
        earlier background save's failure: one nobody was told of is a
        ``RuntimeWarning`` here, and this save goes ahead. StorageError
        before any data is written when the store reports less free space
        than the plan needs (the message names both).
    """
    from .pending import warn_pending_error

    step = check_step(step)
    opts = options or SaveOptions()
    if opts.hmac_key is None or not opts.hmac_key:  # the environment's key (NO_HMAC_KEY: none)
        opts = dataclasses.replace(opts, hmac_key=hmac_key_of(opts.hmac_key))
    # every rank checks in first: a save called on some ranks only fails there, naming the others
    coll = timed_collectives(group, opts.timeout_s, arrival=Arrival(
        kind="save", what=f"save of step {step} at {os.fspath(path)}", timeout_s=opts.arrival_timeout_s))
    if coll.rank != 0 and opts.progress is not False:  # one progress bar: rank 0's
        opts = dataclasses.replace(opts, progress=False)
    warn_pending_error(group, wait=True, step=step)
    st, key = resolve(path, storage)
    t0 = time.perf_counter()
    rss = PeakRss().start()
    snap = None
    err: BaseException | None = None
    try:
        try:  # the block digests are computed while the writer writes (not before)
            snap = collect(state, coll.rank, opts, digests=False)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
        res = run_save(coll, st, key, snap, err, step=step, options=opts, t0=t0)
    finally:
        peak = rss.stop()
    return dataclasses.replace(res, peak_rss_bytes=peak)


def run_save(
    coll: Collectives, st: Storage, key: str, snap: Snapshot | None, err: BaseException | None, *,
    step: int | None, options: SaveOptions, t0: float, on_attempt: Any = None, abort: Any = None,
) -> SaveResult:
    """Plan, persist, validate and publish a collected snapshot (shared by
    ``save`` and the background thread of ``async_save``), through the
    coordinator protocol of :func:`reshard.planning.coordination.save_steps`; the
    plan is reused from the cache when no rank's structure changed."""
    timings: dict[str, float] = {"stage": time.perf_counter() - t0}
    lp = None
    if snap is not None:
        lp = LocalPlan(rank=coll.rank, tensors=tuple(t for t, _, _ in snap.tensors),
                       objects=tuple(o for o, _ in snap.objects), aliases=snap.aliases)
    gkey = group_key(coll)
    cache, restored = _plan_cache(coll, st, key, options, gkey, lp is not None)
    hooks = _RankSaver(coll=coll, st=st, key=key, snap=snap, plan=lp, step=step, options=options,
                       on_attempt=on_attempt, abort=abort)
    inc = options.incremental is True
    ctx = RankSave(rank=coll.rank, world_size=coll.world_size, plan=lp,
                   value_digests=snap.value_digests if snap is not None else {}, err=err,
                   files_per_rank=options.files_per_rank, hooks=hooks, cache=cache,
                   own_file_bytes=options.own_file_bytes if inc else 0)
    # progress lines and collective failures name the save and its phase
    watch(coll, lambda: (f"save of step {step}", ctx.phase))
    try:
        out = drive(coll, save_steps(ctx))
    finally:
        for lease in hooks.leases:
            lease.stop()
    if ctx.new_cache is not None:
        PLAN_CACHE[gkey] = ctx.new_cache
    timings.update(ctx.timings)
    if snap is not None:
        timings["hash"] = snap.hash_s
    timings["cached_plan"] = float(out.cached)
    timings["plan_from_parent"] = float(out.cached and restored)
    return SaveResult(path=st.url(key), step=step, attempt_id=out.attempt_id, bytes_written=out.bytes_written,
                      total_bytes=out.total_bytes, num_files=out.num_files, timings=timings,
                      manifest=hooks.published[0] if hooks.published else None)


def _plan_cache(coll: Collectives, st: Storage, key: str, options: SaveOptions, gkey: Any,
                planned: bool) -> tuple[Any, bool]:
    """The cached plan of this group (taken out of the cache), or, in a new
    process, the parent checkpoint's plan if it fits; and whether it came
    from the parent."""
    cache = PLAN_CACHE.pop(gkey, None)
    if cache is None and planned:  # a new process: the parent checkpoint's plan, if it fits
        prev = parent_path(st, key, options.parent)
        if prev is not None:
            cache = restart_entry(st, prev, coll.rank, coll.world_size,
                                  files_per_rank=options.files_per_rank, hmac_key=options.hmac_key)
            return cache, cache is not None
    return cache, False


class _RankSaver:
    """The I/O of one rank's save at the steps of
    :func:`reshard.planning.coordination_save.save_steps` (its
    :class:`~reshard.planning.coordination_save.SaveHooks`): the attempt
    opened and checked, the snapshot persisted, the manifest signed and
    published. Holds the coordinator's attempt lease (``leases``, stopped by
    the caller) and the published manifest (``published``)."""

    checks_space = True

    def __init__(self, *, coll: Collectives, st: Storage, key: str, snap: Snapshot | None,
                 plan: LocalPlan | None, step: int | None, options: SaveOptions,
                 on_attempt: Any, abort: Any) -> None:
        self.coll, self.st, self.key, self.snap, self.plan = coll, st, key, snap, plan
        self.step, self.options, self.on_attempt, self.abort = step, options, on_attempt, abort
        self.inc = options.incremental is True
        # attempts share the final prefix without rename: no plan kept there
        self.keeps_plan = strategy_for(st).keeps_plan
        self.leases: list[attempts.AttemptLease] = []
        self.published: list[Manifest] = []
        self.parent_m: Manifest | None = None  # the coordinator's view of the parent it links from

    def begin(self) -> Attempt:
        # the lease is held by the coordinator until publish (and rename) or
        # discard; it is written before the attempt exists, so no gc ever
        # sees the attempt without it
        from . import incremental

        st, options = self.st, self.options
        attempt = open_attempt(st, self.key, options, leases=self.leases)
        if self.inc:  # the parent to link unchanged chunks from (none: everything is written)
            src, pm = incremental.link_source(st, self.key, options.parent, hmac_key=options.hmac_key)
            if src is not None and pm is not None:
                attempt = dataclasses.replace(attempt, link_from=src)
                self.parent_m = pm
        return attempt

    def check_location(self, info: Attempt) -> None:
        try:
            check_attempt_location(self.coll.rank, self.st, self.key, info)
        except Exception as e:
            if self.coll.rank != 0:  # elsewhere an unseen attempt is node-local storage, not removal
                raise
            _raise_removed(self.st, info, e)

    def check_space(self, info: Attempt, needed: int) -> None:
        free = self.st.free_bytes(info.attempt_path)
        if free is not None and needed > free:
            raise StorageError(
                f"{info.target}: not enough space for the checkpoint of step {self.step}: it needs "
                f"about {needed} bytes ({needed / 2**20:.1f} MiB), {free} bytes "
                f"({free / 2**20:.1f} MiB) are free; nothing was written")

    def linkable(self, info: Attempt, layout: Any) -> int:
        from . import incremental

        if not self.inc or self.parent_m is None:
            return 0
        return incremental.linkable_bytes(self.st, self.parent_m, layout)

    def persist(self, info: Attempt, assignment: Assignment) -> tuple[bytes, int]:
        snap, lp, st, options = self.snap, self.plan, self.st, self.options
        assert snap is not None and lp is not None
        integrity_check_assignment(assignment, lp)
        attempt = info.attempt_path
        strategy = strategy_for(st)  # attempts under one prefix never share a key
        assignment = msgspec.structs.replace(
            assignment, files=[strategy.data_name(info.attempt_id, f) for f in assignment.files])
        if self.on_attempt is not None:
            self.on_attempt(attempt)
        try:  # into the coordinator's attempt, which this rank has been shown to see
            return persist(st, attempt, snap, assignment, options, link_from=info.link_from)
        except Exception as e:
            gone = removed_error(st, info, e)
            if gone is not e:
                raise gone from e
            if isinstance(e, OSError):  # a backend that raised a bare OSError: the store failed
                raise StorageError(f"{self.key}: writing rank {self.coll.rank}'s files failed: "
                                   f"{type(e).__name__}: {e}") from e
            raise

    def manifest_args(self) -> dict[str, Any]:
        from . import incremental

        snap, options = self.snap, self.options
        assert snap is not None
        return dict(step=self.step, checksum_block_bytes=options.checksum_block_bytes,
                    schema_version=options.schema_version, mesh=options.mesh,
                    values=snap.values_json, extra=dict(options.extra), parent=options.parent,
                    lineage=options.lineage, adapters=snap.adapters,
                    origin_of=incremental.origin_of(self.st, self.parent_m)
                    if self.parent_m is not None else None)

    def write_plan(self, info: Attempt, raw: bytes) -> None:
        try:
            self.st.write_bytes(self.st.join(info.attempt_path, PLAN_FILE), raw,
                                durable=self.options.durable)
        except Exception as e:
            _raise_removed(self.st, info, e)

    def publish(self, info: Attempt, manifest: Manifest) -> None:
        from . import incremental

        st, options = self.st, self.options
        if self.abort is not None and self.abort.is_set():
            raise CheckpointError(f"{self.key}: save abandoned before publishing")
        manifest = strategy_for(st).name_files(manifest, info.attempt_id)  # the keys persist wrote
        if options.hmac_key is not None:
            manifest = sign_manifest(manifest, options.hmac_key)
        try:
            publish(st, info.attempt_path, info.target, manifest, overwrite=options.overwrite,
                    durable=options.durable)
        except Exception as e:
            _raise_removed(st, info, e)
        self.published.append(manifest)
        if self.inc:
            incremental.remember(st, info.target, manifest)

    def discard(self, info: Attempt) -> None:
        discard_attempt(self.coll, self.st, info.attempt_path, attempt_id=info.attempt_id)


def drop_plan_cache(group: Any = None) -> None:
    """Forget this process's cached save plan for ``group`` (default: the
    default group), as a restart does: the next save reuses the parent
    checkpoint's plan (``SaveOptions.parent``) when it fits, else plans."""
    for k in [group_key(get_collectives(group)), *timed_keys(group)]:
        PLAN_CACHE.pop(k, None)


