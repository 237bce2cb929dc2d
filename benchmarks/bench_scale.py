"""Scale simulator: save planning, cached re-save, manifest and load planning over N simulated ranks.

Not a test. Usage (the same options as ``reshard bench scale``)::

    python benchmarks/bench_scale.py --tp 8 --pp 16 --dp 128 --model llama-405b \\
        --reshard-to tp4,pp8,dp512 --json out.json --plot out.png

The real coordinator and rank code of :mod:`reshard.planning.coordination` and
:mod:`reshard.planning.coordination_load` runs in one process over N simulated ranks
(:mod:`reshard.bench.scale_sim`), for world sizes from 8 up to TP*PP*DP.

``--old-protocol`` instead measures what the all-gather protocol (before the
coordinator protocol) cost every rank at 256, 1,024 and 4,096 ranks: every
rank's ``LocalPlan`` as JSON gathered into every rank, decoded, and
``plan_save`` run over all of them on every rank (``plan_save`` is today's,
faster than the old one: the figures measured on the old code are in the
README).
"""

from __future__ import annotations

import sys
import time


def old_protocol(zero_split: str) -> None:
    import msgspec

    from reshard.bench.scale_layout import Layout, rank_plan
    from reshard.errors import outcome
    from reshard.planning.planner import LocalPlan, plan_save

    for tp, pp, dp in [(8, 4, 8), (8, 8, 16), (8, 16, 32)]:
        lay = Layout(tp=tp, pp=pp, dp=dp)
        blobs = [msgspec.json.encode(outcome(r, None, attempt="x", value_digests={}, plan=msgspec.to_builtins(
            rank_plan("llama-405b", lay, r, zero_split=zero_split)))) for r in range(lay.world)]
        t0 = time.perf_counter()
        plans = [msgspec.convert(msgspec.json.decode(b)["plan"], LocalPlan) for b in blobs]
        t1 = time.perf_counter()
        plan_save(plans)
        t2 = time.perf_counter()
        print(f"{lay.world:>6} ranks ({lay}, {zero_split}): {sum(map(len, blobs)) / 1e6:.1f} MB into every "
              f"rank, decode {t1 - t0:.2f} s + plan_save {t2 - t1:.2f} s on every rank", flush=True)


if __name__ == "__main__":
    if "--old-protocol" in sys.argv:
        split = "per-param" if "per-param" in sys.argv else "flat"
        old_protocol(split)
    else:
        from reshard.cli.bench import bench_scale_cmd

        bench_scale_cmd.main(args=sys.argv[1:], prog_name="bench_scale.py")
