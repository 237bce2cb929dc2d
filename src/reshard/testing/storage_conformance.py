"""One conformance suite for every :class:`~reshard.storage.Storage` backend.

Use it for your own backend the way zarr ships ``zarr.testing.store``::

    from reshard.testing.storage_conformance import StorageConformance

    class TestMyStore(StorageConformance):
        def make(self):
            return MyStorage(...), "some/empty/root"   # (storage, root key)

Every ``test_*`` method checks one promise of the protocol
(:mod:`reshard.storage.base`); tests of optional features run only where the
backend declares the capability (``atomic_rename``, ``conditional_put``,
``multipart``, ``file_links``); a store whose probe found conditional requests ignored
(:meth:`~reshard.storage.Storage.check_publish`) must refuse them with
``StoreCapabilityError``. Needs pytest.
"""

from __future__ import annotations

import os
import threading

import pytest

from ..errors import IntegrityError, StoreCapabilityError
from ..storage.base import Capabilities, Storage


class StorageConformance:
    """Mixin of pytest tests; subclasses implement :meth:`make`."""

    #: bytes of the "large" object (spans several parts where ``multipart``)
    large_bytes: int = 3 << 20

    def make(self) -> tuple[Storage, str]:
        """A backend and an empty root key below which the tests write."""
        raise NotImplementedError

    def _setup(self) -> tuple[Storage, str]:
        st, root = self.make()
        st.makedirs(root)
        return st, root

    def _dir(self, st: Storage, root: str, name: str) -> str:
        p = st.join(root, name)
        st.makedirs(p)
        return p

    def test_capabilities_declared(self) -> None:
        st, _ = self._setup()
        assert isinstance(st.capabilities, Capabilities)

    def test_write_read_roundtrip(self) -> None:
        st, root = self._setup()
        d = self._dir(st, root, "ck")
        p = st.join(d, "a.bin")
        st.write_bytes(p, b"hello world")
        assert st.read_bytes(p) == b"hello world"
        assert st.size(p) == 11
        assert st.exists(p) and st.exists(d)

    def test_stream_in_pieces_and_ranged_reads(self) -> None:
        st, root = self._setup()
        d = self._dir(st, root, "ck")
        p = st.join(d, "big.bin")
        data = os.urandom(self.large_bytes)
        s = st.open_write(p)
        for i in range(0, len(data), 777_777):  # writes that do not align with any part size
            s.write(memoryview(data)[i:i + 777_777])
        s.close()
        assert st.size(p) == len(data)
        for off, n in [(0, 1), (5, 1000), (len(data) - 10, 10), (len(data) // 3, len(data) // 3), (0, len(data))]:
            buf = bytearray(n)
            st.read_into(p, off, memoryview(buf))
            assert bytes(buf) == data[off:off + n], (off, n)
        assert st.read_bytes(p, 100, 50) == data[100:150]

    def test_read_parts_in_order(self) -> None:
        """``read_parts`` fills each part before it yields its index, in order;
        a part past the end raises as ``read_into`` does; a missing file raises
        ``FileNotFoundError``."""
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "a.bin")
        data = os.urandom(10_000)
        st.write_bytes(p, data)
        parts = [(0, 10), (5000, 3000), (9990, 10), (123, 0)]
        bufs = [bytearray(n) for _, n in parts]
        seen = []
        for i in st.read_parts(p, ((off, memoryview(b)) for (off, _), b in zip(parts, bufs, strict=True))):
            off, n = parts[i]
            assert bytes(bufs[i]) == data[off:off + n], i  # filled when yielded
            seen.append(i)
        assert seen == [0, 1, 2, 3]
        with pytest.raises(IntegrityError):
            list(st.read_parts(p, [(9995, memoryview(bytearray(10)))]))
        with pytest.raises(FileNotFoundError):
            list(st.read_parts(st.join(root, "nothing-here"), [(0, memoryview(bytearray(1)))]))

    def test_read_past_end_is_integrity_error(self) -> None:
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "a.bin")
        st.write_bytes(p, b"0123456789")
        with pytest.raises(IntegrityError):
            st.read_into(p, 5, memoryview(bytearray(10)))

    def test_missing_is_file_not_found(self) -> None:
        st, root = self._setup()
        p = st.join(root, "nothing-here")
        with pytest.raises(FileNotFoundError):
            st.read_bytes(p)
        with pytest.raises(FileNotFoundError):
            st.size(p)
        with pytest.raises(FileNotFoundError):
            st.list_dir(p)
        assert not st.exists(p)

    def test_list_dir_direct_children(self) -> None:
        st, root = self._setup()
        d = self._dir(st, root, "ck")
        sub = self._dir(st, d, "sub")
        st.write_bytes(st.join(d, "b.bin"), b"b")
        st.write_bytes(st.join(d, "a.bin"), b"a")
        st.write_bytes(st.join(sub, "deep.bin"), b"d")
        assert st.list_dir(d) == ["a.bin", "b.bin", "sub"]
        assert "ck" in st.list_dir(root)

    def test_delete_tree(self) -> None:
        st, root = self._setup()
        d = self._dir(st, root, "ck")
        keep = st.join(self._dir(st, root, "ck2"), "x.bin")
        st.write_bytes(keep, b"keep")
        for name in ("manifest.json", "a.bin", "b.bin"):
            st.write_bytes(st.join(d, name), b"x")
        st.delete_tree(d)
        assert not st.exists(d)
        assert not st.exists(st.join(d, "manifest.json"))
        assert st.read_bytes(keep) == b"keep"  # a sibling with a common name prefix survives
        st.delete_tree(d)  # deleting what is gone is fine

    def test_abort_leaves_nothing(self) -> None:
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "aborted.bin")
        s = st.open_write(p)
        s.write(os.urandom(self.large_bytes))
        s.abort()
        assert not st.exists(p)
        assert st.list_uploads(root) == []

    def _refuses_publishing(self, st: Storage, p: str) -> bool:
        """True where the store proved it cannot publish (its conditional
        requests are ignored): then every conditional put must be refused
        with StoreCapabilityError, writing nothing."""
        try:
            st.check_publish(p)
        except StoreCapabilityError:
            with pytest.raises(StoreCapabilityError, match="refusing to publish"):
                st.put_if_absent(p, b"first")
            with pytest.raises(StoreCapabilityError):
                st.put_if_match(p, b"first", None)
            assert not st.exists(p)
            return True
        return False

    def test_put_if_absent(self) -> None:
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "manifest.json")
        if self._refuses_publishing(st, p):
            return
        st.put_if_absent(p, b"first")
        with pytest.raises(FileExistsError):
            st.put_if_absent(p, b"second")
        assert st.read_bytes(p) == b"first"

    def test_put_if_absent_race_has_one_winner(self) -> None:
        st, root = self._setup()
        if not st.capabilities.conditional_put:
            pytest.skip("no conditional put")
        p = st.join(self._dir(st, root, "ck"), "manifest.json")
        if self._refuses_publishing(st, p):
            return
        wins: list[int] = []
        barrier = threading.Barrier(4)

        def put(i: int) -> None:
            barrier.wait()
            try:
                st.put_if_absent(p, f"writer {i}".encode())
                wins.append(i)
            except FileExistsError:
                pass

        ts = [threading.Thread(target=put, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(wins) == 1
        assert st.read_bytes(p) == f"writer {wins[0]}".encode()

    def test_parallel_reads(self) -> None:
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "a.bin")
        data = os.urandom(1 << 20)
        st.write_bytes(p, data)
        before = st.bytes_read
        out: dict[int, bytes] = {}

        def read(i: int) -> None:
            out[i] = st.read_bytes(p, i * 4096, 4096)

        ts = [threading.Thread(target=read, args=(i,)) for i in range(16)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert all(out[i] == data[i * 4096:(i + 1) * 4096] for i in range(16))
        assert st.bytes_read - before == 16 * 4096

    def test_link_file(self) -> None:
        """Where ``file_links``: the new name holds the file's bytes and keeps
        them after the old name is deleted; a missing source links nothing
        (False). Where a store tells which names share bytes
        (``file_identity``), both names have one identity and two names."""
        st, root = self._setup()
        if not st.capabilities.file_links:
            pytest.skip("no file links")
        a, b = self._dir(st, root, "a"), self._dir(st, root, "b")
        data = os.urandom(300 << 10)
        st.write_bytes(st.join(a, "f"), data)
        assert st.link_file(st.join(a, "f"), st.join(b, "f")) is True
        ia, ib = st.file_identity(st.join(a, "f")), st.file_identity(st.join(b, "f"))
        assert (ia is None) == (ib is None)
        if ia is not None and ib is not None:
            assert ia[0] == ib[0] and ia[1] == ib[1] == 2
        st.delete_tree(a)
        assert st.read_bytes(st.join(b, "f")) == data
        assert st.link_file(st.join(a, "f"), st.join(b, "g")) is False
        assert not st.exists(st.join(b, "g"))

    def test_rename_dir(self) -> None:
        st, root = self._setup()
        if not st.capabilities.atomic_rename:
            pytest.skip("no atomic rename")
        a = self._dir(st, root, "a")
        st.write_bytes(st.join(a, "x"), b"x")
        st.rename_dir(a, st.join(root, "b"))
        assert st.read_bytes(st.join(root, "b", "x")) == b"x"
        assert not st.exists(a)
