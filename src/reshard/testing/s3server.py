"""A real S3 endpoint for tests and benchmarks: moto's server on loopback.

``S3Server()`` starts ``python -m moto.server`` on a free port of 127.0.0.1
(a subprocess: real HTTP, real request parsing), waits until it answers,
creates buckets on request, and gives the standard AWS variables that point
a client at it (:meth:`S3Server.env`). Needs ``moto[server]`` (dev set).

``S3_UPLOAD_PART_MIN_SIZE`` is passed to the server so that tests can use
multipart uploads of small parts (S3 itself requires 5 MiB).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from types import TracebackType


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server on ``127.0.0.1:<free port>``.

    Args:
        min_part_bytes: smallest non-last multipart part the server accepts.
        start_timeout_s: seconds to wait for the server to answer.
    """

    def __init__(self, *, min_part_bytes: int = 64 << 10, start_timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(min_part_bytes),
               "MOTO_PORT": str(self.port)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"moto server did not answer on {self.url}") from None
                time.sleep(0.1)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables pointing at this server (or at
        ``endpoint``, e.g. a fault-injecting proxy in front of it)."""
        return {"AWS_ENDPOINT_URL": endpoint or self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> object:
        """A boto3 client talking to the server directly (bucket setup, checks)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
