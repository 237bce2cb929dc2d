"""The save plan kept beside a committed checkpoint, so that the first save
after a restart reuses it instead of planning again (DESIGN.md section 1,
"Coordination budget"; issue 11 item 3).

At every save the coordinator writes ``plan.bin`` into the attempt, before
the manifest; the manifest names it (:class:`~reshard.ondisk.manifest.PlanIndex`:
size, xxh3-64 checksum, plan id). Its layout (bytes, little-endian u64)::

    [magic 8][world][layout offset][layout length]            header, 32 bytes
    world x [record offset][record length][record xxh3-64]    24 bytes per rank
    world x record: msgpack RankRecord(struct_hash, plan_id, assignment)
    layout: msgpack LayoutRecord (what the coordinator needs to rebuild the
            manifest: the items each rank writes, by an interned name table,
            and the replica groups as ranks)

It keeps only what a restart needs, not every rank's structure: at 16,384
ranks it is smaller than the manifest (``reshard bench scale``:
``plan_file_bytes`` beside ``manifest_bytes``).

After a restart (no plan in this process's cache), each rank reads only the
header, its index entry and its own record from storage (three ranged reads,
no collective); the coordinator reads the parent's manifest and the whole
file, checks its size and checksum against the manifest (so it is the file
that checkpoint's save wrote, for exactly the structure hashes it holds), and
checks that the structure hashes hash to the plan id and that every rank's
record agrees with the layout. The plan is
reused only when every rank's *current* structure hash equals its stored one
and every rank holds the same plan id (the all-reduce of
:func:`~reshard.planning.coordination.save_steps`); anything else (no parent, an older
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

from ..ondisk.manifest import Manifest, PlanIndex
from ..storage import Storage
from .coordination import Assignment, CacheEntry, Layout, plan_id_of
from .planner import LocalObjectItem, LocalTensorItem

PLAN_FILE = "plan.bin"
_MAGIC = b"RSPLAN2\x00"
_HEAD = struct.Struct("<8sQQQ")
_ENTRY = struct.Struct("<QQQ")


class RankRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One rank's part: its structure hash, the plan id and its assignment,
    with the ``check`` list as runs ``(kind, first index, count)``."""

    struct_hash: int
    plan_id: int
    files: list[str]
    writes: list[tuple[int, int, int]]
    check_runs: list[tuple[int, int, int]]


class NameEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A saved name: kind 0 a tensor (with its dtype), 1 an object grid."""

    name: str
    kind: int
    dtype: str
    global_shape: tuple[int, ...]


class LayoutRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What the coordinator needs to rebuild the manifest of a cached save:
    per rank the items it writes (name index, offset, shape, flat range; an
    object: name index, offset), and the replica groups whose digests are
    compared (name index, offset, holder ranks as ``[first, stride, count]``
    or ``[-1, rank, ...]``; a holder's check index is implied: the groups are
    in the order each rank's ``check`` list was built)."""

    plan_id: int
    files_per_rank: int
    struct_hashes: list[int]
    names: list[NameEntry]
    written: list[list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]]]
    replicas: list[tuple[int, tuple[int, ...], list[int]]]
    aliases: dict[str, str]


_ENC = msgspec.msgpack.Encoder()
_DEC_REC = msgspec.msgpack.Decoder(RankRecord)
_DEC_LAYOUT = msgspec.msgpack.Decoder(LayoutRecord)


def _runs(check: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for kind, i in check:
        if out and out[-1][0] == kind and out[-1][1] + out[-1][2] == i:
            k, a, n = out[-1]
            out[-1] = (k, a, n + 1)
        else:
            out.append((kind, i, 1))
    return out


def _unruns(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(kind, i) for kind, a, n in runs for i in range(a, a + n)]


def _ranks_code(ranks: list[int]) -> list[int]:
    if len(ranks) >= 2:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return [ranks[0], step, len(ranks)]
    return [-1, *ranks]


def _ranks_of(code: list[int]) -> list[int]:
    if code and code[0] == -1:
        return list(code[1:])
    a, step, n = code
    return [a + step * k for k in range(n)]


def encode_plan_file(layout: Layout, *, files_per_rank: int) -> tuple[bytes, PlanIndex]:
    """``plan.bin``'s bytes and the manifest's :class:`PlanIndex` for them
    (pure; deterministic in the layout). Only what a restart needs: every
    rank's assignment, the items written (not every replica's) and the
    replica groups (ranks only)."""
    n = len(layout.assignments)
    recs = [_ENC.encode(RankRecord(struct_hash=layout.struct_hashes[r], plan_id=layout.plan_id,
                                   files=a.files, writes=a.writes, check_runs=_runs(a.check)))
            for r, a in enumerate(layout.assignments)]
    names: list[NameEntry] = []
    index: dict[tuple[int, str], int] = {}

    def name_of(kind: int, name: str, dtype: str, gshape: tuple[int, ...]) -> int:
        k = index.get((kind, name))
        if k is None:
            k = index[(kind, name)] = len(names)
            names.append(NameEntry(name=name, kind=kind, dtype=dtype, global_shape=tuple(gshape)))
        return k

    written: list[list[Any]] = []
    for r in range(n):
        rows: list[Any] = []
        for it in layout.written_items(r):
            if isinstance(it, LocalTensorItem):
                rows.append((name_of(0, it.fqn, it.dtype, it.global_shape), tuple(it.global_offset),
                             tuple(it.local_shape), it.flattened_range))
            else:
                rows.append((name_of(1, it.key, "", it.global_shape), tuple(it.global_offset), (), None))
        written.append(rows)
    replicas: list[Any] = []
    for group, (kind, name, goff) in zip(layout.replicas, layout.replica_keys, strict=True):
        ni = index.get((kind, name))
        if ni is None:  # (every replicated chunk has a writer: its name is in the table)
            ni = name_of(kind, name, "", ())
        replicas.append((ni, goff, _ranks_code([rk for rk, _ in group])))
    lay = _ENC.encode(LayoutRecord(plan_id=layout.plan_id, files_per_rank=files_per_rank,
                                   struct_hashes=list(layout.struct_hashes), names=names, written=written,
                                   replicas=replicas, aliases=layout.aliases))
    off = _HEAD.size + _ENTRY.size * n
    entries = bytearray()
    for rec in recs:
        entries += _ENTRY.pack(off, len(rec), xxhash.xxh3_64_intdigest(rec))
        off += len(rec)
    raw = b"".join([_HEAD.pack(_MAGIC, n, off, len(lay)), bytes(entries), *recs, lay])
    return raw, PlanIndex(file=PLAN_FILE, size=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw),
                          plan_id=layout.plan_id)


def _assignment(r: RankRecord) -> Assignment:
    return Assignment(plan_id=r.plan_id, files=r.files, writes=r.writes, check=_unruns(r.check_runs))


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
    return CacheEntry(struct_hash=r.struct_hash, plan_id=r.plan_id, assignment=_assignment(r))


def read_coordinator_entry(st: Storage, checkpoint: str, world_size: int, *, files_per_rank: int,
                           hmac_key: bytes | None = None) -> CacheEntry | None:
    """The coordinator's cached plan (with the layout) from the committed
    checkpoint: its manifest must name ``plan.bin`` at the size and checksum
    read (so the file is the one that checkpoint's save wrote for exactly
    the structure hashes it holds), the stored structure hashes must hash to
    the plan id, and every rank's record must agree with the layout (plan
    id, number of written items, replica check indices). None when anything
    does not hold (never raises)."""
    from ..ondisk.committed import read_manifest

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
        if (rec.plan_id != pi.plan_id or rec.files_per_rank != files_per_rank or len(rec.written) != n
                or len(rec.struct_hashes) != n or plan_id_of(rec.struct_hashes) != rec.plan_id):
            return None
        assignments: list[Assignment] = []
        for r in range(n):
            roff, rlen, _ = _ENTRY.unpack_from(raw, _HEAD.size + _ENTRY.size * r)
            rr = _DEC_REC.decode(raw[roff:roff + rlen])
            if rr.plan_id != rec.plan_id or rr.struct_hash != rec.struct_hashes[r]:
                return None
            assignments.append(_assignment(rr))
        names = rec.names
        written: list[list[LocalTensorItem | LocalObjectItem]] = []
        for r, rows in enumerate(rec.written):
            if len(rows) != len(assignments[r].writes):
                return None
            items: list[LocalTensorItem | LocalObjectItem] = []
            for (ni, goff, lshape, fr), (kind, _, _) in zip(rows, assignments[r].writes, strict=True):
                ne = names[ni]
                if ne.kind != kind:
                    return None
                if kind == 0:
                    items.append(LocalTensorItem(ne.name, ne.dtype, ne.global_shape, goff, lshape, fr, 0, 0))
                else:
                    items.append(LocalObjectItem(ne.name, ne.global_shape, goff, 0, 0, ""))
            written.append(items)
        seen = [0] * n
        replicas: list[list[tuple[int, int]]] = []
        replica_names: list[str] = []
        for ni, goff0, code in rec.replicas:
            group = []
            for rk in _ranks_of(code):
                group.append((rk, seen[rk]))
                seen[rk] += 1
            replicas.append(group)
            replica_names.append(f"{names[ni].name} at {list(goff0)}")
        if seen != [len(a.check) for a in assignments]:
            return None
    except Exception:  # noqa: BLE001 - no usable plan: the save plans as usual
        return None
    layout = Layout(plan_id=rec.plan_id, plans=[], assignments=assignments, replicas=replicas,
                    replica_names=replica_names, aliases=rec.aliases, struct_hashes=list(rec.struct_hashes),
                    encoded=(raw, pi), written=written)
    return CacheEntry(struct_hash=rec.struct_hashes[0], plan_id=rec.plan_id, assignment=assignments[0],
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
