"""Session-wide fixtures: the gloo ``WorkerPool`` and hypothesis profiles.

``tests/`` mirrors ``src/reshard/``: ``tests/saving/`` tests ``reshard.saving`` and so
on; tests of the top-level modules, of the facade and of the documents stay here. A rank
helper (``_*_fns.py``) sits beside the tests that use it; one used from several folders
sits in ``tests/support/`` (on pytest's ``pythonpath``). Basenames are unique over the
tree (pytest imports each test file by its basename, and the pool's workers import rank
functions by module name). ``tools/mirror_tests.py`` keeps the layout; run it after
merging a branch that adds tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from reshard.testing.pool import WorkerPool

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=50,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    """Persistent gloo workers per world size; ``pool.run(n, fn, *args)`` -> per-rank results."""
    p = WorkerPool(grace=5.0)
    try:
        yield p
    finally:
        p.close()


class S3Endpoint:
    """A session S3 endpoint: a real server on loopback (moto's by default,
    ``kind="s3rver"`` for the npm one) behind its own fault proxy; ``env``
    holds the standard AWS variables pointing at the proxy."""

    def __init__(self, kind: str = "moto") -> None:
        from reshard.testing.s3proxy import FaultProxy
        from reshard.testing.s3server import S3rverServer, S3Server

        self.server = S3Server(min_part_bytes=64 << 10) if kind == "moto" else S3rverServer()
        self.proxy = FaultProxy(self.server.url)
        self.bucket = "reshard-test" if kind == "moto" else "reshard-s3rver"
        self.server.create_bucket(self.bucket)
        self.env = {**self.server.env(self.proxy.url), "RESHARD_S3_PART_BYTES": str(256 << 10),
                    "RESHARD_S3_RANGE_BYTES": str(256 << 10), "RESHARD_S3_DEADLINE_S": "4"}
        self._n = 0

    def url(self, name: str) -> str:
        """A fresh ``s3://bucket/<name>-<n>`` prefix."""
        self._n += 1
        return f"s3://{self.bucket}/{name}-{self._n}"

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    """moto + fault proxy for the session; the AWS variables point at the proxy."""
    ep = S3Endpoint()
    old = {k: os.environ.get(k) for k in ep.env}
    os.environ.update(ep.env)
    try:
        yield ep
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        ep.close()


@pytest.fixture
def s3e(s3: S3Endpoint) -> Iterator[S3Endpoint]:
    """The session endpoint with no faults and fresh counters, cleared after the test."""
    s3.proxy.clear()
    s3.proxy.reset_stats()
    try:
        yield s3
    finally:
        s3.proxy.clear()


@pytest.fixture(scope="session")
def s3rver_session() -> Iterator[S3Endpoint]:
    """s3rver (npm), a second S3 implementation, for the session; skipped where node or s3rver is not installed."""
    from reshard.testing.s3server import S3RVER_VERSION, find_s3rver

    if find_s3rver() is None:
        pytest.skip(f"s3rver not installed (node and `npm install --prefix <venv>/s3rver "
                    f"s3rver@{S3RVER_VERSION}`; `make setup` does it)")
    ep = S3Endpoint("s3rver")
    try:
        yield ep
    finally:
        ep.close()


@pytest.fixture
def s3r(s3rver_session: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    """The s3rver endpoint for one test: its AWS variables set, no faults."""
    for k, v in s3rver_session.env.items():
        monkeypatch.setenv(k, v)
    s3rver_session.proxy.clear()
    s3rver_session.proxy.reset_stats()
    try:
        yield s3rver_session
    finally:
        s3rver_session.proxy.clear()


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount_tmpfs(size)``: a real tmpfs of ``size`` (mount's syntax, e.g.
    ``"4m"``) at ``tmp_path/disk`` (:func:`reshard.faults.jobs.mount_tmpfs`;
    the test is skipped where mount is refused), unmounted after the test."""
    from reshard.faults.jobs import mount_tmpfs as mount
    from reshard.faults.jobs import umount

    mounted: list[str] = []

    def make(size: str) -> Path:
        disk = str(tmp_path / "disk")
        why = mount(disk, size)
        if why is not None:
            pytest.skip(f"cannot mount a tmpfs here: {why}")
        mounted.append(disk)
        return Path(disk)

    try:
        yield make
    finally:
        for disk in mounted:
            umount(disk)
