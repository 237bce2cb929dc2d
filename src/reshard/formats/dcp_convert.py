"""Convert a PyTorch DCP checkpoint into a reshard checkpoint (see :mod:`reshard.ondisk.dcp`).
"""

from __future__ import annotations

import contextlib
import os
import time
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, IntegrityError
from ..ondisk.dcp import DCPStorage, open_dcp
from ..ondisk.manifest import Chunk, FileEntry, Manifest, TensorEntry, validate_manifest
from ..state.sharding import itemsize
from ..storage import Storage, resolve

if TYPE_CHECKING:
    from ..collectives import Collectives, Tries
    from ..options import SaveOptions
    from ..planning.coordination_save import Attempt

# --------------------------------------------------------------------------- conversion

#: ``Manifest.extra`` keys that describe a DCP folder as read (:func:`reshard.ondisk.dcp.open_dcp`),
#: not the checkpoint a conversion writes
_DCP_ONLY = frozenset({"source", "dcp_files"})


def convert_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    group: Any = None,
    step: int | None = None,
    options: Any = None,
    file_bytes: int = 256 << 20,
    src_storage: Storage | None = None,
    dst_storage: Storage | None = None,
    skip_unsafe_values: bool = False,
) -> Any:
    """Write the DCP checkpoint ``src`` as a committed reshard checkpoint ``dst``.

    Streams: the DCP chunks are packed, in manifest order, into shard files of
    about ``file_bytes`` each (one chunk larger than that gets a file of its
    own); a file's chunks are decoded, written with
    :func:`reshard.ondisk.shardfile.write_shard_file` (checksums computed while
    writing) and released before the next file is started, so memory stays
    near ``file_bytes`` (or the largest chunk). Each DCP chunk becomes one
    chunk of the new checkpoint; BYTE_IO values become common values (see
    :func:`open_dcp`; skipped ones are listed in ``manifest.extra``). The
    manifest is published last (:func:`reshard.commit.protocol.publish`).

    Rank 0 holds a reader lease on ``src`` while it is read
    (:func:`reshard.commit.leases.reader_lease`: warned and read unprotected
    where it cannot be written) and, as every reader, confirms it before
    reading: a deletion of ``src`` in flight (its ``<name>.deleting-*``
    record beside it: gc finishing an interrupted one) is waited for (at
    most :data:`reshard.commit.leases.CONFIRM_WAIT_S`), so the conversion
    finds the folder gone (CheckpointNotFoundError naming it) rather than
    reading it while it is deleted.

    With ``group`` (or an initialised default group) every rank of it calls
    this; the files are shared out round-robin and rank 0 publishes. Without
    one it runs in this process.

    Args:
        step: recorded in the new manifest; None (default): the source's own
            step (what :func:`reshard.ondisk.dcp.open_dcp` reads: the state
            dict's top-level ``step``, or TorchTitan's ``train_state.step``).
        options: :class:`reshard.SaveOptions` (checksums, block size,
            durable, overwrite, schema_version, extra, hmac_key, progress).
        file_bytes: target size of one shard file.
        skip_unsafe_values: convert even when some BYTE_IO values cannot be
            decoded with ``torch.load(weights_only=True)`` (they are left out
            and listed in ``manifest.extra["dcp_skipped_values"]``); by default
            such a checkpoint is refused with IntegrityError.

    Returns:
        a :class:`reshard.SaveResult` (``manifest`` on rank 0).

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError from reading
        ``src``; CheckpointError ("already there", as :func:`reshard.save`)
        if ``dst`` holds a checkpoint and ``overwrite`` is not set. Any
        failure is raised on every rank (as the common class of every rank's
        error) and publishes nothing.
    """
    from ..collectives import Tries, get_collectives, timed_collectives
    from ..commit.leases import reader_lease
    from ..options import SaveOptions
    from ..saving.attempt import discarding
    from ..saving.save import SaveResult

    held: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if get_collectives(group).rank == 0:  # one lease per conversion group
        src_storage, src = resolve(src, src_storage)
        held = reader_lease(src_storage, src, what="convert")
    with held:
        opts: SaveOptions = options or SaveOptions()
        coll = timed_collectives(group, None)  # gloo, whatever the training backend
        t0 = time.perf_counter()
        dst_st, dst_key = resolve(dst, dst_storage)
        tries = Tries()
        opened = _open(coll, tries, src, src_storage, dst_st, dst_key, opts, skip_unsafe_values)
        t1 = time.perf_counter()
        mine = _write_files(coll, tries, opened, dst_st, opts, _pack(opened.m, file_bytes))
        t2 = time.perf_counter()
        gathered = tries.gather(coll, "convert_dcp", {"written": [f.to_json() for f in mine]},
                                on_fail=discarding(coll, dst_st, opened.coord))
        reports = tuple(tuple(_RankFile.from_json(f) for f in r["written"]) for r in gathered)
        out: Manifest | None = None
        if coll.rank == 0:
            with tries:
                out = _publish(opened, reports, dst_st, dst_key, opts, step)
        tries.gather(coll, "convert_dcp (publish)", on_fail=discarding(coll, dst_st, opened.coord))
        return SaveResult(path=dst_key, step=step if step is not None else opened.m.step,
                          attempt_id=opened.coord.attempt_id, bytes_written=sum(f.size for f in mine),
                          total_bytes=sum(f.size for r in reports for f in r),
                          num_files=sum(len(r) for r in reports),
                          timings={"open": t1 - t0, "write": t2 - t1, "commit": time.perf_counter() - t2},
                          manifest=out)


# --------------------------------------------------------------------------- conversion steps
# convert_dcp: open the source and the attempt (every rank agrees) -> _Opened; pack the
# chunks into files; each rank writes its files -> _RankFile records, gathered; rank 0
# builds, signs and publishes the manifest.


@dataclass(frozen=True, kw_only=True)
class _Opened:
    """The source read and the destination attempt agreed, on every rank.

    Attributes:
        dcp_st, m: the DCP folder as :func:`open_dcp` presents it.
        coord: the attempt the coordinator opened at the destination.
    """

    dcp_st: DCPStorage
    m: Manifest
    coord: Attempt


@dataclass(frozen=True, kw_only=True)
class _RankFile:
    """One shard file a rank wrote into the attempt.

    Attributes:
        name: its key name inside the attempt.
        size: its size (bytes).
        checksum: its whole-file xxh3_64 (hex).
        items: per DCP chunk in it: ``(fqn, chunk index in the source
            manifest, offset (bytes), length (bytes), block checksums)``.
    """

    name: str
    size: int
    checksum: str
    items: tuple[tuple[str, int, int, int, tuple[str, ...]], ...]

    def to_json(self) -> dict[str, Any]:
        """The record as gathered over the ranks (plain JSON)."""
        return {"name": self.name, "size": self.size, "checksum": self.checksum,
                "items": [[fqn, ci, off, length, list(sums)] for fqn, ci, off, length, sums in self.items]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _RankFile:
        """The inverse of :meth:`to_json`."""
        return cls(name=d["name"], size=d["size"], checksum=d["checksum"],
                   items=tuple((fqn, ci, off, length, tuple(sums)) for fqn, ci, off, length, sums in d["items"]))


def _open(coll: Collectives, tries: Tries, src: str | os.PathLike[str], src_st: Storage | None,
          dst_st: Storage, dst_key: str, opts: SaveOptions, skip_unsafe_values: bool) -> _Opened:
    """Every rank opens the DCP folder ``src``; the coordinator opens the
    attempt at ``dst_key``; all agree (a failure anywhere discards the
    attempt and is raised on every rank).

    Raises:
        IntegrityError: values refused (``skip_unsafe_values`` not set).
        CheckpointError: as :func:`open_dcp`, :func:`open_attempt`.
    """
    from ..planning.coordination_save import Attempt
    from ..saving.attempt import agree_attempt_location, discard_attempt, open_attempt

    local: dict[str, Any] = {}  # the coordinator's Attempt, as gathered
    dcp_st: DCPStorage | None = None
    m: Manifest | None = None
    with tries:
        dcp_st, m = open_dcp(src, storage=src_st, cache_bytes=0)
        refused = m.extra.get("dcp_skipped_values") or {}
        if refused and not skip_unsafe_values:
            raise IntegrityError(
                f"{src}: {len(refused)} value(s) need more than torch.load(weights_only=True) and are "
                f"refused: {sorted(refused)[:5]} (pass skip_unsafe_values=True to convert without them)")
        if coll.rank == 0:
            local.update(open_attempt(dst_st, dst_key, opts).to_json())

    def discard_opened(agreed: CheckpointError, mine: BaseException | None) -> None:
        if local:  # the coordinator opened the attempt (the others hold nothing)
            discard_attempt(coll, dst_st, local["attempt_path"], attempt_id=local["attempt"])

    gathered = tries.gather(coll, "convert_dcp", local, on_fail=discard_opened)
    assert dcp_st is not None and m is not None
    coord = Attempt.from_json(gathered[0])
    agree_attempt_location(coll, dst_st, dst_key, coord)
    return _Opened(dcp_st=dcp_st, m=m, coord=coord)


def _pack(m: Manifest, file_bytes: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The chunks of ``m`` as ``(fqn, chunk index)``, in manifest order,
    packed into files of about ``file_bytes`` bytes (a larger chunk gets a
    file of its own); the same on every rank."""
    files: list[list[tuple[str, int]]] = [[]]
    size = 0
    for fqn, te in m.tensors.items():
        for ci, c in enumerate(te.chunks):
            if files[-1] and size + c.length > file_bytes:
                files.append([])
                size = 0
            files[-1].append((fqn, ci))
            size += c.length
    return tuple(tuple(f) for f in files if f)


def _write_files(coll: Collectives, tries: Tries, opened: _Opened, dst_st: Storage, opts: SaveOptions,
                 files: tuple[tuple[tuple[str, int], ...], ...]) -> tuple[_RankFile, ...]:
    """Write this rank's share of ``files`` (round-robin over the ranks) into
    the attempt, one at a time; a failure is held in ``tries`` (agreed by
    the caller's gather). Returns what was written."""
    from ..progress import bar, wanted

    m = opened.m
    mine = [f for k, f in enumerate(files) if k % coll.world_size == coll.rank]
    written: list[_RankFile] = []
    pb = bar(sum(m.tensors[f].chunks[ci].length for mem in mine for f, ci in mem), "convert",
             enabled=coll.rank == 0 and wanted(opts.progress))
    with tries, closing(pb):  # agreed below
        for n, members in enumerate(mine):
            written.append(_write_file(opened, dst_st, opts, f"data-r{coll.rank:05d}-{n}.safetensors", members))
            pb.update(sum(it[3] for it in written[-1].items))
    return tuple(written)


def _write_file(opened: _Opened, dst_st: Storage, opts: SaveOptions, base: str,
                members: tuple[tuple[str, int], ...]) -> _RankFile:
    """Decode the DCP chunks ``members`` and write them as one shard file
    (named ``base``, or with the attempt id where attempts share a prefix)."""
    from ..commit.strategy import strategy_for
    from ..ondisk.shardfile import FileItem, tensor_bytes, write_shard_file

    m, attempt_id = opened.m, opened.coord.attempt_id
    # where attempts share the prefix, keys carry the id
    name = strategy_for(dst_st).data_name(attempt_id, base)
    fitems = []
    for fqn, ci in members:
        c = m.tensors[fqn].chunks[ci]
        t = opened.dcp_st.tensor(c.file)
        key = fqn + ("@" + ",".join(map(str, c.global_offset)) if c.global_offset else "")
        fitems.append(FileItem(name=key, dtype=m.tensors[fqn].dtype, shape=c.local_shape,
                               data=tensor_bytes(t), itemsize=itemsize(m.tensors[fqn].dtype)))
    fsize, checksum, wr = write_shard_file(
        dst_st, dst_st.join(opened.coord.attempt_path, name), fitems,
        block_bytes=opts.checksum_block_bytes, checksums=opts.checksums, durable=opts.durable)
    return _RankFile(name=name, size=fsize, checksum=checksum,
                     items=tuple((fqn, ci, w.offset, w.length, tuple(w.checksums))
                                 for (fqn, ci), w in zip(members, wr, strict=True)))


def _publish(opened: _Opened, reports: tuple[tuple[_RankFile, ...], ...], dst_st: Storage, dst_key: str,
             opts: SaveOptions, step: int | None) -> Manifest:
    """Coordinator: the new checkpoint's manifest from every rank's files
    (``reports``, by rank), signed with the HMAC key if any, validated and
    published. Returns it.

    Raises:
        ManifestError: the manifest is invalid.
        CheckpointError: as :func:`reshard.commit.protocol.publish`.
    """
    from ..commit.protocol import publish
    from ..ondisk.committed import sign_manifest
    from ..ondisk.manifest import MANIFEST_NAME
    from ..options import hmac_key_of

    m, coord = opened.m, opened.coord
    new_files: dict[str, FileEntry] = {}
    chunks: dict[str, list[Chunk]] = {fqn: [] for fqn in m.tensors}
    for r in reports:
        for f in r:
            new_files[f.name] = FileEntry(size=f.size, checksum=f.checksum)
            for fqn, ci, off, length, sums in f.items:
                c = m.tensors[fqn].chunks[ci]
                chunks[fqn].append(Chunk(global_offset=c.global_offset, local_shape=c.local_shape,
                                         file=f.name, offset=off, length=length, checksums=sums))
    # a native checkpoint now (checksummed, its own files): what described the DCP
    # folder itself goes ("source", its file count); its values' DCP paths stay
    extra = {**{k: v for k, v in m.extra.items() if k not in _DCP_ONLY}, "converted_from": "dcp",
             **opts.extra}
    out = Manifest(
        attempt_id=coord.attempt_id, created_at=round(time.time(), 3), world_size=m.world_size,
        checksum_block_bytes=opts.checksum_block_bytes, schema_version=opts.schema_version,
        step=step if step is not None else m.step, mesh=opts.mesh,
        tensors={fqn: TensorEntry(dtype=te.dtype, global_shape=te.global_shape,
                                  chunks=tuple(sorted(chunks[fqn], key=lambda c: c.global_offset)))
                 for fqn, te in m.tensors.items()},
        values=m.values, files=dict(sorted(new_files.items())), extra=extra,
    )
    mac_key = hmac_key_of(opts.hmac_key)  # the caller's, else the environment's
    if mac_key is not None:
        out = sign_manifest(out, mac_key)
    validate_manifest(out, where=f"{dst_key}/{MANIFEST_NAME}")
    publish(dst_st, coord.attempt_path, coord.target, out, overwrite=opts.overwrite, durable=opts.durable)
    return out
