"""Property tests of the pure retention decision ``reshard.retention.decide``.

A random history of saves (increasing steps; some fail and never commit; each
committed one is first in flight, then verified or not), metrics and leases is
replayed; after every event ``decide`` runs and what it says is deleted."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given
from hypothesis import strategies as st

from reshard.retention import Candidate, Decision, Policy, decide

policies = st.builds(
    Policy,
    keep_last=st.sampled_from([None, 0, 1, 1, 2, 3]),
    keep_every=st.sampled_from([None, None, None, 1, 2, 3, 5]),
    keep_best=st.sampled_from([0, 0, 1, 2]),
    mode=st.sampled_from(["min", "max"]),
)

metrics = st.none() | st.floats(-10, 10, allow_nan=False) | st.sampled_from([0.0, 1.0])

ok = st.sampled_from([True, True, False])
save = st.tuples(st.just("save"), st.integers(1, 4), ok, ok, metrics)
lease = st.tuples(st.just("lease"), st.integers(0, 50))
release = st.tuples(st.just("release"), st.integers(0, 50))
events = st.lists(st.one_of(save, save, lease, release), max_size=30)


def _better(a: float, b: float, mode: str) -> bool:
    return a < b if mode == "min" else a > b


def _check(cands: list[Candidate], d: Decision, policy: Policy) -> None:
    names = {c.name for c in cands}
    deleted = set(d.delete)
    assert set(d.keep) | deleted == names and not set(d.keep) & deleted
    assert len(d.delete) == len(deleted)
    by_step = sorted(cands, key=lambda c: c.step)
    verified = [c for c in by_step if c.verified]
    # the newest verified checkpoint is kept
    if verified:
        assert verified[-1].name not in deleted
    for c in by_step:
        if c.name not in deleted:
            continue
        # never a protected one (leased, in flight)
        assert not c.protected, f"{c.name} is protected but deleted"
        # only when a newer verified one exists and stays
        assert any(v.step > c.step and v.name not in deleted for v in verified), (
            f"{c.name} deleted without a newer verified checkpoint")
        # keep_every
        if policy.keep_every:
            assert c.step % policy.keep_every != 0
        # keep_best: at least keep_best kept ones are at least as good
        if policy.keep_best and c.metric is not None:
            as_good = [k for k in cands if k.name not in deleted and k.metric is not None
                       and not _better(c.metric, k.metric, policy.mode)]
            assert len(as_good) >= policy.keep_best
    # keep_last newest are kept (keep_last None: keep everything)
    if policy.keep_last is None:
        assert not deleted
    elif policy.keep_last > 0:
        assert not {c.name for c in by_step[-policy.keep_last:]} & deleted


@given(policy=policies, history=events)
@example(policy=Policy(keep_last=1),  # a lease on an old verified checkpoint
         history=[("save", 1, True, True, None), ("lease", 0), ("save", 1, True, True, None),
                  ("save", 1, True, True, None), ("release", 0), ("save", 1, True, True, None)])
@example(policy=Policy(keep_last=0),  # newer saves that fail or are not verified
         history=[("save", 1, True, True, 1.0), ("save", 2, False, True, None),
                  ("save", 1, True, False, 0.5), ("save", 1, True, True, None)])
def test_decide_over_random_histories(policy: Policy, history: list[tuple]) -> None:
    existing: dict[str, Candidate] = {}
    leases: set[str] = set()
    step = 0
    newest_verified_ever: int | None = None

    def apply(inflight: str | None = None) -> None:
        cands = [replace(c, protected=c.name in leases or c.name == inflight)
                 for c in existing.values()]
        d = decide(cands, policy)
        _check(cands, d, policy)
        for name in d.delete:
            del existing[name]
        if newest_verified_ever is not None:
            assert f"s{newest_verified_ever}" in existing, "the newest verified checkpoint is gone"

    for ev in history:
        if ev[0] == "save":
            _, gap, committed, ok, metric = ev
            step += gap
            if committed:
                name = f"s{step}"
                # committed, in flight (not yet smoke-tested): protected, unverified
                existing[name] = Candidate(name=name, step=step, verified=False, metric=metric)
                apply(inflight=name)
                existing[name] = replace(existing[name], verified=ok)
                if ok:
                    newest_verified_ever = step
            apply()  # a failed save commits nothing; retention runs all the same
        elif existing:
            name = sorted(existing)[ev[1] % len(existing)]
            if ev[0] == "lease":
                leases.add(name)
            else:
                leases.discard(name)
            apply()
    assert all(n in existing for n in leases)  # no leased checkpoint was deleted


def test_unverified_newer_never_frees_older() -> None:
    cands = [Candidate(name=f"s{i}", step=i, verified=i <= 2) for i in range(1, 6)]
    d = decide(cands, Policy(keep_last=1))
    assert d.delete == ("s1",)
    assert d.keep["s2"] == "newest verified"
    assert {"s3", "s4", "s5"} <= set(d.keep)


def test_policy_example() -> None:
    metric = {s: abs(s - 3) + 0.5 for s in range(1, 10)}
    cands = [Candidate(name=f"s{s}", step=s, verified=True, metric=m) for s, m in metric.items()]
    d = decide(cands, Policy(keep_last=2, keep_every=4, keep_best=1))
    assert sorted(d.keep, key=lambda n: int(n[1:])) == ["s3", "s4", "s8", "s9"]
    assert d.delete == ("s1", "s2", "s5", "s6", "s7")
    leased = [replace(c, protected=c.name == "s1") for c in cands]
    assert "s1" in decide(leased, Policy(keep_last=2, keep_every=4, keep_best=1)).keep
    assert decide([], Policy(keep_last=0)).delete == ()
