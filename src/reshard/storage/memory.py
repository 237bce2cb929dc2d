"""In-process ``memory://`` backend (single process; for tests and scratch).

Behaves like an object store: no atomic rename, so the commit protocol
publishes by writing the manifest last under the final prefix."""

from __future__ import annotations

import threading

from ..errors import IntegrityError
from .base import Capabilities, Storage, WriteStream
from .registry import Scheme, register_scheme

_STORES: dict[str, dict[str, bytes]] = {}
_GLOBAL_LOCK = threading.Lock()


class _MemWrite(WriteStream):
    def __init__(self, store: MemoryStorage, path: str):
        self._store, self._path, self._parts = store, path, []  # type: ignore[var-annotated]

    def write(self, data: bytes | memoryview) -> None:
        b = bytes(data)
        self._parts.append(b)
        self._store._count_write(len(b))

    def close(self) -> None:
        with self._store._lock:
            self._store._objects[self._path] = b"".join(self._parts)

    def abort(self) -> None:
        self._parts.clear()


class MemoryStorage(Storage):
    capabilities = Capabilities(atomic_rename=False, listing=True, ranged_reads=True, durable_sync=False,
                                conditional_put=True, file_links=True)

    def __init__(self, namespace: str = "default"):
        super().__init__()
        with _GLOBAL_LOCK:
            self._objects = _STORES.setdefault(namespace, {})

    def makedirs(self, path: str) -> None:
        pass

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        return _MemWrite(self, path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        with self._lock:
            if path in self._objects:
                raise FileExistsError(f"memory://{path}: already exists")
            self._objects[path] = bytes(data)
        self._count_write(len(data))

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        import xxhash

        with self._lock:  # compare and swap under the store's lock: atomic
            cur = self._objects.get(path)
            if tag is None and cur is not None:
                raise FileExistsError(f"memory://{path}: already exists")
            if tag is not None and (cur is None or xxhash.xxh3_128_hexdigest(cur) != tag):
                raise FileExistsError(f"memory://{path}: changed by another writer since it was read")
            self._objects[path] = bytes(data)
        self._count_write(len(data))

    def link_file(self, src: str, dst: str) -> bool:
        """``dst`` shares ``src``'s bytes object (immutable: never copied)."""
        with self._lock:
            data = self._objects.get(src)
            if data is None or dst in self._objects:
                return False
            self._objects[dst] = data
        return True

    def file_identity(self, path: str) -> tuple[object, int] | None:
        with self._lock:
            data = self._get(path)
            return id(data), sum(1 for v in self._objects.values() if v is data)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError("memory:// has no atomic rename")

    def delete_tree(self, path: str) -> None:
        prefix = path.rstrip("/") + "/"
        with self._lock:
            for k in [k for k in self._objects if k.startswith(prefix) or k == path]:
                del self._objects[k]

    def _get(self, path: str) -> bytes:
        try:
            return self._objects[path]
        except KeyError:
            raise FileNotFoundError(path) from None

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        data = self._get(path)
        n = len(buf)
        if offset + n > len(data):
            raise IntegrityError(
                f"{path}: object is shorter than declared: wanted bytes [{offset}, {offset + n}), "
                f"object has {len(data)}"
            )
        buf.cast("B")[:] = data[offset : offset + n]
        self._count_read(n)

    def size(self, path: str) -> int:
        return len(self._get(path))

    def exists(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return path in self._objects or any(k.startswith(prefix) for k in self._objects)

    def list_dir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/" if path else ""
        names = {k[len(prefix):].split("/", 1)[0] for k in self._objects if k.startswith(prefix)}
        if not names and path in self._objects:
            raise NotADirectoryError(path)
        if not names and path:
            raise FileNotFoundError(f"memory://{path}: nothing below this prefix")
        return sorted(names)


def clear_memory_storage(namespace: str | None = None) -> None:
    """Drop everything stored under ``memory://`` (one namespace or all)."""
    with _GLOBAL_LOCK:
        if namespace is None:
            _STORES.clear()
        else:
            _STORES.pop(namespace, None)


def _open(rest: str) -> tuple[Storage, str]:
    """``memory://<prefix>``: the process's store, key ``<prefix>``."""
    return MemoryStorage(), rest.strip("/")


SCHEME = register_scheme(Scheme(name="memory", open=_open, shared=False,
                                test_store="reshard.testing.stores:MemoryTestStore"))
