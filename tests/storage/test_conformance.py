"""The storage conformance suite on every backend: local, memory, S3 (moto over HTTP)."""

from __future__ import annotations

import os

import pytest

from reshard.storage import LocalStorage, MemoryStorage, Storage, clear_memory_storage, resolve
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


class _TagBlindMemory(MemoryStorage):
    """A deliberately broken backend: its compare-and-swap ignores the version
    tag (any swap over an existing object succeeds), as a store that drops
    ``If-Match`` would. Everything else is the honest in-memory store."""

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        if tag is None:
            self.put_if_absent(path, data)
        else:
            self.write_bytes(path, data)


def _outcomes(suite: StorageConformance) -> dict[str, str]:
    """Run every test of the conformance suite on ``suite`` (as pytest would
    call them): test name -> "passed", "skipped" or "failed: <why>"."""
    out = {}
    for name in sorted(n for n in dir(suite) if n.startswith("test_")):
        try:
            getattr(suite, name)()
            out[name] = "passed"
        except pytest.skip.Exception:
            out[name] = "skipped"
        except (AssertionError, pytest.fail.Exception) as e:
            out[name] = f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return out


def test_a_backend_whose_compare_and_swap_ignores_the_tag_fails_the_suite() -> None:
    """The suite catches a store that breaks the commit's compare-and-swap
    (the owner lease, HEAD): with the tag ignored, a swap over a stale
    version succeeds. The same suite on the honest store passes whole."""

    class Broken(StorageConformance):
        def make(self) -> tuple[Storage, str]:
            return _TagBlindMemory(), f"broken/{os.urandom(6).hex()}"  # a fresh root per test

    class Honest(StorageConformance):
        def make(self) -> tuple[Storage, str]:
            return MemoryStorage(), f"honest/{os.urandom(6).hex()}"

    try:
        broken, honest = _outcomes(Broken()), _outcomes(Honest())
    finally:
        clear_memory_storage()
    assert all(v in ("passed", "skipped") for v in honest.values()), honest
    failed = {k for k, v in broken.items() if v.startswith("failed")}
    assert failed == {"test_put_if_match_with_a_stale_tag_fails", "test_put_if_match_race_has_one_winner",
                      "test_owner_lease_is_never_held_twice"}, broken
    assert broken.keys() == honest.keys() and len(broken) >= 20
