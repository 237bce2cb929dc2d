"""The write stream of the S3 backend: parts of ``part_bytes`` uploaded in parallel as one
multipart upload (a single PUT below one part); a failed part fails the stream at the next
``write``/``close`` and the upload is aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from .base import WriteStream
from .s3_client import S3Config, _split

T = TypeVar("T")


class Uploads(Protocol):
    """What a write stream asks of its store (:class:`reshard.storage.s3.S3Storage`)."""

    @property
    def config(self) -> S3Config: ...

    @property
    def client(self) -> Any: ...

    @property
    def _pool(self) -> ThreadPoolExecutor: ...

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T: ...

    def _put(self, b: str, k: str, data: bytes, **cond: str) -> Any: ...

    def _count_write(self, n: int) -> None: ...

    def _note_upload(self, path: str, upload_id: str, opened: bool) -> None: ...

    def abort_upload(self, path: str, upload_id: str) -> None: ...


class _S3Write(WriteStream):
    """A multipart upload of ``part_bytes`` parts uploaded in parallel (a
    single PUT when the object fits one part)."""

    def __init__(self, store: Uploads, path: str):
        self._s, self._path = store, path
        self._bucket, self._key = _split(path)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Future[str]]] = []
        self._closed = False

    def _check_failed(self) -> None:
        for _, f in self._parts:
            if f.done() and f.exception() is not None:
                self.abort()
                raise f.exception()  # type: ignore[misc]

    def _submit_part(self, data: bytes) -> None:
        s = self._s
        if self._upload_id is None:
            r = s._call("create multipart upload", self._path, lambda: s.client.create_multipart_upload(
                Bucket=self._bucket, Key=self._key))
            self._upload_id = r["UploadId"]
            s._note_upload(self._path, self._upload_id, True)
        n = len(self._parts) + 1
        uid = self._upload_id

        def up() -> str:
            r = s._call(f"upload part {n}", self._path, lambda: s.client.upload_part(
                Bucket=self._bucket, Key=self._key, UploadId=uid, PartNumber=n, Body=data))
            return str(r["ETag"])

        self._parts.append((n, s._pool.submit(up)))
        # bound memory: at most `inflight_parts` parts buffered or in flight
        while sum(1 for _, f in self._parts if not f.done()) >= s.config.inflight_parts:
            next(f for _, f in self._parts if not f.done()).exception()
        self._check_failed()

    def write(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        ps = self._s.config.part_bytes
        while mv:
            take = min(len(mv), ps - len(self._buf))
            self._buf += mv[:take]
            mv = mv[take:]
            if len(self._buf) >= ps:
                part, self._buf = bytes(self._buf), bytearray()
                self._submit_part(part)
        self._s._count_write(len(data) if not isinstance(data, memoryview) else data.nbytes)

    def close(self) -> None:
        s = self._s
        if self._closed:
            return
        if self._upload_id is None:
            body = bytes(self._buf)
            s._call("put", self._path, lambda: s._put(self._bucket, self._key, body))
            self._closed = True
            return
        try:
            if self._buf or not self._parts:
                self._submit_part(bytes(self._buf))
                self._buf = bytearray()
            parts = [{"PartNumber": n, "ETag": f.result()} for n, f in self._parts]
            uid = self._upload_id
            s._call("complete multipart upload", self._path, lambda: s.client.complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=uid, MultipartUpload={"Parts": parts}))
        except BaseException:
            self.abort()
            raise
        s._note_upload(self._path, self._upload_id, False)
        self._closed = True

    def abort(self) -> None:
        """Cancel queued parts, wait for running ones, abort the upload."""
        if self._closed:
            return
        self._closed = True
        for _, f in self._parts:
            f.cancel()
        for _, f in self._parts:
            if not f.cancelled():
                f.exception()
        if self._upload_id is not None:
            self._s.abort_upload(self._path, self._upload_id)
            self._s._note_upload(self._path, self._upload_id, False)
