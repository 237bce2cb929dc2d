"""Verification records: ``<name>.verified.json`` beside a checkpoint, bound
to what was verified.

A record holds the outcome (``ok``, ``problems``), how the checkpoint was
checked (``"smoke"``: structure and sizes plus a checksummed trial load of a
sample of tensors; ``"checksums"``: every byte), the xxh3_64 digest of the
manifest's bytes and every file's size. It is trusted only while the
checkpoint still matches it (:func:`record_holds`): a changed manifest or a
file of another size makes the checkpoint unverified again. Retention never
deletes on the strength of a record alone (see
``CheckpointManager.plan_retention``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..commit.listing import Entry
from ..commit.strategy import write_record
from ..errors import CheckpointError, StorageError
from ..ondisk.committed import (
    manifest_digest,
    read_manifest_bytes,
    read_record,
    torn_files,
)
from ..ondisk.manifest import MANIFEST_NAME, Manifest, decode_manifest
from ..options import LoadOptions
from ..storage import Storage
from .verify import verify

log = logging.getLogger("reshard.manager.manager")

VERIFIED = ".verified.json"


def record_path(storage: Storage, root: str, name: str) -> str:
    return storage.join(root, name + VERIFIED)


def _smoke_load(storage: Storage, path: str, m: Manifest, k: int) -> None:
    """Trial-load the ``k`` smallest and largest tensors with checksums on."""
    import torch  # (here: `reshard ls`, which reads records, imports no torch)

    from ..collectives import SingleProcess
    from ..loading.load import load
    from ..state.sharding import ShardedTensor, torch_dtype

    names = sorted(m.tensors, key=lambda t: (sum(c.length for c in m.tensors[t].chunks), t))
    k = min(k, len(names))
    pick = names[: k // 2] + names[len(names) - (k - k // 2):]
    targets = [ShardedTensor(t, torch.empty(m.tensors[t].global_shape,
                                            dtype=torch_dtype(m.tensors[t].dtype)),
                             global_shape=m.tensors[t].global_shape,
                             global_offset=(0,) * len(m.tensors[t].global_shape))
               for t in dict.fromkeys(pick)]
    if targets:
        load({"smoke": targets}, path, group=SingleProcess(), strict=False,
             options=LoadOptions(checksums=True), storage=storage)


def check_and_record(storage: Storage, root: str, name: str, *, smoke_tensors: int,
                     how: str = "smoke", record: bool = True,
                     deferred: list[Any] | None = None) -> bool:
    """Verify ``root/name`` and, with ``record``, write its bound verification
    record. ``how``: "smoke" (structure and sizes, then a checksummed trial
    load of ``smoke_tensors`` tensors), "checksums" (every byte) or
    "structure" (structure and sizes only). Returns whether it passed.
    ``deferred``: append ``(name, record)`` there instead of writing it (the
    caller writes it after it freed space). With an HMAC key (the
    environment's), an unsigned or mis-signed manifest fails the check, but
    is no verdict on the checkpoint (the reader's key is not the writer's,
    or it is unsigned): then only other problems found are recorded (as a
    failure), and a checkpoint with none keeps the record it had.
    StorageError propagates (no record then)."""
    if how not in ("smoke", "checksums", "structure"):
        raise ValueError(f"how must be 'smoke', 'checksums' or 'structure', not {how!r}")
    checksums = how == "checksums"
    path = storage.join(root, name)
    problems: list[str] = []
    key_problems: tuple[str, ...] = ()
    digest, files = None, {}
    try:
        raw = read_manifest_bytes(storage, path)
        digest = manifest_digest(raw)
        m = decode_manifest(raw, where=storage.join(path, MANIFEST_NAME))
        files = {f: fe.size for f, fe in m.files.items()}
        rep = verify(path, checksums=checksums, storage=storage)
        problems.extend(rep.integrity_problems)
        key_problems = rep.key_problems
        if how == "smoke" and not problems and not key_problems:
            _smoke_load(storage, path, m, smoke_tensors)
    except StorageError:
        raise
    except CheckpointError as e:
        problems.append(f"{type(e).__name__}: {e}")
    ok = not problems and not key_problems
    if key_problems:
        log.warning("checkpoint %s: %s (the HMAC key is not its writer's: no verdict recorded "
                    "on that account)", path, key_problems[0])
    if record and (problems or not key_problems):
        kw: dict[str, Any] = dict(ok=not problems, problems=problems, how=how, digest=digest,
                                  files=files)
        if deferred is not None:
            deferred.append((name, kw))
        else:
            write_outcome(storage, root, name, **kw)
    if problems:
        log.warning("checkpoint %s failed its %s check: %s", path, how, problems[:3])
    return ok


def write_outcome(storage: Storage, root: str, name: str, *, ok: bool, problems: list[str],
                  how: str, digest: str | None, files: dict[str, int]) -> None:
    """Write the verification record of ``root/name``: the outcome (``ok``,
    the first 20 ``problems``), ``how`` it was checked, the xxh3_64
    ``digest`` of the manifest bytes checked and every file's size (the
    binding :func:`record_holds` re-checks). A failing record makes the
    checkpoint ``failed`` for ``reshard ls`` and unverified for retention.

    Raises:
        StorageError: the record could not be written."""
    write_record(storage, record_path(storage, root, name),
                 {"ok": ok, "time": time.time(), "problems": problems[:20], "how": how,
                  "manifest_xxh3": digest, "files": files})


def record_holds(storage: Storage, root: str, name: str, entry: Entry | None = None) -> bool:
    """True when ``root/name`` has a passing record that still describes it:
    the same manifest digest and every file at its recorded size (one
    manifest read, unless ``entry`` carries the digest, and one stat per
    file). A record of the old format (unbound) is not trusted."""
    rec = read_record(storage, record_path(storage, root, name))
    if rec is None or rec.get("ok") is not True or not isinstance(rec.get("files"), dict):
        return False
    path = storage.join(root, name)
    if entry is not None and entry.digest is not None and entry.manifest is not None:
        digest, m = entry.digest, entry.manifest
    else:
        try:
            raw = read_manifest_bytes(storage, path)
            m = decode_manifest(raw, where=storage.join(path, MANIFEST_NAME))
        except CheckpointError:
            return False
        digest = manifest_digest(raw)
    if rec.get("manifest_xxh3") != digest:
        return False
    if rec["files"] != {f: fe.size for f, fe in m.files.items()}:
        return False
    return not torn_files(storage, path, m)


def record_failed(storage: Storage, root: str, name: str, entry: Entry) -> str | None:
    """The first problem of a *failing* verification record of ``root/name``
    that describes the checkpoint now there (the same manifest digest as
    ``entry``'s), else None: such a checkpoint is known bad (a smoke test or
    ``gc``'s check found it so), which "unverified" would not say."""
    rec = read_record(storage, record_path(storage, root, name))
    if rec is None or rec.get("ok") is not False or entry.digest is None:
        return None
    if rec.get("manifest_xxh3") != entry.digest:
        return None
    problems = rec.get("problems")
    first = problems[0] if isinstance(problems, list) and problems else "failed its check"
    return str(first)
