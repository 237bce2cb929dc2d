"""Storage backends and URL resolution."""

from __future__ import annotations

import os

from .base import Capabilities, Storage, WriteStream
from .local import LocalStorage
from .memory import MemoryStorage, clear_memory_storage

__all__ = [
    "Capabilities",
    "LocalStorage",
    "MemoryStorage",
    "Storage",
    "WriteStream",
    "clear_memory_storage",
    "local_path",
    "resolve",
]


def resolve(url: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """Map a checkpoint path or URL to ``(backend, key)``.

    ``/a/b``, ``a/b``, ``~/a/b`` and ``file:///a/b`` -> local file system
    (absolute path, ``~`` expanded);
    ``memory://name/prefix`` -> the in-process store; ``s3://bucket/prefix``
    -> :class:`~reshard.storage.s3.S3Storage` (key ``bucket/prefix``;
    needs the ``reshard[s3]`` extra). An explicit ``storage``
    takes the path as is.

    Raises:
        ValueError: an unsupported URL scheme.
    """
    s = os.fspath(url)
    if storage is not None:
        return storage, s.rstrip("/")
    st: Storage
    if s.startswith("memory://"):
        rest = s[len("memory://"):].strip("/")
        st = MemoryStorage()
        st.url_scheme = "memory"
        return st, rest
    if s.startswith("s3://"):
        rest = s[len("s3://"):].strip("/")
        if not rest:
            raise ValueError(f"{s!r}: an s3:// URL needs a bucket")
        from .s3 import S3Storage

        st = S3Storage()
        st.url_scheme = "s3"
        return st, rest
    st = LocalStorage()
    if s.startswith("file://"):
        s = s[len("file://"):]
        if s.startswith("localhost/"):  # file://localhost/abs (RFC 8089)
            s = s[len("localhost"):]
        st.url_scheme = "file"
    elif "://" in s:
        scheme = s.split("://", 1)[0]
        raise ValueError(f"unsupported checkpoint URL scheme {scheme!r} in {s!r}")
    return st, os.path.abspath(os.path.expanduser(s)).rstrip("/") or "/"


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path as :func:`resolve` reads it: ``file://`` stripped, ``~``
    expanded, made absolute (for outputs that are always local: an export's
    directory, a copied file).

    Raises:
        ValueError: a URL of another scheme."""
    st, key = resolve(path)
    if not isinstance(st, LocalStorage):
        raise ValueError(f"{os.fspath(path)!r}: a local path is needed here")
    return key
