"""Synchronous save: snapshot -> plan -> persist -> validate -> publish manifest last."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from ..adapters.model import ModelState
from ..collectives import (
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
from ..errors import CheckpointError, ShardingError, StorageError
from ..ondisk import codec
from ..ondisk.committed import sign_manifest
from ..ondisk.manifest import (
    Manifest,
)
from ..ondisk.shardfile import FileItem, block_digests, digest_of, tensor_bytes, write_shard_file
from ..options import SaveOptions, hmac_key_of
from ..planning.coordination import PLAN_CACHE, Assignment
from ..planning.coordination_save import (
    RankSave,
    integrity_check_assignment,
    report_bytes,
    save_steps,
)
from ..planning.plan_store import PLAN_FILE, parent_path, restart_entry
from ..planning.planner import LocalObjectItem, LocalPlan, LocalTensorItem
from ..state.sharding import ShardedTensor, dtype_name
from ..state.tree import flatten
from ..storage import Storage, resolve
from .attempt import (
    _raise_removed,
    check_attempt_location,
    discard_attempt,
    open_attempt,
    removed_error,
)

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
    """

    path: str
    step: int | None
    attempt_id: str
    bytes_written: int
    total_bytes: int
    num_files: int
    timings: dict[str, float] = field(default_factory=dict)
    manifest: Manifest | None = None


@dataclass
class Snapshot:
    """The state to write, flattened and held in memory the save owns (or, for
    a synchronous save, that the caller promises not to mutate until return)."""

    tensors: list[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None]]
    objects: list[tuple[LocalObjectItem, bytes]]
    values: dict[str, Any]
    values_json: Any
    aliases: dict[str, str]
    value_digests: dict[str, str]
    plain: set[str] = field(default_factory=set)
    #: tree path -> kind of what saved it (Manifest.adapters)
    adapters: dict[str, str] = field(default_factory=dict)


def _storage_key(item: LocalTensorItem) -> str:
    name = item.fqn
    if item.global_offset:
        name += "@" + ",".join(map(str, item.global_offset))
    if item.flattened_range is not None:
        name += "#{}:{}".format(*item.flattened_range)
    return name


def _alias_key(st: ShardedTensor) -> tuple[Any, ...] | None:
    d = st.data
    if d.numel() == 0:
        return None
    return (d.untyped_storage().data_ptr(), d.storage_offset(), tuple(d.shape), tuple(d.stride()),
            d.dtype, d.device, st.global_shape, st.global_offset, st.local_shape,
            st.flat_bounds)


def collect(
    state: Mapping[str, Any],
    rank: int,
    options: SaveOptions,
    *,
    copy: Any = None,
) -> Snapshot:
    """Flatten ``state`` and describe every local item.

    ``copy`` (``tensor -> tensor``): used by async save to copy each tensor
    into library-owned staging memory; None keeps views of the caller's memory.
    """
    from ..adapters.dtensor import dtensor_shards

    leaves = flatten(state, module_adapter=ModelState)
    sts: list[ShardedTensor] = list(leaves.tensors)
    for path, t in leaves.plain.items():
        sts.append(ShardedTensor(path, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim(),
                                 replica_id=rank))
    for path, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(path, dt))
    plain_fqns = set(leaves.plain)
    # plain tensors are replicas: every rank must hold the same ones (a tensor
    # held by one rank only is not a replica), compared like the common values
    presence = {f"<tensor>{p}": f"{tuple(t.shape)}:{t.dtype}" for p, t in leaves.plain.items()}
    tensors: list[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None]] = []
    seen: dict[tuple[Any, ...], int] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for st in sts:
        fqn = st.fqn
        ak = _alias_key(st)
        if ak is not None and by_view.get(ak, fqn) != fqn:
            # the same memory, viewed the same way, under another fqn: tied weights
            aliases[fqn] = by_view[ak]
            continue
        if ak is not None:
            by_view[ak] = fqn
        key = (fqn, st.global_offset, st.local_shape, st.flat_bounds)
        if key in seen:
            raise ShardingError(f"{fqn}: the same chunk at offset {list(st.global_offset)} appears "
                                f"twice in rank {rank}'s state")
        seen[key] = len(tensors)
        data = st.data if copy is None else copy(st.data)
        mv = tensor_bytes(data)
        item = LocalTensorItem(
            fqn=fqn, dtype=dtype_name(st.data.dtype), global_shape=st.global_shape,
            global_offset=st.global_offset, local_shape=st.local_shape,
            flattened_range=st.flat_bounds, replica_id=st.replica_id, nbytes=len(mv),
        )
        tensors.append((item, mv, None))
    objects: list[tuple[LocalObjectItem, bytes]] = []
    encoded: dict[int, tuple[bytes, str]] = {}  # one value under many keys (an optimizer group's
    for ob in leaves.objects:                   # hyperparameters, per parameter): encoded once
        got = encoded.get(id(ob.value))
        if got is None:
            raw = codec.encode(ob.value, path=ob.key)
            got = encoded[id(ob.value)] = (raw, xxhash.xxh3_64_hexdigest(raw))
        raw, digest = got
        objects.append((LocalObjectItem(key=ob.key, global_shape=ob.global_shape,
                                        global_offset=ob.global_offset, replica_id=ob.replica_id,
                                        nbytes=len(raw), digest=digest), raw))
    values_json = {}
    value_digests: dict[str, str] = dict(presence)
    for path, v in leaves.values.items():
        try:
            j = codec.to_json(v, path=path)
        except TypeError as e:
            raise ShardingError(str(e)) from None
        values_json[path] = j
        value_digests[path] = xxhash.xxh3_64_hexdigest(msgspec.json.encode(j))
    clash = (set(values_json) | {o.key for o, _ in objects}) & {t.fqn for t, _, _ in tensors}
    if clash:
        raise ShardingError(f"names used both for a tensor and a value/object: {sorted(clash)[:5]}")
    snap = Snapshot(tensors=tensors, objects=objects, values=leaves.values, values_json=values_json,
                    aliases=aliases, value_digests=value_digests, plain=plain_fqns,
                    adapters=leaves.adapters)
    if copy is None:
        finish_digests(snap, options)
    return snap


def finish_digests(snap: Snapshot, options: SaveOptions) -> None:
    """Compute block checksums (and replica digests) of the snapshot's tensors.

    Runs on the caller's thread for a synchronous save and in the background
    for an asynchronous one (the stall then only covers the copies)."""
    block = options.checksum_block_bytes
    for i, (item, mv, _) in enumerate(snap.tensors):
        # every holder must compute the digest when replicas are compared: replica_id 0
        # does not mean "not replicated" (another rank may hold the same chunk), and a
        # holder without a digest ("") would disagree with one that has it
        if options.checksums or options.verify_replicas or item.fqn in snap.plain:
            sums = block_digests(mv, block)
            item = msgspec.structs.replace(item, digest=digest_of(sums, len(mv)))
            snap.tensors[i] = (item, mv, sums if options.checksums else None)


def persist(storage: Storage, attempt: str, snap: Snapshot, assignment: Assignment,
            options: SaveOptions) -> tuple[bytes, int]:
    """Write this rank's files of ``assignment``; returns the write report for
    the coordinator (see :class:`reshard.planning.coordination.Report`) and the bytes
    written."""
    from ..state.sharding import itemsize as isz

    per_file: list[list[tuple[int, int, int]]] = [[] for _ in assignment.files]
    for pos, (kind, i, fi) in enumerate(assignment.writes):
        per_file[fi].append((pos, kind, i))
    placed: list[tuple[int, int, str, int]] = [(0, 0, "", -1)] * len(assignment.writes)

    def write_one(fi: int) -> tuple[int, str, int]:
        items: list[FileItem] = []
        for _pos, kind, i in per_file[fi]:
            if kind == 0:
                it, mv, sums = snap.tensors[i]
                shape = (it.flattened_range[1] - it.flattened_range[0],) if it.flattened_range else it.local_shape
                items.append(FileItem(name=_storage_key(it), dtype=it.dtype, shape=tuple(shape), data=mv,
                                      itemsize=isz(it.dtype), checksums=sums))
            else:
                ob, raw = snap.objects[i]
                key = "__object__/" + ob.key + "@" + ",".join(map(str, ob.global_offset))
                items.append(FileItem(name=key, dtype="uint8", shape=(len(raw),),
                                      data=memoryview(raw), itemsize=1))
        size, checksum, written = write_shard_file(
            storage, storage.join(attempt, assignment.files[fi]), items,
            block_bytes=options.checksum_block_bytes, checksums=options.checksums, durable=options.durable,
            block_table=True)
        blocks = 0
        for (pos, _, _), w in zip(per_file[fi], written, strict=True):
            placed[pos] = (w.offset, w.length, w.root, w.block_index)
            blocks += len(w.checksums) if w.block_index >= 0 else 0
        return size, checksum, blocks

    n = len(assignment.files)
    from ..progress import bar, wanted

    with bar(None, "save", enabled=wanted(options.progress)) as pb:
        def write_counted(k: int) -> tuple[int, str, int]:
            r = write_one(k)
            pb.update(r[0])
            return r

        if n <= 1:
            files = [write_counted(k) for k in range(n)]
        else:
            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="reshard-write") as ex:
                files = list(ex.map(write_counted, range(n)))
    digests = [snap.tensors[i][0].digest if kind == 0 else snap.objects[i][0].digest
               for kind, i in assignment.check]
    return report_bytes(files, placed, digests), sum(f[0] for f in files)


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
    coll = timed_collectives(group, opts.timeout_s)
    if coll.rank != 0 and opts.progress is not False:  # one progress bar: rank 0's
        opts = dataclasses.replace(opts, progress=False)
    warn_pending_error(group, wait=True, step=step)
    st, key = resolve(path, storage)
    t0 = time.perf_counter()
    snap = None
    err: BaseException | None = None
    try:
        snap = collect(state, coll.rank, opts)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        err = e
    return run_save(coll, st, key, snap, err, step=step, options=opts, t0=t0)


def run_save(
    coll: Collectives, st: Storage, key: str, snap: Snapshot | None, err: BaseException | None, *,
    step: int | None, options: SaveOptions, t0: float, on_attempt: Any = None, abort: Any = None,
) -> SaveResult:
    """Plan, persist, validate and publish a collected snapshot (shared by
    ``save`` and the background thread of ``async_save``), through the
    coordinator protocol of :func:`reshard.planning.coordination.save_steps`; the
    plan is reused from the cache when no rank's structure changed."""
    timings: dict[str, float] = {"stage": time.perf_counter() - t0}
    rank = coll.rank
    lp = None
    if snap is not None:
        lp = LocalPlan(rank=rank, tensors=tuple(t for t, _, _ in snap.tensors),
                       objects=tuple(o for o, _ in snap.objects), aliases=snap.aliases)
    gkey = group_key(coll)

    def check_location(info: dict[str, Any]) -> None:
        try:
            check_attempt_location(coll.rank, st, key, info)
        except Exception as e:
            if coll.rank != 0:  # elsewhere an unseen attempt is node-local storage, not removal
                raise
            _raise_removed(st, info, e)

    def do_persist(info: dict[str, Any], assignment: Assignment) -> tuple[bytes, int]:
        assert snap is not None and lp is not None
        integrity_check_assignment(assignment, lp)
        attempt = info["attempt_path"]
        if not st.capabilities.atomic_rename:  # attempts under one prefix never share a key
            assignment = msgspec.structs.replace(
                assignment, files=[attempts.data_name(info["attempt"], f) for f in assignment.files])
        if on_attempt is not None:
            on_attempt(attempt)
        try:  # into the coordinator's attempt, which this rank has been shown to see
            return persist(st, attempt, snap, assignment, options)
        except Exception as e:
            gone = removed_error(st, info, e)
            if gone is not e:
                raise gone from e
            if isinstance(e, OSError):  # a backend that raised a bare OSError: the store failed
                raise StorageError(f"{key}: writing rank {rank}'s files failed: "
                                   f"{type(e).__name__}: {e}") from e
            raise

    def do_publish(info: dict[str, Any], manifest: Manifest) -> None:
        if abort is not None and abort.is_set():
            raise CheckpointError(f"{key}: save abandoned before publishing")
        if not st.capabilities.atomic_rename:  # the keys persist wrote
            manifest = attempts.rename_files(
                manifest, {n: attempts.data_name(info["attempt"], n) for n in manifest.files})
        if options.hmac_key is not None:
            manifest = sign_manifest(manifest, options.hmac_key)
        try:
            publish(st, info["attempt_path"], info["target"], manifest, overwrite=options.overwrite,
                    durable=options.durable)
        except Exception as e:
            _raise_removed(st, info, e)
        published.append(manifest)

    def manifest_args() -> dict[str, Any]:
        assert snap is not None
        return dict(step=step, checksum_block_bytes=options.checksum_block_bytes,
                    schema_version=options.schema_version, mesh=options.mesh,
                    values=snap.values_json, extra=dict(options.extra), parent=options.parent,
                    lineage=options.lineage, adapters=snap.adapters)

    published: list[Manifest] = []
    cache = PLAN_CACHE.pop(gkey, None)
    restored = False
    if cache is None and lp is not None:  # a new process: the parent checkpoint's plan, if it fits
        prev = parent_path(st, key, options.parent)
        if prev is not None:
            cache = restart_entry(st, prev, rank, coll.world_size, files_per_rank=options.files_per_rank,
                                  hmac_key=options.hmac_key)
            restored = cache is not None

    def write_plan(info: dict[str, Any], raw: bytes) -> None:
        try:
            st.write_bytes(st.join(info["attempt_path"], PLAN_FILE), raw, durable=options.durable)
        except Exception as e:
            _raise_removed(st, info, e)

    leases: list[attempts.AttemptLease] = []

    def begin() -> dict[str, Any]:
        # the lease is held by the coordinator until publish (and rename) or
        # discard; it is written before the attempt exists, so no gc ever
        # sees the attempt without it
        return open_attempt(st, key, options, leases=leases)

    def check_space(info: dict[str, Any], needed: int) -> None:
        free = st.free_bytes(info["attempt_path"])
        if free is not None and needed > free:
            raise StorageError(
                f"{info['target']}: not enough space for the checkpoint of step {step}: it needs "
                f"about {needed} bytes ({needed / 2**20:.1f} MiB), {free} bytes "
                f"({free / 2**20:.1f} MiB) are free; nothing was written")

    ctx = RankSave(rank=rank, world_size=coll.world_size, plan=lp,
                   value_digests=snap.value_digests if snap is not None else {}, err=err,
                   files_per_rank=options.files_per_rank, begin=begin,
                   check_location=check_location, persist=do_persist, publish=do_publish,
                   discard=lambda info: discard_attempt(coll, st, info["attempt_path"],
                                                        attempt_id=info["attempt"]),
                   manifest_args=manifest_args, cache=cache, check_space=check_space,
                   # attempts share the final prefix without rename: no plan kept there
                   write_plan=write_plan if st.capabilities.atomic_rename else None)
    # progress lines and collective failures name the save and its phase
    watch(coll, lambda: (f"save of step {step}", ctx.phase))
    try:
        out = drive(coll, save_steps(ctx))
    finally:
        for lease in leases:
            lease.stop()
    if ctx.new_cache is not None:
        PLAN_CACHE[gkey] = ctx.new_cache
    timings.update(ctx.timings)
    timings["cached_plan"] = float(out.cached)
    timings["plan_from_parent"] = float(out.cached and restored)
    return SaveResult(path=st.url(key), step=step, attempt_id=out.attempt_id, bytes_written=out.bytes_written,
                      total_bytes=out.total_bytes, num_files=out.num_files, timings=timings,
                      manifest=published[0] if published else None)


def drop_plan_cache(group: Any = None) -> None:
    """Forget this process's cached save plan for ``group`` (default: the
    default group), as a restart does: the next save reuses the parent
    checkpoint's plan (``SaveOptions.parent``) when it fits, else plans."""
    for k in [group_key(get_collectives(group)), *timed_keys(group)]:
        PLAN_CACHE.pop(k, None)


