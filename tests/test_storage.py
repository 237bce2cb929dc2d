"""The storage conformance suite on every backend: local, memory, S3 (moto over HTTP)."""

from __future__ import annotations

import os

import pytest

from reshard.storage import LocalStorage, MemoryStorage, Storage, resolve
from reshard.testing.storage_conformance import StorageConformance


class TestLocalConformance(StorageConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: os.PathLike[str]) -> None:
        self.root = os.fspath(tmp_path)

    def make(self) -> tuple[Storage, str]:
        return LocalStorage(), self.root


class TestMemoryConformance(StorageConformance):
    @pytest.fixture(autouse=True)
    def _root(self, request: pytest.FixtureRequest) -> None:
        self.root = f"conformance/{request.node.name}"

    def make(self) -> tuple[Storage, str]:
        return MemoryStorage(), self.root


class TestS3Conformance(StorageConformance):
    large_bytes = 1 << 20  # four 256 KiB parts (the test endpoint's part size)

    @pytest.fixture(autouse=True)
    def _root(self, s3e) -> None:  # type: ignore[no-untyped-def]
        self.url = s3e.url("conformance")

    def make(self) -> tuple[Storage, str]:
        st, key = resolve(self.url)
        return st, key
