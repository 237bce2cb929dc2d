"""Storage backends and URL resolution."""

from __future__ import annotations

import os

from .base import Capabilities, Storage, WriteStream
from .local import LocalStorage
from .memory import MemoryStorage, clear_memory_storage
from .registry import (
    Scheme,
    TestStore,
    get_scheme,
    open_url,
    register_scheme,
    scheme_of,
    schemes,
    start_test_store,
)

__all__ = [
    "Capabilities",
    "LocalStorage",
    "MemoryStorage",
    "Scheme",
    "Storage",
    "TestStore",
    "WriteStream",
    "clear_memory_storage",
    "get_scheme",
    "local_path",
    "register_scheme",
    "resolve",
    "scheme_of",
    "schemes",
    "start_test_store",
]


def resolve(url: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """Map a checkpoint path or URL to ``(backend, key)``.

    The scheme's registered backend opens it (:mod:`reshard.storage.registry`):
    ``/a/b``, ``a/b``, ``~/a/b`` and ``file:///a/b`` -> local file system
    (absolute path, ``~`` expanded);
    ``memory://name/prefix`` -> the in-process store; ``s3://bucket/prefix``
    -> :class:`~reshard.storage.s3.S3Storage` (key ``bucket/prefix``;
    needs the ``reshard[s3]`` extra); a scheme a backend outside reshard
    registered (entry point group ``reshard.storage``). An explicit
    ``storage`` takes the path as is.

    Raises:
        ValueError: an unsupported URL scheme, or a URL its backend refuses.
    """
    s = os.fspath(url)
    if storage is not None:
        return storage, s.rstrip("/")
    return open_url(s)


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path as :func:`resolve` reads it: ``file://`` stripped, ``~``
    expanded, made absolute (for outputs that are always local: an export's
    directory, a copied file).

    Raises:
        ValueError: a URL of another scheme."""
    st, key = resolve(path)
    if not scheme_of(path).bare_paths:
        raise ValueError(f"{os.fspath(path)!r}: a local path is needed here")
    return key
