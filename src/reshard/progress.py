"""Progress bars (tqdm, on stderr) for long operations.

The library shows one only when asked: ``progress=True`` (an argument of
``export_hf``, ``import_hf``, ``verify``, ``convert_dcp``; an option of
:class:`~reshard.SaveOptions` / :class:`~reshard.LoadOptions`) or the
environment variable ``RESHARD_PROGRESS=1``. The ``reshard`` command asks for
one when stderr is a terminal, and stays quiet otherwise (logs, pipes, CI).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

ENV = "RESHARD_PROGRESS"


def wanted(flag: bool | None) -> bool:
    """``flag`` when given, else whether ``RESHARD_PROGRESS`` is set to a true value."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def interactive() -> bool:
    """True when stderr is a terminal (the CLI's default for progress bars)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Quiet:
    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def bar(total: float | None, desc: str, *, enabled: bool, unit: str = "B") -> Any:
    """A tqdm bar on stderr (bytes scaled as KiB/MiB when ``unit`` is "B"),
    or an object with the same ``update``/``close``/context-manager interface
    that prints nothing when not ``enabled``."""
    if not enabled:
        return _Quiet()
    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):
        # a thread lock: tqdm's default adds a multiprocessing RLock, a named
        # semaphore under the spawn/forkserver start methods that it never
        # releases ("resource_tracker: There appear to be 2 leaked semaphore
        # objects" at the exit of every `reshard bench io` with a bar); our
        # bars are written by one process each
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                file=sys.stderr, leave=False, dynamic_ncols=True)
