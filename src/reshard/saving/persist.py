"""The save pipeline's write phase: one rank's files of the coordinator's
assignment written (or, in an incremental save, linked from the parent
checkpoint) from a collected :class:`~reshard.saving.snapshot.Snapshot`,
one thread per file, and the write report the coordinator checks before it
publishes.

Called by :mod:`reshard.saving.save` (its rank saver's ``persist`` step of
:func:`reshard.planning.coordination_save.save_steps`), for synchronous and
asynchronous saves alike.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from ..ondisk.shardfile import (
    BlockHasher,
    FileItem,
    content_digest,
    digest_of,
    link_shard_file,
    write_shard_file,
)
from ..options import SaveOptions
from ..planning.coordination import Assignment
from ..planning.coordination_save import LinkSource, report_bytes
from ..planning.planner import LocalTensorItem
from ..storage import Storage
from .snapshot import Snapshot, wants_digest


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
    :func:`~reshard.saving.snapshot.finish_digests`, the staging run (computed from the caller's
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


def _storage_key(item: LocalTensorItem) -> str:
    name = item.fqn
    if item.global_offset:
        name += "@" + ",".join(map(str, item.global_offset))
    if item.flattened_range is not None:
        name += "#{}:{}".format(*item.flattened_range)
    return name
