"""The commit protocol: attempt directories, manifest-last publish, discovery.

A checkpoint is committed when, and only when, ``<path>/manifest.json`` exists
and validates. Two publish strategies, chosen once per store by its
capabilities (:mod:`reshard.commit.strategy`, after Orbax ``path/atomicity.py``);
this module holds what both share and asks the store's strategy the rest:

* atomic rename (local file system): data and manifest are written in
  ``<path>.incomplete-<attempt_id>/``; the manifest is written last and fsynced,
  then the directory is renamed to ``<path>`` and the parent fsynced.
* manifest marker (object stores, ``memory://``): data is written under
  ``<path>/`` directly, in keys that carry the attempt id
  (:mod:`reshard.commit.attempts`), and the manifest last with a conditional put
  (``If-None-Match: *``): exactly one attempt publishes a step; before the
  manifest exists, readers see no checkpoint.

Beside the checkpoints of a root live small JSON records, each written by
:func:`write_record` (atomic where the store can rename): the ``HEAD`` record
(the checkpoint the current lineage resumed from, :mod:`reshard.commit.lineage`) and
quarantine markers. On stores without rename but with conditional puts the
``HEAD`` is replaced by compare-and-swap (:func:`write_head`: S3 ``If-Match``
on the ETag read, ``If-None-Match: *`` when there was none), so of two jobs
resuming one root at once the second gets a clear error naming the first. A checkpoint found unloadable by a restore is quarantined:
renamed aside to ``<name>.quarantined-<id>`` where rename is atomic, else
marked by a ``<name>.quarantined.json`` record; either way it is never listed
as committed, never returned by ``latest`` and never deleted by retention or
garbage collection.
"""

from __future__ import annotations

import os
import time

import msgspec

from ..errors import CheckpointError, IntegrityError

# Read-side names that live in the floors below (reshard.ondisk.committed, reshard.commit.listing), re-exported
# for the modules that still import them from here (manager.py and the fault matrix, edited by
# other branches this round; they move to the new paths with the package layout).
from ..ondisk.committed import (  # noqa: E402, F401
    _TMP,
    INCOMPLETE,
    QUARANTINE_MARK,
    QUARANTINED,
    RETIRED,
    linked_children,
    read_manifest,
    read_record,
)
from ..ondisk.manifest import (
    MANIFEST_NAME,
    Manifest,
)
from ..storage import Storage
from .listing import Entry, committed, read_head, scan  # noqa: E402, F401
from .strategy import ATTEMPT_NONCE, strategy_for, write_record  # noqa: F401


def new_attempt_id() -> str:
    """A unique attempt id from the clock and ``os.urandom`` (never from the
    Python/NumPy/torch generators, which save must not disturb)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.urandom(4).hex()}"


def attempt_path(storage: Storage, path: str, attempt_id: str) -> str:
    """Where an attempt writes: a sibling directory where rename is atomic,
    else the final prefix itself (:meth:`CommitStrategy.attempt_path
    <reshard.commit.strategy.CommitStrategy.attempt_path>`)."""
    return strategy_for(storage).attempt_path(storage, path, attempt_id)


def nonce_key(storage: Storage, attempt: str, attempt_id: str) -> str:
    """Where an attempt's nonce lives: :data:`ATTEMPT_NONCE` in the attempt
    directory, or, where attempts share the final prefix (no rename), a key
    carrying the attempt id (``att-<id>.attempt-nonce.json``), so concurrent
    attempts never overwrite each other's."""
    return strategy_for(storage).nonce_key(storage, attempt, attempt_id)


def create_attempt(storage: Storage, attempt: str, attempt_id: str) -> str:
    """Coordinator: create the attempt directory (or prefix) and write
    :data:`ATTEMPT_NONCE` into it: 16 random bytes from ``os.urandom``.
    Returns the nonce (hex) that every rank must read back."""
    nonce = os.urandom(16).hex()
    storage.makedirs(attempt)
    body = msgspec.json.encode({"attempt_id": attempt_id, "nonce": nonce})
    storage.write_bytes(nonce_key(storage, attempt, attempt_id), body, durable=False)
    return nonce


def check_attempt(storage: Storage, attempt: str, nonce: str, *, rank: int,
                  attempt_id: str = "") -> None:
    """Every rank: read the coordinator's nonce back through this rank's own
    storage before writing any data.

    Raises:
        CheckpointError: the nonce file is absent (this rank does not see the
            coordinator's storage: node-local disks under one spelling) or
            holds another nonce.
    """
    from ..errors import CheckpointError

    p = nonce_key(storage, attempt, attempt_id)
    try:
        got = msgspec.json.decode(storage.read_bytes(p)).get("nonce")
    except (FileNotFoundError, NotADirectoryError):
        got = None
    except (msgspec.DecodeError, AttributeError):
        got = "<unreadable>"
    if got != nonce:
        why = "" if got is None else f" (its {ATTEMPT_NONCE} holds another attempt's nonce)"
        raise CheckpointError(
            f"rank {rank} cannot see the attempt written by the coordinator at {attempt}{why}: "
            "node-local storage? every rank must see the same checkpoint location")


def confirm_files(storage: Storage, attempt: str, files: dict[str, int]) -> None:
    """Coordinator, before publishing: every file the manifest names exists in
    the attempt at its declared size (one ``size`` call per file, from up to 16
    threads).

    Raises:
        IntegrityError: files missing or of another size (all listed).
    """
    from concurrent.futures import ThreadPoolExecutor

    def stat(name: str) -> str | None:
        p = storage.join(attempt, name)
        try:
            got = storage.size(p)
        except (FileNotFoundError, NotADirectoryError):
            return f"{p}: missing (the writer reported {files[name]} bytes)"
        return None if got == files[name] else f"{p}: {got} bytes, the writer reported {files[name]}"

    names = sorted(files)
    if len(names) > 8:
        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="reshard-stat") as ex:
            found = list(ex.map(stat, names))
    else:
        found = [stat(n) for n in names]
    bad = [f for f in found if f is not None]
    if bad:
        raise IntegrityError(f"{len(bad)} of {len(names)} data file(s) not as written, refusing to "
                             "publish: " + "; ".join(bad[:10]))


def check_target(storage: Storage, path: str, *, overwrite: bool) -> None:
    """Refuse to save over a committed checkpoint unless ``overwrite`` (and
    never on a store without atomic rename, where a replace could not be
    atomic: publish under a new step instead). Anything else already at
    ``path`` on a rename-capable store (a directory that is not a committed
    checkpoint) is never replaced, ``overwrite`` or not."""
    strategy_for(storage).check_target(storage, path, overwrite=overwrite)


def publish(storage: Storage, attempt: str, path: str, manifest: Manifest, *, overwrite: bool,
            durable: bool) -> int:
    """Write the manifest last and make the attempt the checkpoint at ``path``;
    returns the bytes of the manifest written (sealed, :func:`encode_sealed`).

    First every file the manifest names is confirmed at its declared size
    (:func:`confirm_files`) and :data:`ATTEMPT_NONCE` is deleted. With
    ``overwrite`` on a rename-capable store, an existing checkpoint is moved
    aside, the new one renamed into place, then the old one deleted.

    Raises:
        IntegrityError: a data file is missing or of another size (nothing published).
        FileExistsError: something appeared at ``path`` during the save.
    """
    confirm_files(storage, attempt, {n: fe.size for n, fe in manifest.files.items()})
    strategy = strategy_for(storage)
    storage.delete_tree(strategy.nonce_key(storage, attempt, manifest.attempt_id))
    return strategy.publish(storage, attempt, path, manifest, overwrite=overwrite, durable=durable)


#: what :func:`retire_checkpoint` did
DELETED = "deleted"
ALREADY_REMOVED = "already removed"


def retire_checkpoint(storage: Storage, root: str, name: str) -> str:
    """Delete the committed checkpoint ``root/name`` unless a reader holds it:
    the one place a committed checkpoint is deleted (the manager's
    retention, its deletion before a save that would not fit, and ``reshard
    gc`` all call it through ``CheckpointManager._delete_checkpoint``).

    It writes nothing before it frees space where rename is atomic (a full
    disk: renames and deletes need no free block), and never deletes a
    checkpoint a live reader lease holds (:mod:`reshard.commit.leases`):

    1. live reader leases on ``name``? Then nothing is done.
    2. The manifest (the proof of the commit) is moved aside to
       ``<name>.deleting-<id>.json`` beside it: renamed where rename is
       atomic, else copied there and deleted. From here no reader finds the
       checkpoint; the data stay readable for one that read the manifest before.
    3. Live reader leases now (a reader whose lease was written since 1)?
       Then the manifest is put back and nothing is deleted.
    4. Else the checkpoint goes: renamed out of the committed namespace
       (``<name>.incomplete-deleting-<id>``, where rename is atomic) and
       deleted, then the moved manifest. An interruption leaves only what
       ``gc`` finishes (:func:`finish_interrupted`).

    Returns:
        ``"deleted"``, ``"already removed"`` (another deleter got there
        first: a race, never an error) or ``"in use by N reader(s)"``.

    Raises:
        StorageError: the store failed (nothing half-done is left listed as committed).
    """
    from .leases import DELETING, live_readers

    path = storage.join(root, name)
    n = live_readers(storage, root, {name}).get(name, 0)
    if n:
        return in_use(n)
    strategy = strategy_for(storage)
    mpath = storage.join(path, MANIFEST_NAME)
    aside = storage.join(root, f"{name}{DELETING}{os.urandom(4).hex()}.json")
    try:
        raw = strategy.manifest_aside(storage, mpath, aside)
    except (FileNotFoundError, NotADirectoryError):
        return ALREADY_REMOVED
    except CheckpointError:
        if not storage.exists(mpath):
            storage.delete_tree(aside)
            return ALREADY_REMOVED
        raise
    n = live_readers(storage, root, {name}).get(name, 0)
    if n:  # a reader came while the manifest was being moved: put it back
        strategy.manifest_back(storage, mpath, aside, raw)
        return in_use(n)
    finish_deletion(storage, root, name, aside)
    return DELETED


def in_use(n: int) -> str:
    return f"in use by {n} reader{'' if n == 1 else 's'}"


def finish_deletion(storage: Storage, root: str, name: str, aside: str | None) -> None:
    """Step 4 of :func:`retire_checkpoint`: delete the checkpoint
    ``root/name`` whose manifest is gone (moved to ``aside``)."""
    strategy_for(storage).finish_deletion(storage, storage.join(root, name), aside)


def finish_interrupted(storage: Storage, root: str, names: list[str], *, dry_run: bool = False) -> list[str]:
    """Finish the deletions that :func:`retire_checkpoint` began and an
    interruption (SIGKILL) left: each ``<name>.deleting-<id>.json`` among
    ``names`` (the children of ``root``) whose checkpoint has no manifest is
    deleted with it; one whose checkpoint has its manifest again (put back,
    or a new save of that name), or is gone, loses only the record.
    Returns what was (or, with ``dry_run``, would be) removed."""
    from .leases import DELETING

    out = []
    for child in names:
        if DELETING not in child or not child.endswith(".json") or INCOMPLETE in child:
            continue
        name = child.split(DELETING, 1)[0]
        path = storage.join(root, name)
        aside = storage.join(root, child)
        # where attempts share the final prefix (no rename), a prefix without a manifest
        # may be a new save of the same name: its objects are gc_root's (attempt leases)
        has_dir = name in names and not strategy_for(storage).shares_prefix
        if has_dir and not storage.exists(storage.join(path, MANIFEST_NAME)):
            out.append(name)
            if not dry_run:
                finish_deletion(storage, root, name, aside)
            continue
        out.append(child)
        if not dry_run:
            storage.delete_tree(aside)
    return out


def delete_checkpoint(storage: Storage, path: str) -> None:
    """Delete the committed checkpoint at ``path`` (whatever readers hold it:
    :func:`retire_checkpoint` is the reader-aware form retention uses). An
    interrupted deletion leaves only what ``gc`` removes."""
    from .leases import DELETING

    root, name = storage.parent(path), storage.basename(path)
    aside = storage.join(root, f"{name}{DELETING}{os.urandom(4).hex()}.json")
    moved = strategy_for(storage).drop_manifest(storage, storage.join(path, MANIFEST_NAME), aside)
    finish_deletion(storage, root, name, moved)


def quarantine(storage: Storage, root: str, name: str, *, reason: str,
               attempt_id: str | None) -> str:
    """Set the checkpoint ``root/name`` aside so that nothing lists it as
    committed, loads it or deletes it: rename it to
    ``<name>.quarantined-<id>`` where the store renames atomically, else write
    the marker ``<name>.quarantined.json``. Returns the name it now has (the
    same name, on stores that keep it in place)."""
    rec = {"name": name, "reason": reason[:2000], "time": time.time(), "attempt_id": attempt_id}
    return strategy_for(storage).quarantine(storage, root, name, rec, new_attempt_id())


