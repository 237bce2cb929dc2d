"""Storage writer/reader protocol.

A :class:`Storage` is a byte store addressed by ``/``-separated keys under a
root. It knows nothing of tensors. Backends declare :class:`Capabilities`; the
commit protocol picks atomic-rename publish or manifest-marker publish from
them. Every backend passes the shared conformance suite in
``reshard.testing.storage_conformance`` (importable for your own backends).

Call order during a save (every rank unless noted): ``canonical(path)`` ->
[coordinator] ``makedirs(attempt)`` and ``write_bytes`` of the attempt nonce
-> ``read_bytes`` of the nonce (every rank: proof that it sees the
coordinator's attempt) -> ``open_write(file)``/``write``/``close`` (fsync'd
when ``durable``) -> [coordinator] ``size`` of every data file ->
``delete_tree(nonce)`` -> ``write_bytes(manifest)`` -> ``rename_dir``
(atomic-rename stores only) -> ``fsync_dir``. Without atomic rename the
coordinator also writes (and renews, from a background thread) the
attempt's lease right after the nonce, and the manifest is published with
``put_if_absent``; failed attempts are removed with ``delete_tree`` of each
of their keys and ``abort_upload`` of their open uploads.
During a load: ``read_bytes(manifest)`` -> ``size``/``is_link`` of every
needed file -> ``read_into`` (or ``read_parts``) of byte ranges, from several
threads at once.

Errors: a missing key raises ``FileNotFoundError`` (callers turn it into
``CheckpointNotFoundError``); any other failure of the store raises
:class:`~reshard.errors.StorageError`; a read past the end of a file raises
:class:`~reshard.errors.IntegrityError`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend can do.

    Attributes:
        atomic_rename: a directory can be renamed atomically (local FS); the
            commit protocol then publishes by rename, else by writing the
            manifest last with :meth:`Storage.put_if_absent`.
        listing: children of a prefix can be listed.
        ranged_reads: a byte range can be read without reading the whole object.
        durable_sync: writes can be made durable explicitly (fsync).
        conditional_put: :meth:`Storage.put_if_absent` is atomic against
            other writers (S3 ``If-None-Match: *``, ``O_EXCL``/``link``).
        multipart: large objects are uploaded in parts that can be listed
            and aborted (:meth:`Storage.list_uploads`).
        file_links: a whole file can be given a second name without its
            bytes passing through the client (:meth:`Storage.link_file`: a
            hard link on a local file system, a shared object in
            ``memory://``, a copy inside the store on S3). Proven at each
            use: a link that fails returns False and the caller writes the
            bytes instead.
    """

    atomic_rename: bool
    listing: bool
    ranged_reads: bool
    durable_sync: bool
    conditional_put: bool = False
    multipart: bool = False
    file_links: bool = False


class WriteStream(ABC):
    """A file being written sequentially. ``close()`` makes it durable (if the
    stream was opened ``durable``) and visible; ``abort()`` discards it."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Storage(ABC):
    """One backend. Keys are ``/``-joined strings as returned by :meth:`join`.

    Attributes:
        bytes_read: total bytes returned by reads since creation (counted
            across threads), for tests and benchmarks.
        read_segment_bytes: bytes a reader should ask for in one
            ``read_into`` call of a large chunk (None: the reader's default,
            sized for the page cache; object stores want larger requests,
            which they split into parallel ranged GETs themselves).
        url_scheme: the scheme the caller named this store by (``"s3"``,
            ``"memory"``, ``"file"``), set by :func:`reshard.storage.resolve`
            on the backend it makes; None for a plain local path or a backend
            the caller passed (its keys are then given back as they are).
    """

    capabilities: Capabilities
    read_segment_bytes: int | None = None
    url_scheme: str | None = None
    #: what this store could not do while serving a request (e.g. "the store
    #: does not list multipart uploads"), for tools to report (``reshard gc``)
    notes: list[str]

    def url(self, key: str) -> str:
        """``key`` in the form the caller named the store by: ``s3://`` +
        key, ``memory://`` + key, ``file://`` + key; the key itself for a
        plain local path or a backend passed explicitly. Every result path
        (``SaveResult.path``, ``SaveHandle.path``, ``LoadResult.path``,
        ``latest()``, the CLI's output) goes through it, so it resolves back
        to the same store."""
        return f"{self.url_scheme}://{key}" if self.url_scheme else key

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.notes = []

    def _count_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _count_write(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join(p.rstrip("/") for p in parts if p)

    @staticmethod
    def parent(path: str) -> str:
        return path.rstrip("/").rpartition("/")[0]

    @staticmethod
    def basename(path: str) -> str:
        return path.rstrip("/").rpartition("/")[2]

    def free_bytes(self, path: str) -> int | None:
        """Bytes free for writing under ``path`` (its nearest existing
        ancestor), or None when the store does not say (object stores: a
        save then skips its free-space check)."""
        return None

    # -- writing
    @abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abstractmethod
    def open_write(self, path: str, *, durable: bool = True) -> WriteStream: ...

    def write_bytes(self, path: str, data: bytes, *, durable: bool = True) -> None:
        s = self.open_write(path, durable=durable)
        try:
            s.write(data)
        except BaseException:
            s.abort()
            raise
        s.close()

    def check_publish(self, path: str) -> None:
        """Prove, before a save writes data (and again at publish), that this
        store can publish a checkpoint at ``path`` safely: what the commit
        relies on (atomic rename, or conditional put and replace) is probed
        once per store and cached (DESIGN.md section 1). Default: nothing to
        prove (the local file system and ``memory://`` implement them
        themselves).

        Raises:
            StoreCapabilityError: the store was found to lack one (one line:
                what was found, what to set).
            StorageError: the probe itself failed.
        """
        return None

    def put_if_absent(self, path: str, data: bytes) -> None:
        """Create ``path`` holding ``data`` unless it exists (atomically where
        ``capabilities.conditional_put``).

        Raises:
            FileExistsError: ``path`` already exists; it is left unchanged.
        """
        if self.exists(path):
            raise FileExistsError(f"{path}: already exists")
        self.write_bytes(path, data)

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        """The whole object at ``path`` and an opaque version tag of it (S3:
        its ETag; here: the xxh3-128 of its bytes), for :meth:`put_if_match`.

        Raises:
            FileNotFoundError: there is no ``path``.
        """
        import xxhash

        data = self.read_bytes(path)
        return data, xxhash.xxh3_128_hexdigest(data)

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        """Compare-and-swap: replace ``path`` with ``data`` only if it still
        has version ``tag`` (from :meth:`read_tagged`); ``tag=None``: only if
        it does not exist (:meth:`put_if_absent`). Atomic against other
        writers where ``capabilities.conditional_put`` (S3 ``If-Match`` /
        ``If-None-Match: *``); this default compares then writes.

        Raises:
            FileExistsError: another writer changed (or created, or deleted)
                ``path`` since ``tag`` was read; ``path`` is left as it is.
        """
        if tag is None:
            self.put_if_absent(path, data)
            return
        try:
            _, now = self.read_tagged(path)
        except FileNotFoundError:
            raise FileExistsError(f"{path}: deleted by another writer since it was read") from None
        if now != tag:
            raise FileExistsError(f"{path}: replaced by another writer since it was read")
        self.write_bytes(path, data)

    def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Open multipart uploads below ``prefix``: ``(key, upload id,
        initiated seconds since the epoch)``; none where not ``multipart``."""
        return []

    def abort_upload(self, path: str, upload_id: str) -> None:  # noqa: B027 - optional hook
        """Abort one open multipart upload (where ``multipart``)."""

    def link_file(self, src: str, dst: str) -> bool:
        """Give the existing file ``src`` the new name ``dst`` (a new file
        that does not exist yet) without passing its bytes through this
        process, where ``capabilities.file_links``: afterwards ``dst`` holds
        exactly ``src``'s bytes and stays readable whatever later happens to
        ``src`` (deleted, renamed). Returns False when it could not (no such
        capability, ``src`` gone, the file system refused: another device,
        no hard links, too many links); then nothing was created at ``dst``.
        Never raises for those: the caller writes the bytes instead.

        Raises:
            StorageError: the store failed in a way a write would fail too.
        """
        return False

    def file_identity(self, path: str) -> tuple[object, int] | None:
        """``(identity, names)`` of the bytes behind the file ``path``: an
        identity shared by every name that :meth:`link_file` gave the same
        bytes, and how many names they have in the whole store (a local
        file: ``(st_dev, st_ino)`` and ``st_nlink``). None where each name
        holds bytes of its own (S3: a copy is stored again). Used to say
        which bytes a checkpoint alone holds and what deleting it frees.

        Raises:
            FileNotFoundError: there is no ``path``.
        """
        return None

    @abstractmethod
    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a directory; only where ``atomic_rename``."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Delete a checkpoint directory/prefix and everything below it."""

    def fsync_dir(self, path: str) -> None:  # noqa: B027 - optional hook
        """Make the directory entry changes under ``path`` durable (if supported)."""

    # -- reading
    @abstractmethod
    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes of ``path`` from byte ``offset``."""

    def read_parts(self, path: str, parts: Iterable[tuple[int, memoryview]]) -> Generator[int, None, None]:
        """Fill each ``(offset, buf)`` of ``parts`` from ``path`` in order,
        yielding its index once it is filled (so the caller can verify a part
        while it is still in the CPU cache, before the next is read). The
        default calls :meth:`read_into` per part; a backend may keep the file
        open across parts (:class:`~reshard.storage.local.LocalStorage`).
        Raises what :meth:`read_into` raises."""
        for i, (offset, buf) in enumerate(parts):
            self.read_into(path, offset, buf)
            yield i

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is None:
            length = self.size(path) - offset
        buf = bytearray(length)
        self.read_into(path, offset, memoryview(buf))
        return bytes(buf)

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    def is_link(self, path: str) -> bool:
        return False

    def canonical(self, path: str) -> str:
        """The one spelling of ``path`` in this store: two spellings that name
        the same location give the same string (the save protocol compares
        ranks' checkpoint locations by it). Keys of an object store are
        already canonical; the local file system resolves symbolic links."""
        return path.rstrip("/") or "/"

    @abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names of the direct children of ``path`` (files and directories)."""

    def modified_time(self, path: str) -> float | None:
        """Modification time in seconds since the epoch, where known."""
        return None
