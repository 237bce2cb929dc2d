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
    "resolve",
]


def resolve(url: str | os.PathLike[str], storage: Storage | None = None) -> tuple[Storage, str]:
    """Map a checkpoint path or URL to ``(backend, key)``.

    ``/a/b``, ``a/b`` and ``file:///a/b`` -> local file system (absolute path);
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
    if s.startswith("memory://"):
        rest = s[len("memory://"):].strip("/")
        return MemoryStorage(), rest
    if s.startswith("s3://"):
        rest = s[len("s3://"):].strip("/")
        if not rest:
            raise ValueError(f"{s!r}: an s3:// URL needs a bucket")
        from .s3 import S3Storage

        return S3Storage(), rest
    if s.startswith("file://"):
        s = s[len("file://"):]
    elif "://" in s:
        scheme = s.split("://", 1)[0]
        raise ValueError(f"unsupported checkpoint URL scheme {scheme!r} in {s!r}")
    return LocalStorage(), os.path.abspath(s).rstrip("/") or "/"
