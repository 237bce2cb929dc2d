"""The S3 side of ``reshard bench io``: the endpoint and its limits.

* :class:`Endpoint`: moto's S3 server on 127.0.0.1 started for the run
  (:class:`reshard.testing.s3server.S3Server`), or an endpoint given with
  ``--s3-endpoint`` (credentials from the standard AWS variables, default
  ``testing``); a bucket of its own, deleted again by :meth:`Endpoint.close`
  when this run created it; the AWS variables set in this process before
  the ranks start (they inherit them).
* The limits of the endpoint (no peer: DCP, ``torch.save`` and safetensors
  have no S3 writer): ``limit-write`` is a raw boto3 upload of the bytes
  reshard makes a rank write, as one object (multipart, ``part_bytes``
  parts, ``workers`` in flight; one PUT below one part); ``limit-read`` is
  raw boto3 ranged GETs (``range_bytes`` each, ``workers`` in flight) of the
  checkpoint's own data objects into preallocated memory. Both use the
  backend's client (:func:`reshard.storage.s3._client`) and its part / range
  sizes, so the ratio is reshard's overhead over the same HTTP requests.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..testing.s3server import S3TestStore


class Endpoint(S3TestStore):
    """The run's S3 endpoint and bucket (see the module doc): the ``s3``
    backend's test store (:class:`reshard.testing.s3server.S3TestStore`),
    named ``reshard-bench-...``.

    Raises:
        RuntimeError: moto's server did not start (``moto[server]`` missing),
            or the endpoint did not answer / refused to create the bucket
            (the message names the URL and bucket).
    """

    def __init__(self, url: str | None = None, bucket: str | None = None):
        super().__init__(endpoint=url, bucket=bucket or f"reshard-bench-{uuid.uuid4().hex[:8]}")


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key.strip("/")


def objects(url: str) -> list[tuple[str, int]]:
    """``(key, size)`` of every object under the ``s3://`` prefix ``url``."""
    from ..storage.s3_client import _client

    c = _client()
    bucket, key = _split(url)
    out: list[tuple[str, int]] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": key + "/"}
    while True:
        r = c.list_objects_v2(**kw)
        out.extend((o["Key"], int(o["Size"])) for o in r.get("Contents", ()))
        if not r.get("IsTruncated"):
            return out
        kw["ContinuationToken"] = r["NextContinuationToken"]


def put_limit(url: str, views: list[memoryview], nbytes: int) -> int:
    """Upload ``nbytes`` of ``views`` (wrapping around them, as the local
    limit does) as the object ``url`` with raw boto3 calls; the bytes uploaded."""
    from ..storage.s3_client import S3Config, _client

    cfg = S3Config.from_env()
    c = _client()
    bucket, key = _split(url)
    parts: list[bytes] = []
    cur: list[memoryview] = []
    have = done = 0
    from .limits import _cycle

    for mv in _cycle(views, nbytes):
        while mv:
            take = mv[:cfg.part_bytes - have]
            cur.append(take)
            have += len(take)
            done += len(take)
            mv = mv[len(take):]
            if have == cfg.part_bytes:
                parts.append(b"".join(cur))
                cur, have = [], 0
    if cur:
        parts.append(b"".join(cur))
    if len(parts) <= 1:
        c.put_object(Bucket=bucket, Key=key, Body=parts[0] if parts else b"")
        return done
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def one(i: int) -> dict[str, Any]:
        r = c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=parts[i])
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(min(cfg.inflight_parts * 2, cfg.max_workers)) as ex:
        done_parts = list(ex.map(one, range(len(parts))))
    c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up,
                                MultipartUpload={"Parts": done_parts})
    return done


def get_limit(url: str, buf: memoryview) -> None:
    """Fill ``buf`` with ranged GETs of the data objects under ``url`` (its
    ``.json`` objects left out), one after another, wrapping around them."""
    from ..storage.s3_client import S3Config, _client

    cfg = S3Config.from_env()
    c = _client()
    bucket, _ = _split(url)
    objs = [(k, n) for k, n in sorted(objects(url)) if not k.endswith(".json") and n]
    jobs: list[tuple[str, int, int, int]] = []  # key, object offset, length, buffer offset
    pos, i = 0, 0
    while pos < len(buf) and objs:
        k, n = objs[i % len(objs)]
        off = 0
        while off < n and pos < len(buf):
            ln = min(cfg.range_bytes, n - off, len(buf) - pos)
            jobs.append((k, off, ln, pos))
            off += ln
            pos += ln
        i += 1

    def one(j: tuple[str, int, int, int]) -> None:
        k, off, ln, at = j
        body = c.get_object(Bucket=bucket, Key=k, Range=f"bytes={off}-{off + ln - 1}")["Body"]
        got = 0
        try:
            while got < ln:
                chunk = body.read(min(ln - got, 1 << 20))
                if not chunk:
                    raise OSError(f"s3://{bucket}/{k}: short ranged GET at {off + got}")
                buf[at + got:at + got + len(chunk)] = chunk
                got += len(chunk)
        finally:
            body.close()

    with ThreadPoolExecutor(cfg.max_workers) as ex:
        list(ex.map(one, jobs))
