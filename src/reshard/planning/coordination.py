"""Coordinator planning of a save: who sends what to whom (DESIGN.md section 1,
"Coordination budget").

The protocol of one save is written once, as a generator of collective
requests (:func:`reshard.planning.coordination_save.save_steps`), so that the real save (driven over a
:class:`~reshard.collectives.Collectives` by :func:`~reshard.collectives.drive`)
and the scale simulator (which runs N of them in lockstep in one process,
:mod:`reshard.bench.simulate`) execute the same rank and coordinator code::

    all ranks   agree (1 all-reduce): failures, structure hash vs cache, values hash
    coordinator broadcast the attempt (target, attempt path, nonce); every rank
                checks it sees the attempt before writing (agreed below)
    (planned)   gather local plans -> coordinator: validate, dedup, balance (plan_save)
                -> agree -> scatter: each rank receives only its own assignment
    (cached)    every rank reuses its cached assignment -> agree (location only)
    all ranks   write their files -> agree -> gather write reports -> coordinator
    coordinator rebuild the manifest from the layout + reports, compare replica
                digests, publish -> agree (carrying the totals)

The cache lives in this process (:data:`PLAN_CACHE`, per group); it is
invalidated on every rank by any change on any rank (the all-reduce of the
structure hash), and dropped by any failed save. Every save also keeps its
plan beside the checkpoint (``plan.bin``, named by the manifest); after a
restart the cache is rebuilt from the parent checkpoint's
(:mod:`reshard.planning.plan_store`) and reused under the same all-reduce.

Messages are msgpack (msgspec) records encoded as arrays, with each rank's fqns
interned in a table. Nothing here does I/O: writing, publishing and discarding
are the hooks of :class:`~reshard.planning.coordination_save.SaveHooks`.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from ..errors import CheckpointError, ShardingError
from ..ondisk.manifest import (
    Chunk,
    FileEntry,
    Manifest,
    ObjectChunk,
    ObjectEntry,
    PlanIndex,
    TensorEntry,
)
from .planner import LocalObjectItem, LocalPlan, LocalTensorItem, plan_save

_MASK = (1 << 62) - 1


# ----------------------------------------------------------------------------- messages


class WireTensor(LocalTensorItem, array_like=True, frozen=True, gc=False):
    """A :class:`~reshard.planning.planner.LocalTensorItem` encoded as an array (the
    planner reads it as it is: decoding is the only per-item cost). A table of
    interned fqns did not pay here: a rank's fqns are nearly all distinct."""


class WireObject(LocalObjectItem, array_like=True, frozen=True, gc=False):
    """A :class:`~reshard.planning.planner.LocalObjectItem` encoded as an array."""


class WirePlan(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a rank sends the coordinator when planning (gather)."""

    rank: int
    struct_hash: int
    tensors: list[WireTensor]
    objects: list[WireObject]
    aliases: dict[str, str]
    value_digests: dict[str, str]


class Assignment(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What one rank receives (scatter): its plan's id, the files it writes and,
    in file order, ``writes``: ``(kind, local index, file index)`` (kind 0: a
    tensor item, 1: an object item); ``check``: ``(kind, local index)`` of the
    replicated items whose digest the coordinator compares at every save."""

    plan_id: int
    files: list[str]
    writes: list[tuple[int, int, int]]
    check: list[tuple[int, int]]


class Report(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a rank sends the coordinator after writing (gather): per file of its
    assignment ``(size, checksum, block-table entries)``; per write ``(offset,
    length, root digest, first block index)`` (bytes; the per-block digests
    stay in the file's block table); the digests of its ``check`` items.
    Incremental saves add per write the chunk's content digest
    (``contents``, "" where none) and the indices of the files linked from
    the parent checkpoint instead of written (``linked``)."""

    files: list[tuple[int, str, int]]
    writes: list[tuple[int, int, str, int]]
    digests: list[str]
    contents: list[str] = []
    linked: list[int] = []


_ENC = msgspec.msgpack.Encoder()
_DEC_PLAN = msgspec.msgpack.Decoder(WirePlan)
_DEC_ASSIGN = msgspec.msgpack.Decoder(Assignment)
_DEC_REPORT = msgspec.msgpack.Decoder(Report)

# ----------------------------------------------------------------------------- rank side


def structure_hash(lp: LocalPlan, *, world_size: int, files_per_rank: int, own_file_bytes: int = 0) -> int:
    """63-bit hash of everything the plan depends on: the rank, world size,
    file options, and per item fqn, dtype, shapes, offsets, flat range and
    replica id (not digests or object sizes, which change between saves)."""
    h = xxhash.xxh3_64()
    fopts: list[int] = [files_per_rank] + ([own_file_bytes] if own_file_bytes else [])
    h.update(_ENC.encode([lp.rank, world_size, *fopts, sorted(lp.aliases.items())]))
    h.update(_ENC.encode([(t.fqn, t.dtype, t.global_shape, t.global_offset, t.local_shape,
                           t.flattened_range, t.replica_id) for t in lp.tensors]))
    h.update(_ENC.encode([(o.key, o.global_shape, o.global_offset, o.replica_id) for o in lp.objects]))
    return h.intdigest() & _MASK


def values_hash(value_digests: dict[str, str]) -> int:
    return xxhash.xxh3_64_intdigest(_ENC.encode(sorted(value_digests.items()))) & _MASK


def encode_plan(lp: LocalPlan, struct_hash: int, value_digests: dict[str, str]) -> bytes:
    tf, of = LocalTensorItem.__struct_fields__, LocalObjectItem.__struct_fields__
    tensors = [WireTensor(*[getattr(t, f) for f in tf]) for t in lp.tensors]
    objects = [WireObject(*[getattr(o, f) for f in of]) for o in lp.objects]
    return _ENC.encode(WirePlan(rank=lp.rank, struct_hash=struct_hash, tensors=tensors, objects=objects,
                                aliases=dict(lp.aliases), value_digests=value_digests))


def decode_plan(raw: bytes) -> tuple[LocalPlan, int, dict[str, str]]:
    w = _DEC_PLAN.decode(raw)
    return (LocalPlan(rank=w.rank, tensors=tuple(w.tensors), objects=tuple(w.objects), aliases=w.aliases),
            w.struct_hash, w.value_digests)


# ----------------------------------------------------------------------------- coordinator


@dataclass
class Layout:
    """The coordinator's view of a plan, kept between saves (plan cache):
    every rank's local items (structure), assignment, and the replica groups
    whose digests are compared: ``(kind, fqn/key)`` -> ``[(rank, check index)]``."""

    plan_id: int
    plans: list[LocalPlan]
    assignments: list[Assignment]
    replicas: list[list[tuple[int, int]]]
    replica_names: list[str]
    aliases: dict[str, str]
    struct_hashes: list[int] = field(default_factory=list)
    #: plan.bin's bytes and index, encoded once per layout (cached saves reuse them)
    encoded: tuple[bytes, PlanIndex] | None = None
    #: per replica group, ``(kind (0 tensor, 1 object), fqn or key, chunk offset)``
    replica_keys: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)
    #: per rank, the items it writes, in the order of its assignment's writes
    #: (derived from ``plans``; a layout rebuilt from plan.bin holds only these)
    written: list[list[LocalTensorItem | LocalObjectItem]] | None = None

    def written_items(self, rank: int) -> list[LocalTensorItem | LocalObjectItem]:
        """The items ``rank`` writes, in the order of its assignment's writes."""
        if self.written is None:
            self.written = [[lp.tensors[i] if kind == 0 else lp.objects[i] for kind, i, _ in a.writes]
                            for lp, a in zip(self.plans, self.assignments, strict=True)]
        return self.written[rank]


def check_values(digests: Sequence[dict[str, str]]) -> None:
    """Common values (and plain-tensor presence) must agree on every rank."""
    ref = digests[0]
    for r, d in enumerate(digests[1:], start=1):
        if d != ref:
            keys = sorted(k for k in set(d) | set(ref) if d.get(k) != ref.get(k))
            raise ShardingError(
                f"common values differ between rank 0 and rank {r} at {keys[:10]} "
                "(plain values and plain tensors (<tensor>) must be held, equal, by every rank; "
                "per-rank values are ShardedObjects, per-rank tensors ShardedTensors; an empty "
                "list is a plain value: a rank that holds no shard of a tensor leaves its key out)"
            )


def merge_aliases(plans: Sequence[LocalPlan]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in plans:
        for a, t in p.aliases.items():
            if out.setdefault(a, t) != t:
                raise ShardingError(f"{a}: aliased to {out[a]!r} on one rank and {t!r} on rank {p.rank}")
    if out:
        # a name aliased on one rank but saved as a tensor of its own elsewhere would be both
        saved = {it.fqn: p.rank for p in plans for it in p.tensors if it.fqn in out}
        for a, t in out.items():
            if a in saved:
                raise ShardingError(
                    f"{a}: shares memory with {t!r} on one rank (a tie) but is a tensor of its own on "
                    f"rank {saved[a]}; declare it the same way on every rank (distinct names that "
                    "must not be tied need memory of their own)")
    return out


def plan_id_of(struct_hashes: Sequence[int]) -> int:
    """The plan's id: a nonzero 63-bit hash of every rank's structure hash, in rank order."""
    h = xxhash.xxh3_64()
    for sh in struct_hashes:
        h.update(sh.to_bytes(8, "little"))
    return (h.intdigest() & _MASK) | 1


def coordinate(messages: Sequence[bytes], *, files_per_rank: int,
               own_file_bytes: int = 0) -> tuple[list[bytes], Layout]:
    """The coordinator's planning: decode every rank's plan, validate (values,
    aliases, dtype/shape conflicts, replica digests, coverage), deduplicate
    and balance (:func:`~reshard.planning.planner.plan_save`), and encode each rank's
    assignment. Deterministic in the messages.

    Raises:
        ShardingError: as plan_save, or differing common values or aliases.
    """
    decoded = [decode_plan(m) for m in messages]
    plans = [d[0] for d in decoded]
    check_values([d[2] for d in decoded])
    aliases = merge_aliases(plans)
    plan = plan_save(plans, files_per_rank=files_per_rank, own_file_bytes=own_file_bytes)
    plan_id = plan_id_of([sh for _, sh, _ in decoded])
    # replica groups (more than one holder): their digests are compared at every save
    checks: list[list[tuple[int, int]]] = [[] for _ in plans]
    replicas: list[list[tuple[int, int]]] = []
    names: list[str] = []
    keys: list[tuple[int, str, tuple[int, ...]]] = []
    for kind, hs in plan.replicas:
        k = 0 if kind == "tensor" else 1
        group = []
        for r, i in hs:
            cr = checks[r]
            group.append((r, len(cr)))
            cr.append((k, i))
        replicas.append(group)
        r, i = hs[0]
        it = plans[r].tensors[i] if kind == "tensor" else plans[r].objects[i]
        name = str(getattr(it, "fqn", None) or getattr(it, "key", ""))
        names.append(f"{name} at {list(it.global_offset)}")
        keys.append((k, name, tuple(it.global_offset)))
    assignments = []
    for p in plans:
        files = list(plan.files.get(p.rank, ()))
        index = {f: k for k, f in enumerate(files)}
        writes = [(0 if w.kind == "tensor" else 1, w.index, index[w.file]) for w in plan.writes.get(p.rank, ())]
        assignments.append(Assignment(plan_id=plan_id, files=files, writes=writes, check=checks[p.rank]))
    layout = Layout(plan_id=plan_id, plans=plans, assignments=assignments, replicas=replicas,
                    replica_names=names, aliases=aliases, struct_hashes=[sh for _, sh, _ in decoded],
                    replica_keys=keys)
    return [_ENC.encode(a) for a in assignments], layout


def build_manifest(layout: Layout, reports: Sequence[bytes], *, attempt_id: str, step: int | None,
                   checksum_block_bytes: int, schema_version: str | None, mesh: dict[str, Any] | None,
                   values: Any, extra: dict[str, Any], parent: str | None = None,
                   lineage: str | None = None, plan: PlanIndex | None = None,
                   adapters: dict[str, str] | None = None,
                   origin_of: Any = None) -> Manifest:
    """The manifest from the layout and every rank's write report: compares
    the digests of every replica group, then places each written item at the
    offset, length and checksums its writer reported. Deterministic.

    ``origin_of(file name) -> attempt id`` names where the bytes of a file a
    rank reported as linked come from (:attr:`FileEntry.origin`); required
    when any report links a file.

    Raises:
        ShardingError: replicas whose digests differ (named by fqn and ranks).
        CheckpointError: a report that does not match its assignment.
    """
    reps = [_DEC_REPORT.decode(b) for b in reports]
    for r, (a, rep) in enumerate(zip(layout.assignments, reps, strict=True)):
        if (len(rep.files) != len(a.files) or len(rep.writes) != len(a.writes) or len(rep.digests) != len(a.check)
                or (rep.contents and len(rep.contents) != len(a.writes))
                or any(not 0 <= k < len(a.files) for k in rep.linked)):
            raise CheckpointError(f"rank {r}'s write report does not match its assignment")
    for name, group in zip(layout.replica_names, layout.replicas, strict=True):
        ref = reps[group[0][0]].digests[group[0][1]]
        if any(reps[r].digests[k] != ref for r, k in group[1:]):
            by: dict[str, list[int]] = defaultdict(list)
            for r, k in group:
                by[reps[r].digests[k]].append(r)
            parts = sorted(by.values(), key=lambda rs: (-len(rs), rs))
            raise ShardingError(f"{name}: replicas differ: ranks {parts[0]} hold one value, "
                                + ", ".join(f"ranks {rs} another" for rs in parts[1:])
                                + " (replicated data must be identical on every holder)")
    tensors: dict[str, tuple[str, tuple[int, ...], list[Chunk]]] = {}
    objects: dict[str, tuple[tuple[int, ...], list[ObjectChunk]]] = {}
    files: dict[str, FileEntry] = {}
    for r, (a, rep) in enumerate(zip(layout.assignments, reps, strict=True)):
        linked = set(rep.linked)
        if linked and origin_of is None:
            raise CheckpointError(f"rank {r} reports linked files, but the save has no parent to link from")
        for k, (name, (size, checksum, blocks)) in enumerate(zip(a.files, rep.files, strict=True)):
            files[name] = FileEntry(size=size, checksum=checksum, blocks=blocks,
                                    origin=origin_of(name) if k in linked else "")
        contents = rep.contents or [""] * len(a.writes)
        for x, (kind, _, fi), (off, length, root, bi), content in zip(
                layout.written_items(r), a.writes, rep.writes, contents, strict=True):
            if kind == 0:
                it: Any = x
                e = tensors.get(it.fqn)
                if e is None:
                    e = tensors[it.fqn] = (it.dtype, it.global_shape, [])
                e[2].append(Chunk(it.global_offset, it.local_shape, a.files[fi], off, length, (),
                                  it.flattened_range, root, bi, content))
            else:
                ob: Any = x
                oe = objects.get(ob.key)
                if oe is None:
                    oe = objects[ob.key] = (ob.global_shape, [])
                oe[1].append(ObjectChunk(ob.global_offset, a.files[fi], off, length, (), root, bi))
    return Manifest(
        attempt_id=attempt_id, created_at=round(time.time(), 3), world_size=len(layout.assignments),
        checksum_block_bytes=checksum_block_bytes, schema_version=schema_version, step=step, mesh=mesh,
        tensors={k: TensorEntry(dtype=v[0], global_shape=v[1], chunks=tuple(
            sorted(v[2], key=lambda c: (c.global_offset, c.flattened_range or (0, 0)))))
            for k, v in sorted(tensors.items())},
        objects={k: ObjectEntry(global_shape=v[0], chunks=tuple(sorted(v[1], key=lambda c: c.global_offset)))
                 for k, v in sorted(objects.items())},
        values=values, aliases=dict(sorted(layout.aliases.items())), files=dict(sorted(files.items())),
        extra=dict(extra), parent=parent, lineage=lineage, plan=plan, adapters=dict(adapters or {}))


# ----------------------------------------------------------------------------- plan cache


@dataclass
class CacheEntry:
    """One rank's cached plan for one group: its structure hash, the agreed
    plan id and its assignment; the coordinator also keeps the layout."""

    struct_hash: int
    plan_id: int
    assignment: Assignment
    layout: Layout | None = None


#: group key (see :func:`reshard.collectives.group_key`) -> this rank's cache entry
PLAN_CACHE: dict[Any, CacheEntry] = {}


# ----------------------------------------------------------------------------- the protocol


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (the coordinator's planning and
    manifest building allocate many small containers, none of them cyclic: a
    full collection triggered there scans the whole heap of a training
    process, torch's objects included)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


