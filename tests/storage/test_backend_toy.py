"""Adding a storage backend, as docs/extending.md walks it: a toy backend
defined here (one module: this file), registered under ``toy://`` (one
call), passes the conformance suite and carries reshard.save -> reshard.load
on real gloo ranks (one test). Nothing in reshard was edited for it.

The toy keeps each key as a file of that path, with no atomic rename, so
reshard commits to it as to an object store: data under the final prefix,
the manifest published last with a compare-and-swap.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.errors import IntegrityError
from reshard.storage import Capabilities, Scheme, Storage, WriteStream, register_scheme, resolve
from reshard.testing.storage_conformance import StorageConformance

# ----------------------------------------------------------------------------- the backend (one module)

_LOCK = os.path.join(tempfile.gettempdir(), "reshard-toy-store.lock")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One lock for every compare-and-swap of every process on this host."""
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class _ToyWrite(WriteStream):
    def __init__(self, st: ToyStorage, path: str):
        self.st, self.path, self.buf = st, path, bytearray()

    def write(self, data: bytes | memoryview) -> None:
        self.buf += data
        self.st._count_write(len(data))

    def close(self) -> None:  # whole or not at all: a temporary file, then replace
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(self.path), f".toy-tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(self.buf)
        os.replace(tmp, self.path)

    def abort(self) -> None:
        self.buf.clear()


class ToyStorage(Storage):
    """``toy:///abs/path``: every key a file of that path; no rename."""

    capabilities = Capabilities(atomic_rename=False, listing=True, ranged_reads=True,
                                durable_sync=False, conditional_put=True)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        return _ToyWrite(self, path)

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        with _locked():
            try:
                now: str | None = self.read_tagged(path)[1]
            except FileNotFoundError:
                now = None
            if now != tag:
                raise FileExistsError(f"toy://{path}: changed since it was read")
            self.write_bytes(path, data)

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.put_if_match(path, data, None)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError("toy:// has no rename")

    def delete_tree(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            n = f.readinto(buf)
        if n != len(buf):
            raise IntegrityError(f"toy://{path}: {n} bytes at {offset}, expected {len(buf)}")
        self._count_read(n)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def list_dir(self, path: str) -> list[str]:
        return sorted(n for n in os.listdir(path) if not n.startswith(".toy-tmp-"))

    def modified_time(self, path: str) -> float | None:
        return os.stat(path).st_mtime if os.path.exists(path) else None


# ----------------------------------------------------------------------------- the registration (one call)

register_scheme(Scheme(name="toy", open=lambda rest: (ToyStorage(), "/" + rest.strip("/"))))

# ----------------------------------------------------------------------------- the test


class TestToyConformance(StorageConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: os.PathLike[str]) -> None:
        self.url = f"toy://{os.fspath(tmp_path)}/conformance"

    def make(self) -> tuple[Storage, str]:
        return resolve(self.url)


def _state(rank: int, world: int, rows: int = 12, cols: int = 8) -> dict[str, object]:
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    lo, hi = rank * rows // world, (rank + 1) * rows // world
    return {"w": reshard.ShardedTensor("w", full[lo:hi].clone(), global_shape=(rows, cols),
                                       global_offset=(lo, 0)),
            "b": torch.arange(cols, dtype=torch.float32), "step": 5}


def save_toy(url: str) -> str:
    res = reshard.save(_state(dist.get_rank(), dist.get_world_size()), url, step=5)
    return res.path


def load_toy(url: str) -> bool:
    r, n = dist.get_rank(), dist.get_world_size()
    want = _state(r, n)
    got = _state(r, n)
    for t in (got["w"].data, got["b"]):  # type: ignore[union-attr]
        t.fill_(float("nan"))
    res = reshard.load(got, url)
    return (torch.equal(got["w"].data, want["w"].data)  # type: ignore[union-attr]
            and torch.equal(got["b"], want["b"]) and res.values["step"] == 5)  # type: ignore[arg-type]


def test_save_on_2_load_on_3_through_the_toy_backend(pool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"toy://{tmp_path}/run/step-5"
    assert pool.run(2, save_toy, url) == [url, url]  # the result path names the toy store
    st, key = resolve(url)
    assert isinstance(st, ToyStorage) and "manifest.json" in st.list_dir(key)
    assert not any(n.endswith(".nonce") or ".lease-" in n for n in os.listdir(tmp_path / "run"))
    assert pool.run(3, load_toy, url) == [True, True, True]
    assert reshard.verify(url).ok
    assert reshard.latest(f"toy://{tmp_path}/run") == url
