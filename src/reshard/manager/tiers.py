"""Two checkpoint tiers: a fast local tier and a durable remote tier.

The local tier (local disk or ``/dev/shm``, seen by every rank of the job)
is written every ``local_every`` steps by an ordinary
:class:`~reshard.CheckpointManager`. Every ``remote_every`` steps the
committed local checkpoint is copied in the background to the remote tier
(S3 or any other store): data files first, streamed in bounded pieces with
every block checksum and file checksum verified on the way, then the
manifest last (a conditional put, or rename where the store has it). Each
tier has its own retention; the local checkpoint being copied is held by a
lease so retention cannot delete it mid-copy.

``restore`` tries the newest committed checkpoint across both tiers (the
local one first at equal steps), verifies it (structure, then checksums as
it loads) and falls back tier by tier, older step by older step.

Threads: the copy runs on one background thread of the coordinator (rank 0);
``save``/``restore``/``wait`` are called by every rank from the training loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..collectives_deferred import Deferred
from ..commit import attempts
from ..commit.listing import committed
from ..commit.protocol import check_target, new_attempt_id, publish
from ..commit.strategy import strategy_for
from ..errors import CheckpointError, IntegrityError, StorageError
from ..loading.load import LoadResult
from ..ondisk.committed import read_manifest, sign_manifest
from ..ondisk.manifest import Manifest
from ..ondisk.shardfile import block_digests, file_checksum
from ..options import SaveOptions
from ..saving.save import SaveResult
from ..storage import Storage
from .manager import CheckpointManager

log = logging.getLogger("reshard.manager.tiers")

_PIECE = 8 << 20  # bytes read and written at once while copying (whole checksum blocks)


@dataclass(frozen=True, kw_only=True)
class CopyReport:
    """One checkpoint copied between tiers.

    Attributes:
        step: the checkpoint's step.
        source, target: checkpoint paths (keys of their stores).
        bytes: data and manifest bytes copied.
        seconds: wall time of the copy.
        error: why the copy failed (None on success; nothing was published then).
    """

    step: int
    source: str
    target: str
    bytes: int
    seconds: float
    error: str | None = None

    @property
    def bandwidth_mb_s(self) -> float:
        """Copy bandwidth in MB/s (10**6 bytes per second)."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def _copy_file(src: Storage, sp: str, dst: Storage, dp: str, m: Manifest, name: str) -> int:
    """Stream one data file from ``src`` to ``dst`` in bounded pieces,
    checking every block checksum and the file checksum before the stream is
    closed (a mismatch aborts the upload). Returns bytes copied."""
    fe = m.files[name]
    b = m.checksum_block_bytes
    items = sorted([(c.offset, c.length, c.checksums) for te in m.tensors.values()
                    for c in te.chunks if c.file == name]
                   + [(c.offset, c.length, c.checksums) for oe in m.objects.values()
                      for c in oe.chunks if c.file == name])
    piece = b * max(1, _PIECE // b)
    out = dst.open_write(dp)
    try:
        pos = 0
        prefix = b""
        tree: list[tuple[str, ...]] = []

        def plain(upto: int) -> bytes:
            nonlocal pos
            data = src.read_bytes(sp, pos, upto - pos) if upto > pos else b""
            out.write(data)
            pos = upto
            return data

        for off, length, want in items:
            gap = plain(off)
            if not tree:
                prefix += gap
            got: list[str] = []
            for a in range(0, length, piece):
                data = src.read_bytes(sp, off + a, min(piece, length - a))
                got.extend(block_digests(memoryview(data), b))
                out.write(data)
            pos = off + length
            if want and tuple(got) != tuple(want):
                k = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
                raise IntegrityError(f"{sp}: checksum mismatch in block {k} of the chunk at byte "
                                     f"{off} (refusing to copy a corrupt checkpoint)")
            tree.append(tuple(got))
        if not items:
            prefix = plain(fe.size)
        plain(fe.size)
        if fe.checksum and all(w for _, _, w in items) and file_checksum(prefix, tree) != fe.checksum:
            raise IntegrityError(f"{sp}: file checksum mismatch (refusing to copy)")
    except BaseException:
        out.abort()
        raise
    out.close()
    return fe.size


def copy_checkpoint(src: Storage, src_path: str, dst: Storage, dst_path: str, *, step: int,
                    hmac_key: bytes | None = None) -> CopyReport:
    """Copy one committed checkpoint to another store: data first, verified
    on the way, manifest last, with the target's commit protocol (rename, or
    a conditional put of the manifest where objects carry the attempt id).

    Raises:
        CheckpointError: the source is not committed or fails a checksum; the
            target already holds this checkpoint (FileExistsError); the store
            failed (StorageError). Nothing is published then.
    """
    t0 = time.perf_counter()
    m = read_manifest(src, src_path, hmac_key=hmac_key)
    if "hmac_sha256" in m.extra and hmac_key is None:
        raise CheckpointError(f"{src_path}: the manifest is signed; copying it to another tier "
                              "renames its files and needs the HMAC key to sign it again")
    check_target(dst, dst_path, overwrite=False)
    from ..catalog.verify import verify

    # every block and file checksum of the source, wherever the manifest keeps them (chunk
    # lists or the files' block tables); the copy below re-checks chunk-listed ones in flight
    rep = verify(src_path, checksums=True, storage=src)
    if not rep.ok:
        raise IntegrityError(f"{src_path}: refusing to copy a corrupt checkpoint: "
                             + "; ".join(rep.problems[:3]))
    aid = new_attempt_id()
    strategy = strategy_for(dst)
    names = {n: strategy.data_name(aid, n) for n in m.files}
    target = strategy.attempt_path(dst, dst_path, aid)
    # a lease where attempts share the prefix (gc collects them by it); the
    # local tier's attempt directory is protected by gc's grace period
    lease = strategy.attempt_lease(dst, dst_path, target, aid).start() if strategy.shares_prefix else None
    copied = 0
    try:
        dst.makedirs(target)
        for n in sorted(m.files):
            copied += _copy_file(src, src.join(src_path, n), dst, dst.join(target, names[n]), m, n)
        new = attempts.rename_files(m, names)
        if hmac_key is not None and "hmac_sha256" in m.extra:
            new = sign_manifest(new, hmac_key)
        copied += publish(dst, target, dst_path, new, overwrite=False, durable=True)
    except BaseException:
        with contextlib.suppress(Exception):
            strategy.discard(dst, target, aid)
        raise
    finally:
        if lease is not None:
            lease.stop()
    return CopyReport(step=step, source=src_path, target=dst_path, bytes=copied,
                      seconds=time.perf_counter() - t0)


class TieredCheckpointManager:
    """Checkpoints in a fast local tier and a durable remote tier.

    Args:
        local_root: the local tier (path or URL), seen by every rank.
        remote_root: the remote tier (e.g. ``s3://bucket/run``).
        local_every: save to the local tier when ``step % local_every == 0``.
        remote_every: copy to the remote tier when ``step % remote_every == 0``
            (such a step is also saved locally first).
        keep_local, keep_remote: ``keep_last`` of each tier's retention
            (None keeps all).
        options: SaveOptions of every save (its HMAC key signs tier copies).
        group: process group.
        local_storage, remote_storage: backends instead of resolving the roots.

    Attributes:
        copies: :class:`CopyReport` of every finished copy (coordinator only),
            with its bandwidth.
    """

    def __init__(self, local_root: str | os.PathLike[str], remote_root: str | os.PathLike[str], *,
                 local_every: int, remote_every: int, keep_local: int | None = 2,
                 keep_remote: int | None = None, options: SaveOptions | None = None,
                 group: Any = None, local_storage: Storage | None = None,
                 remote_storage: Storage | None = None):
        if local_every <= 0 or remote_every <= 0:
            raise ValueError("local_every and remote_every must be positive")
        self.local_every, self.remote_every = local_every, remote_every
        self.options = options or SaveOptions()
        self.group = group
        self.coll = Deferred(group, None)  # gloo, whatever the training backend (made at first use)
        self.local = CheckpointManager(local_root, keep_last=keep_local, options=self.options,
                                       group=group, storage=local_storage, preempt_signals=())
        self.remote = CheckpointManager(remote_root, keep_last=keep_remote, options=self.options,
                                        group=group, storage=remote_storage, preempt_signals=())
        self.copies: list[CopyReport] = []
        self._queue: queue.Queue[tuple[int, contextlib.ExitStack] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ saving
    def should_save(self, step: int) -> bool:
        return step % self.local_every == 0 or step % self.remote_every == 0

    def save(self, step: int, state: Mapping[str, Any], *,
             metric: float | None = None) -> SaveResult | None:
        """Save ``step`` to the local tier if it is a local or remote step;
        on a remote step, queue its copy to the remote tier (coordinator).
        Returns the local SaveResult, or None when ``step`` is neither."""
        if not self.should_save(step):
            return None
        res = self.local.save(step, state, metric=metric, sync=True)
        assert isinstance(res, SaveResult)
        if step % self.remote_every == 0 and self.coll.rank == 0:
            hold = contextlib.ExitStack()
            hold.enter_context(self.local.lease(step))  # retention keeps it until copied
            self._idle.clear()
            self._queue.put((step, hold))
            if self._thread is None:
                self._thread = threading.Thread(target=self._copier, daemon=True,
                                                name="reshard-tier-copy")
                self._thread.start()
        return res

    def _copier(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            step, hold = job
            src = self.local.path_for(step)
            dst = self.remote.path_for(step)
            t0 = time.perf_counter()
            try:
                rep = copy_checkpoint(self.local.storage, src, self.remote.storage, dst, step=step,
                                      hmac_key=self.options.hmac_key)
                log.info("tier copy of step %d: %.1f MB in %.2f s (%.1f MB/s)", step,
                         rep.bytes / 1e6, rep.seconds, rep.bandwidth_mb_s)
                self.remote.verify_checkpoint(step)
                self.remote.apply_retention()
            except Exception as e:  # noqa: BLE001 - reported in copies, never kills training
                rep = CopyReport(step=step, source=src, target=dst, bytes=0,
                                 seconds=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
                log.warning("tier copy of step %d failed: %s", step, rep.error)
            finally:
                hold.close()
            self.copies.append(rep)
            if self._queue.empty():
                self._idle.set()

    def wait(self, timeout: float | None = None) -> list[CopyReport]:
        """Wait until queued copies finished (coordinator); returns every report.

        Raises:
            TimeoutError: copies still running after ``timeout`` seconds.
        """
        if not self._idle.wait(timeout):
            raise TimeoutError(f"tier copies still running after {timeout} s")
        return list(self.copies)

    # ------------------------------------------------------------ restoring
    def restore(self, state: Mapping[str, Any], **load_kwargs: Any) -> LoadResult | None:
        """Load the newest committed checkpoint across the tiers (local first
        at equal steps); one that fails verification or its load falls back
        to the next, tier by tier. ``LoadResult.notes["tier"]`` says which.

        Returns:
            The LoadResult, or None when neither tier holds a checkpoint.

        Raises:
            CheckpointError: checkpoints exist but none loads.
            StorageError: a tier could not be listed (never taken as empty).
        """
        tiers = {"local": self.local, "remote": self.remote}
        cands = [(e.step if e.step is not None else -1, pref, name)
                 for pref, name in ((1, "local"), (0, "remote"))
                 for e in committed(tiers[name].storage, tiers[name].root)]
        failures: list[str] = []
        for step, _, name in sorted(cands, reverse=True):
            try:
                res = tiers[name].restore(state, step=step, **load_kwargs)
            except StorageError:
                raise
            except CheckpointError as e:
                failures.append(f"{name} step {step}: {e}")
                warnings.warn(f"{name} tier, step {step}: {e}; falling back", RuntimeWarning,
                              stacklevel=2)
                continue
            if res is None:
                continue
            res.notes["tier"] = name
            if failures:
                res.notes["tier_fallback"] = failures
            return res
        if failures:
            raise CheckpointError("no checkpoint of either tier loads:\n  " + "\n  ".join(failures))
        return None

    def close(self) -> None:
        """Finish queued copies and stop the copy thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self.local.close()
        self.remote.close()
