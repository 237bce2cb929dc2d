"""S3 backend (AWS, MinIO, Ceph RGW, R2, ...) through boto3.

Keys are ``bucket/key`` strings, so ``s3://`` + a key is the object's URL.
Credentials, region and endpoint come from the standard AWS variables and
files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``~/.aws/config``), read by botocore.

* Writes: a :class:`WriteStream` buffers ``part_bytes`` and uploads the parts
  of one object in parallel (a multipart upload; a single PUT for objects
  smaller than one part). A failed part fails the stream at the next
  ``write``/``close`` and the upload is aborted.
* Reads: ``read_into`` issues ranged GETs of exactly the bytes asked for,
  split into ``range_bytes`` pieces fetched in parallel.
* Conditional put: ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *``;
  ``put_if_match`` (compare-and-swap of a small record) is ``PutObject`` with
  ``If-Match: <ETag>`` (S3 since 2024-11; MinIO, moto 5.2 honour it too).
* Capabilities are proven, not declared: before the first save (or HEAD
  write) to a bucket, :meth:`S3Storage.check_publish` probes on a scratch key
  that a second ``If-None-Match: *`` put is refused (412), that ``If-Match``
  with a wrong ETag is refused and with the right one accepted; the answer is
  cached per endpoint and bucket. A store that ignores the headers (s3rver,
  some older or self-hosted stores: they answer 200 and overwrite) is refused
  for publishing with :class:`~reshard.errors.StoreCapabilityError`, since
  two writers of one step would both "succeed" and the first one's committed
  checkpoint would be replaced. ``RESHARD_S3_TRUST_CONDITIONAL=1`` skips the
  probe (a store known to honour them; the probe costs five requests once per
  process and bucket). After every publish the manifest is read back and
  must be this attempt's (:meth:`reshard.commit.strategy.MarkerCommit.publish`).
* Retries: throttling (503 SlowDown), 5xx, timeouts and reset connections are
  retried with exponential backoff and full jitter, bounded by
  ``deadline_s`` seconds per request; past it a :class:`StorageError`.
  ``501 NotImplemented`` and other permanent answers fail at once, never
  retried. botocore's own retries are off (one policy, counted here).
* A store that does not implement ListMultipartUploads (501): ``list_uploads``
  returns nothing and says so once in :attr:`Storage.notes` (``reshard gc``
  prints it): gc deletes what listing objects found, and cannot abort open
  multipart uploads it cannot see.

Threads: every method may be called from several threads at once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from ..errors import IntegrityError, StorageError
from .base import Capabilities, Storage, WriteStream
from .registry import Scheme, register_scheme
from .s3_client import (
    _CLIENTS_LOCK,
    S3Config,
    _BodyMismatch,
    _client,
    _pool,
    _retryable,
    _split,
    _status,
    permanent,
)
from .s3_write import _S3Write

T = TypeVar("T")

#: (endpoint, bucket) -> the probe's answer (:class:`Probe`)
_PROBES: dict[tuple[str, str], Probe] = {}
#: the environment variable that skips the probe (a store known to honour conditional requests)
TRUST_ENV = "RESHARD_S3_TRUST_CONDITIONAL"


@dataclass(frozen=True)
class Probe:
    """What :meth:`S3Storage.probe` found about one endpoint and bucket.

    Attributes:
        conditional_put: a second ``PutObject`` with ``If-None-Match: *`` of
            one key was refused (412).
        conditional_replace: ``If-Match`` with a wrong ETag was refused and
            with the object's own ETag accepted.
        why: what the store did instead, in words ("" when both hold).
    """

    conditional_put: bool
    conditional_replace: bool
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.conditional_put and self.conditional_replace


class S3Storage(Storage):
    """Objects in S3 buckets; keys are ``bucket/key``.

    Args:
        config: tuning (default: :meth:`S3Config.from_env`).

    Attributes:
        requests: requests sent, retries included (for tests and benchmarks).
        retries: requests retried after a retryable failure.
    """

    capabilities = Capabilities(atomic_rename=False, listing=True, ranged_reads=True,
                                durable_sync=False, conditional_put=True, multipart=True,
                                file_links=True)
    #: objects up to this size are copied with one ``CopyObject`` (the S3
    #: limit is 5 GiB); larger ones by a multipart upload of ``UploadPartCopy``
    #: parts (``RESHARD_S3_COPY_MAX_BYTES`` lowers it, for tests)
    copy_max_bytes: int = 5 << 30

    def __init__(self, config: S3Config | None = None):
        super().__init__()
        self.config = config or S3Config.from_env()
        self.read_segment_bytes = self.config.range_bytes * 8  # 8 parallel ranged GETs per call
        self.client = _client()
        self._pool = _pool("reshard-s3-put", self.config.max_workers)
        self._get_pool = _pool("reshard-s3-get", self.config.max_workers)
        self._rng = random.Random(os.urandom(16))  # never the global generator
        self.requests = 0
        self.retries = 0
        self.open_uploads: dict[str, str] = {}
        #: (endpoint, bucket) that answered ListMultipartUploads with NotImplemented
        self._no_list_uploads: set[tuple[str, str]] = set()

    def _note_upload(self, path: str, upload_id: str, opened: bool) -> None:
        with self._lock:
            if opened:
                self.open_uploads[upload_id] = path
            else:
                self.open_uploads.pop(upload_id, None)

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run one request with retries (backoff with full jitter) until
        ``deadline_s``; 404 -> FileNotFoundError, 412 -> FileExistsError,
        anything else -> StorageError."""
        from botocore.exceptions import ClientError

        cfg = self.config
        deadline = time.monotonic() + cfg.deadline_s
        attempt = 0
        while True:
            with self._lock:
                self.requests += 1
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                status, code = _status(e) if isinstance(e, ClientError) else (0, "")
                if status == 404 or code in ("NoSuchKey", "NotFound", "NoSuchBucket", "NoSuchUpload"):
                    raise FileNotFoundError(f"s3://{path}: {code or 'not found'}") from e
                if status == 412 or code == "PreconditionFailed":
                    raise FileExistsError(f"s3://{path}: already exists (conditional put refused)") from e
                if status == 416 or code == "InvalidRange":
                    raise IntegrityError(f"s3://{path}: object is shorter than the range read") from e
                delay = self._rng.uniform(0, min(cfg.backoff_cap_s, cfg.backoff_s * 2 ** attempt))
                if not _retryable(e) or time.monotonic() + delay > deadline:
                    why = f"{code or type(e).__name__}: {e}"
                    extra = f" after {attempt + 1} attempt(s) in {cfg.deadline_s:g} s" if _retryable(e) else ""
                    raise StorageError(f"s3 {op} s3://{path} failed{extra}: {why}") from e
                attempt += 1
                with self._lock:
                    self.retries += 1
                time.sleep(delay)

    # -- writing
    def makedirs(self, path: str) -> None:
        pass  # prefixes need no creation

    def open_write(self, path: str, *, durable: bool = True) -> WriteStream:
        return _S3Write(self, path)

    def write_bytes(self, path: str, data: bytes, *, durable: bool = True) -> None:
        if len(data) < self.config.part_bytes:
            b, k = _split(path)
            self._call("put", path, lambda: self._put(b, k, data))
            self._count_write(len(data))
            return
        super().write_bytes(path, data, durable=durable)

    def _put(self, b: str, k: str, data: bytes, **cond: str) -> Any:
        """One ``PutObject`` sent with ``Content-MD5`` (S3 refuses a body
        altered in transit: BadDigest); where the answer's ETag is an MD5 (a
        plain single PUT) and not the one of ``data``, the store kept other
        bytes (a body cut short by a middlebox, a store that does not check):
        :class:`_BodyMismatch`, retried."""
        md5 = hashlib.md5(data, usedforsecurity=False)
        r = self.client.put_object(Bucket=b, Key=k, Body=data, **cond,
                                   ContentMD5=base64.b64encode(md5.digest()).decode())
        etag = str(r.get("ETag", "")).strip('"')
        if re.fullmatch("[0-9a-f]{32}", etag) and etag != md5.hexdigest():
            raise _BodyMismatch(f"the store kept {etag}, not the MD5 {md5.hexdigest()} of the "
                                f"{len(data)} bytes sent (body altered in transit)", etag)
        return r

    def _put_cond(self, op: str, path: str, data: bytes, cond: dict[str, str]) -> None:
        """A conditional put with the retries of :meth:`_call`. A refusal (412,
        or 404: deleted meanwhile) is FileExistsError, unless a retry after a
        lost response finds our own bytes there. After a body mismatch the
        object holds our own bad bytes: the retry replaces exactly those
        (``If-Match`` their ETag), and if every try fails they are deleted,
        so no torn object stays published."""
        b, k = _split(path)
        cur, bad, tried = dict(cond), [""], [0]

        def put() -> Any:
            tried[0] += 1
            try:
                return self._put(b, k, data, **cur)
            except _BodyMismatch as e:
                cur.clear()
                cur["IfMatch"], bad[0] = f'"{e.etag}"', e.etag
                raise

        try:
            self._call(op, path, put)
        except (FileExistsError, FileNotFoundError) as e:
            try:
                if tried[0] > 1 and self._get_all(path) == data:
                    return
            except FileNotFoundError:
                pass
            raise FileExistsError(str(e)) from e
        except StorageError:
            try:
                if bad[0] and self.read_tagged(path)[1].strip('"') == bad[0]:
                    self.delete_keys([path])
            except Exception:  # noqa: BLE001, S110 - best effort; the put's error is what counts
                pass
            raise
        self._count_write(len(data))

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.check_publish(path)
        self._put_cond("conditional put", path, data, {"IfNoneMatch": "*"})

    def _endpoint(self, bucket: str) -> tuple[str, str]:
        return (str(getattr(self.client.meta, "endpoint_url", "") or ""), bucket)

    def probe(self, path: str) -> Probe:
        """Probe (once per endpoint and bucket, cached) whether the store
        honours conditional requests, on a scratch key beside ``path``
        (``<parent of path>/.reshard-probe-<random>``, deleted after): put it
        with ``If-None-Match: *`` (accepted), again (must be refused: 412),
        with ``If-Match`` a wrong ETag (must be refused), with its own ETag
        (must be accepted). Five requests. When the first conditional put is
        not accepted, the same put without the header tells why: refused too,
        the request fails for another reason than the header (no such bucket,
        access denied, an endpoint that does not answer) and that reason is
        raised; accepted, the store does not honour the header.

        Raises:
            StorageError: a request of the probe failed for another reason than
                the conditional headers: ``NoSuchBucket`` (the message names
                the bucket and the endpoint), ``AccessDenied``, an endpoint down
                past the retries...; nothing is cached, a later call probes again."""
        b, k = _split(path)
        ident = self._endpoint(b)
        with _CLIENTS_LOCK:
            got = _PROBES.get(ident)
        if got is not None:
            return got
        parent = k.rstrip("/").rpartition("/")[0]
        scratch = f"{b}/{parent + '/' if parent else ''}.reshard-probe-{os.urandom(6).hex()}"
        sb, sk = _split(scratch)

        def put(data: bytes, **cond: str) -> str:
            """"ok", "refused" (412 / 404) or "answered <code>" (501, 400...)."""
            try:
                self._call("capability probe", scratch, lambda: self._put(sb, sk, data, **cond))
                return "ok"
            except (FileExistsError, FileNotFoundError):
                return "refused"
            except StorageError as e:
                if e.__cause__ is not None and not _retryable(e.__cause__):
                    status, code = _status(e.__cause__)
                    return f"answered {code or status or type(e.__cause__).__name__}"
                raise

        try:
            cp, cr, why = True, True, []
            first = put(b"reshard capability probe 1", IfNoneMatch="*")
            if first != "ok":
                self._control_put(scratch, first)
                cp = cr = False
                why.append(f"PutObject with If-None-Match: * of a new key was {first}")
            else:
                second = put(b"reshard capability probe 2", IfNoneMatch="*")
                if second != "refused":
                    cp = False
                    why.append("a second PutObject with If-None-Match: * of one key was "
                               + ("accepted (the header is ignored: the object was replaced)"
                                  if second == "ok" else second))
                wrong = put(b"reshard capability probe 3", IfMatch='"00000000000000000000000000000000"')
                if wrong != "refused":
                    cr = False
                    why.append("PutObject with If-Match: <a wrong ETag> was "
                               + ("accepted (the header is ignored)" if wrong == "ok" else wrong))
                else:
                    _, tag = self.read_tagged(scratch)
                    right = put(b"reshard capability probe 4", IfMatch=tag)
                    if right != "ok":
                        cr = False
                        why.append(f"PutObject with If-Match: <its own ETag> was {right}")
        finally:
            try:
                self.delete_keys([scratch])
            except Exception:  # noqa: BLE001, S110 - a leftover scratch key is ignored by every listing
                pass
        out = Probe(conditional_put=cp, conditional_replace=cr, why="; ".join(why))
        with _CLIENTS_LOCK:
            _PROBES[ident] = out
        return out

    def _control_put(self, scratch: str, first: str) -> None:
        """After the probe's first ``If-None-Match: *`` put was ``first`` (not
        accepted): put the same new key without any condition. Accepted, the
        header alone was the matter (return). Refused too, the request fails for
        another reason, raised as StorageError naming it (never advice about
        conditional requests)."""
        b, k = _split(scratch)
        endpoint, bucket = self._endpoint(b)
        where = f"the store at {endpoint or 'AWS'} (bucket {bucket})"
        try:
            self._call("capability probe", scratch,
                       lambda: self._put(b, k, b"reshard capability probe 1 (unconditional)"))
        except FileNotFoundError as e:
            _, code = _status(e.__cause__) if e.__cause__ is not None else (0, "")
            if code == "NoSuchBucket":
                raise StorageError(f"s3://{scratch}: bucket {bucket!r} does not exist at "
                                   f"{endpoint or 'AWS'} "
                                   "(NoSuchBucket): create it, or check the URL and the endpoint "
                                   "(AWS_ENDPOINT_URL)") from e
            raise StorageError(f"s3://{scratch}: {where} answered {code or '404 Not Found'} to a "
                               f"plain PutObject of a new key (and {first} to the same with "
                               "If-None-Match: *): check the URL and the endpoint") from e
        except FileExistsError as e:
            raise StorageError(f"s3://{scratch}: {where} refused a plain PutObject of a new key "
                               f"with 412 Precondition Failed (and {first} to the same with "
                               "If-None-Match: *)") from e
        except StorageError as e:
            raise StorageError(f"{e} (the capability probe's first write; it fails without "
                               "conditional headers too, so this is not about conditional "
                               "requests: check the bucket, the credentials and the endpoint)") from e

    def check_publish(self, path: str) -> None:
        """Refuse to publish at ``path`` on a store that does not honour
        conditional puts and replaces (:meth:`probe`), with one line saying
        what was found and what to set; ``RESHARD_S3_TRUST_CONDITIONAL=1``
        skips the probe.

        Raises:
            StoreCapabilityError: the store ignores or refuses them.
            StorageError: the probe failed."""
        from ..errors import StoreCapabilityError

        if os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes"):
            return
        got = self.probe(path)
        if not got.ok:
            endpoint, bucket = self._endpoint(_split(path)[0])
            raise StoreCapabilityError(
                f"s3://{path}: refusing to publish: the store at {endpoint or 'AWS'} (bucket {bucket}) "
                f"does not honour conditional requests ({got.why}), so two writers of one step or two "
                "jobs resuming from one root could both succeed and replace each other's commit; use "
                "a store that does (AWS S3, MinIO, Ceph RGW...), or set "
                f"{TRUST_ENV}=1 only if one job alone ever writes this root")

    def read_tagged(self, path: str) -> tuple[bytes, str]:
        b, k = _split(path)

        def get() -> tuple[bytes, str]:
            r = self.client.get_object(Bucket=b, Key=k)
            return bytes(r["Body"].read()), str(r["ETag"])

        data, etag = self._call("get", path, get)
        self._count_read(len(data))
        return data, etag

    def put_if_match(self, path: str, data: bytes, tag: str | None) -> None:
        """``PutObject`` with ``If-Match: <tag>`` (``If-None-Match: *`` when
        ``tag`` is None): S3 refuses it with 412 when another writer got there
        first. A 412 (or 404: deleted meanwhile) is FileExistsError, unless a
        retry after a lost response finds our own bytes there."""
        if tag is None:
            self.put_if_absent(path, data)
            return
        self.check_publish(path)
        try:
            self._put_cond("conditional replace", path, data, {"IfMatch": tag})
        except FileExistsError as e:
            raise FileExistsError(f"s3://{path}: changed by another writer since it was read "
                                  f"(If-Match {tag} refused)") from e

    def link_file(self, src: str, dst: str) -> bool:
        """A copy inside the store: ``CopyObject`` up to :attr:`copy_max_bytes`,
        else a multipart upload whose parts are ``UploadPartCopy`` ranges of
        ``src`` (parts of ``max(part_bytes, 5 MiB)``: S3's smallest part but
        the last). No byte passes through this process; the store keeps a
        second copy of the bytes (S3 has no links). False when ``src`` is
        gone or the store does not copy (NotImplemented): the caller writes."""
        sb, sk = _split(src)
        db, dk = _split(dst)
        limit = int(os.environ.get("RESHARD_S3_COPY_MAX_BYTES") or self.copy_max_bytes)
        try:
            size = self.size(src)
            if size <= limit:
                self._call("copy", dst, lambda: self.client.copy_object(
                    Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk}))
            else:
                self._copy_parts(src, dst, size, min(limit, max(self.config.part_bytes, 5 << 20)))
        except (FileNotFoundError, FileExistsError, StorageError):
            return False
        return True

    def _copy_parts(self, src: str, dst: str, size: int, part: int) -> None:
        """``dst`` as a multipart upload of ``UploadPartCopy`` parts of ``src``
        (aborted on any failure)."""
        sb, sk = _split(src)
        db, dk = _split(dst)
        r = self._call("create multipart upload", dst,
                       lambda: self.client.create_multipart_upload(Bucket=db, Key=dk))
        uid = r["UploadId"]
        self._note_upload(dst, uid, True)
        try:
            def one(n: int, a: int) -> dict[str, Any]:
                rng = f"bytes={a}-{min(a + part, size) - 1}"
                got = self._call(f"upload part copy {n}", dst, lambda: self.client.upload_part_copy(
                    Bucket=db, Key=dk, UploadId=uid, PartNumber=n, CopySourceRange=rng,
                    CopySource={"Bucket": sb, "Key": sk}))
                return {"PartNumber": n, "ETag": got["CopyPartResult"]["ETag"]}

            futs = [self._pool.submit(one, n, a) for n, a in enumerate(range(0, size, part), start=1)]
            parts = [f.result() for f in futs]
            self._call("complete multipart upload", dst, lambda: self.client.complete_multipart_upload(
                Bucket=db, Key=dk, UploadId=uid, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self.abort_upload(dst, uid)
            except Exception:  # noqa: BLE001, S110 - gc aborts what is left
                pass
            finally:
                self._note_upload(dst, uid, False)
            raise
        self._note_upload(dst, uid, False)

    def rename_dir(self, src: str, dst: str) -> None:
        raise NotImplementedError("S3 has no atomic rename")

    def _keys(self, prefix: str) -> list[str]:
        """Every key (``bucket/key``) under ``prefix`` (recursive)."""
        b, k = _split(prefix)
        out: list[str] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": b, "Prefix": k}
            if token:
                kw["ContinuationToken"] = token
            r = self._call("list", prefix, partial(self.client.list_objects_v2, **kw))
            out.extend(f"{b}/{o['Key']}" for o in r.get("Contents", ()))
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return out

    def delete_keys(self, keys: list[str]) -> None:
        """Delete objects (``bucket/key``), 1000 per request."""
        by_bucket: dict[str, list[str]] = {}
        for key in keys:
            b, k = _split(key)
            by_bucket.setdefault(b, []).append(k)
        for b, ks in by_bucket.items():
            for i in range(0, len(ks), 1000):
                objs = [{"Key": k} for k in ks[i:i + 1000]]
                r = self._call("delete", f"{b}/{ks[i]}", partial(
                    self.client.delete_objects, Bucket=b, Delete={"Objects": objs, "Quiet": True}))
                if r.get("Errors"):
                    e = r["Errors"][0]
                    raise StorageError(f"s3 delete s3://{b}/{e.get('Key')}: {e.get('Code')}: "
                                       f"{e.get('Message')}")

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` (an object) or every object below the prefix
        ``path/``, ``manifest.json`` first (a half-deleted checkpoint is never
        seen as committed), and abort multipart uploads below it."""
        b, k = _split(path)
        if not k:
            raise ValueError(f"refusing to delete a whole bucket ({path!r})")
        keys = self._keys(path.rstrip("/") + "/")
        if not keys:
            self.delete_keys([path])
            return
        first = [x for x in keys if x.endswith("/manifest.json")]
        if first:
            self.delete_keys(first)
        self.delete_keys([x for x in keys if x not in first])
        for key, uid, _ in self.list_uploads(path.rstrip("/") + "/"):
            self.abort_upload(key, uid)

    # -- multipart bookkeeping (for gc)
    def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Open multipart uploads below ``prefix``: ``(key, upload id, initiated
        seconds since the epoch)``."""
        b, k = _split(prefix)
        ident = self._endpoint(b)
        if ident in self._no_list_uploads:
            return []
        out: list[tuple[str, str, float]] = []
        kw: dict[str, Any] = {"Bucket": b, "Prefix": k}
        while True:
            try:
                r = self._call("list uploads", prefix, partial(self.client.list_multipart_uploads, **kw))
            except StorageError as e:
                if e.__cause__ is None or not permanent(e.__cause__):
                    raise
                with self._lock:
                    self._no_list_uploads.add(ident)
                self._note_no_list_uploads(ident)
                return []
            for u in r.get("Uploads", ()):
                out.append((f"{b}/{u['Key']}", u["UploadId"], u["Initiated"].timestamp()))
            if not r.get("IsTruncated"):
                return out
            kw = {**kw, "KeyMarker": r["NextKeyMarker"], "UploadIdMarker": r["NextUploadIdMarker"]}

    def _note_no_list_uploads(self, ident: tuple[str, str]) -> None:
        note = (f"the store at {ident[0] or 'AWS'} does not list multipart uploads (ListMultipartUploads "
                "answered NotImplemented): open uploads of abandoned attempts in bucket "
                f"{ident[1]} cannot be found or aborted here (a lifecycle rule "
                "AbortIncompleteMultipartUpload on the bucket removes them)")
        with self._lock:
            if note not in self.notes:
                self.notes.append(note)

    def abort_upload(self, path: str, upload_id: str) -> None:
        b, k = _split(path)
        try:
            self._call("abort multipart upload", path, lambda: self.client.abort_multipart_upload(
                Bucket=b, Key=k, UploadId=upload_id))
        except FileNotFoundError:
            pass
        except StorageError as e:  # a store without AbortMultipartUpload (s3rver): the object
            if e.__cause__ is None or not permanent(e.__cause__):  # never appears; its parts stay
                raise
            note = (f"the store at {self._endpoint(b)[0] or 'AWS'} does not abort multipart uploads "
                    f"({_status(e.__cause__)[1]}): the parts of an aborted upload stay on the store "
                    "until a lifecycle rule (AbortIncompleteMultipartUpload) removes them")
            with self._lock:
                if note not in self.notes:
                    self.notes.append(note)

    # -- reading
    def _get_range(self, path: str, offset: int, buf: memoryview) -> None:
        b, k = _split(path)
        n = len(buf)

        def get() -> int:
            r = self.client.get_object(Bucket=b, Key=k, Range=f"bytes={offset}-{offset + n - 1}")
            body = r["Body"]
            got = 0
            try:
                while got < n:
                    chunk = body.read(min(n - got, 1 << 20))
                    if not chunk:
                        break
                    buf[got:got + len(chunk)] = chunk
                    got += len(chunk)
            finally:
                body.close()
            return got

        got = self._call("get", path, get)
        if got < n:
            raise IntegrityError(f"s3://{path}: object is shorter than declared: wanted bytes "
                                 f"[{offset}, {offset + n}), got {got}")
        self._count_read(n)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        buf = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        n = len(buf)
        if n == 0:
            self.size(path)  # a missing object is still FileNotFoundError
            return
        rb = self.config.range_bytes
        if n <= rb:
            self._get_range(path, offset, buf)
            return
        futs = [self._get_pool.submit(self._get_range, path, offset + a, buf[a:a + rb])
                for a in range(0, n, rb)]
        for f in futs:
            f.result()

    def _get_all(self, path: str) -> bytes:
        b, k = _split(path)

        def get() -> bytes:
            r = self.client.get_object(Bucket=b, Key=k)
            return bytes(r["Body"].read())

        data = self._call("get", path, get)
        self._count_read(len(data))
        return data

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset == 0 and length is None:
            return self._get_all(path)
        return super().read_bytes(path, offset, length)

    def _head(self, path: str) -> dict[str, Any]:
        b, k = _split(path)
        if not k:
            raise FileNotFoundError(path)
        return self._call("head", path, lambda: self.client.head_object(Bucket=b, Key=k))

    def size(self, path: str) -> int:
        return int(self._head(path)["ContentLength"])

    def exists(self, path: str) -> bool:
        try:
            self._head(path)
            return True
        except FileNotFoundError:
            pass
        b, k = _split(path)
        r = self._call("list", path, lambda: self.client.list_objects_v2(
            Bucket=b, Prefix=k.rstrip("/") + "/" if k else "", MaxKeys=1))
        return bool(r.get("KeyCount") or r.get("Contents"))

    def list_dir(self, path: str) -> list[str]:
        """Direct children of the prefix ``path/`` (objects and sub-prefixes).

        Raises:
            FileNotFoundError: nothing below ``path`` (an empty prefix).
            NotADirectoryError: ``path`` is an object with nothing below it.
            StorageError: the LIST failed after retries (never "empty").
        """
        b, k = _split(path)
        pre = k.rstrip("/") + "/" if k else ""
        names: set[str] = set()
        kw: dict[str, Any] = {"Bucket": b, "Prefix": pre, "Delimiter": "/"}
        while True:
            r = self._call("list", path, partial(self.client.list_objects_v2, **kw))
            names.update(o["Key"][len(pre):] for o in r.get("Contents", ()))
            names.update(p["Prefix"][len(pre):].rstrip("/") for p in r.get("CommonPrefixes", ()))
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                break
            kw = {**kw, "ContinuationToken": token}
        names.discard("")
        if not names:
            if k and self._is_object(path):
                raise NotADirectoryError(path)
            raise FileNotFoundError(f"s3://{path}: no objects below this prefix")
        return sorted(names)

    def _is_object(self, path: str) -> bool:
        try:
            self._head(path)
            return True
        except FileNotFoundError:
            return False

    def modified_time(self, path: str) -> float | None:
        try:
            return float(self._head(path)["LastModified"].timestamp())
        except (FileNotFoundError, StorageError):
            pass
        try:
            keys = self._keys(path.rstrip("/") + "/")
        except StorageError:
            return None
        times = [t for t in (self._mtime_of(x) for x in keys[:20]) if t is not None]
        return max(times) if times else None

    def _mtime_of(self, key: str) -> float | None:
        try:
            return float(self._head(key)["LastModified"].timestamp())
        except (FileNotFoundError, StorageError):
            return None


def _open(rest: str) -> tuple[Storage, str]:
    """``s3://bucket/prefix``: key ``bucket/prefix``.

    Raises:
        ValueError: no bucket."""
    key = rest.strip("/")
    if not key:
        raise ValueError(f"{'s3://' + rest!r}: an s3:// URL needs a bucket")
    return S3Storage(), key


SCHEME = register_scheme(Scheme(name="s3", open=_open, test_store="reshard.testing.s3server:S3TestStore",
                                fault_kit="reshard.faults.matrix_s3"))
