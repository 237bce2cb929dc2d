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
:func:`pin_latest` is the same choice for a longer task (:func:`reshard.pin`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
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
            lease = leased_newest(st, key, hmac_key=opts.hmac_key, required=opts.require_lease,
                                  attempts=attempts, include_model_only=include_model_only)
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


@contextlib.contextmanager
def pin_latest(root: str | os.PathLike[str], *, ttl_s: float | None = None, storage: Storage | None = None,
               required: bool = True, include_model_only: bool = False, hmac_key: bytes | None = None,
               attempts: int = LATEST_ATTEMPTS) -> Iterator[ReaderLease]:
    """:func:`reshard.pin` of the newest committed checkpoint under ``root``,
    chosen and leased as :func:`load_latest` does (the lease written before
    the checkpoint is confirmed still committed and whole, else the newest
    chosen again, ``attempts`` choices in all): ``reshard.pin(reshard.latest(root))``
    without the gap in which retention may delete the checkpoint ``latest``
    named. The lease (``lease.path``: the checkpoint, a key of the root's
    store) is held and renewed for the block, on this process (not a
    collective).

    Example::

        with reshard.pin_latest(root) as lease:
            evaluate(lease.path)

    Raises:
        CheckpointNotFoundError: no committed checkpoint under ``root``, or
            each choice was deleted before its lease held it.
        CheckpointError: ``required`` (the default) and the lease could not be written.
        IntegrityError: with an HMAC key (``hmac_key``, else the
            environment's), the newest is unsigned or mis-signed.
        ValueError: ``attempts`` < 1.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    st, key = resolve(root, storage)
    lease = leased_newest(st, key, hmac_key=hmac_key_of(hmac_key), required=required, attempts=attempts,
                          include_model_only=include_model_only, what="pin", ttl_s=ttl_s)
    try:
        yield lease
    finally:
        lease.release()


def leased_newest(st: Storage, root: str, *, hmac_key: bytes | None, required: bool,
                  attempts: int = LATEST_ATTEMPTS, include_model_only: bool = False,
                  what: str = "load", ttl_s: float | None = None) -> ReaderLease:
    """The newest committed checkpoint under ``root`` (a key of ``st``) with
    a reader lease written and confirmed on it (``lease.path`` is the
    checkpoint; the caller releases it). After the lease is written the
    checkpoint must still have its manifest and every file at its declared
    size; else (deleted since it was chosen) the lease is released and the
    newest is chosen again, ``attempts`` choices in all. ``hmac_key``: the
    newest must be signed with it (None: no check). Where the lease cannot be
    written the checkpoint is read unprotected after one warning
    (``required``: refused), as :func:`reshard.load` does. ``what`` and
    ``ttl_s``: the lease's (:class:`~reshard.commit.leases.ReaderLease`).

    Raises:
        CheckpointNotFoundError: nothing committed under ``root``, or every
            choice was deleted before its lease held it.
        IntegrityError: with ``hmac_key``, the newest is unsigned or mis-signed.
        CheckpointError: ``required`` and the lease could not be written.
        StorageError: listing or a stat failed.
    """
    gone: list[str] = []
    for _ in range(attempts):
        best = latest_entry(st, root, include_model_only=include_model_only)
        if best is None or best.manifest is None:
            since = f" (deleted since they were chosen: {', '.join(gone)})" if gone else ""
            raise CheckpointNotFoundError(f"{st.url(root)}: no committed checkpoint here{since}; "
                                          "nothing was loaded")
        check_newest_signature(st, root, best, hmac_key)
        lease = ReaderLease(st, best.path, what=what, ttl_s=ttl_s).acquire(required=required)
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
