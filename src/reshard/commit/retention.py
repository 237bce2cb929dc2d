"""Retention decisions: a pure function, tested with hypothesis.

Rules (the seed article's retention section, following the lineage of
:mod:`reshard.commit.lineage`):

* keep the newest ``keep_last`` checkpoints of the current lineage, one every
  ``keep_every`` steps (long-term), and the best ``keep_best`` by a user metric;
* always keep the newest *verified* checkpoint of the current lineage, the
  lineage's newest checkpoint, and the resume source of the current run;
* delete a checkpoint only when a newer checkpoint of the current lineage is
  committed **and** verified (passed the restore smoke test) and kept;
* never delete a checkpoint of another lineage (the branch a rollback left,
  a finished job's checkpoints this run did not resume from): a job's
  retention deletes its own lineage only. Such lineages are collected
  explicitly (``Policy(collect_other_lineages=True)``, ``reshard gc
  --collect-other-lineages``: then one is kept until the current lineage has
  a verified checkpoint of a greater step, and the rules above apply to it;
  ``keep_last`` counts the current lineage only) or adopted by restoring one;
* never delete an in-flight checkpoint, the target of a save, one held by
  a reader lease (a load, export, conversion, tier copy, evaluation: "in use
  by N readers", deleted once released), or one a symbolic link in the root
  points at (an operator's ``best`` alias).

Orders are by (step, commit time), never by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A committed checkpoint as retention sees it.

    Attributes:
        current: on the current lineage (True for all when the root has no HEAD).
        resume_source: the checkpoint the current run resumed from (HEAD).
        created_at: commit time, seconds (orders checkpoints of one step).
    """

    name: str
    step: int
    verified: bool
    metric: float | None = None
    protected: bool = False  # in flight, the current target, or a link's target
    readers: int = 0  # live reader leases on it
    current: bool = True
    resume_source: bool = False
    created_at: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Policy:
    """``keep_last``: newest N of the current lineage kept (None: keep all).
    ``keep_every``: steps that are multiples of M kept. ``keep_best``: best N
    by metric (``mode`` "min" or "max"). ``collect_other_lineages``: also
    delete checkpoints of other lineages once the current lineage passed
    them (default: never; a job's retention deletes its own lineage only)."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int = 0
    mode: str = "min"
    collect_other_lineages: bool = False


@dataclass(frozen=True, kw_only=True)
class Decision:
    keep: dict[str, str]  # name -> reason
    delete: tuple[str, ...]


def _key(c: Candidate) -> tuple[int, float]:
    return (c.step, c.created_at)


def decide(cands: Sequence[Candidate], policy: Policy) -> Decision:
    """Which checkpoints to keep (with a reason) and which to delete."""
    by_step = sorted(cands, key=_key)
    lineage = [c for c in by_step if c.current]
    keep: dict[str, str] = {}
    verified = [c for c in lineage if c.verified]
    newest_verified = verified[-1] if verified else None
    if newest_verified is not None:
        keep[newest_verified.name] = "newest verified"
    if lineage:
        keep.setdefault(lineage[-1].name, "newest of the current lineage")
    for c in by_step:
        if c.resume_source:
            keep.setdefault(c.name, "resume source of the current run")
        if c.readers:
            keep.setdefault(c.name, f"in use by {c.readers} reader{'' if c.readers == 1 else 's'}"
                                    " (deleted once released)")
        if c.protected:
            keep.setdefault(c.name, "in flight, the target of a link in the root, or this run's newest save")
        if c.current and (newest_verified is None or _key(c) >= _key(newest_verified)):
            keep.setdefault(c.name, "no newer verified checkpoint")
        if not c.current and not policy.collect_other_lineages:
            keep.setdefault(c.name, "another lineage: never deleted by this run's retention "
                                    "(collect it with `reshard gc --collect-other-lineages`)")
        if not c.current and (newest_verified is None or c.step >= newest_verified.step):
            keep.setdefault(c.name, "other lineage, not yet passed by a verified checkpoint")
    if policy.keep_last is None:
        for c in by_step:
            keep.setdefault(c.name, "keep all")
    else:
        for c in lineage[max(0, len(lineage) - policy.keep_last):] if policy.keep_last > 0 else []:
            keep.setdefault(c.name, f"last {policy.keep_last}")
    if policy.keep_every:
        for c in by_step:
            if c.step % policy.keep_every == 0:
                keep.setdefault(c.name, f"every {policy.keep_every} steps")
    if policy.keep_best > 0:
        scored = [(c.metric, c) for c in by_step if c.metric is not None]
        scored.sort(key=lambda mc: mc[0] if policy.mode == "min" else -mc[0])
        for _, c in scored[:policy.keep_best]:
            keep.setdefault(c.name, f"best {policy.keep_best} by metric")
    delete = tuple(c.name for c in by_step if c.name not in keep)
    return Decision(keep=keep, delete=delete)
