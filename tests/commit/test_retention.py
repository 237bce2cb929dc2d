"""Property tests of the pure retention decision ``reshard.commit.retention.decide``.

A random history of saves (increasing steps; some fail and never commit; each
committed one is first in flight, then verified or not), metrics, leases and
rollbacks (a resume from an older checkpoint: it becomes the resume source,
later saves continue from it, and what is neither its ancestor nor a later
save is another lineage) is replayed; after every event ``decide`` runs and
what it says is deleted."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given
from hypothesis import strategies as st

from reshard.commit.retention import Candidate, Decision, Policy, decide

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
rollback = st.tuples(st.just("rollback"), st.integers(0, 50))
events = st.lists(st.one_of(save, save, save, lease, release, rollback), max_size=30)


def _better(a: float, b: float, mode: str) -> bool:
    return a < b if mode == "min" else a > b


def _key(c: Candidate) -> tuple[int, float]:
    return (c.step, c.created_at)


def _check(cands: list[Candidate], d: Decision, policy: Policy) -> None:
    names = {c.name for c in cands}
    deleted = set(d.delete)
    assert set(d.keep) | deleted == names and not set(d.keep) & deleted
    assert len(d.delete) == len(deleted)
    by_step = sorted(cands, key=_key)
    lineage = [c for c in by_step if c.current]
    verified = [c for c in lineage if c.verified]
    # the newest verified checkpoint of the current lineage, and its newest, are kept
    if verified:
        assert verified[-1].name not in deleted
    if lineage:
        assert lineage[-1].name not in deleted
    for c in by_step:
        if c.name not in deleted:
            continue
        # never a protected one (leased, in flight), never the resume source
        assert not c.protected, f"{c.name} is protected but deleted"
        assert not c.resume_source, f"{c.name} is the resume source but deleted"
        # only when a newer verified checkpoint of the current lineage exists and stays
        # (for another lineage's checkpoint: one of a greater step)
        assert any((_key(v) > _key(c) if c.current else v.step > c.step) and v.name not in deleted
                   for v in verified), f"{c.name} deleted without a newer verified checkpoint"
        # keep_every
        if policy.keep_every:
            assert c.step % policy.keep_every != 0
        # keep_best: at least keep_best kept ones are at least as good
        if policy.keep_best and c.metric is not None:
            as_good = [k for k in cands if k.name not in deleted and k.metric is not None
                       and not _better(c.metric, k.metric, policy.mode)]
            assert len(as_good) >= policy.keep_best
    # keep_last newest of the current lineage are kept (keep_last None: keep everything)
    if policy.keep_last is None:
        assert not deleted
    elif policy.keep_last > 0:
        assert not {c.name for c in lineage[-policy.keep_last:]} & deleted


@given(policy=policies, history=events)
@example(policy=Policy(keep_last=1),  # a lease on an old verified checkpoint
         history=[("save", 1, True, True, None), ("lease", 0), ("save", 1, True, True, None),
                  ("save", 1, True, True, None), ("release", 0), ("save", 1, True, True, None)])
@example(policy=Policy(keep_last=0),  # newer saves that fail or are not verified
         history=[("save", 1, True, True, 1.0), ("save", 2, False, True, None),
                  ("save", 1, True, False, 0.5), ("save", 1, True, True, None)])
@example(policy=Policy(keep_last=2),  # the rollback: 100, 150; back to 100; 110, ...
         history=[("save", 4, True, True, None), ("save", 4, True, True, None), ("rollback", 0),
                  ("save", 1, True, True, None), ("save", 3, True, True, None),
                  ("save", 2, True, True, None)])
def test_decide_over_random_histories(policy: Policy, history: list[tuple]) -> None:
    existing: dict[str, Candidate] = {}
    parent: dict[str, str | None] = {}
    leases: set[str] = set()
    step = 0
    clock = 0.0
    head: str | None = None  # the resume source (None: no HEAD, one lineage)
    since_head: set[str] = set()  # saved since the last rollback: descendants of HEAD
    last: str | None = None  # the previous save of this run (the next save's parent)

    def current() -> set[str]:
        if head is None:
            return set(existing)
        cur = {n for n in since_head if n in existing}
        n: str | None = head
        while n is not None and n in existing:  # ancestors through the checkpoints that exist
            cur.add(n)
            n = parent.get(n)
        return cur

    def apply(inflight: str | None = None) -> None:
        cur = current()
        cands = [replace(c, protected=c.name in leases or c.name == inflight, current=c.name in cur,
                         resume_source=c.name == head) for c in existing.values()]
        d = decide(cands, policy)
        _check(cands, d, policy)
        for name in d.delete:
            del existing[name]
        if head is not None:
            assert head in existing, "the resume source is gone"

    for i, ev in enumerate(history):
        if ev[0] == "save":
            _, gap, committed, ok, metric = ev
            step += gap
            clock += 1.0
            if committed:
                name = f"c{i}"
                parent[name] = last
                last = name
                if head is not None:
                    since_head.add(name)
                # committed, in flight (not yet smoke-tested): protected, unverified
                existing[name] = Candidate(name=name, step=step, verified=False, metric=metric,
                                           created_at=clock)
                apply(inflight=name)
                existing[name] = replace(existing[name], verified=ok)
            apply()  # a failed save commits nothing; retention runs all the same
        elif existing:
            name = sorted(existing)[ev[1] % len(existing)]
            if ev[0] == "lease":
                leases.add(name)
            elif ev[0] == "release":
                leases.discard(name)
            else:  # resume from `name` (possibly an older one: a rollback)
                head, last, since_head = name, name, set()
                step = existing[name].step
            apply()
    assert all(n in existing for n in leases)  # no leased checkpoint was deleted


def test_rollback_keeps_the_abandoned_branch_until_passed() -> None:
    def c(name: str, step: int, t: float, **kw: object) -> Candidate:
        return Candidate(name=name, step=step, verified=True, created_at=t, **kw)  # type: ignore[arg-type]

    base = [c("s100", 100, 1, resume_source=True), c("s150", 150, 2, current=False)]
    collect = Policy(keep_last=1, collect_other_lineages=True)  # collected explicitly
    d = decide([*base, c("s110", 110, 3)], collect)
    assert d.delete == () and d.keep["s100"] == "resume source of the current run"
    assert d.keep["s150"].startswith("other lineage")
    d = decide([*base, c("s110", 110, 3), c("s150.1", 150, 4)], collect)
    assert d.delete == ("s110",)  # same step as the abandoned one: not yet passed
    d = decide([*base, c("s150.1", 150, 4), c("s160", 160, 5)], collect)
    assert set(d.delete) == {"s150", "s150.1"} and d.keep["s160"] == "newest verified"
    # by default a run's retention deletes its own lineage only: the other branch stays
    d = decide([*base, c("s150.1", 150, 4), c("s160", 160, 5)], Policy(keep_last=1))
    assert d.delete == ("s150.1",) and d.keep["s150"].startswith("another lineage: never deleted")
    # the order is by step then commit time, never by name
    d = decide([c("b", 1, 2), c("a", 1, 1)], Policy(keep_last=1))
    assert d.delete == ("a",)


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
