"""``reshard copy SRC DST``: a checkpoint copied to another place (another
root, another store: local to S3 and back) as a checkpoint of its own.

Every byte is read once from SRC, checked against the block checksums the
manifest names (and each file against its whole-file checksum) while it is
copied, and written to an attempt at DST that is published manifest-last
like a save (:func:`reshard.commit.protocol.publish`), under an attempt
lease, so a copy that fails or is killed leaves nothing that passes for a
checkpoint and is collected by ``reshard gc``. The copy holds its own bytes
(no link to SRC: ``FileEntry.origin`` is cleared) and gets its own identity
(a new ``attempt_id``); step, parent, lineage, values and user metadata are
kept. A signed SRC is checked with the key and the copy signed with it; a
signed SRC without a key is refused (a copy never drops a signature).

A checkpoint written by an incremental save is self-contained already (its
unchanged files are hard links or copies inside the store), so ``cp -r`` or
``aws s3 sync`` of one checkpoint also gives a checkpoint; ``reshard copy``
adds the check of every byte, the commit protocol at DST and copies
between stores.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

import msgspec

from ..commit import attempts
from ..commit.protocol import publish
from ..commit.strategy import strategy_for
from ..errors import CheckpointError, IntegrityError
from ..ondisk.committed import read_manifest, sign_manifest
from ..ondisk.manifest import Manifest
from ..ondisk.shardfile import BlockTables, block_digests, file_checksum, note_rotten
from ..options import SaveOptions
from ..saving.incremental import plain_name as _plain
from ..storage import Storage, resolve

_READ = 8 << 20


def copy_checkpoint(src: str | os.PathLike[str], dst: str | os.PathLike[str], *,
                    hmac_key: bytes | None = None, overwrite: bool = False,
                    src_storage: Storage | None = None, dst_storage: Storage | None = None,
                    progress: Any = None) -> Manifest:
    """Copy the checkpoint at ``src`` to ``dst`` (a new checkpoint path),
    checking every checksum on the way; returns the published manifest.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``src``.
        IntegrityError: a byte of ``src`` does not match its checksum, a file
            is missing or short (the file is named; nothing is published at
            ``dst``, the attempt is removed); ``src`` is signed and no
            ``hmac_key`` was given, or the signature does not match it.
        FileExistsError: a checkpoint is already at ``dst`` (and not
            ``overwrite``).
    """
    from ..saving.attempt import open_attempt

    sst, skey = resolve(src, src_storage)
    dst_st, dkey = resolve(dst, dst_storage)
    m = read_manifest(sst, skey, hmac_key=hmac_key)
    if "hmac_sha256" in m.extra and hmac_key is None:
        raise IntegrityError(f"{sst.url(skey)}: the manifest is signed (HMAC): give the key "
                             "(--hmac-key-file) so that it is checked and the copy signed with it")
    leases: list[attempts.AttemptLease] = []
    info = open_attempt(dst_st, dkey, SaveOptions(overwrite=overwrite), leases=leases)
    attempt, aid = info.attempt_path, info.attempt_id
    strategy = strategy_for(dst_st)  # where attempts share the prefix, keys carry the id
    names = {n: strategy.data_name(aid, _plain(n)) for n in m.files}
    if len(set(names.values())) != len(names):
        raise CheckpointError(f"{sst.url(skey)}: two data files map to one name at {dst_st.url(dkey)}")
    try:
        tables = BlockTables(sst, skey, m)
        per_file: dict[str, list[tuple[int, int, Any, str]]] = defaultdict(list)
        for fqn, te in m.tensors.items():
            for c in te.chunks:
                per_file[c.file].append((c.offset, c.length, c, f"tensor {fqn!r} chunk at {list(c.global_offset)}"))
        for k, oe in m.objects.items():
            for oc in oe.chunks:
                per_file[oc.file].append((oc.offset, oc.length, oc,
                                          f"object {k!r} element {list(oc.global_offset)}"))
        for name, fe in sorted(m.files.items()):
            _copy_file(sst, skey, dst_st, dst_st.join(attempt, names[name]), name, fe.size, fe.checksum,
                       sorted(per_file.get(name, []), key=lambda t: (t[0], t[1])), tables,
                       m.checksum_block_bytes, progress)
        out = msgspec.structs.replace(
            m, attempt_id=aid, created_at=round(time.time(), 3),
            extra={k: v for k, v in m.extra.items() if k != "hmac_sha256"},
            files={names[n]: msgspec.structs.replace(fe, origin="") for n, fe in m.files.items()},
            tensors={k: msgspec.structs.replace(te, chunks=tuple(
                msgspec.structs.replace(c, file=names[c.file]) for c in te.chunks)) for k, te in m.tensors.items()},
            objects={k: msgspec.structs.replace(oe, chunks=tuple(
                msgspec.structs.replace(c, file=names[c.file]) for c in oe.chunks)) for k, oe in m.objects.items()},
            plan=None)
        if hmac_key is not None and "hmac_sha256" in m.extra:
            out = sign_manifest(out, hmac_key)
        publish(dst_st, attempt, info.target, out, overwrite=overwrite, durable=True)
    except BaseException:
        try:
            strategy.discard(dst_st, attempt, aid)
        except Exception:  # noqa: BLE001, S110 - gc removes what is left
            pass
        raise
    finally:
        for lease in leases:
            lease.stop()
    return out


def _copy_file(sst: Storage, skey: str, dst: Storage, to: str, name: str, size: int, checksum: str,
               items: list[tuple[int, int, Any, str]], tables: BlockTables, block: int, progress: Any) -> None:
    """Stream one data file to ``to``, checking every chunk's blocks (and the
    whole-file checksum) as it goes; the stream is aborted on a mismatch."""
    src = sst.join(skey, name)
    step = block * max(1, _READ // block)
    tree: list[tuple[str, ...]] = []
    prefix = b""
    out = dst.open_write(to, durable=True)

    def raw(a: int, b: int, keep: bool = False) -> bytes:
        """Copy bytes [a, b) as they are (header, block table); return them if ``keep``."""
        parts = []
        for x in range(a, b, step):
            data = sst.read_bytes(src, x, min(step, b - x))
            out.write(data)
            if keep:
                parts.append(data)
            if progress is not None:
                progress(len(data))
        return b"".join(parts)

    try:
        try:
            pos = 0
            for off, length, c, what in items:
                if off < pos:
                    raise IntegrityError(f"{src}: {what} overlaps the bytes before it")
                head = raw(pos, off, keep=not tree)
                if not tree:
                    prefix = head
                want = tables.sums(c) if BlockTables.has(c) else ()
                got: list[str] = []
                for a in range(0, length, step):
                    data = sst.read_bytes(src, off + a, min(step, length - a))
                    got.extend(block_digests(memoryview(data), block))
                    out.write(data)
                    if progress is not None:
                        progress(len(data))
                if want and tuple(got) != tuple(want):
                    note_rotten(sst, src)
                    bad = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
                    raise IntegrityError(f"{src}: checksum mismatch in {what} block {bad}: not copied")
                tree.append(tuple(got))
                pos = off + length
            raw(pos, size)
        except FileNotFoundError:
            raise IntegrityError(f"{src}: data file named by the manifest is missing: not copied") from None
        if checksum and items and all(BlockTables.has(i[2]) for i in items) \
                and file_checksum(prefix, tree) != checksum:
            raise IntegrityError(f"{src}: file checksum mismatch (header or layout changed): not copied")
    except BaseException:
        out.abort()
        raise
    out.close()
