"""One conformance suite for every :class:`~reshard.storage.Storage` backend.

Use it for your own backend the way zarr ships ``zarr.testing.store``::

    from reshard.testing.storage_conformance import StorageConformance

    class TestMyStore(StorageConformance):
        def make(self):
            return MyStorage(...), "some/empty/root"   # (storage, root key)

Every ``test_*`` method checks one promise of the protocol
(:mod:`reshard.storage.base`), and together they check everything the commit
protocol relies on: compare-and-swap (:meth:`~reshard.storage.Storage.put_if_match`
with a stale tag fails, one of two racing swaps wins), the owner lease and
the reader leases built on it (:mod:`reshard.commit.ownership`,
:mod:`reshard.commit.leases`), the publish check and a publish by
``put_if_absent``, and the listing and aborting of open uploads. Tests of
optional features run only where the backend declares the capability
(``atomic_rename``, ``conditional_put``, ``multipart``, ``file_links``); a
store whose probe found conditional requests ignored
(:meth:`~reshard.storage.Storage.check_publish`) must refuse them with
``StoreCapabilityError``. Needs pytest.
"""

from __future__ import annotations

import json
import os
import threading
import time

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

    # -- compare-and-swap, leases, publish, uploads: what the commit relies on
    def test_put_if_match_with_a_stale_tag_fails(self) -> None:
        """A swap succeeds over the version it read, fails (FileExistsError,
        the object unchanged) over any older one, over an object created
        since (``tag=None``) and over one deleted since; every write gives a
        new tag. The owner lease of a root and a checkpoint's HEAD are
        compare-and-swaps: a store that ignores the tag lets two jobs both
        own a root."""
        st, root = self._setup()
        p = st.join(self._dir(st, root, "ck"), "owner.json")
        if self._refuses_publishing(st, p):
            return
        st.put_if_match(p, b"v1", None)
        with pytest.raises(FileExistsError):
            st.put_if_match(p, b"v1 again", None)
        data, t1 = st.read_tagged(p)
        assert data == b"v1"
        st.put_if_match(p, b"v2", t1)
        data, t2 = st.read_tagged(p)
        assert data == b"v2" and t2 != t1
        with pytest.raises(FileExistsError):
            st.put_if_match(p, b"v3 over a stale tag", t1)
        assert st.read_tagged(p) == (b"v2", t2)
        st.delete_tree(p)
        with pytest.raises(FileExistsError):
            st.put_if_match(p, b"v3 over a deleted object", t2)
        assert not st.exists(p)

    def test_put_if_match_race_has_one_winner(self) -> None:
        """Writers that read the same version and swap at once: one wins."""
        st, root = self._setup()
        if not st.capabilities.conditional_put:
            pytest.skip("no conditional put")
        p = st.join(self._dir(st, root, "ck"), "head.json")
        if self._refuses_publishing(st, p):
            return
        st.put_if_match(p, b"start", None)
        _, tag = st.read_tagged(p)
        wins: list[int] = []
        barrier = threading.Barrier(4)

        def swap(i: int) -> None:
            barrier.wait()
            try:
                st.put_if_match(p, f"writer {i}".encode(), tag)
                wins.append(i)
            except FileExistsError:
                pass

        ts = [threading.Thread(target=swap, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(wins) == 1, f"{len(wins)} writers swapped over one version"
        assert st.read_bytes(p) == f"writer {wins[0]}".encode()

    def test_owner_lease_is_never_held_twice(self) -> None:
        """The owner lease of a root, as :mod:`reshard.commit.ownership`
        writes it: each holder swaps its record over the version it read,
        then reads it back to confirm; of two holders that read the same
        version only one writes, the other's swap fails and the record stays
        the winner's; a renewal over the winner's own latest version works,
        one over an older version fails."""
        st, root = self._setup()
        key = st.join(self._dir(st, root, "root"), "owner.json")
        if self._refuses_publishing(st, key):
            return

        def write(rec: dict[str, object], tag: str | None) -> str:
            data = json.dumps(rec, sort_keys=True).encode()
            st.put_if_match(key, data, tag)
            raw, now = st.read_tagged(key)
            assert raw == data, f"{key}: a successful swap did not leave its bytes"
            return now

        t = time.time()
        rec = {"job": "a", "expires": t + 60, "renewed": t}
        ta = write(rec, None)  # both found no owner: tag None
        with pytest.raises(FileExistsError):
            write({**rec, "job": "b"}, None)
        ta2 = write({**rec, "renewed": t + 1}, ta)  # a renews over its own version
        assert ta2 != ta
        with pytest.raises(FileExistsError):
            write({**rec, "job": "b"}, ta)  # b swaps over the version it read before the renewal
        assert json.loads(st.read_bytes(key))["job"] == "a"
        write({**rec, "job": "b"}, ta2)  # b takes the root over the latest version
        with pytest.raises(FileExistsError):
            write({**rec, "renewed": t + 2}, ta2)  # a's next renewal finds the root taken
        assert json.loads(st.read_bytes(key))["job"] == "b"

    def test_reader_lease_records(self) -> None:
        """Reader leases, as :mod:`reshard.commit.leases` keeps them: a small
        record written (not fsync'd) beside a checkpoint is listed among its
        parent's children, read back whole, rewritten in place at each
        renewal, and removed by ``delete_tree`` of its own key, leaving the
        checkpoint and the other records; ``modified_time`` of a fresh record
        is None or within a minute of now (gc spares an unreadable young one)."""
        st, root = self._setup()
        r = self._dir(st, root, "root")
        st.write_bytes(st.join(self._dir(st, r, "step-1"), "manifest.json"), b"{}")
        a, b = st.join(r, "step-1.lease-1-aa.json"), st.join(r, "step-1.lease-2-bb.json")
        now = time.time()
        for k in (a, b):
            st.write_bytes(k, json.dumps({"expires": now + 60, "renewed": now}).encode(), durable=False)
        assert sorted(st.list_dir(r)) == sorted(["step-1", st.basename(a), st.basename(b)])
        renewed = json.dumps({"expires": now + 120, "renewed": now + 60}).encode()
        st.write_bytes(a, renewed, durable=False)
        assert st.read_bytes(a) == renewed
        mtime = st.modified_time(a)
        assert mtime is None or abs(mtime - now) < 60
        st.delete_tree(b)
        assert not st.exists(b) and st.exists(a) and st.exists(st.join(r, "step-1", "manifest.json"))
        st.delete_tree(a)
        assert st.list_dir(r) == ["step-1"]

    def test_publish_check_and_publish(self) -> None:
        """The publish check passes (or, on a store found to ignore conditional
        requests, refuses every conditional put), gives the same answer when
        asked again, and leaves nothing visible under the checkpoint; a
        publish then writes the manifest last with ``put_if_absent`` beside
        the data, and a second publisher of the same checkpoint fails."""
        st, root = self._setup()
        d = self._dir(st, root, "step-1")
        manifest = st.join(d, "manifest.json")
        if self._refuses_publishing(st, manifest):
            from ..errors import StoreCapabilityError

            with pytest.raises(StoreCapabilityError):
                st.check_publish(manifest)
            return
        st.check_publish(manifest)
        st.check_publish(manifest)
        assert not st.exists(manifest)
        st.write_bytes(st.join(d, "data-0.bin"), b"data")
        st.put_if_absent(manifest, b'{"step": 1}')
        with pytest.raises(FileExistsError):
            st.put_if_absent(manifest, b'{"step": 1, "writer": 2}')
        assert st.read_bytes(manifest) == b'{"step": 1}'
        assert st.list_dir(d) == ["data-0.bin", "manifest.json"]

    def test_open_uploads_are_listed_and_aborted(self) -> None:
        """Where ``multipart``: a file still being written (more than a part
        written, not closed) is listed by ``list_uploads`` of any prefix
        above it, with its upload id and start time; ``abort_upload`` ends
        it (nothing is left at its key); a closed file is never listed. gc
        finds an abandoned attempt's uploads this way. Elsewhere there is
        never an open upload to list."""
        st, root = self._setup()
        d = self._dir(st, root, "att")
        p = st.join(d, "data-0.bin")
        s = st.open_write(p)
        s.write(os.urandom(self.large_bytes))
        if not st.capabilities.multipart:
            assert st.list_uploads(root) == []
            s.abort()
            return
        ups = st.list_uploads(root)
        if not ups and any("does not list multipart uploads" in n for n in st.notes):
            s.abort()
            pytest.skip("the store does not list multipart uploads (noted for gc)")
        assert [u[0] for u in ups] == [p], ups
        key, upload_id, started = ups[0]
        assert isinstance(upload_id, str) and upload_id and started < time.time() + 3600, (upload_id, started)
        assert [u[0] for u in st.list_uploads(d)] == [p]
        st.abort_upload(key, upload_id)
        assert st.list_uploads(root) == []
        assert not st.exists(p)
        try:
            s.abort()  # the stream of the upload aborted above: only its buffers are left to drop
        except Exception:  # noqa: BLE001 - a store may tell that the upload is gone
            pass
        q = st.join(d, "data-1.bin")
        s = st.open_write(q)
        s.write(os.urandom(self.large_bytes))
        s.close()
        assert st.list_uploads(root) == [] and st.size(q) == self.large_bytes
