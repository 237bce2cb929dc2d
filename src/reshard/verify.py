"""Discovery, inspection and verification of committed checkpoints."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import xxhash

from .commit import committed, read_manifest
from .errors import CheckpointError, CheckpointNotFoundError, ShardingError
from .manifest import Manifest
from .planning import _check_coverage
from .storage import Storage, resolve

_READ = 8 << 20


def latest(root: str | os.PathLike[str], *, storage: Storage | None = None) -> str | None:
    """Path of the newest committed, valid checkpoint under ``root`` (by the
    step in its manifest, commit time where step is absent), or None.

    Incomplete attempts and directories without a valid manifest are never
    returned. Raises StorageError if listing fails (never "no checkpoint").
    """
    st, key = resolve(root, storage)
    done = committed(st, key)
    return done[-1].path if done else None


def inspect(path: str | os.PathLike[str], *, storage: Storage | None = None) -> Manifest:
    """The validated manifest of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError.
    """
    st, key = resolve(path, storage)
    return read_manifest(st, key)


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


def verify(path: str | os.PathLike[str], *, checksums: bool = True,
           storage: Storage | None = None) -> VerifyReport:
    """Check a checkpoint's structure and, by default, every checksum.

    Structure: the manifest validates; every logical element of every tensor
    is covered exactly once; every object grid is complete; every file exists,
    is not a symbolic link, and has its declared size. Checksums: every block
    of every chunk and every whole file.

    Raises:
        CheckpointNotFoundError: no manifest at ``path``. Every other problem
        is reported in ``problems``.
    """
    st, key = resolve(path, storage)
    problems: list[str] = []
    try:
        m = read_manifest(st, key)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as e:
        return VerifyReport(path=key, ok=False, problems=(f"{type(e).__name__}: {e}",))
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
    for k, oe in m.objects.items():
        offs = {tuple(c.global_offset) for c in oe.chunks}
        n = 1
        for d in oe.global_shape:
            n *= d
        if len(offs) != n or len(oe.chunks) != n:
            problems.append(f"object {k!r}: {len(offs)} of {n} grid elements recorded")
    good_files: set[str] = set()
    for name, fe in m.files.items():
        p = st.join(key, name)
        if st.is_link(p):
            problems.append(f"{p}: is a symbolic link")
            continue
        try:
            size = st.size(p)
        except FileNotFoundError:
            problems.append(f"{p}: missing (manifest declares {fe.size} bytes)")
            continue
        if size != fe.size:
            problems.append(f"{p}: {size} bytes, manifest declares {fe.size}")
            continue
        good_files.add(name)
    checked = 0
    if checksums:
        for name in sorted(good_files):
            fe = m.files[name]
            p = st.join(key, name)
            h = xxhash.xxh3_64()
            for off in range(0, fe.size, _READ):
                h.update(st.read_bytes(p, off, min(_READ, fe.size - off)))
            checked += fe.size
            if fe.checksum and h.hexdigest() != fe.checksum:
                problems.append(f"{p}: file checksum mismatch")
        b = m.checksum_block_bytes
        for fqn, te in m.tensors.items():
            for c in te.chunks:
                if c.file not in good_files or not c.checksums:
                    continue
                for k, want in enumerate(c.checksums):
                    n = min(b, c.length - k * b)
                    got = xxhash.xxh3_64_hexdigest(st.read_bytes(st.join(key, c.file), c.offset + k * b, n))
                    if got != want:
                        problems.append(f"{st.join(key, c.file)}: checksum mismatch in tensor {fqn!r} "
                                        f"chunk at {list(c.global_offset)} block {k}")
                        break
        for ok_, oe in m.objects.items():
            for oc in oe.chunks:
                if oc.file not in good_files or not oc.checksums:
                    continue
                raw = st.read_bytes(st.join(key, oc.file), oc.offset, oc.length)
                if any(xxhash.xxh3_64_hexdigest(raw[k * b:(k + 1) * b]) != d
                       for k, d in enumerate(oc.checksums)):
                    problems.append(f"{st.join(key, oc.file)}: checksum mismatch in object {ok_!r} "
                                    f"element {list(oc.global_offset)}")
    return VerifyReport(path=key, ok=not problems, problems=tuple(problems), bytes_checked=checked,
                        manifest=m)
