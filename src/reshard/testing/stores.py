"""Throw-away stores of reshard's own local and in-process backends, for
tests and benchmarks (:func:`reshard.storage.start_test_store`; the S3 one
is :class:`reshard.testing.s3server.S3TestStore`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

from ..storage.registry import get_scheme


class LocalTestStore:
    """A temporary directory under ``scratch`` (removed by :meth:`close`)."""

    description = "local file system (a temporary directory)"

    def __init__(self, *, scratch: str | None = None, endpoint: str | None = None):
        self.root = tempfile.mkdtemp(prefix="reshard-test-store-", dir=scratch)

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

    def env(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class MemoryTestStore:
    """A prefix of its own in this process's in-memory store (``memory://``):
    only this process sees it. :meth:`close` drops the process's in-memory
    objects under that prefix."""

    description = "in-process memory (memory://; one process only)"

    def __init__(self, *, scratch: str | None = None, endpoint: str | None = None):
        self.prefix = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def url(self, name: str) -> str:
        return get_scheme("memory").url(f"{self.prefix}/{name}")

    def env(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        from ..storage import resolve

        st, key = resolve(self.url(""))
        st.delete_tree(key)

