"""Convert a PyTorch DCP checkpoint into a reshard checkpoint (see :mod:`reshard.ondisk.dcp`).
"""

from __future__ import annotations

import os
import time
from contextlib import closing
from typing import Any

from ..errors import CheckpointError, IntegrityError
from ..ondisk.dcp import DCPStorage, open_dcp
from ..ondisk.manifest import Chunk, FileEntry, Manifest, TensorEntry, validate_manifest
from ..state.sharding import itemsize
from ..storage import Storage, resolve

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

    Rank 0 holds a reader lease on ``src`` while it is read (warned and
    read unprotected where it cannot be written).

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
    from ..collectives import get_collectives
    from ..commit.leases import ReaderLease

    lease = None
    if get_collectives(group).rank == 0:
        st, key = resolve(src, src_storage)
        src, src_storage = key, st
        lease = ReaderLease(st, key, what="convert").acquire()
    try:
        return _convert_dcp(src, dst, group=group, step=step, options=options, file_bytes=file_bytes,
                            src_storage=src_storage, dst_storage=dst_storage,
                            skip_unsafe_values=skip_unsafe_values)
    finally:
        if lease is not None:
            lease.release()


def _convert_dcp(
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
    """The body of :func:`convert_dcp` (the lease is the caller's)."""
    from ..collectives import Tries, timed_collectives
    from ..commit.protocol import publish
    from ..commit.strategy import strategy_for
    from ..ondisk.committed import sign_manifest
    from ..ondisk.manifest import MANIFEST_NAME
    from ..ondisk.shardfile import FileItem, tensor_bytes, write_shard_file
    from ..options import SaveOptions, hmac_key_of
    from ..planning.coordination_save import Attempt
    from ..saving.attempt import (
        agree_attempt_location,
        discard_attempt,
        discarding,
        open_attempt,
    )
    from ..saving.save import SaveResult

    opts: SaveOptions = options or SaveOptions()
    coll = timed_collectives(group, None)  # gloo, whatever the training backend
    rank, world = coll.rank, coll.world_size
    t0 = time.perf_counter()
    dst_st, dst_key = resolve(dst, dst_storage)
    tries = Tries()
    local: dict[str, Any] = {}
    dcp_st: DCPStorage | None = None
    m: Manifest | None = None
    with tries:
        dcp_st, m = open_dcp(src, storage=src_storage, cache_bytes=0)
        refused = m.extra.get("dcp_skipped_values") or {}
        if refused and not skip_unsafe_values:
            raise IntegrityError(
                f"{src}: {len(refused)} value(s) need more than torch.load(weights_only=True) and are "
                f"refused: {sorted(refused)[:5]} (pass skip_unsafe_values=True to convert without them)")
        if rank == 0:
            local.update(open_attempt(dst_st, dst_key, opts).to_json())

    def discard_opened(agreed: CheckpointError, mine: BaseException | None) -> None:
        if local:  # the coordinator opened the attempt (the others hold nothing)
            discard_attempt(coll, dst_st, local["attempt_path"], attempt_id=local["attempt"])

    gathered = tries.gather(coll, "convert_dcp", local, on_fail=discard_opened)
    assert dcp_st is not None and m is not None
    coord = Attempt.from_json(gathered[0])
    attempt, target, attempt_id = coord.attempt_path, coord.target, coord.attempt_id
    agree_attempt_location(coll, dst_st, dst_key, coord)
    t1 = time.perf_counter()
    # pack chunks into files (deterministic on every rank), round-robin over ranks
    files: list[list[tuple[str, int]]] = [[]]
    size = 0
    for fqn, te in m.tensors.items():
        for ci, c in enumerate(te.chunks):
            if files[-1] and size + c.length > file_bytes:
                files.append([])
                size = 0
            files[-1].append((fqn, ci))
            size += c.length
    files = [f for f in files if f]
    mine = [(k, f) for k, f in enumerate(files) if k % world == rank]
    written: list[dict[str, Any]] = []
    from ..progress import bar, wanted

    pb = bar(sum(m.tensors[f].chunks[ci].length for _k, mem in mine for f, ci in mem), "convert",
             enabled=rank == 0 and wanted(opts.progress))
    with tries, closing(pb):  # agreed below
        for n, (_k, members) in enumerate(mine):
            # where attempts share the prefix, keys carry the id
            name = strategy_for(dst_st).data_name(attempt_id, f"data-r{rank:05d}-{n}.safetensors")
            fitems = []
            for fqn, ci in members:
                c = m.tensors[fqn].chunks[ci]
                t = dcp_st.tensor(c.file)
                key = fqn + ("@" + ",".join(map(str, c.global_offset)) if c.global_offset else "")
                fitems.append(FileItem(name=key, dtype=m.tensors[fqn].dtype, shape=c.local_shape,
                                       data=tensor_bytes(t), itemsize=itemsize(m.tensors[fqn].dtype)))
            fsize, checksum, wr = write_shard_file(
                dst_st, dst_st.join(attempt, name), fitems, block_bytes=opts.checksum_block_bytes,
                checksums=opts.checksums, durable=opts.durable)
            del fitems
            pb.update(sum(w.length for w in wr))
            written.append({"name": name, "size": fsize, "checksum": checksum,
                            "items": [[fqn, ci, w.offset, w.length, list(w.checksums)]
                                      for (fqn, ci), w in zip(members, wr, strict=True)]})
    t2 = time.perf_counter()
    reports = tries.gather(coll, "convert_dcp", {"written": written},
                           on_fail=discarding(coll, dst_st, coord))
    out: Manifest | None = None
    if rank == 0:
        with tries:
            new_files: dict[str, FileEntry] = {}
            chunks: dict[str, list[Chunk]] = {fqn: [] for fqn in m.tensors}
            for r in reports:
                for f in r["written"]:
                    new_files[f["name"]] = FileEntry(size=f["size"], checksum=f["checksum"])
                    for fqn, ci, off, length, sums in f["items"]:
                        c = m.tensors[fqn].chunks[ci]
                        chunks[fqn].append(Chunk(global_offset=c.global_offset, local_shape=c.local_shape,
                                                 file=f["name"], offset=off, length=length,
                                                 checksums=tuple(sums)))
            # a native checkpoint now (checksummed, its own files): what described the DCP
            # folder itself goes ("source", its file count); its values' DCP paths stay
            extra = {**{k: v for k, v in m.extra.items() if k not in _DCP_ONLY}, "converted_from": "dcp",
                     **opts.extra}
            out = Manifest(
                attempt_id=attempt_id, created_at=round(time.time(), 3), world_size=m.world_size,
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
            publish(dst_st, attempt, target, out, overwrite=opts.overwrite, durable=opts.durable)
    tries.gather(coll, "convert_dcp (publish)", on_fail=discarding(coll, dst_st, coord))
    total = sum(f["size"] for r in reports for f in r["written"])
    nfiles = sum(len(r["written"]) for r in reports)
    return SaveResult(path=dst_key, step=step if step is not None else m.step, attempt_id=attempt_id,
                      bytes_written=sum(f["size"] for f in written), total_bytes=total, num_files=nfiles,
                      timings={"open": t1 - t0, "write": t2 - t1, "commit": time.perf_counter() - t2},
                      manifest=out)
