"""The registry of storage schemes: which backend serves ``<scheme>://...``.

Each backend registers its own scheme in its own module
(:func:`register_scheme` at import: ``file`` in :mod:`.local`, ``memory``
in :mod:`.memory`, ``s3`` in :mod:`.s3`); a backend outside reshard does the
same from its package and names that module (or a :class:`Scheme`, or a
function returning one) under the Python entry point group
``reshard.storage``, so that ``reshard.load("gs://...")`` finds it without
any change to reshard::

    [project.entry-points."reshard.storage"]
    gs = "mypackage.gcs_store"      # importing it calls register_scheme(...)

:func:`reshard.storage.resolve` asks :func:`scheme_of` for the scheme of a
path or URL and calls its ``open``; nothing else in reshard names a scheme.
Tools that run against a throw-away store (the conformance tests, ``reshard
bench io``, the fault matrix) start one through :func:`start_test_store`.

Lookups are thread-safe; registration normally happens at import.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .base import Storage

log = logging.getLogger("reshard.storage.registry")

#: the entry point group an out-of-tree backend registers under
ENTRY_POINT_GROUP = "reshard.storage"
#: the modules of reshard's own backends (importing one registers its scheme)
_BUILTIN = ("reshard.storage.local", "reshard.storage.memory", "reshard.storage.s3")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


class TestStore(Protocol):
    """A throw-away store started for tests and benchmarks
    (:func:`start_test_store`): a temporary directory, an in-process
    namespace, a local S3 server on 127.0.0.1 with a bucket of its own.

    Attributes:
        description: one line saying what it is (for reports and notes).
    """

    description: str

    def url(self, name: str) -> str:
        """The path or URL of the (empty) root ``name`` on this store, as
        :func:`reshard.storage.resolve` reads it."""
        ...

    def env(self) -> dict[str, str]:
        """Environment variables a process (a rank, a restarted job) needs to
        reach the store; already set in this process."""
        ...

    def close(self) -> None:
        """Stop the store and remove what it holds (idempotent)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """One URL scheme and the backend serving it.

    Attributes:
        name: the scheme, ``[a-z][a-z0-9+.-]*`` (``"s3"`` serves ``s3://...``).
        open: ``open(rest)`` -> ``(storage, key)`` for the URL
            ``<name>://<rest>`` (or, where ``bare_paths``, a path without a
            scheme). A fresh :class:`~reshard.storage.Storage` each call; it
            raises ValueError for a malformed ``rest`` (one line naming it).
        backend: the name tools give this backend (``reshard bench io
            --backend``, ``reshard faults matrix --backend``); default ``name``.
        bare_paths: this backend also serves paths without a scheme (the
            local file system; exactly one registered scheme says so).
        shared: separate processes (the ranks of a job, a restarted job) see
            the same objects. False for an in-process store (``memory://``):
            a multi-rank save there is refused, a benchmark skips it.
        test_store: ``"module:callable"`` starting a :class:`TestStore` of
            this backend, called as ``callable(scratch=dir, endpoint=url or
            None)`` (None: the backend has none). A string, so that the
            storage floor never imports the testing code.
        fault_kit: the module holding this backend's side of the fault
            matrix (:mod:`reshard.faults.local`, :mod:`reshard.faults.matrix_s3`),
            or None where the fault matrix does not run on it.
    """

    name: str
    open: Callable[[str], tuple[Storage, str]]
    backend: str = ""
    bare_paths: bool = False
    shared: bool = True
    test_store: str | None = None
    fault_kit: str | None = None

    def __post_init__(self) -> None:
        if not _SCHEME.match(self.name):
            raise ValueError(f"storage scheme {self.name!r}: expected a URL scheme "
                             "([a-z][a-z0-9+.-]*, e.g. 's3' for s3://...)")
        if not self.backend:
            object.__setattr__(self, "backend", self.name)

    def url(self, key: str) -> str:
        """``key`` as a URL of this scheme."""
        return f"{self.name}://{key}"


_LOCK = threading.RLock()
_SCHEMES: dict[str, Scheme] = {}
_loaded = {"builtin": False, "entry_points": False}


def register_scheme(scheme: Scheme, *, replace: bool = False) -> Scheme:
    """Make ``scheme`` serve its URLs; returns it.

    Raises:
        ValueError: another backend already registered that scheme (or that
            backend name, or bare paths), unless ``replace``.
    """
    with _LOCK:
        for other in _SCHEMES.values():
            if other.name == scheme.name or replace:
                continue
            clash = ("backend name " + repr(scheme.backend) if other.backend == scheme.backend
                     else "bare paths" if other.bare_paths and scheme.bare_paths else None)
            if clash:
                raise ValueError(f"storage scheme {scheme.name!r}: the {clash} is already served by "
                                 f"scheme {other.name!r}")
        old = _SCHEMES.get(scheme.name)
        if old is not None and _origin(old) != _origin(scheme) and not replace:
            raise ValueError(f"storage scheme {scheme.name!r} is already registered (by "
                             f"{getattr(old.open, '__module__', '?')}); pass replace=True to replace it")
        _SCHEMES[scheme.name] = scheme
    return scheme


def _origin(s: Scheme) -> tuple[str, str]:
    """Where a scheme's opener is defined (the same module registering again,
    e.g. reloaded, is no clash)."""
    return getattr(s.open, "__module__", "?"), getattr(s.open, "__qualname__", "?")


def unregister_scheme(name: str) -> None:
    """Remove the scheme ``name`` (tests that register a toy backend)."""
    with _LOCK:
        _SCHEMES.pop(name, None)


def _load_builtin() -> None:
    if _loaded["builtin"]:
        return
    with _LOCK:
        if _loaded["builtin"]:
            return
        _loaded["builtin"] = True
        for mod in _BUILTIN:
            importlib.import_module(mod)


def _load_entry_points() -> None:
    """Import every backend registered under :data:`ENTRY_POINT_GROUP` (once
    per process). One that fails to load is logged and skipped: a broken
    plug-in must not break the schemes that work."""
    if _loaded["entry_points"]:
        return
    with _LOCK:
        if _loaded["entry_points"]:
            return
        _loaded["entry_points"] = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if not isinstance(obj, Scheme) and callable(obj) and not isinstance(obj, type):
                    obj = obj()
                if isinstance(obj, Scheme):
                    register_scheme(obj)
            except Exception as e:  # noqa: BLE001 - named and skipped
                log.warning("storage backend %r (entry point %s in group %s) did not load: %s",
                            ep.name, ep.value, ENTRY_POINT_GROUP, e)


def schemes() -> list[Scheme]:
    """Every registered scheme (reshard's own and those of entry points), by name."""
    _load_builtin()
    _load_entry_points()
    with _LOCK:
        return [_SCHEMES[k] for k in sorted(_SCHEMES)]


def get_scheme(name: str) -> Scheme:
    """The scheme registered as ``name``, or whose backend is called ``name``.

    Raises:
        ValueError: none is (the message lists those that are).
    """
    _load_builtin()
    for attempt in range(2):
        with _LOCK:
            s = _SCHEMES.get(name) or next((x for x in _SCHEMES.values() if x.backend == name), None)
        if s is not None:
            return s
        if attempt == 0:
            _load_entry_points()
    known = ", ".join(f"{s.name}://" + (f" ({s.backend})" if s.backend != s.name else "") for s in schemes())
    raise ValueError(f"unknown storage scheme or backend {name!r} (registered: {known}; a backend "
                     f"outside reshard registers through the {ENTRY_POINT_GROUP!r} entry point group)")


def split_url(url: str | os.PathLike[str]) -> tuple[str | None, str]:
    """``(scheme, rest)`` of ``url``; ``(None, url)`` for a path without one."""
    s = os.fspath(url)
    head, sep, rest = s.partition("://")
    return (head, rest) if sep else (None, s)


def scheme_of(url: str | os.PathLike[str]) -> Scheme:
    """The scheme serving ``url`` (a path without a scheme: the one serving bare paths).

    Raises:
        ValueError: an unsupported URL scheme (the message names it and the
            registered ones).
    """
    name, _ = split_url(url)
    if name is None:
        _load_builtin()
        with _LOCK:
            bare = next((x for x in _SCHEMES.values() if x.bare_paths), None)
        if bare is None:
            raise ValueError(f"{os.fspath(url)!r}: no storage backend serves paths without a scheme")
        return bare
    try:
        s = get_scheme(name)
    except ValueError:
        s = None
    if s is None or s.name != name:
        known = ", ".join(f"{x.name}://" for x in schemes())
        raise ValueError(f"unsupported checkpoint URL scheme {name!r} in {os.fspath(url)!r} "
                         f"(registered: {known})")
    return s


def open_url(url: str | os.PathLike[str]) -> tuple[Storage, str]:
    """``(storage, key)`` for ``url`` from the scheme serving it; the store
    records the scheme it was named by (``url_scheme``, None for a bare
    path), so that its result paths resolve back to it."""
    scheme = scheme_of(url)
    name, rest = split_url(url)
    st, key = scheme.open(rest)
    if name is not None:
        st.url_scheme = name
    return st, key


def start_test_store(name: str, *, scratch: str, endpoint: str | None = None) -> TestStore:
    """Start a throw-away store of the backend ``name`` (scheme or backend
    name) for tests and benchmarks: ``scratch`` is a directory it may use,
    ``endpoint`` an existing server to use instead of starting one (where
    the backend has servers).

    Raises:
        ValueError: no such backend, or it registered no test store.
        RuntimeError: the store did not start (the message says why).
    """
    s = get_scheme(name)
    if s.test_store is None:
        raise ValueError(f"storage backend {s.backend!r} ({s.name}://) registered no test store")
    mod, _, attr = s.test_store.partition(":")
    factory = getattr(importlib.import_module(mod), attr)
    store: TestStore = factory(scratch=scratch, endpoint=endpoint)
    return store
