"""Local file system backend: real files, fsync of files and directories,
atomic directory rename, ranged reads with ``os.preadv`` straight into the
caller's buffer."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Generator, Iterable

from ..errors import IntegrityError, NotARegularFileError, StorageError
from .base import Capabilities, Storage, WriteStream
from .registry import Scheme, register_scheme


def _storage_error(op: str, path: str, e: OSError) -> StorageError:
    what = "no space left on device" if e.errno == errno.ENOSPC else e.strerror or str(e)
    return StorageError(f"{op} {path!r}: {what}")


#: held by a thread of this process around each compare-and-swap (the
#: POSIX lock under it excludes only other processes)
_CAS_LOCK = threading.Lock()

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NONBLOCK)``, then ``fstat``: the descriptor of
    a regular file, never one of a FIFO, socket or device (opening those
    without ``O_NONBLOCK`` can block forever: a FIFO waits for a writer).
    ``O_NONBLOCK`` changes nothing for a regular file's reads and writes.

    Raises:
        IsADirectoryError: ``path`` is a directory (the content is wrong, not the store).
        NotARegularFileError: ``path`` is a FIFO, a socket or a device (refused at once).
        OSError: as ``os.open`` (FileNotFoundError for a missing path; ENXIO for
            a FIFO opened for writing with no reader).
    """
    fd = os.open(path, flags | os.O_NONBLOCK, mode)
    try:
        st_mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(st_mode):
        return fd
    os.close(fd)
    if stat.S_ISDIR(st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", path)
    raise NotARegularFileError(f"{path}: is {file_kind(st_mode)}, not a regular file (refused: "
                               "only regular files and directories are opened)")


class _LocalWrite(WriteStream):
    def __init__(self, store: LocalStorage, path: str, durable: bool):
        self._store, self._path, self._durable = store, path, durable
        try:
            self._fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except (FileNotFoundError, IsADirectoryError):
            raise
        except OSError as e:
            if e.errno == errno.ENXIO:  # a FIFO without a reader: never wait for one
                raise NotARegularFileError(f"{path}: is a FIFO, not a regular file (refused: only "
                                           "regular files and directories are opened)") from None
            raise _storage_error("open", path, e) from e

    def write(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        try:
            while mv:
                n = os.write(self._fd, mv)
                mv = mv[n:]
                self._store._count_write(n)
        except OSError as e:
            raise _storage_error("write", self._path, e) from e

    def close(self) -> None:
        try:
            if self._durable:
                os.fsync(self._fd)
        except OSError as e:
            raise _storage_error("fsync", self._path, e) from e
        finally:
            os.close(self._fd)

    def abort(self) -> None:
        try:
            os.close(self._fd)
        finally:
            try:
                os.unlink(self._path)
            except OSError:
                pass


class LocalStorage(Storage):
    capabilities = Capabilities(atomic_rename=True, listing=True, ranged_reads=True, durable_sync=True,
                                conditional_put=True, file_links=True)

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise _storage_error("mkdir", path, e) from e

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        return _LocalWrite(self, path, durable)

    def put_if_absent(self, path: str, data: bytes) -> None:
        """Write a temporary file, fsync it, then ``link`` it to ``path``
        (fails atomically when ``path`` exists)."""
        tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        self.write_bytes(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(f"{path}: already exists") from None
        except OSError as e:
            raise _storage_error("link", path, e) from e
        finally:
            os.unlink(tmp)

    def link_file(self, src: str, dst: str) -> bool:
        """A hard link (``os.link``): ``dst`` is a second name of ``src``'s
        inode, whose bytes the file system keeps while any name remains.
        False where the file system refuses one (another device, no hard
        links: some FUSE and object-store mounts, too many links) or ``src``
        is gone. The link's directory entry is made durable by the caller's
        ``fsync_dir`` of ``dst``'s directory (the publish does it)."""
        try:
            os.link(src, dst, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
                           errno.ENOSYS, errno.EACCES, errno.EEXIST, errno.EINVAL):
                return False
            raise _storage_error("link", f"{src} -> {dst}", e) from e
        return True

    def file_identity(self, path: str) -> tuple[object, int] | None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise
        except OSError as e:
            raise _storage_error("stat", path, e) from e
        return (st.st_dev, st.st_ino), st.st_nlink

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        """Compare-and-swap of a small record, atomic against other processes:
        under an exclusive POSIX lock (``lockf``, which NFSv4 and Lustre
        honour across hosts) on the sidecar ``<path>.lock`` the version of
        ``path`` is compared with ``tag`` (:meth:`read_tagged`: xxh3-128 of
        its bytes; None: it must not exist), then ``data`` is written to a
        temporary file, fsynced and renamed over ``path`` (the parent
        fsynced). The lock ends with the descriptor, also when the process
        dies; the lock file stays (empty). A POSIX lock excludes other
        processes only, so the threads of this process also take one lock
        of the process (:data:`_CAS_LOCK`) around it.

        Raises:
            FileExistsError: ``path`` changed (or appeared, or vanished) since ``tag``.
            StorageError: the store failed.
        """
        with _CAS_LOCK:
            self._put_if_match_locked(path, data, tag)

    def _put_if_match_locked(self, path: str, data: bytes, tag: str | None) -> None:
        import fcntl

        lock = f"{path}.lock"
        try:
            fd = open_regular(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _storage_error("open", lock, e) from e
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
            except OSError as e:
                raise _storage_error("lock", lock, e) from e
            try:
                _, now = self.read_tagged(path)
            except (FileNotFoundError, NotADirectoryError):
                now = None
            if now != tag:
                raise FileExistsError(f"{path}: changed by another writer since it was read"
                                      if tag is not None else f"{path}: already exists")
            tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                self.write_bytes(tmp, data)
                self.rename_dir(tmp, path)
            except BaseException:
                self.delete_tree(tmp)
                raise
            self.fsync_dir(os.path.dirname(path) or "/")
        finally:
            os.close(fd)

    def rename_dir(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as e:
            raise _storage_error("rename", f"{src} -> {dst}", e) from e

    def delete_tree(self, path: str) -> None:
        try:
            if os.path.islink(path) or os.path.isfile(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _storage_error("delete", path, e) from e

    def fsync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        except OSError as e:
            raise _storage_error("open dir", path, e) from e
        try:
            os.fsync(fd)
        except OSError as e:
            raise _storage_error("fsync dir", path, e) from e
        finally:
            os.close(fd)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        for _ in self.read_parts(path, ((offset, buf),)):
            pass

    def read_parts(self, path: str, parts: Iterable[tuple[int, memoryview]]) -> Generator[int, None, None]:
        """The file is opened once for all ``parts`` (``os.preadv`` into each buffer)."""
        try:  # never blocks on a FIFO; a directory, FIFO, socket or device is refused
            fd = open_regular(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # as the protocol says
            raise
        except OSError as e:
            raise _storage_error("open", path, e) from e
        try:
            for i, (offset, buf) in enumerate(parts):
                self._pread(fd, path, offset, buf)
                yield i
        finally:
            os.close(fd)

    def _pread(self, fd: int, path: str, offset: int, buf: memoryview) -> None:
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        want = len(buf)
        got = 0
        try:
            while got < want:
                n = os.preadv(fd, [buf[got:]], offset + got)
                if n == 0:
                    raise IntegrityError(
                        f"{path}: file is shorter than declared: wanted bytes [{offset}, "
                        f"{offset + want}), file ends at {offset + got}"
                    )
                got += n
        except OSError as e:
            raise _storage_error("read", path, e) from e
        self._count_read(want)

    def size(self, path: str) -> int:
        """Bytes of the file at ``path`` (a stat: never opens it).

        Raises:
            NotARegularFileError: a FIFO, a socket or a device is there."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # a missing key, as the protocol says
            raise
        except OSError as e:
            raise _storage_error("stat", path, e) from e
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise NotARegularFileError(f"{path}: is {file_kind(st.st_mode)}, not a regular file "
                                       "(refused: only regular files and directories are opened)")
        return st.st_size

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def canonical(self, path: str) -> str:
        """``os.path.realpath`` of the absolute path: relative spellings and
        symbolic links (of the path or any parent) resolve to one string; the
        part of the path that does not exist yet is kept as spelled."""
        return os.path.realpath(os.path.abspath(path))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):  # a missing key, as the protocol says
            raise
        except OSError as e:
            raise _storage_error("list", path, e) from e

    def free_bytes(self, path: str) -> int | None:
        """``statvfs`` of ``path``'s nearest existing ancestor: the blocks
        available to an unprivileged writer (``f_bavail * f_frsize``)."""
        p = os.path.abspath(path)
        while p and not os.path.exists(p):
            p = os.path.dirname(p)
        try:
            st = os.statvfs(p or "/")
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def modified_time(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None


def _open(rest: str) -> tuple[Storage, str]:
    """A local path, or the part of a ``file://`` URL after the scheme
    (``file://localhost/abs`` as ``/abs``, RFC 8089): ``~`` expanded, made absolute."""
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return LocalStorage(), os.path.abspath(os.path.expanduser(rest)).rstrip("/") or "/"


SCHEME = register_scheme(Scheme(name="file", backend="local", open=_open, bare_paths=True,
                                test_store="reshard.testing.stores:LocalTestStore",
                                fault_kit="reshard.faults.local"))
