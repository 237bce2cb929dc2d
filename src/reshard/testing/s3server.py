"""Real S3 endpoints for tests and benchmarks: moto's server on loopback, and
s3rver (npm), a second S3 implementation (:class:`S3rverServer`).

``S3Server()`` starts ``python -m moto.server`` on a free port of 127.0.0.1
(a subprocess: real HTTP, real request parsing), waits until it answers,
creates buckets on request, and gives the standard AWS variables that point
a client at it (:meth:`S3Server.env`). Needs ``moto[server]`` (dev set).

``S3_UPLOAD_PART_MIN_SIZE`` is passed to the server so that tests can use
multipart uploads of small parts (S3 itself requires 5 MiB).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from types import TracebackType
from typing import Self


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _LocalS3:
    """A real S3 server in a subprocess on ``127.0.0.1:<free port>``; the
    subclasses say how to start it (:meth:`_command`), how to tell that it
    answers (:meth:`_answers`) and its credentials (:attr:`KEY`)."""

    KEY = "testing"
    NAME = "S3 server"
    port: int
    url: str
    _proc: subprocess.Popen[bytes]

    def _start(self, cmd: list[str], env: dict[str, str], start_timeout_s: float) -> None:
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._proc.poll() is not None:
                self._cleanup()
                raise RuntimeError(f"{self.NAME} exited with {self._proc.returncode}")
            try:
                self._answers()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"{self.NAME} did not answer on {self.url}") from None
                time.sleep(0.1)

    def _answers(self) -> None:
        """Raises OSError until the server accepts requests."""
        raise NotImplementedError

    def _cleanup(self) -> None:
        """Removes what the server kept on disk (nothing by default)."""

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables pointing at this server (or at
        ``endpoint``, e.g. a fault-injecting proxy in front of it)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.url, "AWS_ACCESS_KEY_ID": self.KEY,
                "AWS_SECRET_ACCESS_KEY": self.KEY, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> object:
        """A boto3 client talking to the server directly (bucket setup, checks)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=self.KEY,
                            aws_secret_access_key=self.KEY, region_name="us-east-1")

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after 10 s) and removes its data."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class S3Server(_LocalS3):
    """moto's S3 server on ``127.0.0.1:<free port>``.

    Args:
        min_part_bytes: smallest non-last multipart part the server accepts.
        start_timeout_s: seconds to wait for the server to answer.

    Raises:
        RuntimeError: the server exited or did not answer within ``start_timeout_s``.
    """

    NAME = "moto server"

    def __init__(self, *, min_part_bytes: int = 64 << 10, start_timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(min_part_bytes),
               "MOTO_PORT": str(self.port)}
        self._start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                    env, start_timeout_s)

    def _answers(self) -> None:
        urllib.request.urlopen(self.url + "/moto-api/", timeout=2).read()


#: s3rver's version the dev setup installs (``make setup``: ``npm install --prefix .venv/s3rver``)
S3RVER_VERSION = "3.7.1"


def find_s3rver() -> tuple[str, str] | None:
    """``(node, s3rver's bin script)``, or None where node or s3rver is not
    installed: ``$RESHARD_S3RVER``, else ``<venv>/s3rver/node_modules/.bin/s3rver``
    (``make setup`` puts it there), else ``s3rver`` on the PATH."""
    node = shutil.which("node")
    if node is None:
        return None
    cands = [os.environ.get("RESHARD_S3RVER", ""),
             os.path.join(sys.prefix, "s3rver", "node_modules", ".bin", "s3rver"),
             shutil.which("s3rver") or ""]
    for c in cands:
        if c and os.path.isfile(c):
            return node, os.path.realpath(c)
    return None


class S3rverServer(_LocalS3):
    """s3rver on ``127.0.0.1:<free port>``, data in a temporary directory: a
    second S3 implementation beside moto. It ignores ``If-None-Match`` and
    ``If-Match`` on PutObject (answers 200 and overwrites) and answers
    ListMultipartUploads with 501 NotImplemented, which is what the tests
    against it are about. ``NODE_OPTIONS=--openssl-legacy-provider`` is set
    (Node 17+ refuses the cipher s3rver's listing continuation tokens use).

    Same interface as :class:`S3Server` (``url``, ``env()``, ``client()``,
    ``create_bucket()``, ``close()``).

    Raises:
        RuntimeError: node or s3rver is not installed (:func:`find_s3rver`),
            or the server did not answer.
    """

    KEY = "S3RVER"  # s3rver's built-in credentials
    NAME = "s3rver"

    def __init__(self, *, start_timeout_s: float = 60.0):
        found = find_s3rver()
        if found is None:
            raise RuntimeError("s3rver is not installed (npm install --prefix <venv>/s3rver "
                               f"s3rver@{S3RVER_VERSION}, or set RESHARD_S3RVER)")
        node, script = found
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="s3rver-")
        env = {**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"}
        self._start([node, script, "-d", self._dir, "-a", "127.0.0.1", "-p", str(self.port),
                     "--silent", "--allow-mismatched-signatures", "--no-vhost-buckets"],
                    env, start_timeout_s)

    def _answers(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2):
            pass

    def _cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


class S3TestStore:
    """A bucket of its own on a throw-away S3 endpoint, for tests and
    benchmarks (the ``s3`` scheme's test store:
    :func:`reshard.storage.start_test_store`): moto's server on 127.0.0.1
    started for it (``endpoint=None``), or the ``endpoint`` given
    (credentials from the standard AWS variables, default ``testing``). The
    AWS variables are set in this process (processes started afterwards,
    e.g. ranks, inherit them) and put back by :meth:`close`, which also
    deletes the bucket's objects, and the bucket where this store created it.

    Attributes:
        endpoint: the endpoint's URL. bucket: the bucket's name.
        server: the moto server started for it, or None.

    Raises:
        RuntimeError: moto's server did not start (``moto[server]`` missing),
            or the endpoint did not answer / refused to create the bucket
            (the message names the URL and bucket).
    """

    def __init__(self, *, scratch: str | None = None, endpoint: str | None = None,
                 bucket: str | None = None, min_part_bytes: int = 5 << 20):
        import uuid

        self.server: S3Server | None = None
        self.created = False  # this store created the bucket: close() deletes it
        self.bucket = bucket or f"reshard-test-{uuid.uuid4().hex[:8]}"
        self._old = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                                    "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        if endpoint is None:
            self.server = S3Server(min_part_bytes=min_part_bytes)
            self._env = self.server.env()
            self.endpoint = self.server.url
        else:
            self._env = {"AWS_ENDPOINT_URL": endpoint,
                         "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
                         "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
                         "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}
            self.endpoint = endpoint
        self.description = (f"S3 ({endpoint})" if endpoint is not None
                            else "S3 (moto server on 127.0.0.1, started for this run)")
        os.environ.update(self._env)
        from ..storage.s3_client import _client

        c = _client()
        try:
            c.head_bucket(Bucket=self.bucket)
        except Exception:  # noqa: BLE001 - absent: created
            try:
                c.create_bucket(Bucket=self.bucket)
            except Exception as e:  # noqa: BLE001 - unreachable, refused: named
                self.close()
                raise RuntimeError(f"S3 endpoint {self.endpoint}: cannot create the bucket {self.bucket!r}: "
                                   f"{' '.join(str(e).split())}") from None
            self.created = True

    def url(self, name: str) -> str:
        from ..storage.registry import get_scheme

        return get_scheme("s3").url(f"{self.bucket}/{name}")

    prefix = url

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def close(self) -> None:
        from ..storage import resolve

        try:
            st, key = resolve(self.url(""))
            st.delete_tree(key)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        if self.created:  # its own bucket: not left behind on the user's endpoint
            from ..storage.s3_client import _client

            try:
                c = _client()
                for u in c.list_multipart_uploads(Bucket=self.bucket).get("Uploads", ()):
                    c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                while True:  # whatever is left in it
                    keys = [{"Key": o["Key"]} for o in
                            c.list_objects_v2(Bucket=self.bucket).get("Contents", ())]
                    if not keys:
                        break
                    c.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
                c.delete_bucket(Bucket=self.bucket)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            self.created = False
        if self.server is not None:
            self.server.close()
            self.server = None
        for k, v in self._old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._old = {}
