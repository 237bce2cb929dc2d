"""Discovery, inspection and verification of committed checkpoints."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..commit.listing import Entry, committed, read_head
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    ShardingError,
)
from ..ondisk.committed import read_manifest, torn_files
from ..ondisk.manifest import Manifest
from ..ondisk.shardfile import BlockTables, block_digests, file_checksum, note_rotten
from ..planning.planner import _check_coverage
from ..storage import Storage, resolve

_READ = 8 << 20


#: ``Manifest.extra[CONTENT]``: what a checkpoint holds; :data:`MODEL_ONLY`
#: marks weights without the training state (a model-only last save, a seed
#: checkpoint): never resumed as a training state (:func:`resumable`)
CONTENT = "content"
MODEL_ONLY = "model_only"


def resumable(m: Manifest) -> bool:
    """Whether the checkpoint of manifest ``m`` is a training state to resume
    from: False when its ``extra`` marks it model-only
    (``extra["content"] == "model_only"``, or the TorchTitan integration's
    ``extra["torchtitan"]["content"]``, written before the generic mark)."""
    extra = m.extra or {}
    tt = extra.get("torchtitan")
    return extra.get(CONTENT) != MODEL_ONLY and not (isinstance(tt, dict) and tt.get(CONTENT) == MODEL_ONLY)


def latest(root: str | os.PathLike[str], *, storage: Storage | None = None,
           hmac_key: bytes | None = None, include_model_only: bool = False) -> str | None:
    """Path of the newest committed, complete checkpoint under ``root`` that
    holds a training state, or None.

    A checkpoint marked model-only (:func:`resumable`: a TorchTitan
    ``last_save_model_only`` save, a seed checkpoint) is not a training
    state and is passed over, as :meth:`reshard.CheckpointManager.restore`
    passes it over; ``include_model_only=True`` returns it too (the newest
    weights, e.g. for an evaluation or an export).

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

    With an HMAC key (``hmac_key``, else the environment's:
    ``RESHARD_HMAC_KEY_FILE`` / ``RESHARD_HMAC_KEY``), the checkpoint found
    must be signed with it: an unsigned or mis-signed one raises, naming it
    (never skipped: skipping would silently resume an older one).

    Beside a job whose retention prunes ``root``, the checkpoint named may be
    deleted before a later call leases it: load it with
    :func:`reshard.load_latest` (pin it with :func:`reshard.pin_latest`),
    not ``load(state, latest(root))``.

    Raises:
        StorageError: listing or a stat failed (never "no checkpoint").
        IntegrityError: with a key, the newest checkpoint is unsigned or mis-signed.
    """
    from ..options import hmac_key_of

    st, key = resolve(root, storage)
    best = latest_entry(st, key, include_model_only=include_model_only)
    if best is None:
        return None
    check_newest_signature(st, key, best, hmac_key_of(hmac_key))
    # a URL root gives a URL back (load must resolve it to the same store)
    return st.url(best.path)


def check_newest_signature(st: Storage, root: str, best: Entry, key: bytes | None) -> None:
    """With an HMAC ``key``: the newest checkpoint ``best`` under ``root``
    must be signed with it (an older one is never chosen in its place).

    Raises:
        IntegrityError: it is unsigned or mis-signed (naming it)."""
    from ..ondisk.committed import check_signature
    from ..ondisk.manifest import MANIFEST_NAME

    if key is None or best.manifest is None:
        return
    try:
        check_signature(best.manifest, key, where=st.join(best.path, MANIFEST_NAME))
    except IntegrityError as e:
        raise IntegrityError(f"{e}; it is the newest checkpoint under {st.url(root)}: refusing "
                             "it (an older one is not returned in its place)") from None


def latest_entry(st: Storage, root: str, *, include_model_only: bool = False) -> Entry | None:
    """The entry :func:`latest` returns the path of (same rules), or None."""
    from ..commit.lineage import Head, lineage_of, resume_order

    done = committed(st, root)
    if not done:
        return None
    order = resume_order(done, lineage_of(done, Head.from_record(read_head(st, root))))
    return next((e for e in order if e.manifest is not None
                 and (include_model_only or resumable(e.manifest))
                 and not torn_files(st, e.path, e.manifest)), None)


def inspect(path: str | os.PathLike[str], *, storage: Storage | None = None,
            hmac_key: bytes | None = None) -> Manifest:
    """The validated manifest of the checkpoint at ``path``; for a PyTorch DCP
    checkpoint, the manifest :func:`reshard.ondisk.dcp.open_dcp` presents
    (``extra["source"] == "dcp"``, no checksums, one value per DCP key).
    It accepts what :func:`load` and :func:`verify` accept and nothing more
    (the same structural validation,
    :func:`reshard.planning.validation.structure_problems`). A reader lease
    is held while the manifest is read. With an HMAC key (``hmac_key``, else
    the environment's), an unsigned or mis-signed manifest is refused.

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError (CoverageError:
        the chunks do not tile a tensor).
    """
    from ..commit.leases import reader_lease
    from ..options import hmac_key_of
    from ..planning.validation import structure_problems

    st, key = resolve(path, storage)
    k = hmac_key_of(hmac_key)
    with reader_lease(st, key, what="inspect"):
        try:
            m = read_manifest(st, key, hmac_key=k)
        except CheckpointNotFoundError:
            from ..ondisk.dcp_metadata import is_dcp_checkpoint

            if not is_dcp_checkpoint(key, storage=st):
                raise
            from ..ondisk.dcp import open_dcp

            if k is not None:
                raise IntegrityError(f"{key}: a DCP checkpoint carries no HMAC, but an HMAC key was "
                                     "given") from None
            return open_dcp(key, storage=st)[1]
    bad = structure_problems(m, where=st.join(key, "manifest.json"))
    if bad:
        from ..errors import CoverageError

        cls = CoverageError if all(p.startswith("coverage:") for p in bad) else ManifestError
        raise cls(f"{st.join(key, 'manifest.json')}: {len(bad)} problem(s) load and verify refuse too: "
                  + "; ".join(bad[:5]))
    return m


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        path: the checkpoint checked.
        ok: no problem found.
        problems: one line per problem (file, key and what was expected).
        bytes_checked: bytes whose checksums were verified.
        key_problems: the problems (also in ``problems``) that say only that
            the HMAC key given is not the writer's (an unsigned or mis-signed
            manifest, a DCP checkpoint, which carries no HMAC): not that the
            checkpoint is damaged, so no verification record takes them for
            its integrity verdict (:attr:`integrity_problems`).
    """

    path: str
    ok: bool
    problems: tuple[str, ...] = ()
    bytes_checked: int = 0
    manifest: Manifest | None = field(default=None, repr=False)
    #: what the check could and could not cover (e.g. a DCP checkpoint has no checksums)
    notes: tuple[str, ...] = ()
    #: what carries no checksum and so was NOT CHECKED (chunks saved with
    #: ``checksums=False`` or whose digests were removed, files with an empty
    #: checksum): ``reshard verify`` then exits non-zero unless told to accept it
    unchecked: tuple[str, ...] = ()
    key_problems: tuple[str, ...] = ()

    @property
    def integrity_problems(self) -> tuple[str, ...]:
        """The problems that say the checkpoint itself is damaged (the
        ``problems`` that are not ``key_problems``)."""
        return tuple(p for p in self.problems if p not in self.key_problems)

    @property
    def checked(self) -> bool:
        """Every byte's checksum could be compared (nothing is ``unchecked``)."""
        return not self.unchecked


def verify(path: str | os.PathLike[str], *, checksums: bool = True,
           storage: Storage | None = None, progress: bool | None = None,
           hmac_key: bytes | None = None) -> VerifyReport:
    """Check a checkpoint's structure and, by default, every checksum.

    Structure (:func:`reshard.planning.validation.structure_problems`, the
    validation :func:`load` and :func:`inspect` share): the manifest
    validates; every logical element of every tensor is covered exactly once;
    every object grid is complete; every value decodes; the world size fits
    the files; every file exists, is a regular file (not a symbolic link, a
    FIFO or a device), and has its declared size. Checksums: every block of
    every chunk and every whole file; what carries none is listed in
    ``unchecked`` (NOT CHECKED: saved with ``checksums=False``, or edited to
    drop them; without an HMAC key that is honesty, not security). With an
    HMAC key (``hmac_key``, else the environment's), an unsigned or
    mis-signed manifest is a problem. A reader lease is held while it reads.
    ``progress``: a progress bar (bytes checksummed) on stderr; None: only
    with ``RESHARD_PROGRESS=1``.

    Raises:
        CheckpointNotFoundError: no manifest at ``path``. Every other problem
        is reported in ``problems``.
    """
    from ..commit.leases import reader_lease

    st, key = resolve(path, storage)
    with reader_lease(st, key, what="verify"):
        return _verify(st, key, checksums=checksums, progress=progress, hmac_key=hmac_key)


def _verify(st: Storage, key: str, *, checksums: bool, progress: bool | None,
            hmac_key: bytes | None) -> VerifyReport:
    from ..ondisk.committed import check_signature
    from ..ondisk.manifest import MANIFEST_NAME
    from ..options import hmac_key_of
    from ..planning.validation import structure_problems

    problems: list[str] = []
    key_problems: list[str] = []
    k = hmac_key_of(hmac_key)
    try:
        m = read_manifest(st, key)
    except CheckpointNotFoundError:
        from ..ondisk.dcp import is_dcp_checkpoint

        if is_dcp_checkpoint(key, storage=st):
            if k is not None:
                p = "IntegrityError: a DCP checkpoint carries no HMAC, but an HMAC key was given"
                return VerifyReport(path=st.url(key), ok=False, notes=(DCP_NOTE,), problems=(p,),
                                    key_problems=(p,))
            return _verify_dcp(st, key, decode=checksums, progress=progress)
        raise
    except CheckpointError as e:
        return VerifyReport(path=st.url(key), ok=False, problems=(f"{type(e).__name__}: {e}",))
    if k is not None:
        try:
            check_signature(m, k, where=st.join(key, MANIFEST_NAME))
        except IntegrityError as e:
            key_problems.append(f"IntegrityError: {e}")
            problems.append(key_problems[-1])
    problems.extend(structure_problems(m, where=st.join(key, MANIFEST_NAME)))
    for k2, oe in m.objects.items():
        offs = {tuple(c.global_offset) for c in oe.chunks}
        n = 1
        for d in oe.global_shape:
            n *= d
        if len(offs) != n or len(oe.chunks) != n:
            problems.append(f"object {k2!r}: {len(offs)} of {n} grid elements recorded")
    torn = torn_files(st, key, m)
    problems.extend(torn.values())
    good_files = {name for name in m.files if name not in torn}
    checked = 0
    if checksums:
        from ..progress import bar, wanted

        with bar(sum(m.files[n].size for n in good_files), "verify", enabled=wanted(progress)) as pb:
            checked = _verify_checksums(st, key, m, good_files, problems, pb)
    return VerifyReport(path=st.url(key), ok=not problems, problems=tuple(problems), bytes_checked=checked,
                        manifest=m, unchecked=unchecked_parts(m), key_problems=tuple(key_problems))


def unchecked_parts(m: Manifest) -> tuple[str, ...]:
    """What of ``m`` carries no checksum to compare (one line per kind, with
    counts and examples): chunks and object elements without block digests,
    data files with an empty whole-file checksum."""
    from ..ondisk.shardfile import BlockTables

    bare = [f"{fqn}[{i}]" for fqn, te in m.tensors.items() for i, c in enumerate(te.chunks)
            if not BlockTables.has(c)]
    bare += [f"{k}{list(oc.global_offset)}" for k, oe in m.objects.items() for oc in oe.chunks
             if not BlockTables.has(oc)]
    files = [n for n, fe in m.files.items() if not fe.checksum]
    out = []
    if bare:
        out.append(f"{len(bare)} chunk(s) carry no checksum (e.g. {bare[:3]})")
    if files:
        out.append(f"{len(files)} file(s) have an empty checksum (e.g. {files[:3]})")
    return tuple(out)


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

