"""Synchronous save: snapshot -> plan -> persist -> validate -> publish manifest last."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import xxhash

from ..adapters.model import ModelState
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
from ..errors import CheckpointError, ShardingError, StorageError
from ..ondisk import codec
from ..ondisk.committed import sign_manifest
from ..ondisk.manifest import (
    Manifest,
)
from ..ondisk.shardfile import (
    BlockHasher,
    FileItem,
    block_digests,
    content_digest,
    digest_of,
    link_shard_file,
    tensor_bytes,
    write_shard_file,
)
from ..options import SaveOptions, hmac_key_of
from ..planning.coordination import PLAN_CACHE, Assignment
from ..planning.coordination_save import (
    Attempt,
    LinkSource,
    RankSave,
    integrity_check_assignment,
    report_bytes,
    save_steps,
)
from ..planning.plan_store import PLAN_FILE, parent_path, restart_entry
from ..planning.planner import LocalObjectItem, LocalPlan, LocalTensorItem
from ..state.sharding import ShardedTensor, dtype_name
from ..state.tree import Leaves, flatten
from ..storage import Storage, resolve
from .attempt import (
    _raise_removed,
    check_attempt_location,
    discard_attempt,
    open_attempt,
    removed_error,
)
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
    #: the staging run of an asynchronous save whose tensors are staged piece
    #: by piece (:class:`reshard.saving.staging_run.StagingRun`): their bytes
    #: come from ``source.chunk(i)`` (``tensors[i]`` holds an empty view) and
    #: their digests are computed while they are written
    source: Any = None
    #: block digests computed (finish_digests); else they are computed while writing
    hashed: bool = False
    #: index into ``tensors`` -> xxh3_128 of the chunk's bytes (incremental
    #: saves: the chunks that get a file of their own; :func:`finish_digests`,
    #: or the writer of the chunk's file, or the staging run)
    content: dict[int, str] = field(default_factory=dict)
    #: seconds :func:`finish_digests` took (``SaveResult.timings["hash"]``)
    hash_s: float = 0.0


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


@dataclass(frozen=True, kw_only=True)
class _TensorItems:
    """The tensors of one rank's state, described (the collect phase's
    result for tensors).

    Attributes:
        tensors: ``(item, bytes, block checksums)`` per chunk written or
            compared, in the order of the flattened state; the bytes are an
            empty view where a staging run holds them; checksums None (they
            are computed later).
        aliases: fqn -> the fqn whose chunk is the same memory viewed the
            same way (tied weights: saved once).
    """

    tensors: tuple[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None], ...]
    aliases: Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class _Values:
    """The common values of one rank's state, encoded (the collect phase's
    result for values).

    Attributes:
        as_json: tree path -> the value as JSON (``Manifest.values``).
        digests: what every rank must agree on: tree path -> xxh3_64 of its
            JSON, and ``<tensor><path>`` -> ``"<shape>:<dtype>"`` of every
            plain tensor (a replica every rank must hold).
    """

    as_json: Mapping[str, Any]
    digests: Mapping[str, str]


def collect(
    state: Mapping[str, Any],
    rank: int,
    options: SaveOptions,
    *,
    copy: Any = None,
    stage: Any = None,
    digests: bool = True,
) -> Snapshot:
    """Flatten ``state`` and describe every local item.

    ``copy`` (``tensor -> tensor``): copies each tensor into library-owned
    memory; None keeps views of the caller's memory. ``stage`` (a
    :class:`~reshard.saving.staging_run.StagingRun`): each tensor is handed
    to ``stage.add(index, fqn, tensor)`` instead, which stages it under the
    budget; the snapshot then holds no bytes of it (``Snapshot.source``).
    ``digests=False``: the views' block digests are left to the writer, which
    computes them while it writes (a synchronous save: hashing then costs no
    time of its own on two cores).

    Raises:
        ShardingError: a chunk twice in this rank's state, a value that
            cannot be saved, or a name used both for a tensor and a
            value/object.
    """
    leaves = flatten(state, module_adapter=ModelState)
    tensors = _collect_tensors(_sharded_tensors(leaves, rank), rank, options, copy=copy, stage=stage)
    objects = _collect_objects(leaves)
    values = _collect_values(leaves)
    clash = (set(values.as_json) | {o.key for o, _ in objects}) & {t.fqn for t, _, _ in tensors.tensors}
    if clash:
        raise ShardingError(f"names used both for a tensor and a value/object: {sorted(clash)[:5]}")
    snap = Snapshot(tensors=list(tensors.tensors), objects=objects, values=leaves.values,
                    values_json=dict(values.as_json), aliases=dict(tensors.aliases),
                    value_digests=dict(values.digests), plain=set(leaves.plain),
                    adapters=leaves.adapters, source=stage)
    if copy is None and stage is None and digests:
        finish_digests(snap, options)
    return snap


def _sharded_tensors(leaves: Leaves, rank: int) -> list[ShardedTensor]:
    """Every tensor chunk of ``leaves``: its sharded tensors, its plain
    tensors (whole, replica ``rank``) and its DTensors' local shards."""
    from ..adapters.dtensor import dtensor_shards

    sts: list[ShardedTensor] = list(leaves.tensors)
    for path, t in leaves.plain.items():
        sts.append(ShardedTensor(path, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim(),
                                 replica_id=rank))
    for path, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(path, dt))
    return sts


def _collect_tensors(sts: list[ShardedTensor], rank: int, options: SaveOptions, *,
                     copy: Any, stage: Any) -> _TensorItems:
    """Describe each chunk of ``sts`` (see :func:`collect` for ``copy`` and
    ``stage``); a chunk that is another fqn's memory viewed the same way
    becomes an alias.

    Raises:
        ShardingError: the same chunk (fqn, offset, shape, flat range) twice.
    """
    own = options.own_file_bytes if options.incremental else 0  # chunks that get a file of their own
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
        if stage is not None:
            nbytes = st.data.numel() * st.data.element_size()
            stage.add(len(tensors), fqn, st.data, content=bool(own) and nbytes >= own)
            mv = _NO_BYTES
        else:
            mv = tensor_bytes(st.data if copy is None else copy(st.data))
            nbytes = len(mv)
        item = LocalTensorItem(
            fqn=fqn, dtype=dtype_name(st.data.dtype), global_shape=st.global_shape,
            global_offset=st.global_offset, local_shape=st.local_shape,
            flattened_range=st.flat_bounds, replica_id=st.replica_id, nbytes=nbytes,
        )
        tensors.append((item, mv, None))
    return _TensorItems(tensors=tuple(tensors), aliases=aliases)


def _collect_objects(leaves: Leaves) -> list[tuple[LocalObjectItem, bytes]]:
    """Each object element of ``leaves`` with its encoded bytes; one value
    under many keys (an optimizer group's hyperparameters, per parameter) is
    encoded once."""
    objects: list[tuple[LocalObjectItem, bytes]] = []
    encoded: dict[int, tuple[bytes, str]] = {}
    for ob in leaves.objects:
        got = encoded.get(id(ob.value))
        if got is None:
            raw = codec.encode(ob.value, path=ob.key)
            got = encoded[id(ob.value)] = (raw, xxhash.xxh3_64_hexdigest(raw))
        raw, digest = got
        objects.append((LocalObjectItem(key=ob.key, global_shape=ob.global_shape,
                                        global_offset=ob.global_offset, replica_id=ob.replica_id,
                                        nbytes=len(raw), digest=digest), raw))
    return objects


def _collect_values(leaves: Leaves) -> _Values:
    """The common values of ``leaves`` as JSON with their digests, and the
    presence of its plain tensors.

    Raises:
        ShardingError: a value that cannot be saved as JSON.
    """
    # plain tensors are replicas: every rank must hold the same ones (a tensor
    # held by one rank only is not a replica), compared like the common values
    digests = {f"<tensor>{p}": f"{tuple(t.shape)}:{t.dtype}" for p, t in leaves.plain.items()}
    as_json = {}
    for path, v in leaves.values.items():
        try:
            j = codec.to_json(v, path=path)
        except TypeError as e:
            raise ShardingError(str(e)) from None
        as_json[path] = j
        digests[path] = xxhash.xxh3_64_hexdigest(msgspec.json.encode(j))
    return _Values(as_json=as_json, digests=digests)


_NO_BYTES = memoryview(b"")


def wants_digest(snap: Snapshot, item: LocalTensorItem, options: SaveOptions) -> bool:
    """Whether ``item``'s digest is computed: with checksums, replica
    verification, or for a plain tensor (always compared across ranks)."""
    return options.checksums or options.verify_replicas or item.fqn in snap.plain


def finish_digests(snap: Snapshot, options: SaveOptions) -> None:
    """Compute block checksums (and replica digests) of the snapshot's tensors,
    and, in an incremental save, the xxh3_128 of every chunk that gets a
    file of its own (``Snapshot.content``: what decides that it is unchanged).

    Runs on the caller's thread for a synchronous save and in the background
    for an asynchronous one (the stall then only covers the copies), on up
    to ``staging_threads`` threads (default: every CPU the process may use,
    at most 4) when there is more than 64 MiB to hash (xxhash releases the
    GIL: the chunks hash in parallel). A snapshot staged piece by piece
    (``Snapshot.source``) is hashed while it is written instead."""
    if snap.source is not None:
        return
    snap.hashed = True
    block = options.checksum_block_bytes
    own = options.own_file_bytes if options.incremental else 0

    def one(i: int) -> None:
        item, mv, _ = snap.tensors[i]
        compare = options.checksums or options.verify_replicas or item.fqn in snap.plain
        if own and len(mv) >= own:
            # a chunk with a file of its own: one pass, its xxh3_128, which decides the link and
            # stands for it among replicas; its block checksums are computed where it is written
            # (or read from the parent's block table where it is linked)
            c = snap.content[i] = content_digest(mv)
            if compare:
                snap.tensors[i] = (msgspec.structs.replace(item, digest=f"x128:{c}"), mv, None)
            return
        # every holder must compute the digest when replicas are compared: replica_id 0
        # does not mean "not replicated" (another rank may hold the same chunk), and a
        # holder without a digest ("") would disagree with one that has it
        if compare:
            sums = block_digests(mv, block)
            item = msgspec.structs.replace(item, digest=digest_of(sums, len(mv)))
            snap.tensors[i] = (item, mv, sums if options.checksums else None)

    t0 = time.perf_counter()
    n = len(snap.tensors)
    total = sum(len(mv) for _, mv, _ in snap.tensors)
    threads = min(options.staging_threads or _cpus(), n)
    if threads <= 1 or total < _PARALLEL_HASH_BYTES:
        for i in range(n):
            one(i)
    else:
        order = sorted(range(n), key=lambda i: -len(snap.tensors[i][1]))  # largest first: balanced
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-hash") as ex:
            list(ex.map(one, order))
    snap.hash_s = time.perf_counter() - t0


#: hashing on several threads only pays beyond this many bytes
_PARALLEL_HASH_BYTES = 64 << 20


def _cpus() -> int:
    """The CPUs this process may run on, at most 4."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


@dataclass(frozen=True, kw_only=True)
class _WriteLayout:
    """How one rank writes its part of an assignment (the persist phase's
    plan, from :func:`_write_layout`).

    Attributes:
        per_file: per file of ``assignment.files`` (same index), its entries
            ``(pos, kind, i)``: ``pos`` indexes ``assignment.writes``,
            ``kind`` 0 a tensor (``i`` indexes ``snap.tensors``) or 1 an
            object (``i`` indexes ``snap.objects``); in write order when
            ``lazy`` (tensors by position, then objects).
        lazy: the digests are computed here, while writing (a snapshot
            staged piece by piece, or one not hashed beforehand).
        written: the tensors (indices into ``snap.tensors``) this rank
            writes (``lazy`` only; else empty).
        hash_only: the tensors whose digest this rank reports for a replica
            comparison without writing them, in the staging run's order
            (item size down, then position; ``lazy`` only).
    """

    per_file: tuple[tuple[tuple[int, int, int], ...], ...]
    lazy: bool
    written: frozenset[int]
    hash_only: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class _PersistJob:
    """One rank's write of its files of ``assignment`` into ``attempt`` (see
    :func:`persist` for ``link_from``), laid out by ``layout``."""

    storage: Storage
    attempt: str
    snap: Snapshot
    assignment: Assignment
    options: SaveOptions
    link_from: LinkSource | None
    layout: _WriteLayout


@dataclass(frozen=True, kw_only=True)
class _FileWritten:
    """One file of the assignment, written or linked (:func:`_write_file`).

    Attributes:
        size: the file's bytes.
        checksum: the file's checksum.
        blocks: block checksums its block table holds.
        linked: linked from the parent checkpoint, not written.
        placed: ``(pos, (offset, length, root, block index))`` per entry of
            the file: ``pos`` indexes ``assignment.writes``; offset and
            length in bytes.
        digests: ``(i, digest)`` of each tensor ``i`` whose digest was
            computed while writing it.
    """

    size: int
    checksum: str
    blocks: int
    linked: bool
    placed: tuple[tuple[int, tuple[int, int, str, int]], ...]
    digests: tuple[tuple[int, str], ...]


def persist(storage: Storage, attempt: str, snap: Snapshot, assignment: Assignment,
            options: SaveOptions, link_from: LinkSource | None = None) -> tuple[bytes, int]:
    """Write this rank's files of ``assignment``; returns the write report for
    the coordinator (see :class:`reshard.planning.coordination.Report`) and the bytes
    written. ``link_from`` (an incremental save with a parent,
    :func:`reshard.saving.incremental.link_source`): a file of one chunk
    whose bytes the parent's file of the same name already holds is linked
    from there, not written; the chunk's xxh3_128 that decides it comes from
    :func:`finish_digests`, the staging run (computed from the caller's
    tensor before its first byte was staged) or, for a view, is computed by
    the file's writer before it writes.

    A snapshot staged piece by piece (``snap.source``, an asynchronous save
    under a staging budget) first tells its staging run which tensors this
    rank needs (those it writes, and those whose digest it reports for a
    replica comparison), then each file's writer asks the run for every
    chunk's staged pieces in write order (:meth:`StagingRun.chunk
    <reshard.saving.staging_run.StagingRun.chunk>`: the per-chunk step where
    a staged chunk's bytes are in host memory just before they are written)
    and hashes them as it writes them; a replica this rank only reports is
    hashed from its staged pieces by one more thread, in the same order.

    Raises:
        CheckpointError: the staging run's mutation guard found a tensor
            changed before it was staged (the save then fails on every rank).
    """
    src = snap.source
    layout = _write_layout(snap, assignment, options)
    if src is not None:
        src.need(set(layout.written) | set(layout.hash_only))
    job = _PersistJob(storage=storage, attempt=attempt, snap=snap, assignment=assignment,
                      options=options, link_from=link_from, layout=layout)
    files, replica_digests = _write_files(job)
    if src is not None:
        src.finish()  # the mutation guard: a tensor changed before it was staged fails the save
    return _write_report(job, files, replica_digests)


def _write_layout(snap: Snapshot, assignment: Assignment, options: SaveOptions) -> _WriteLayout:
    """Group ``assignment.writes`` by file and, when the digests are
    computed while writing, order each file as the staging run stages and
    find the replicas this rank only hashes."""
    from ..state.sharding import itemsize as isz

    lazy = snap.source is not None or not snap.hashed
    per_file: list[list[tuple[int, int, int]]] = [[] for _ in assignment.files]
    for pos, (kind, i, fi) in enumerate(assignment.writes):
        per_file[fi].append((pos, kind, i))
    if not lazy:
        return _WriteLayout(per_file=tuple(map(tuple, per_file)), lazy=False, written=frozenset(),
                            hash_only=())
    # every file in write order (the order the staging run stages in): tensors
    # by position (write_shard_file keeps it among equal item sizes), then objects
    for entries in per_file:
        entries.sort(key=lambda e: (e[1], e[2]))
    written = frozenset(i for kind, i, _ in assignment.writes if kind == 0)
    hash_only = sorted((i for kind, i in assignment.check
                        if kind == 0 and i not in written
                        and wants_digest(snap, snap.tensors[i][0], options)),
                       key=lambda i: (-isz(snap.tensors[i][0].dtype), i))
    return _WriteLayout(per_file=tuple(map(tuple, per_file)), lazy=True, written=written,
                        hash_only=tuple(hash_only))


def _write_files(job: _PersistJob) -> tuple[list[_FileWritten], dict[int, str]]:
    """Write (or link) every file of the job, one thread per file (at most
    16, more with ``files_per_rank``), and hash the replicas this rank only
    reports on one more; returns the files in ``assignment.files`` order and
    the replicas' digests (tensor index -> digest)."""
    from ..progress import bar, wanted
    from ..state.sharding import itemsize as isz

    snap, layout = job.snap, job.layout
    n = len(job.assignment.files)
    with bar(None, "save", enabled=wanted(job.options.progress)) as pb:
        def write_counted(k: int) -> _FileWritten:
            r = _write_file(job, k)
            pb.update(r.size)
            return r

        if n <= 1 and not layout.hash_only:
            return [write_counted(k) for k in range(n)], {}
        # one thread per file (files_per_rank), at most 16 (an incremental
        # save gives large chunks files of their own: there may be many)
        workers = min(n, max(16, job.options.files_per_rank)) + bool(layout.hash_only)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard-write") as ex:
            hashed = ex.submit(_hash_replicas, job) if layout.hash_only else None
            # the files in the order their first chunk is staged (the staging run's
            # order: item size down, then position), so the writers running are
            # always those whose staged pieces hold the slabs (a file whose chunk is
            # staged later never waits in a writer thread the earlier ones need)
            order = sorted(range(n), key=lambda fi: min(
                ((-isz(snap.tensors[i][0].dtype), i) for _p, kind, i in layout.per_file[fi] if kind == 0),
                default=(1, 0))) if snap.source is not None else list(range(n))
            done = dict(zip(order, ex.map(write_counted, order), strict=True))
            files = [done[k] for k in range(n)]
            replica_digests = hashed.result() if hashed is not None else {}
    return files, replica_digests


def _hash_replicas(job: _PersistJob) -> dict[int, str]:
    """The digest of each tensor this rank only reports (``layout.hash_only``),
    from its staged pieces or its view: tensor index -> digest."""
    src, block = job.snap.source, job.options.checksum_block_bytes
    out: dict[int, str] = {}
    for i in job.layout.hash_only:
        h, n = BlockHasher(block), 0
        for mv in (src.chunk(i) if src is not None else iter((job.snap.tensors[i][1],))):
            h.update(mv)
            n += len(mv)
        out[i] = digest_of(h.finish(), n)
    return out


def _write_file(job: _PersistJob, fi: int) -> _FileWritten:
    """Write file ``fi`` of the assignment, or link it from the parent
    checkpoint where its one chunk is unchanged (``link_from``, with
    checksums)."""
    from . import incremental

    snap, options, src = job.snap, job.options, job.snap.source
    entries = job.layout.per_file[fi]
    items = _file_items(job, fi)
    name = job.assignment.files[fi]
    dst = job.storage.join(job.attempt, name)
    got = None
    if (job.link_from is not None and options.checksums and len(items) == 1
            and incremental.is_chunk_file(name)):
        # the per-chunk decision: the staged bytes' digest against the parent's file
        got = link_shard_file(job.storage, incremental.source_key(job.storage, job.link_from, name), dst,
                              items, block_bytes=options.checksum_block_bytes, checksums=options.checksums,
                              block_table=True)
        if got is not None and src is not None:  # its staged pieces go back to the pool (and pass the guard)
            for _ in src.chunk(entries[0][2]):
                pass
    linked = got is not None
    if got is None:
        got = write_shard_file(
            job.storage, dst, items,
            block_bytes=options.checksum_block_bytes, checksums=options.checksums,
            durable=options.durable, block_table=True,
            digests=job.layout.lazy and (options.verify_replicas or bool(snap.plain)))
    size, checksum, written = got
    blocks = 0
    placed: list[tuple[int, tuple[int, int, str, int]]] = []
    digests: list[tuple[int, str]] = []
    for (pos, kind, i), w in zip(entries, written, strict=True):
        placed.append((pos, (w.offset, w.length, w.root, w.block_index)))
        blocks += len(w.checksums) if w.block_index >= 0 else 0
        if job.layout.lazy and kind == 0 and wants_digest(snap, snap.tensors[i][0], options):
            digests.append((i, digest_of(w.checksums, w.length)))
    return _FileWritten(size=size, checksum=checksum, blocks=blocks, linked=linked,
                        placed=tuple(placed), digests=tuple(digests))


def _file_items(job: _PersistJob, fi: int) -> list[FileItem]:
    """The items of file ``fi`` in write order: each tensor from its staged
    pieces or its view (its digests computed while writing it when lazy),
    each object from its encoded bytes."""
    from ..state.sharding import itemsize as isz
    from . import incremental

    snap, src, entries = job.snap, job.snap.source, job.layout.per_file[fi]
    single = len(entries) == 1 and incremental.is_chunk_file(job.assignment.files[fi])
    items: list[FileItem] = []
    for _pos, kind, i in entries:
        if kind != 0:
            ob, raw = snap.objects[i]
            key = "__object__/" + ob.key + "@" + ",".join(map(str, ob.global_offset))
            items.append(FileItem(name=key, dtype="uint8", shape=(len(raw),),
                                  data=memoryview(raw), itemsize=1))
            continue
        it, mv, sums = snap.tensors[i]
        shape = (it.flattened_range[1] - it.flattened_range[0],) if it.flattened_range else it.local_shape
        content = _content_of(snap, i, job.options) if single else None
        if src is not None:
            items.append(FileItem(name=_storage_key(it), dtype=it.dtype, shape=tuple(shape), data=mv,
                                  itemsize=isz(it.dtype), pieces=partial(src.chunk, i),
                                  nbytes=it.nbytes, content=content))
        else:
            items.append(FileItem(name=_storage_key(it), dtype=it.dtype, shape=tuple(shape), data=mv,
                                  itemsize=isz(it.dtype), checksums=None if job.layout.lazy else sums,
                                  content=content))
    return items


def _content_of(snap: Snapshot, i: int, options: SaveOptions) -> str | None:
    """The xxh3_128 of chunk ``i`` when it gets a file of its own (an
    incremental save), remembered in ``snap.content``; None: unknown, the
    file is written in full."""
    own = options.own_file_bytes if options.incremental else 0
    c = snap.content.get(i)
    if c is None and own and snap.tensors[i][0].nbytes >= own:
        src = snap.source
        c = src.content(i) if src is not None else content_digest(snap.tensors[i][1])
        if c is not None:
            snap.content[i] = c
    return c


def _write_report(job: _PersistJob, files: list[_FileWritten],
                  replica_digests: dict[int, str]) -> tuple[bytes, int]:
    """The write report of the job's files (see :func:`persist`) and the
    bytes this rank wrote (linked files excluded)."""
    snap, assignment = job.snap, job.assignment
    placed: list[tuple[int, int, str, int]] = [(0, 0, "", -1)] * len(assignment.writes)
    digests_of = dict(replica_digests)
    for f in files:
        for pos, where in f.placed:
            placed[pos] = where
        digests_of.update(f.digests)
    if job.layout.lazy:
        digests = [digests_of.get(i, "") if kind == 0 else snap.objects[i][0].digest
                   for kind, i in assignment.check]
    else:
        digests = [snap.tensors[i][0].digest if kind == 0 else snap.objects[i][0].digest
                   for kind, i in assignment.check]
    contents = [snap.content.get(i, "") if kind == 0 else "" for kind, i, _ in assignment.writes] \
        if snap.content else []
    linked = [k for k, f in enumerate(files) if f.linked]
    return (report_bytes([(f.size, f.checksum, f.blocks) for f in files], placed, digests, contents, linked),
            sum(f.size for f in files if not f.linked))


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


