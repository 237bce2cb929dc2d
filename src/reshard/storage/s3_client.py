"""The boto3 side of the S3 backend (:mod:`reshard.storage.s3`): its tuning (:class:`S3Config`,
from ``RESHARD_S3_*`` variables), one client per endpoint and settings shared by every
store of the process, the thread pools, and which answers are retried (throttling, 5xx,
timeouts, reset connections) or permanent (501 NotImplemented and the like).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_RETRY_CODES = {"BadDigest", "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                "ServiceUnavailable", "RequestTimeTooSkewed", "ConditionalRequestConflict"}


_CLIENTS: dict[tuple[Any, ...], Any] = {}


_CLIENTS_LOCK = threading.Lock()


#: answers that are permanent even though their status is 5xx: never retried
_PERMANENT_CODES = {"NotImplemented", "MethodNotAllowed", "NotSupported"}


_PERMANENT_STATUS = {501, 505}


def permanent(e: BaseException) -> bool:
    """An answer no retry can change: 501 NotImplemented and the like."""
    status, code = _status(e)
    return status in _PERMANENT_STATUS or code in _PERMANENT_CODES


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Tuning of :class:`S3Storage` (defaults from ``RESHARD_S3_*`` variables).

    Attributes:
        part_bytes: multipart part size in bytes (S3 needs >= 5 MiB except the
            last part; ``RESHARD_S3_PART_BYTES``).
        range_bytes: reads larger than this are split into parallel ranged GETs
            of this many bytes (``RESHARD_S3_RANGE_BYTES``).
        max_workers: threads uploading parts / fetching ranges (per storage).
        inflight_parts: parts of one object buffered or in flight at once
            (bounds memory to ``inflight_parts * part_bytes`` per stream).
        deadline_s: seconds after the first try of a request past which it
            is not retried again (``RESHARD_S3_DEADLINE_S``); one try is
            itself bounded by the client's 10 s connect and 60 s read timeouts.
        backoff_s, backoff_cap_s: first and largest backoff, seconds.
    """

    part_bytes: int = 8 << 20
    range_bytes: int = 8 << 20
    max_workers: int = 16
    inflight_parts: int = 4
    deadline_s: float = 60.0
    backoff_s: float = 0.05
    backoff_cap_s: float = 2.0

    @classmethod
    def from_env(cls) -> S3Config:
        return cls(part_bytes=int(_env_float("RESHARD_S3_PART_BYTES", 8 << 20)),
                   range_bytes=int(_env_float("RESHARD_S3_RANGE_BYTES", 8 << 20)),
                   deadline_s=_env_float("RESHARD_S3_DEADLINE_S", 60.0))


def _client() -> Any:
    """One thread-safe boto3 client per (profile, endpoint, region, key id)."""
    import boto3
    from botocore.config import Config

    ident = (os.environ.get("AWS_PROFILE"), os.environ.get("AWS_ENDPOINT_URL"),
             os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_DEFAULT_REGION"),
             os.environ.get("AWS_ACCESS_KEY_ID"))
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(ident)
        if c is None:
            session = boto3.session.Session(profile_name=ident[0])
            style = "path" if (ident[1] or ident[2]) else "auto"
            c = session.client("s3", config=Config(
                retries={"max_attempts": 1, "mode": "standard"}, max_pool_connections=64,
                connect_timeout=10, read_timeout=60, s3={"addressing_style": style},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required"))
            _CLIENTS[ident] = c
        return c


_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    """Process-wide thread pools (part uploads and range GETs never share one,
    so a read never waits behind a write)."""
    with _CLIENTS_LOCK:
        p = _POOLS.get((name, workers))
        if p is None:
            p = _POOLS[(name, workers)] = ThreadPoolExecutor(max_workers=workers,
                                                             thread_name_prefix=name)
        return p


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        raise ValueError(f"s3 path {path!r} names no bucket")
    return bucket, key


def _status(e: BaseException) -> tuple[int, str]:
    resp = getattr(e, "response", None) or {}
    return (int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0),
            str(resp.get("Error", {}).get("Code", "")))


class _BodyMismatch(Exception):
    """A PUT answered 200 with the ETag of other bytes than those sent."""

    def __init__(self, msg: str, etag: str):
        super().__init__(msg)
        self.etag = etag


def _retryable(e: BaseException) -> bool:
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

    if isinstance(e, ClientError):
        if permanent(e):
            return False
        status, code = _status(e)
        return status >= 500 or status == 429 or code in _RETRY_CODES
    # connection refused/reset/closed, timeouts, a body cut short; never a bad parameter
    if isinstance(e, HTTPClientError | IncompleteReadError | ConnectionError | TimeoutError
                  | _BodyMismatch):
        return True
    name = type(e).__name__  # urllib3's ProtocolError / IncompleteRead from a reset stream
    return name in ("ProtocolError", "IncompleteRead", "ReadTimeoutError", "SSLError")
