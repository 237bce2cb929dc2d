"""RNG timing, stated (issue 27 point 6): RNG streams saved mid-epoch must be
restored after the resumed run's DataLoader iterator exists; restored before
``iter(loader)`` (which draws the loader's base seed from the global torch
generator) every later draw is one step off the uninterrupted run. Shown on 2
gloo ranks, each with its own streams; ``RNGState.loaded`` restores them again
after a ``reshard.load``."""

from __future__ import annotations

from pathlib import Path

import reshard
from _rng_timing_fns import r_restore_timing
from reshard.testing.pool import WorkerPool


def test_restore_after_the_iterator_exists(pool: WorkerPool, tmp_path: Path) -> None:
    for got in pool.run(2, r_restore_timing, str(tmp_path / "rng"), timeout=60):
        assert got == {"restore, then iter": False,  # one draw off: other dropout masks
                       "iter, then restore": True,
                       "load, iter, restore again": True}, got


def test_the_rule_is_stated() -> None:
    doc = " ".join((reshard.RNGState.__doc__ or "").split())
    assert "restore it after the resumed run has created its iterator" in doc
    assert "``iter(DataLoader)`` draws from the global torch generator" in doc
    guide = " ".join((Path(__file__).parents[2] / "docs" / "user-guide.md").read_text().split())
    assert "## When to restore RNG" in guide and "rng.restore(rng.loaded)" in guide
