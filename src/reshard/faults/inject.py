"""A fault-injecting :class:`~reshard.storage.Storage` wrapper (any backend inside).

:class:`FaultStorage` forwards every call to the wrapped store and, where a
:class:`Fault` matches the call, fails it the way a real backend would: an
``OSError`` with ``errno`` ``ENOSPC``, ``EIO`` or ``EDQUOT`` becomes the
:class:`~reshard.errors.StorageError` that ``storage/base.py``'s contract
prescribes (the ``OSError`` as its cause), a timeout becomes a
``StorageError`` caused by ``TimeoutError``. It can also corrupt silently
(truncate or flip a byte of a file after it was written), delay a call
(a slow writer, a rank that never arrives), SIGKILL its own process at the
call (a rank dying exactly in that phase of a save or load) or SIGSTOP it (a
rank that hangs there: alive, holding its connections, never answering).

Operations counted (the ``op`` of a fault; ``match`` is an ``fnmatch`` pattern
on the key's last component):

``makedirs`` ``open_write`` ``write`` (each chunk written to a stream)
``fsync`` (closing a durable stream) ``close`` ``write_bytes`` ``rename``
(``rename_dir``; matched on the source) ``delete`` (``delete_tree``)
``fsync_dir`` ``read`` (``read_into`` / ``read_bytes``) ``size`` ``exists``
``list`` ``put_if_absent`` (the conditional put that publishes a manifest on
a store without rename) ``put_if_match``. Conditional puts, tagged reads and
multipart bookkeeping are forwarded to the wrapped store as they are (never
replaced by the base class's compare-then-write), so a wrapped S3 store keeps
its atomic publish.

Phases of a save, as the calls they start with (``PHASES``): ``attempt``
(``makedirs`` of the attempt directory: planning is done), ``data`` (a write
to a shard file), ``data-durable`` (fsync of a shard file), ``manifest``
(``open_write`` of ``manifest.json``: all data is durable, nothing is
published), ``publish`` (``rename_dir`` of the attempt into place),
``retention`` (``delete_tree`` of an older checkpoint); of a load: ``read``.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import StorageError
from ..storage.base import Storage, WriteStream

ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "edquot": errno.EDQUOT}
ACTIONS = (*ERRNOS, "timeout", "truncate", "flip", "delay", "kill", "stop", "call")
OPS = ("makedirs", "open_write", "write", "fsync", "close", "write_bytes", "rename", "delete",
       "fsync_dir", "read", "size", "exists", "list", "put_if_absent", "put_if_match", "link")

#: save / load phase -> (op, match) of the call that marks it
PHASES: dict[str, tuple[str, str]] = {
    "attempt": ("makedirs", "*.incomplete-*"),
    "data": ("write", "data-*"),
    "data-durable": ("fsync", "data-*"),
    "manifest": ("open_write", "manifest.json"),
    "publish": ("rename", "*.incomplete-*"),
    "retention": ("delete", "*"),
    "read": ("read", "data-*"),
}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault.

    Attributes:
        op: the operation counted (see the module docstring), or a phase name
            of ``PHASES`` (which sets ``op`` and ``match``).
        action: "enospc", "eio", "edquot" (raise as the backend would),
            "timeout" (StorageError caused by TimeoutError), "truncate" /
            "flip" (after a write completes: cut the file to ``arg`` bytes
            (default: half) / flip bit 0 of byte ``arg`` (default: the middle),
            silently), "delay" (sleep ``delay_s`` seconds, then proceed),
            "kill" (SIGKILL this process), "stop" (SIGSTOP it: it hangs until
            SIGCONT), "call" (run ``callback(op, path)``).
        match: ``fnmatch`` pattern on the last component of the key.
        nth: the first matching call that triggers (1-based).
        times: how many matching calls trigger from ``nth`` on (0: all).
        after: trigger after the wrapped call succeeded instead of before
            (always so for "truncate" and "flip").
        delay_s: seconds, for "delay" (and "timeout": how long the call hangs
            before failing).
        arg: byte count / index for "truncate" / "flip".
        callback: for "call".
    """

    op: str
    action: str
    match: str = "*"
    nth: int = 1
    times: int = 1
    after: bool = False
    delay_s: float = 0.0
    arg: int | None = None
    callback: Callable[[str, str], None] | None = None

    def __post_init__(self) -> None:
        if self.op in PHASES:
            op, match = PHASES[self.op]
            object.__setattr__(self, "op", op)
            if self.match == "*":
                object.__setattr__(self, "match", match)
        if self.op not in OPS:
            raise ValueError(f"Fault.op must be one of {OPS} or a phase of {sorted(PHASES)}, "
                             f"got {self.op!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"Fault.action must be one of {ACTIONS}, got {self.action!r}")
        if self.nth < 1 or self.times < 0:
            raise ValueError("Fault.nth must be >= 1 and Fault.times >= 0")
        if self.action in ("truncate", "flip"):
            object.__setattr__(self, "after", True)


@dataclass
class _State:
    counts: Counter[int] = field(default_factory=Counter)
    fired: list[tuple[str, str, str]] = field(default_factory=list)


class FaultStorage(Storage):
    """Wraps ``inner`` and injects ``faults`` (see the module docstring).

    Attributes:
        inner: the wrapped backend.
        faults: the faults armed (a list: tests may append while running).
        log: every call as ``(op, key)``, in order (thread-safe appends).
        fired: ``(op, key, action)`` of every fault that triggered.
        on_fire: ``on_fire(op, key, action)`` is called as a fault triggers,
            before it acts (the fault matrix times its faults with it).
    """

    def __init__(self, inner: Storage, faults: list[Fault] | tuple[Fault, ...] = (),
                 on_fire: Callable[[str, str, str], None] | None = None):
        super().__init__()
        self.on_fire = on_fire
        self.inner = inner
        self.capabilities = inner.capabilities
        self.faults: list[Fault] = list(faults)
        self.log: list[tuple[str, str]] = []
        self._st = _State()
        self._flock = threading.Lock()

    @property
    def fired(self) -> list[tuple[str, str, str]]:
        return list(self._st.fired)

    # -- fault machinery
    def _due(self, op: str, path: str, *, after: bool) -> list[Fault]:
        name = self.basename(path)
        out = []
        with self._flock:
            if not after:
                self.log.append((op, path))
            for i, f in enumerate(self.faults):
                if f.op != op or f.after != after or not fnmatch.fnmatchcase(name, f.match):
                    continue
                self._st.counts[i] += 1
                k = self._st.counts[i]
                if k >= f.nth and (f.times == 0 or k < f.nth + f.times):
                    out.append(f)
                    self._st.fired.append((op, path, f.action))
        return out

    def _fire(self, op: str, path: str, *, after: bool = False) -> None:
        for f in self._due(op, path, after=after):
            self._apply(f, op, path)

    def _apply(self, f: Fault, op: str, path: str) -> None:
        a = f.action
        if self.on_fire is not None:
            self.on_fire(op, path, a)
        if a in ERRNOS:
            code = ERRNOS[a]
            e = OSError(code, os.strerror(code), path)
            what = "no space left on device" if code == errno.ENOSPC else os.strerror(code)
            raise StorageError(f"{op} {path!r}: {what} (injected)") from e
        if a == "timeout":
            if f.delay_s:
                time.sleep(f.delay_s)
            raise StorageError(f"{op} {path!r}: timed out (injected)") from TimeoutError(path)
        if a == "delay":
            time.sleep(f.delay_s)
        elif a == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover - the signal is delivered first
        elif a == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif a == "call":
            assert f.callback is not None
            f.callback(op, path)
        elif a in ("truncate", "flip"):
            self._corrupt(f, path)

    def _corrupt(self, f: Fault, path: str) -> None:
        raw = bytearray(self.inner.read_bytes(path))
        if f.action == "truncate":
            raw = raw[: len(raw) // 2 if f.arg is None else f.arg]
        elif raw:
            i = len(raw) // 2 if f.arg is None else f.arg % len(raw)
            raw[i] ^= 1
        self.inner.write_bytes(path, bytes(raw), durable=False)

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        self._fire(op, path)
        out = fn()
        self._fire(op, path, after=True)
        return out

    # -- writing
    def makedirs(self, path: str) -> None:
        self._call("makedirs", path, lambda: self.inner.makedirs(path))

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        inner = self._call("open_write", path, lambda: self.inner.open_write(path, durable=durable))
        return _FaultStream(self, inner, path, durable)

    def write_bytes(self, path: str, data: bytes, *, durable: bool = True) -> None:
        self._fire("write_bytes", path)
        super().write_bytes(path, data, durable=durable)  # through open_write: counted there too
        self._fire("write_bytes", path, after=True)

    def check_publish(self, path: str) -> None:
        self.inner.check_publish(path)

    def free_bytes(self, path: str) -> int | None:
        return self.inner.free_bytes(path)  # the space check sees the wrapped store's disk

    def put_if_absent(self, path: str, data: bytes) -> None:
        self._call("put_if_absent", path, lambda: self.inner.put_if_absent(path, data))

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        self._call("put_if_match", path, lambda: self.inner.put_if_match(path, data, tag))

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        out: tuple[bytes, str] = self._call("read", path, lambda: self.inner.read_tagged(path))
        return out

    def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        out: list[tuple[str, str, float]] = self._call("list", prefix,
                                                       lambda: self.inner.list_uploads(prefix))
        return out

    def abort_upload(self, path: str, upload_id: str) -> None:
        self._call("delete", path, lambda: self.inner.abort_upload(path, upload_id))

    def rename_dir(self, src: str, dst: str) -> None:
        self._call("rename", src, lambda: self.inner.rename_dir(src, dst))

    def link_file(self, src: str, dst: str) -> bool:
        """The op ``"link"`` (matched against ``dst``, the new name)."""
        return bool(self._call("link", dst, lambda: self.inner.link_file(src, dst)))

    def file_identity(self, path: str) -> tuple[object, int] | None:
        return self.inner.file_identity(path)

    def delete_tree(self, path: str) -> None:
        self._call("delete", path, lambda: self.inner.delete_tree(path))

    def fsync_dir(self, path: str) -> None:
        self._call("fsync_dir", path, lambda: self.inner.fsync_dir(path))

    # -- reading
    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self._call("read", path, lambda: self.inner.read_into(path, offset, buf))
        self._count_read(len(buf))

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        out: bytes = self._call("read", path, lambda: self.inner.read_bytes(path, offset, length))
        self._count_read(len(out))
        return out

    def size(self, path: str) -> int:
        return int(self._call("size", path, lambda: self.inner.size(path)))

    def exists(self, path: str) -> bool:
        return bool(self._call("exists", path, lambda: self.inner.exists(path)))

    def is_link(self, path: str) -> bool:
        return self.inner.is_link(path)

    def list_dir(self, path: str) -> list[str]:
        out: list[str] = self._call("list", path, lambda: self.inner.list_dir(path))
        return out

    def modified_time(self, path: str) -> float | None:
        return self.inner.modified_time(path)


class _FaultStream(WriteStream):
    def __init__(self, store: FaultStorage, inner: WriteStream, path: str, durable: bool):
        self._store, self._inner, self._path, self._durable = store, inner, path, durable

    def write(self, data: bytes | memoryview) -> None:
        self._store._fire("write", self._path)
        self._inner.write(data)
        self._store._count_write(len(memoryview(data).cast("B")))
        self._store._fire("write", self._path, after=True)

    def close(self) -> None:
        op = "fsync" if self._durable else "close"
        try:
            self._store._fire(op, self._path)
        except BaseException:
            self._inner.abort()
            raise
        self._inner.close()
        self._store._fire(op, self._path, after=True)

    def abort(self) -> None:
        self._inner.abort()


def wrap(path: str, faults: list[Fault] | tuple[Fault, ...]) -> tuple[FaultStorage, str]:
    """``(FaultStorage over the backend of path, key)`` for ``save(..., storage=)``."""
    from ..storage import resolve

    inner, key = resolve(path)
    return FaultStorage(inner, faults), key
