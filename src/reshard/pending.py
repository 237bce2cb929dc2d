"""The in-flight asynchronous saves of each process group, and the error of a
failed one.

:mod:`reshard.staging` registers one saver per group here (its buffer pool,
its pending saves); :func:`reshard.save` asks here whether a background save
failed before it starts. Keeping the registry apart keeps the arrows one way:
``staging -> save`` and ``staging -> pending <- save``.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import CheckpointError

# group (or "default") -> reshard.staging._Saver
SAVERS: dict[Any, Any] = {}
SAVERS_LOCK = threading.Lock()


def raise_pending_error(group: Any = None, *, wait: bool = False) -> None:
    """Raise (once) the error of a failed background save of ``group``.

    With ``wait``, first wait for every in-flight save of the group, so that
    all ranks decide on the same outcome (a background failure is agreed
    across ranks, but may surface on one rank slightly before another)."""
    s = SAVERS.get(group if group is not None else "default")
    if s is None:
        return
    if wait:
        for slot in list(s.pending):
            slot.handle.committed.exception()
    s.reclaim()
    if s.error is not None:
        err, h, s.error, s.error_handle = s.error, s.error_handle, None, None
        if h is not None and h._reported:  # already raised by its handle's wait()
            return
        if h is not None:
            h._reported = True
        raise CheckpointError(f"a previous asynchronous save failed: {err}") from err
