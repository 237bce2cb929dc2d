"""The save plan kept beside a committed checkpoint, so that the first save
after a restart reuses it instead of planning again (DESIGN.md section 1,
"Coordination budget"; issue 11 item 3).

At every save the coordinator writes ``plan.bin`` into the attempt, before
the manifest; the manifest names it (:class:`~reshard.manifest.PlanIndex`:
size, xxh3-64 checksum, plan id). Its layout (bytes, little-endian u64)::

    [magic 8][world][layout offset][layout length]            header, 32 bytes
    world x [record offset][record length][record xxh3-64]    24 bytes per rank
    world x record: msgpack RankRecord(struct_hash, plan_id, assignment)
    layout: msgpack LayoutRecord (every rank's structure, assignments,
            replica groups: what the coordinator needs to rebuild the manifest)

After a restart (no plan in this process's cache), each rank reads only the
header, its index entry and its own record from storage (three ranged reads,
no collective); the coordinator reads the parent's manifest and the whole
file, checks its size and checksum against the manifest, and recomputes every
rank's structure hash and the plan id from the stored structure. The plan is
reused only when every rank's *current* structure hash equals its stored one
and every rank holds the same plan id (the all-reduce of
:func:`~reshard.coordination.save_steps`); anything else (no parent, an older
checkpoint without ``plan.bin``, a torn or foreign file, a changed structure
on any rank, another world size) plans as usual. A stale plan can therefore
not name a wrong file or offset: the assignment used is the one planned for
exactly this structure.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import xxhash

from .coordination import (
    Assignment,
    CacheEntry,
    Layout,
    WireObject,
    WireTensor,
    plan_id_of,
    structure_hash,
)
from .manifest import Manifest, PlanIndex
from .planning import LocalObjectItem, LocalPlan, LocalTensorItem
from .storage import Storage

PLAN_FILE = "plan.bin"
_MAGIC = b"RSPLAN1\x00"
_HEAD = struct.Struct("<8sQQQ")
_ENTRY = struct.Struct("<QQQ")


class RankRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    struct_hash: int
    plan_id: int
    assignment: Assignment


class WireLocalPlan(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rank: int
    tensors: list[WireTensor]
    objects: list[WireObject]
    aliases: dict[str, str]


class LayoutRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    plan_id: int
    files_per_rank: int
    struct_hashes: list[int]
    plans: list[WireLocalPlan]
    assignments: list[Assignment]
    replicas: list[list[tuple[int, int]]]
    replica_names: list[str]
    aliases: dict[str, str]


_ENC = msgspec.msgpack.Encoder()
_DEC_REC = msgspec.msgpack.Decoder(RankRecord)
_DEC_LAYOUT = msgspec.msgpack.Decoder(LayoutRecord)


def encode_plan_file(layout: Layout, *, files_per_rank: int) -> tuple[bytes, PlanIndex]:
    """``plan.bin``'s bytes and the manifest's :class:`PlanIndex` for them
    (pure; deterministic in the layout)."""
    n = len(layout.plans)
    tf, of = LocalTensorItem.__struct_fields__, LocalObjectItem.__struct_fields__
    recs = [_ENC.encode(RankRecord(struct_hash=layout.struct_hashes[r], plan_id=layout.plan_id,
                                   assignment=layout.assignments[r])) for r in range(n)]
    wplans = [WireLocalPlan(rank=p.rank, tensors=[WireTensor(*[getattr(t, f) for f in tf]) for t in p.tensors],
                            objects=[WireObject(*[getattr(o, f) for f in of]) for o in p.objects],
                            aliases=dict(p.aliases)) for p in layout.plans]
    lay = _ENC.encode(LayoutRecord(plan_id=layout.plan_id, files_per_rank=files_per_rank,
                                   struct_hashes=list(layout.struct_hashes), plans=wplans,
                                   assignments=list(layout.assignments), replicas=layout.replicas,
                                   replica_names=layout.replica_names, aliases=layout.aliases))
    off = _HEAD.size + _ENTRY.size * n
    index = bytearray()
    for rec in recs:
        index += _ENTRY.pack(off, len(rec), xxhash.xxh3_64_intdigest(rec))
        off += len(rec)
    raw = b"".join([_HEAD.pack(_MAGIC, n, off, len(lay)), bytes(index), *recs, lay])
    return raw, PlanIndex(file=PLAN_FILE, size=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw),
                          plan_id=layout.plan_id)


def read_rank_entry(st: Storage, checkpoint: str, rank: int, world_size: int) -> CacheEntry | None:
    """This rank's cached plan from ``<checkpoint>/plan.bin`` (three ranged
    reads: header, index entry, record), or None when there is none or it
    does not fit (other world size, torn, checksum mismatch). Never raises."""
    path = st.join(checkpoint, PLAN_FILE)
    try:
        magic, n, _, _ = _HEAD.unpack(st.read_bytes(path, 0, _HEAD.size))
        if magic != _MAGIC or n != world_size or not 0 <= rank < n:
            return None
        off, length, digest = _ENTRY.unpack(st.read_bytes(path, _HEAD.size + _ENTRY.size * rank, _ENTRY.size))
        rec = st.read_bytes(path, off, length)
        if len(rec) != length or xxhash.xxh3_64_intdigest(rec) != digest:
            return None
        r = _DEC_REC.decode(rec)
    except Exception:  # noqa: BLE001 - no usable plan: this rank plans as usual
        return None
    return CacheEntry(struct_hash=r.struct_hash, plan_id=r.plan_id, assignment=r.assignment)


def read_coordinator_entry(st: Storage, checkpoint: str, world_size: int, *, files_per_rank: int,
                           hmac_key: bytes | None = None) -> CacheEntry | None:
    """The coordinator's cached plan (with the layout) from the committed
    checkpoint: its manifest must name ``plan.bin`` at the size and checksum
    read, and every stored rank structure must hash to its stored structure
    hash, and those to the plan id. None when anything does not hold (never
    raises)."""
    from .commit import read_manifest

    try:
        m: Manifest = read_manifest(st, checkpoint, hmac_key=hmac_key)
        pi = m.plan
        if pi is None or pi.file != PLAN_FILE or m.world_size != world_size:
            return None
        raw = st.read_bytes(st.join(checkpoint, PLAN_FILE))
        if len(raw) != pi.size or xxhash.xxh3_64_hexdigest(raw) != pi.checksum:
            return None
        magic, n, loff, llen = _HEAD.unpack(raw[:_HEAD.size])
        if magic != _MAGIC or n != world_size:
            return None
        rec = _DEC_LAYOUT.decode(raw[loff:loff + llen])
        if rec.plan_id != pi.plan_id or rec.files_per_rank != files_per_rank or len(rec.plans) != n:
            return None
        plans = [LocalPlan(rank=w.rank, tensors=tuple(w.tensors), objects=tuple(w.objects), aliases=w.aliases)
                 for w in rec.plans]
        if any(p.rank != r or structure_hash(p, world_size=n, files_per_rank=files_per_rank) != rec.struct_hashes[r]
               for r, p in enumerate(plans)):
            return None
        if plan_id_of(rec.struct_hashes) != rec.plan_id or any(a.plan_id != rec.plan_id for a in rec.assignments):
            return None
    except Exception:  # noqa: BLE001 - no usable plan: the save plans as usual
        return None
    layout = Layout(plan_id=rec.plan_id, plans=plans, assignments=list(rec.assignments), replicas=rec.replicas,
                    replica_names=rec.replica_names, aliases=rec.aliases, struct_hashes=list(rec.struct_hashes),
                    encoded=(raw, pi))
    return CacheEntry(struct_hash=rec.struct_hashes[0], plan_id=rec.plan_id, assignment=rec.assignments[0],
                      layout=layout)


def restart_entry(st: Storage, checkpoint: str, rank: int, world_size: int, *, files_per_rank: int,
                  hmac_key: bytes | None = None) -> CacheEntry | None:
    """:func:`read_coordinator_entry` on rank 0, :func:`read_rank_entry` elsewhere."""
    if rank == 0:
        return read_coordinator_entry(st, checkpoint, world_size, files_per_rank=files_per_rank,
                                      hmac_key=hmac_key)
    return read_rank_entry(st, checkpoint, rank, world_size)


def parent_path(st: Storage, key: str, parent: str | None) -> str | None:
    """The checkpoint named by ``SaveOptions.parent`` (a sibling of ``key``), or None."""
    if not parent:
        return None
    return st.join(st.parent(key), parent) if st.parent(key) else parent


__all__: list[Any] = ["PLAN_FILE", "encode_plan_file", "parent_path", "read_coordinator_entry",
                      "read_rank_entry", "restart_entry"]
