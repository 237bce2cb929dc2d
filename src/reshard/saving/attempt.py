"""The attempt of one save, seen from every rank: the coordinator opens it (target checked,
attempt id, path, nonce), every rank checks that it sees it before writing and the ranks agree
on that; a failure on any rank discards it (nothing published, no older checkpoint touched);
a target removed meanwhile is named as such.
"""

from __future__ import annotations

from typing import NoReturn

from ..collectives import (
    Collectives,
    OnFail,
    Tries,
)
from ..commit import attempts
from ..commit.protocol import (
    attempt_path,
    check_attempt,
    check_target,
    create_attempt,
    new_attempt_id,
)
from ..commit.strategy import strategy_for
from ..errors import CheckpointError
from ..options import SaveOptions
from ..planning.coordination_save import Attempt
from ..storage import Storage


def _raise_removed(st: Storage, info: Attempt, e: BaseException) -> NoReturn:
    """Raise :func:`removed_error` of ``e`` (chained to it), or ``e`` itself."""
    gone = removed_error(st, info, e)
    if gone is e:
        raise e
    raise gone from e


def removed_error(st: Storage, info: Attempt, e: BaseException) -> BaseException:
    """``e`` as a CheckpointError naming what happened when the attempt
    directory no longer exists (removed under the running save: a ``reshard
    gc`` of another version, a person, a script), else ``e`` itself."""
    attempt = info.attempt_path
    if isinstance(e, CheckpointError) and "was removed while the save ran" in str(e):
        return e
    try:
        if not strategy_for(st).vanished(st, attempt, info.target):
            return e
    except Exception:  # noqa: BLE001 - the original error is what matters then
        return e
    return CheckpointError(
        f"{attempt}: the attempt directory was removed while the save ran (by a garbage "
        f"collection that ignored its lease, or by a person or script); nothing was published "
        f"and no older checkpoint was touched ({type(e).__name__}: {e})")


def open_attempt(st: Storage, key: str, options: SaveOptions,
                 leases: list[attempts.AttemptLease] | None = None) -> Attempt:
    """Coordinator, before any rank writes: decide where the checkpoint goes.

    ``key`` is made canonical (``Storage.canonical``: absolute, symbolic
    links resolved), checked (:func:`~reshard.commit.protocol.check_target`), and the
    attempt is created with a nonce in it (:func:`~reshard.commit.protocol.create_attempt`).
    With ``leases``, the attempt's lease (:class:`reshard.commit.attempts.AttemptLease`)
    is started first and appended to it (the caller stops it).
    Returns what every rank needs: the :class:`~reshard.planning.coordination_save.Attempt`
    (the canonical checkpoint location, the attempt id, path and nonce).
    """
    target = st.canonical(key)
    st.check_publish(target)  # a store that cannot publish safely is refused before any data
    check_target(st, target, overwrite=options.overwrite)
    attempt_id = new_attempt_id()
    attempt = attempt_path(st, target, attempt_id)
    strategy = strategy_for(st)
    try:
        if leases is not None:
            leases.append(strategy.attempt_lease(st, target, attempt, attempt_id).start())
        nonce = create_attempt(st, attempt, attempt_id)
    except Exception:
        try:  # nothing was published: the attempt (or its objects under the prefix) goes
            strategy.discard(st, attempt, attempt_id)
        except Exception:  # noqa: BLE001, S110 - best effort; the creation error is what matters
            pass
        raise
    return Attempt(target=target, attempt_id=attempt_id, attempt_path=attempt, nonce=nonce)


def check_attempt_location(rank: int, st: Storage, key: str, coord: Attempt) -> None:
    """This rank names the coordinator's checkpoint (same canonical spelling)
    and sees the coordinator's attempt (reads the nonce back through its own
    storage).

    Raises:
        CheckpointError: a different checkpoint, or the attempt is not visible.
    """
    mine = st.canonical(key)
    if mine != coord.target:
        raise CheckpointError(
            f"rank {rank} names checkpoint {mine!r}, the coordinator (rank 0) names "
            f"{coord.target!r}: every rank must pass the same checkpoint path (no per-rank "
            "names, relative paths resolved in one directory)")
    check_attempt(st, coord.attempt_path, coord.nonce, rank=rank, attempt_id=coord.attempt_id)


def agree_attempt_location(coll: Collectives, st: Storage, key: str, coord: Attempt) -> None:
    """Every rank, before writing any data: the checkpoint this rank named is
    the coordinator's (same canonical spelling), and this rank sees the
    coordinator's attempt (it reads the nonce back through its own storage).
    Agreed: on any rank's failure every rank raises and the attempt is
    discarded, before any data is written.

    Args:
        coord: the coordinator's :func:`open_attempt` result.

    Raises:
        CheckpointError: ranks name different checkpoints, or a rank cannot
            see the coordinator's attempt (node-local storage).
    """
    tries = Tries()
    with tries:
        check_attempt_location(coll.rank, st, key, coord)
    tries.gather(coll, "save (attempt location)", on_fail=discarding(coll, st, coord))


def discarding(coll: Collectives, st: Storage, coord: Attempt) -> OnFail:
    """``on_fail`` of a save phase (:class:`reshard.collectives.Tries`):
    the coordinator discards the attempt (:func:`discard_attempt`)."""
    def discard(agreed: CheckpointError, mine: BaseException | None) -> None:
        discard_attempt(coll, st, coord.attempt_path, attempt_id=coord.attempt_id)
    return discard


def discard_attempt(coll: Collectives, st: Storage, attempt: str, *,
                    attempt_id: str | None = None) -> None:
    """Remove a failed attempt (coordinator only, after every rank stopped
    writing). Never touches a committed checkpoint: on rename-capable stores
    the attempt is its own directory; on others only the objects (and open
    multipart uploads) whose keys carry ``attempt_id`` are deleted."""
    if coll.rank != 0:
        return
    try:
        strategy_for(st).discard(st, attempt, attempt_id)
    except Exception:  # noqa: BLE001 - best effort; gc and abandoned-attempt listing handle the rest
        pass
