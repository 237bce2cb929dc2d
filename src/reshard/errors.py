"""One error hierarchy for every failure reshard reports.

All classes derive from :class:`CheckpointError` (itself an ``Exception``, never
``BaseException``), so ``except reshard.CheckpointError`` catches every fault
reshard raises. A failure on one rank of a distributed save or load is raised on
every rank; the error then carries ``failures``: for each failing rank, the
exception's type name, message and traceback text (carried between ranks as
text, never pickled).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """What one rank reported when it failed.

    Attributes:
        rank: the rank in the process group of the call.
        type_name: ``type(exc).__name__`` of the exception raised there.
        message: ``str(exc)``.
        traceback: the formatted traceback text.
    """

    rank: int
    type_name: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank=rank, type_name=type(exc).__name__, message=str(exc), traceback=tb)

    def to_json(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "type_name": self.type_name,
            "message": self.message,
            "traceback": self.traceback,
        }

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> RankFailure:
        return cls(
            rank=int(obj["rank"]),  # type: ignore[call-overload]
            type_name=str(obj["type_name"]),
            message=str(obj["message"]),
            traceback=str(obj["traceback"]),
        )


class CheckpointError(Exception):
    """Root of reshard's errors.

    Attributes:
        failures: ``{rank: RankFailure}`` when the error was agreed across the
            ranks of a collective save or load; empty for a local error.
    """

    def __init__(self, message: str, *, failures: dict[int, RankFailure] | None = None):
        super().__init__(message)
        self.failures: dict[int, RankFailure] = dict(failures or {})


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path, or no valid manifest there."""


class ManifestError(CheckpointError):
    """Manifest unreadable, fails its schema, names a file outside the checkpoint,
    or requires a feature this version does not know."""


class ShardingError(CheckpointError, ValueError):
    """Overlap, hole, conflicting shape or dtype, mismatch with the target,
    or replicas that differ."""


class IntegrityError(CheckpointError):
    """Checksum mismatch, file shorter than declared, or declared sizes that
    are inconsistent with the files."""


class CoverageError(IntegrityError, ShardingError):
    """The recorded chunks of a saved tensor do not tile its declared global
    shape (overlap, hole, or a declared shape larger than the data can fill):
    both an integrity fault of the checkpoint and a sharding fault."""


class NotARegularFileError(ManifestError):
    """A path the library was to open is a FIFO, a socket or a device, not a
    regular file: refused at once, never waited on (only regular files and
    directories are ever opened)."""


class RootOwnedError(CheckpointError):
    """Another live job owns the checkpoint root (its owner lease is live):
    a second writer is refused before it writes. The message names the owner
    (job id, host, pid, start, lease) and how to proceed."""


class StorageError(CheckpointError):
    """The store failed: I/O error, no space, throttled past retries, listing failed."""


class StoreCapabilityError(StorageError):
    """The store lacks what the commit protocol needs (probed, not declared):
    e.g. an S3-compatible store that ignores ``If-None-Match``/``If-Match``.
    Permanent: never retried; the message says what was found and what to set."""


_BY_NAME: dict[str, type[CheckpointError]] = {
    c.__name__: c
    for c in (
        CheckpointError,
        CheckpointNotFoundError,
        ManifestError,
        ShardingError,
        IntegrityError,
        CoverageError,
        StorageError,
        StoreCapabilityError,
        NotARegularFileError,
        RootOwnedError,
    )
}


#: at most this many distinct (type, message) groups are listed in an agreed error's message
MAX_GROUPS = 16


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def summarize_failures(failures: dict[int, RankFailure]) -> list[dict[str, object]]:
    """Failures deduplicated by (type, message): one record per group with
    ``type_name``, ``message`` and ``ranks`` (as ranges text, e.g. "0-3,7"),
    ``count``; groups in order of their first rank, at most MAX_GROUPS."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in sorted(failures):
        f = failures[r]
        groups.setdefault((f.type_name, f.message), []).append(r)
    return [{"type_name": t, "message": m[:2000], "ranks": rank_ranges(rs), "count": len(rs)}
            for (t, m), rs in list(groups.items())[:MAX_GROUPS]] + (
        [{"type_name": "", "message": f"... and {len(groups) - MAX_GROUPS} more distinct failures",
          "ranks": "", "count": 0}] if len(groups) > MAX_GROUPS else [])


def agreed_error(what: str, failures: dict[int, RankFailure], *,
                 groups: list[dict[str, object]] | None = None, total: int | None = None,
                 world_size: int | None = None) -> CheckpointError:
    """Build the error every rank raises after an all-ranks agreement step.

    ``failures``: the failures this rank knows (every failing rank's on the
    coordinator, a bounded sample elsewhere); ``groups`` / ``total``: the
    coordinator's summary (see :func:`summarize_failures`) when ``failures``
    is only a sample. The class is the common reshard class of all failures
    when they agree (e.g. every failing rank raised ``ShardingError``), else
    ``CheckpointError``. The message lists each distinct (type, message) once,
    with the ranks that raised it as ranges, so its size is bounded whatever
    the world size. In a world of one rank (``world_size`` 1) it is that
    rank's message alone (with the exception type when it is not the class
    raised), without rank framing (prefixed by what failed).
    """
    if groups is None:
        groups = summarize_failures(failures)
    n = total if total is not None else len(failures)
    names = {str(g["type_name"]) for g in groups if g["type_name"]}
    cls: type[CheckpointError] = CheckpointError
    if len(names) == 1 and len(groups) <= MAX_GROUPS:
        cls = _BY_NAME.get(next(iter(names)), CheckpointError)
    if world_size == 1 and len(failures) == 1:
        f = next(iter(failures.values()))
        kind = "" if f.type_name == cls.__name__ else f"{f.type_name}: "
        msg = f"{what} failed: {kind}{f.message}"
        return cls(msg, failures=failures)
    lines = [f"{what} failed on {n} rank(s):"]
    for g in groups:
        if not g["type_name"]:
            lines.append(f"  {g['message']}")
            continue
        who = f"rank {g['ranks']}" if g["count"] == 1 else f"ranks {g['ranks']} ({g['count']} ranks)"
        lines.append(f"  {who}: {g['type_name']}: {g['message']}")
    return cls("\n".join(lines), failures=failures)


def outcome(rank: int, err: BaseException | None, **payload: object) -> dict[str, object]:
    """What a rank contributes to an all-gathered agreement step (kept for
    small groups and foreign-format converters; the save and load paths use
    :meth:`reshard.collectives.Collectives.agree`): its failure as text (or
    None) and, on success, ``payload``. JSON-safe, for ``all_gather_json``."""
    if err is not None:
        return {"error": RankFailure.from_exception(rank, err).to_json()}
    return {"error": None, **payload}


def raise_agreed(what: str, gathered: list[dict[str, object]], mine: BaseException | None = None) -> None:
    """Raise :func:`agreed_error` on every rank when any gathered outcome failed
    (chained to this rank's own exception, if it had one)."""
    failures = {r: RankFailure.from_json(g["error"])  # type: ignore[arg-type]
                for r, g in enumerate(gathered) if g.get("error")}
    if failures:
        raise agreed_error(what, failures, world_size=len(gathered)) from mine
