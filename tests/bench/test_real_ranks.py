"""The scale simulator checked by real gloo ranks (the CI smoke of
``benchmarks/bench_real_ranks.py``): 8 processes save and load the state the
simulator describes for TP2 x PP2 x DP2 (tiny tensors); the bytes every rank
receives through the real collectives equal the simulator's prediction for
the same layout and path within 10% (no timing is checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.bench import real_ranks
from reshard.testing.pool import WorkerPool


@pytest.mark.timeout(240)
def test_real_ranks_match_the_simulator_at_8(pool: WorkerPool, tmp_path: Path) -> None:
    layout, target = (2, 2, 2), (1, 2, 4)
    rows = pool.run(8, real_ranks.r_measure, str(tmp_path), real_ranks.MICRO, layout, target, timeout=200)
    m = real_ranks.summarise(rows)
    assert m["load_exact"], [r["load"] for r in rows]  # loaded into TP1 x PP2 x DP4, bit for bit
    assert m["cached_all"]  # the second save reused the plan on every rank
    p = real_ranks.predict(real_ranks.MICRO, layout, target, str(tmp_path))
    byts = {c["what"]: c for c in real_ranks.compare(m, p) if "bytes" in c["what"]}
    assert len(byts) == 4
    for what, c in byts.items():
        assert 0.9 <= c["ratio"] <= 1.1, (what, c)
