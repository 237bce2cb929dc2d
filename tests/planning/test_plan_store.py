"""plan.bin keeps only what a restart needs (the items written and the replica
groups), and the plan cache rebuilt from it gives the same manifest."""

from __future__ import annotations

from reshard.bench import scale_sim
from reshard.bench.scale_layout import Layout


def test_slim_plan_file_rebuilds_the_same_manifest_and_is_smaller_than_it() -> None:
    lay = Layout(tp=2, pp=2, dp=4)  # 16 simulated ranks, DP replicas and ZeRO flat ranges
    row = scale_sim.simulate_one("llama-8b", lay, scale_sim.default_target(lay))
    # the cached save after a simulated restart (every rank's cache rebuilt from
    # plan.bin) published the manifest of the first, planned save
    assert row["restart_manifest_equal"] is True
    assert row["plan_file_bytes"] < row["manifest_bytes"], row
    assert row["plan_file_vs_manifest"] < 1
