"""Durations of the in-process coordination simulation (``reshard bench scale``)
come from one clock: the simulated write is left out by a block nested in the
rank's step and measured by the same CPU clock, so no rank's seconds can come
out negative however long the write takes on the wall clock."""

from __future__ import annotations

import time

import pytest

from reshard.bench import scale_sim
from reshard.bench.scale_layout import Layout
from reshard.bench.simulate import SimWorld


def _busy(seconds: float) -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass


def _protocol(rank: int, world: SimWorld, *, counted: float, uncounted: float, sleep: float):
    _busy(counted)
    with world.uncounted():
        _busy(uncounted)
        time.sleep(sleep)  # wall time, no CPU: the old wall-minus-CPU subtraction went negative here
    got = yield ("broadcast_bytes", b"x" if rank == 0 else None)
    assert got == b"x"
    return rank


def test_uncounted_block_is_left_out_by_the_same_clock() -> None:
    w = SimWorld(2)
    res, st = w.run([_protocol(0, w, counted=0.03, uncounted=0.0, sleep=0.05),
                     _protocol(1, w, counted=0.0, uncounted=0.03, sleep=0.05)])
    assert res == [0, 1]
    assert all(0 <= x <= c for x, c in zip(st.excluded_ns, st.cpu_ns, strict=True))
    assert st.seconds[0] >= 0.03  # counted work stays counted
    assert st.excluded_ns[1] >= 30_000_000  # uncounted work is left out ...
    assert 0.0 <= st.seconds[1] < 0.03  # ... and never more than the step's own time


def test_uncounted_outside_a_step_is_refused() -> None:
    with pytest.raises(RuntimeError, match="outside a rank's step"), SimWorld(1).uncounted():
        pass


def test_slow_simulated_write_never_makes_a_rank_time_negative(monkeypatch) -> None:
    """The bench's row for a small world with a write that takes wall time but
    no CPU (as a loaded machine makes it): every duration is >= 0 and the
    write's wall time is in none of them."""
    real = scale_sim._fake_report

    def slow(plan, a):
        time.sleep(0.01)
        return real(plan, a)

    monkeypatch.setattr(scale_sim, "_fake_report", slow)
    lay = Layout(tp=2, pp=2, dp=2)
    row = scale_sim.simulate_one("llama-8b", lay, scale_sim.default_target(lay))
    secs = {k: v for k, v in row.items() if k.endswith("_s")}
    assert "coordinator_s" in secs and "max_rank_s" in secs
    assert all(v >= 0 for v in secs.values()), secs
    # 8 ranks x 3 saves x 10 ms of sleep per write would be >= 0.03 s on one rank alone
    # if the write were counted; ranks other than the coordinator do almost nothing
    assert row["max_rank_s"] < 0.03 + row["coordinator_s"]


def test_bench_scale_measures_the_sealed_manifest(monkeypatch) -> None:
    """The simulated save encodes the manifest as a real publish does (sealed:
    the seal's hash is in ``manifest_encode_s``, its check in
    ``manifest_parse_s``); it encoded it unsealed, so the bench timed a
    manifest no save writes."""
    import json

    from reshard.ondisk.manifest import SEAL_KEY

    seen: list[bytes] = []
    real = scale_sim.decode_manifest

    def recording(raw: bytes, **kw):
        seen.append(raw)
        return real(raw, **kw)

    monkeypatch.setattr(scale_sim, "decode_manifest", recording)
    lay = Layout(tp=2, pp=1, dp=2)
    row = scale_sim.simulate_one("llama-8b", lay, scale_sim.default_target(lay))
    assert seen and row["manifest_bytes"] == len(seen[0])
    doc = json.loads(seen[0])
    assert next(iter(doc)) == SEAL_KEY and len(doc[SEAL_KEY]) == 16
