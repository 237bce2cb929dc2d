"""Load the newest committed checkpoint of a root, leased before it is read.

``reshard.load(state, reshard.latest(root))`` races a trainer's retention:
the checkpoint :func:`~reshard.catalog.verify.latest` names can be deleted
before :func:`~reshard.loading.load.load` writes its reader lease (with
``keep_last=1``, as soon as the next save commits), and the load then fails
with "no manifest.json". :func:`load_latest` closes the gap: the coordinator
chooses the newest checkpoint, writes its reader lease, and only then
confirms the checkpoint is still there (:mod:`reshard.commit.leases`: a
reader that finds the manifest after its lease is written never loses a file
to retention or gc); when it was deleted in between it chooses again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..collectives import Arrival, Tries, timed_collectives
from ..commit.leases import ReaderLease
from ..errors import CheckpointNotFoundError
from ..loading.load import LoadResult, load_leased
from ..ondisk.committed import torn_files
from ..ondisk.manifest import MANIFEST_NAME
from ..options import LoadOptions, hmac_key_of
from ..storage import Storage, resolve
from .verify import check_newest_signature, latest_entry

#: how many times :func:`load_latest` chooses the newest checkpoint again by default
#: when the one it chose was deleted before its reader lease held it
LATEST_ATTEMPTS = 3


def load_latest(
    state: Mapping[str, Any],
    root: str | os.PathLike[str],
    *,
    group: Any = None,
    strict: bool = True,
    allow_missing: Sequence[Any] = (),
    transforms: Sequence[Any] = (),
    options: LoadOptions | None = None,
    storage: Storage | None = None,
    include_model_only: bool = False,
    attempts: int = LATEST_ATTEMPTS,
) -> LoadResult:
    """Fill ``state`` from the newest committed checkpoint under ``root``,
    holding its reader lease from before it is read until the load returns
    (the reader's side of a root a training job keeps saving to and pruning).

    The coordinator (rank 0 of ``group``) chooses the checkpoint as
    :func:`reshard.latest` does (same rules: ``HEAD``, model-only ones passed
    over unless ``include_model_only``, torn ones never; with an HMAC key the
    newest must be signed), writes its reader lease, and then checks that the
    checkpoint is still committed and whole. When retention or gc deleted it
    between the choice and the lease, the lease is released and the newest is
    chosen again, at most ``attempts`` times in all; a half-deleted checkpoint
    is never loaded. Every rank then loads the path the coordinator chose
    (one broadcast), as :func:`reshard.load` does: a collective over
    ``group``, called on every rank. ``LoadResult.path`` is the checkpoint
    loaded.

    Args:
        state, group, strict, allow_missing, transforms, options, storage: as
            :func:`reshard.load`.
        root: the directory (or URL) holding the committed checkpoints.
        include_model_only: a checkpoint marked model-only may be chosen.
        attempts: choices at most (>= 1), each after the previous one was
            found deleted.

    Raises:
        CheckpointNotFoundError: no committed checkpoint under ``root``, or
            each of ``attempts`` choices was deleted before its lease held it
            (every rank).
        ValueError: ``attempts`` < 1.
        Otherwise what :func:`reshard.load` raises (IntegrityError: with a
        key, the newest checkpoint unsigned or mis-signed), on every rank.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    opts = options or LoadOptions()
    if opts.hmac_key is None or not opts.hmac_key:  # the environment's key (NO_HMAC_KEY: none)
        opts = dataclasses.replace(opts, hmac_key=hmac_key_of(opts.hmac_key))
    where = os.fspath(root)
    coll = timed_collectives(group, opts.timeout_s, arrival=Arrival(
        kind="load", what=f"load_latest of {where}", timeout_s=opts.arrival_timeout_s))
    tries = Tries()
    lease: ReaderLease | None = None
    chosen = b""
    if coll.rank == 0:
        with tries:
            st, key = resolve(root, storage)
            lease = leased_newest(st, key, opts, attempts=attempts,
                                  include_model_only=include_model_only)
            # the other ranks name it as the caller named the root: a URL, or a key of `storage`
            chosen = (lease.path if storage is not None else st.url(lease.path)).encode()
    try:
        tries.agree(coll, f"load_latest of {where}")
        path = coll.broadcast_bytes(chosen if coll.rank == 0 else None).decode()
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    if lease is not None:  # the coordinator reads through its own store, as load() does
        return load_leased(state, lease.path, lease=lease, group=group, strict=strict,
                           allow_missing=allow_missing, transforms=transforms, options=opts,
                           storage=lease.storage)
    return load_leased(state, path, lease=None, group=group, strict=strict,
                       allow_missing=allow_missing, transforms=transforms, options=opts,
                       storage=storage)


def leased_newest(st: Storage, root: str, options: LoadOptions, *, attempts: int = LATEST_ATTEMPTS,
                  include_model_only: bool = False) -> ReaderLease:
    """The newest committed checkpoint under ``root`` (a key of ``st``) with
    a reader lease written and confirmed on it (``lease.path`` is the
    checkpoint; the caller releases it). After the lease is written the
    checkpoint must still have its manifest and every file at its declared
    size; else (deleted since it was chosen) the lease is released and the
    newest is chosen again, ``attempts`` choices in all. Where the lease
    cannot be written the checkpoint is read unprotected after one warning
    (``options.require_lease``: refused), as :func:`reshard.load` does.

    Raises:
        CheckpointNotFoundError: nothing committed under ``root``, or every
            choice was deleted before its lease held it.
        IntegrityError: with ``options.hmac_key``, the newest is unsigned or mis-signed.
        CheckpointError: ``options.require_lease`` and the lease could not be written.
        StorageError: listing or a stat failed.
    """
    gone: list[str] = []
    for _ in range(attempts):
        best = latest_entry(st, root, include_model_only=include_model_only)
        if best is None or best.manifest is None:
            since = f" (deleted since they were chosen: {', '.join(gone)})" if gone else ""
            raise CheckpointNotFoundError(f"{st.url(root)}: no committed checkpoint here{since}; "
                                          "nothing was loaded")
        check_newest_signature(st, root, best, options.hmac_key)
        lease = ReaderLease(st, best.path, what="load").acquire(required=options.require_lease)
        try:
            lease.confirm()
            # the lease is written: a manifest found now stays (the deleter's second look sees the lease)
            if st.exists(st.join(best.path, MANIFEST_NAME)) and not torn_files(st, best.path, best.manifest):
                return lease
        except BaseException:
            lease.release()
            raise
        lease.release()
        gone.append(best.name)
    raise CheckpointNotFoundError(
        f"{st.url(root)}: the newest committed checkpoint was deleted before its reader lease "
        f"held it, {attempts} time(s) in a row ({', '.join(gone)}); nothing was loaded")
