"""The in-flight asynchronous saves of each process group, and the error of a
failed one.

:mod:`reshard.saving.staging` registers one saver per group here (its buffer pool,
its pending saves); :func:`reshard.save` asks here whether a background save
failed before it starts. Keeping the registry apart keeps the arrows one way:
``staging -> save`` and ``staging -> pending <- save``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ..collectives import on_new_world
from ..errors import CheckpointError

# group (or "default") -> reshard.saving.staging._Saver
SAVERS: dict[Any, Any] = {}
SAVERS_LOCK = threading.Lock()


def _forget_savers() -> None:
    """The default process group was destroyed and made again: the savers
    (their checkpoint groups, keyed by "default" or a group of the old world)
    belong to the old one."""
    with SAVERS_LOCK:
        SAVERS.clear()


on_new_world(_forget_savers)


def _take_error(group: Any, wait: bool) -> tuple[BaseException, Any] | None:
    """The failure (and its handle, None if unknown) of an earlier background
    save of ``group`` that no one was told of yet, taken so it is reported
    once; None without one. ``wait``: first wait for every in-flight save."""
    s = SAVERS.get(group if group is not None else "default")
    if s is None:
        return None
    if wait:
        for slot in list(s.pending):
            slot.handle.committed.exception()
    s.reclaim()
    if s.error is None:
        return None
    err, h, s.error, s.error_handle = s.error, s.error_handle, None, None
    if h is not None and h._reported:  # already raised by its handle's wait()
        return None
    if h is not None:
        h._reported = True
    return err, h


def raise_pending_error(group: Any = None, *, wait: bool = False) -> None:
    """Raise (once) the error of a failed background save of ``group``.

    With ``wait``, first wait for every in-flight save of the group, so that
    all ranks decide on the same outcome (a background failure is agreed
    across ranks, but may surface on one rank slightly before another)."""
    got = _take_error(group, wait)
    if got is not None:
        raise CheckpointError(f"a previous asynchronous save failed: {got[0]}") from got[0]


def warn_pending_error(group: Any = None, *, wait: bool = False, step: int | None = None) -> None:
    """Surface (once) the failure of an earlier background save of ``group``
    as a ``RuntimeWarning``, without raising: the save that calls it (of
    ``step``) goes ahead. A failure is reported when it happens (a log line
    on the coordinator, the handle's ``committed`` future, the manager's
    ``on_save_error`` hook) and never costs a later save. ``wait``: as
    :func:`raise_pending_error`."""
    got = _take_error(group, wait)
    if got is None or got[1] is None:
        return
    err, h = got
    warnings.warn(f"the asynchronous save of step {h.step} to {h.path} failed earlier "
                  f"({type(err).__name__}: {err}); the save of step {step} goes ahead",
                  RuntimeWarning, stacklevel=3)
