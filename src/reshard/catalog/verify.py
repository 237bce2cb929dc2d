"""Discovery, inspection and verification of committed checkpoints."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..commit.listing import Entry, committed, read_head
from ..errors import CheckpointError, CheckpointNotFoundError, IntegrityError, ShardingError
from ..ondisk import codec
from ..ondisk.committed import read_manifest, torn_files
from ..ondisk.manifest import Manifest
from ..ondisk.shardfile import BlockTables, block_digests, file_checksum, note_rotten
from ..planning.planner import _check_coverage
from ..storage import Storage, resolve

_READ = 8 << 20


def latest(root: str | os.PathLike[str], *, storage: Storage | None = None) -> str | None:
    """Path of the newest committed, complete checkpoint under ``root``, or None.

    With a ``HEAD`` record at the root (written by
    ``CheckpointManager.restore``): the newest committed descendant of the
    checkpoint ``HEAD`` names (by step, then commit time), else that
    checkpoint itself, else its newest ancestor, else the newest of another
    lineage (:func:`reshard.commit.lineage.resume_order`). Without ``HEAD``: by the
    step in the manifests (commit time where step is absent). Never by name.

    Incomplete attempts, directories without a valid manifest, quarantined
    checkpoints and committed ones whose files are not all present at their
    declared sizes (one stat per file; checksums stay :func:`verify`'s job)
    are never returned.

    Raises:
        StorageError: listing or a stat failed (never "no checkpoint").
    """
    st, key = resolve(root, storage)
    best = latest_entry(st, key)
    if best is None:
        return None
    # a URL root gives a URL back (load must resolve it to the same store)
    return st.url(best.path)


def latest_entry(st: Storage, root: str) -> Entry | None:
    """The entry :func:`latest` returns the path of (same rules), or None."""
    from ..commit.lineage import Head, lineage_of, resume_order

    done = committed(st, root)
    if not done:
        return None
    order = resume_order(done, lineage_of(done, Head.from_record(read_head(st, root))))
    return next((e for e in order if e.manifest is not None
                 and not torn_files(st, e.path, e.manifest)), None)


def inspect(path: str | os.PathLike[str], *, storage: Storage | None = None) -> Manifest:
    """The validated manifest of the checkpoint at ``path``; for a PyTorch DCP
    checkpoint, the manifest :func:`reshard.ondisk.dcp.open_dcp` presents
    (``extra["source"] == "dcp"``, no checksums, one value per DCP key).

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError.
    """
    st, key = resolve(path, storage)
    try:
        return read_manifest(st, key)
    except CheckpointNotFoundError:
        from ..ondisk.dcp_metadata import is_dcp_checkpoint

        if not is_dcp_checkpoint(key, storage=st):
            raise
        from ..ondisk.dcp import open_dcp

        return open_dcp(key, storage=st)[1]


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        path: the checkpoint checked.
        ok: no problem found.
        problems: one line per problem (file, key and what was expected).
        bytes_checked: bytes whose checksums were verified.
    """

    path: str
    ok: bool
    problems: tuple[str, ...] = ()
    bytes_checked: int = 0
    manifest: Manifest | None = field(default=None, repr=False)
    #: what the check could and could not cover (e.g. a DCP checkpoint has no checksums)
    notes: tuple[str, ...] = ()


def verify(path: str | os.PathLike[str], *, checksums: bool = True,
           storage: Storage | None = None, progress: bool | None = None) -> VerifyReport:
    """Check a checkpoint's structure and, by default, every checksum.

    Structure: the manifest validates; every logical element of every tensor
    is covered exactly once; every object grid is complete; every file exists,
    is not a symbolic link, and has its declared size. Checksums: every block
    of every chunk and every whole file. ``progress``: a progress bar (bytes
    checksummed) on stderr; None: only with ``RESHARD_PROGRESS=1``.

    Raises:
        CheckpointNotFoundError: no manifest at ``path``. Every other problem
        is reported in ``problems``.
    """
    st, key = resolve(path, storage)
    problems: list[str] = []
    try:
        m = read_manifest(st, key)
    except CheckpointNotFoundError:
        from ..ondisk.dcp import is_dcp_checkpoint

        if is_dcp_checkpoint(key, storage=st):
            return _verify_dcp(st, key, decode=checksums, progress=progress)
        raise
    except CheckpointError as e:
        return VerifyReport(path=st.url(key), ok=False, problems=(f"{type(e).__name__}: {e}",))
    for fqn, te in m.tensors.items():
        chunks: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for i, c in enumerate(te.chunks):
            chunks[(c.global_offset, c.local_shape, c.flattened_range)].append((0, i))
        dup = [k for k, v in chunks.items() if len(v) > 1]
        if dup:
            problems.append(f"tensor {fqn!r}: chunk at {list(dup[0][0])} recorded twice")
        try:
            _check_coverage(fqn, te.global_shape, chunks)
        except ShardingError as e:
            problems.append(f"coverage: {e}")
    for vk, enc in (m.values or {}).items():
        try:
            codec.from_json(enc)
        except CheckpointError as e:
            problems.append(f"value {vk!r}: {e}")
    for k, oe in m.objects.items():
        offs = {tuple(c.global_offset) for c in oe.chunks}
        n = 1
        for d in oe.global_shape:
            n *= d
        if len(offs) != n or len(oe.chunks) != n:
            problems.append(f"object {k!r}: {len(offs)} of {n} grid elements recorded")
    torn = torn_files(st, key, m)
    problems.extend(torn.values())
    good_files = {name for name in m.files if name not in torn}
    checked = 0
    if checksums:
        from ..progress import bar, wanted

        with bar(sum(m.files[n].size for n in good_files), "verify", enabled=wanted(progress)) as pb:
            checked = _verify_checksums(st, key, m, good_files, problems, pb)
    return VerifyReport(path=st.url(key), ok=not problems, problems=tuple(problems), bytes_checked=checked,
                        manifest=m)


def _verify_checksums(st: Storage, key: str, m: Manifest, files: set[str], problems: list[str],
                      pb: Any) -> int:
    """Recompute every block digest of every chunk and object, and every
    file's hash tree from them, reading each file once. Returns bytes read."""
    b = m.checksum_block_bytes
    tables = BlockTables(st, key, m)
    per_file: dict[str, list[tuple[int, int, Any, str]]] = defaultdict(list)

    def sums(c: Any) -> tuple[str, ...]:
        try:
            return tables.sums(c)  # from the file's block table, checked against the manifest
        except IntegrityError as e:
            problems.append(str(e))
            return ("<bad block table>",) * -(-c.length // b)

    for fqn, te in m.tensors.items():
        for c in te.chunks:
            per_file[c.file].append((c.offset, c.length, c,
                                     f"tensor {fqn!r} chunk at {list(c.global_offset)}"))
    for k, oe in m.objects.items():
        for oc in oe.chunks:
            per_file[oc.file].append((oc.offset, oc.length, oc,
                                      f"object {k!r} element {list(oc.global_offset)}"))
    checked = 0
    for name in sorted(files):
        p = st.join(key, name)
        fe = m.files[name]
        items = [(off, n, sums(c), what) for off, n, c, what in
                 sorted(per_file.get(name, []), key=lambda i: (i[0], i[1]))]
        checked += 8 * fe.blocks  # the block table, read and checked against the manifest
        first = items[0][0] if items else fe.size
        prefix = st.read_bytes(p, 0, first)
        checked += first
        pb.update(first)
        tree: list[tuple[str, ...]] = []
        step = b * max(1, _READ // b)  # whole blocks per read
        for off, length, want, what in items:
            got: list[str] = []
            for a in range(0, length, step):
                data = st.read_bytes(p, off + a, min(step, length - a))
                got.extend(block_digests(memoryview(data), b))
                pb.update(len(data))
            checked += length
            tree.append(tuple(got))
            if want and tuple(got) != tuple(want):
                bad = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
                problems.append(f"{p}: checksum mismatch in {what} block {bad}")
                note_rotten(st, p)  # no incremental save of this process links it again
        if fe.checksum and all(i[2] for i in items) and file_checksum(prefix, tree) != fe.checksum:
            problems.append(f"{p}: file checksum mismatch (header or layout changed)")
    return checked


DCP_NOTE = ("DCP has no checksums: structure, sizes and (unless --no-checksums) that every "
            "tensor item decodes as declared were checked; the bytes cannot be verified")


def _verify_dcp(st: Storage, key: str, *, decode: bool, progress: bool | None) -> VerifyReport:
    """A PyTorch DCP checkpoint: the metadata is accepted by the restricted
    unpickler, every tensor's chunks cover it exactly once, every declared
    byte range lies inside its data file; with ``decode``, every tensor item
    is read and decoded (``torch.load(weights_only=True)``) and must be the
    dtype and shape the metadata declares. No checksums exist to compare."""
    from ..ondisk.dcp import open_dcp
    from ..progress import bar, wanted

    try:
        dst, m = open_dcp(key, storage=st, cache_bytes=0)
    except CheckpointError as e:
        return VerifyReport(path=st.url(key), ok=False, problems=(f"{type(e).__name__}: {e}",),
                            notes=(DCP_NOTE,))
    problems: list[str] = []
    for fqn, te in m.tensors.items():
        chunks: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for i, c in enumerate(te.chunks):
            chunks[(c.global_offset, c.local_shape, c.flattened_range)].append((0, i))
        try:
            _check_coverage(fqn, te.global_shape, chunks)
        except ShardingError as e:
            problems.append(f"coverage: {e}")
    for name in m.files:
        try:
            dst.size(name)  # the declared byte range lies inside its data file
        except (CheckpointError, OSError) as e:
            problems.append(f"{type(e).__name__}: {e}")
    checked = 0
    if decode and not problems:
        total = sum(c.length for te in m.tensors.values() for c in te.chunks)
        with bar(total, "verify", enabled=wanted(progress)) as pb:
            for fqn, te in m.tensors.items():
                for c in te.chunks:
                    try:
                        dst.chunk(c.file, keep=False)
                    except (CheckpointError, OSError) as e:
                        problems.append(f"tensor {fqn!r} chunk at {list(c.global_offset)}: {e}")
                    checked += c.length
                    pb.update(c.length)
    for k, why in (m.extra.get("dcp_skipped_values") or {}).items():
        problems.append(f"value {k!r} cannot be read safely: {why}")
    return VerifyReport(path=st.url(key), ok=not problems, problems=tuple(problems), bytes_checked=checked,
                        manifest=m, notes=(DCP_NOTE,))

