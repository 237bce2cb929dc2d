"""Lineage of the checkpoints under one root: which ones the current run
continues, in what order a resume tries them. Pure (no I/O): it works on the
entries and the ``HEAD`` record that :mod:`reshard.commit.protocol` reads.

* Every manifest records its ``parent`` (the checkpoint its state continues
  from) and, when saved by a :class:`~reshard.manager.manager.CheckpointManager`, its
  ``lineage``: the id of the ``HEAD`` record the saving run resumed from.
* ``CheckpointManager.restore`` writes ``HEAD`` = ``{"name", "attempt_id",
  "step", "id", "time"}``: the checkpoint resumed from, and a fresh id.
* The **current lineage** is the ``HEAD`` checkpoint (the *resume source*),
  its ancestors (parent links followed through the checkpoints that still
  exist) and its descendants *since* ``HEAD`` was written: checkpoints whose
  ``lineage`` is the ``HEAD`` id, or whose parent is a descendant (or the
  source) and that were committed after ``HEAD``, or that record neither a
  parent nor a lineage (a plain :func:`reshard.save` after the resume) and
  were committed after ``HEAD``. A checkpoint committed before a rollback is
  therefore never a descendant, even when its parent is the source (the
  abandoned branch of a rollback).
* Without ``HEAD`` every committed checkpoint is on the current lineage (the
  order is then the step order of :func:`reshard.commit.protocol.committed`).

Orders are by (step, commit time), never by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .listing import Entry, order_key


@dataclass(frozen=True, kw_only=True)
class Head:
    """The ``HEAD`` record: the checkpoint the current lineage resumed from.

    Attributes:
        name: the checkpoint's name under the root (None: a fresh start).
        attempt_id: its manifest's attempt id (so a replaced name is not it).
        step: its step. id: this resume's id (manifests' ``lineage``).
        time: when the resume happened, seconds since the epoch.
        owner: the owner lease (``OWNER``'s ``lease``) of the run that
            resumed, None when unknown (a run that owns no lease, a HEAD from
            before this field): retention keeps the resume source only while
            that run's lease is live (:meth:`RetentionMixin.source_pinned`).
    """

    name: str | None
    id: str
    time: float
    attempt_id: str | None = None
    step: int | None = None
    owner: str | None = None

    @classmethod
    def from_record(cls, rec: dict[str, Any] | None) -> Head | None:
        if not rec or not isinstance(rec.get("id"), str):
            return None
        name = rec.get("name")
        step = rec.get("step")
        aid = rec.get("attempt_id")
        owner = rec.get("owner")
        return cls(name=name if isinstance(name, str) else None, id=rec["id"],
                   time=float(rec.get("time") or 0.0),
                   attempt_id=aid if isinstance(aid, str) else None,
                   step=step if isinstance(step, int) else None,
                   owner=owner if isinstance(owner, str) else None)

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"name": self.name, "attempt_id": self.attempt_id, "step": self.step,
                               "id": self.id, "time": self.time}
        if self.owner is not None:
            rec["owner"] = self.owner
        return rec


@dataclass(frozen=True, kw_only=True)
class Lineage:
    """The current lineage among committed entries.

    Attributes:
        head: the HEAD record (None: no HEAD; every entry is current).
        source: name of the HEAD checkpoint if it is among the entries.
        current: names on the current lineage (source, ancestors, descendants).
        descendants: names of the descendants since HEAD.
    """

    head: Head | None
    source: str | None
    current: frozenset[str]
    descendants: frozenset[str]

    def branch(self, name: str) -> str:
        """"current" or "other" (another lineage: an abandoned branch)."""
        return "current" if name in self.current else "other"


def lineage_of(entries: Sequence[Entry], head: Head | None) -> Lineage:
    """Classify committed ``entries`` against ``head``."""
    names = {e.name for e in entries}
    if head is None:
        return Lineage(head=None, source=None, current=frozenset(names), descendants=frozenset())
    by_name = {e.name: e for e in entries}
    src = by_name.get(head.name) if head.name is not None else None
    if src is not None and head.attempt_id and src.manifest is not None \
            and src.manifest.attempt_id != head.attempt_id:
        src = None  # the name now holds another checkpoint
    memo: dict[str, bool] = {}
    if src is not None:
        memo[src.name] = False  # the source is not its own descendant

    def descends(name: str) -> bool:
        """Walk parent links up from ``name`` (iteratively: chains may be long)
        until an answer is known, then record it for the whole path."""
        path: list[str] = []
        ok = False
        n: str | None = name
        while n is not None and n not in memo and n not in path:
            e = by_name.get(n)
            m = e.manifest if e is not None else None
            if m is None:
                break  # a missing link (deleted): not known to descend
            path.append(n)
            if m.lineage == head.id:
                ok = True
                break
            if m.created_at < head.time:
                break
            if m.parent is None:
                # committed after HEAD by a save that records no lineage (a
                # plain reshard.save of the resumed run): the newest work
                # since the resume, never to be passed over for HEAD's source
                ok = m.lineage is None
                break
            if src is not None and m.parent == src.name:
                ok = True
                break
            n = m.parent
        else:
            ok = memo.get(n, False) if n is not None else False
        for p in path:
            memo[p] = ok
        return memo.get(name, ok)

    desc = {n for n in names if descends(n)}
    current = set(desc)
    seen = 0
    e = src
    while e is not None and e.manifest is not None and e.name not in current and seen <= len(names):
        current.add(e.name)
        seen += 1
        p = e.manifest.parent
        e = by_name.get(p) if p is not None else None
    return Lineage(head=head, source=src.name if src is not None else None,
                   current=frozenset(current), descendants=frozenset(desc))


def resume_order(entries: Sequence[Entry], lin: Lineage) -> list[Entry]:
    """The order in which a resume tries ``entries``, first first: the current
    lineage newest first (its descendants, then the source, then its
    ancestors: all by step, then commit time), then every other checkpoint
    newest first."""
    cur = sorted((e for e in entries if e.name in lin.current), key=order_key, reverse=True)
    rest = sorted((e for e in entries if e.name not in lin.current), key=order_key, reverse=True)
    return cur + rest
