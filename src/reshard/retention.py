"""Retention decisions: a pure function, tested with hypothesis.

Rules (the seed article's retention section):

* keep the last ``keep_last`` checkpoints, one every ``keep_every`` steps
  (long-term), and the best ``keep_best`` by a user metric;
* always keep the newest *verified* checkpoint;
* delete a checkpoint only when a newer one is committed **and** verified
  (passed the restore smoke test);
* never delete an in-flight checkpoint, the target of a save, or one held by
  a lease (a reader: export, conversion, tier copy, evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A committed checkpoint as retention sees it."""

    name: str
    step: int
    verified: bool
    metric: float | None = None
    protected: bool = False  # leased, in flight, or the current target


@dataclass(frozen=True, kw_only=True)
class Policy:
    """``keep_last``: newest N kept (None: keep all). ``keep_every``: steps that
    are multiples of M kept. ``keep_best``: best N by metric (``mode`` "min" or
    "max")."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int = 0
    mode: str = "min"


@dataclass(frozen=True, kw_only=True)
class Decision:
    keep: dict[str, str]  # name -> reason
    delete: tuple[str, ...]


def decide(cands: Sequence[Candidate], policy: Policy) -> Decision:
    """Which checkpoints to keep (with a reason) and which to delete."""
    by_step = sorted(cands, key=lambda c: c.step)
    keep: dict[str, str] = {}
    verified = [c for c in by_step if c.verified]
    newest_verified = verified[-1] if verified else None
    if newest_verified is not None:
        keep[newest_verified.name] = "newest verified"
    for c in by_step:
        if c.protected:
            keep.setdefault(c.name, "leased or in flight")
        if newest_verified is None or c.step >= newest_verified.step:
            keep.setdefault(c.name, "no newer verified checkpoint")
    if policy.keep_last is None:
        for c in by_step:
            keep.setdefault(c.name, "keep all")
    else:
        for c in by_step[max(0, len(by_step) - policy.keep_last):] if policy.keep_last > 0 else []:
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
