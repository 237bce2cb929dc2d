"""Session-wide fixtures: the gloo ``WorkerPool`` and hypothesis profiles."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
