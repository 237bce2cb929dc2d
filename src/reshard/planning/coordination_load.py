"""Load coordination without a world-wide exchange (DESIGN.md section 1,
"Coordination budget").

* The manifest is read from storage once, by the coordinator, and reaches
  every rank by broadcast (:func:`read_shared`); each rank decodes and
  validates it and plans its own reads locally. (The alternative, every rank
  reading it from storage, costs the store ``world`` reads of the manifest;
  the scale simulator measures both, see ``reshard bench scale``.)
* Strictness across ranks (saved keys that no rank requested) is decided by the
  coordinator from compact key sets: each rank sends a bitmap over the sorted
  saved keys (``ceil(keys / 8)`` bytes) to the coordinator only (gather); the
  coordinator ORs them and broadcasts the bitmap of unexpected keys
  (:func:`key_census`). Missing keys are each rank's own business.
* Replicas are read once (:func:`read_once`): each rank sends the coordinator
  the byte ranges of saved chunks it needs (four int64 per range: tensor
  index, chunk index, first and end byte); the coordinator finds the ranges
  several ranks need, names one reader per range (balancing the bytes each
  rank reads from storage) and scatters to each rank only its own part: from
  whom it receives each shared range, or to whom it hands it. The data then
  moves point to point (:meth:`Collectives.exchange`).

The steps are generators of collective requests (like
:func:`reshard.planning.coordination.save_steps`), driven by
:func:`reshard.collectives.drive`, so the simulator runs the same code.
"""

from __future__ import annotations

from array import array
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..collectives_base import Collectives, Request, drive
from ..errors import CheckpointError
from ..ondisk.committed import check_signature
from ..ondisk.manifest import MANIFEST_NAME, Manifest, decode_manifest
from ..storage import Storage


def read_shared_steps(rank: int, read: Any, decode: Any) -> Generator[Request, Any, Manifest | None]:
    """Coordinator: ``read()`` the raw manifest (b"" when it cannot: then every
    rank falls back to reading on its own and raises its own error); every
    rank: ``decode(raw)``."""
    raw = b""
    if rank == 0:
        try:
            raw = read()
        except Exception:  # noqa: BLE001 - each rank then reads and reports itself
            raw = b""
    got = yield ("broadcast_bytes", raw if rank == 0 else None)
    if not got:
        return None
    m: Manifest = decode(got)
    return m


def read_shared(coll: Collectives, st: Storage, key: str, *, hmac_key: bytes | None = None,
                limits: Any = None) -> Manifest | None:
    """The checkpoint's manifest, read by the coordinator and broadcast, then
    decoded and validated (and its HMAC checked) on every rank. Returns None
    when the coordinator could not read one (no manifest, a DCP checkpoint, a
    symbolic link, an I/O error): the caller then reads on every rank and
    reports what it finds.

    The same broadcast carries the coordinator's canonical spelling of
    ``key`` (``Storage.canonical``): every rank must name the coordinator's
    checkpoint, as a save requires (every rank reads data through the
    coordinator's manifest, so a rank naming another checkpoint (per-rank
    paths, a relative path under another working directory, ``latest(root)``
    evaluated per rank while a newer one was published) would read another
    checkpoint's bytes).

    Raises:
        ManifestError, IntegrityError: the manifest is invalid (every rank).
        CheckpointError: this rank names another location than the coordinator.
    """
    mpath = st.join(key, MANIFEST_NAME)
    mine = st.canonical(key)

    from ..ondisk.limits import default_limits

    lim = limits if limits is not None else default_limits()

    def read() -> bytes:
        if st.is_link(mpath) or st.size(mpath) > lim.manifest_bytes:
            return b""  # every rank reads it itself and raises what it finds
        raw = st.read_bytes(mpath)
        where = mine.encode()
        return len(where).to_bytes(4, "little") + where + raw if raw else b""

    def decode(got: bytes) -> Manifest:
        n = int.from_bytes(got[:4], "little")
        coord, raw = got[4:4 + n].decode(), got[4 + n:]
        if mine != coord:
            raise CheckpointError(
                f"rank {coll.rank} loads checkpoint {mine!r}, the coordinator (rank 0) loads "
                f"{coord!r}: every rank must name the same checkpoint (resolve the path once, e.g. "
                "on rank 0, and pass it to every rank)")
        m = decode_manifest(raw, where=mpath, limits=lim)
        if hmac_key is not None:
            check_signature(m, hmac_key, where=mpath)
        return m

    return drive(coll, read_shared_steps(coll.rank, read, decode))


@dataclass(frozen=True, kw_only=True)
class KeyCensus:
    """What the coordinator found from every rank's key set.

    Attributes:
        unexpected: saved keys that no rank requested (sorted).
        any_requested: some rank requested at least one key.
        any_matched: some rank requested a key the checkpoint provides.
    """

    unexpected: tuple[str, ...]
    any_requested: bool
    any_matched: bool


def _bitmap(indices: Iterable[int], n: int) -> bytes:
    buf = bytearray((n + 7) // 8)
    for i in indices:
        buf[i >> 3] |= 1 << (i & 7)
    return bytes(buf)


def _indices(bits: bytes, n: int) -> list[int]:
    return [i for i in range(n) if bits[i >> 3] >> (i & 7) & 1]


def key_census_steps(rank: int, saved: Sequence[str], requested: Iterable[str],
                     available: set[str]) -> Generator[Request, Any, KeyCensus]:
    """:func:`key_census` as protocol steps; ``saved`` sorted, the same on every rank."""
    index = {k: i for i, k in enumerate(saved)}
    req = list(requested)
    n = len(saved)
    flags = bytes([1 if req else 0, 1 if any(k in available for k in req) else 0])
    got = yield ("gather_bytes", flags + _bitmap((index[k] for k in req if k in index), n))
    out = b""
    if got is not None:
        acc = 0
        fr = fm = 0
        for msg in got:
            fr |= msg[0]
            fm |= msg[1]
            acc |= int.from_bytes(msg[2:], "little")
        full = (1 << n) - 1
        out = bytes([fr, fm]) + ((~acc) & full).to_bytes((n + 7) // 8, "little")
    res = yield ("broadcast_bytes", out if got is not None else None)
    return KeyCensus(unexpected=tuple(saved[i] for i in _indices(res[2:], n)),
                     any_requested=bool(res[0]), any_matched=bool(res[1]))


def saved_keys(m: Manifest) -> list[str]:
    """Every key the manifest saves (tensors, aliases, objects, values), sorted."""
    return sorted(set(m.tensors) | set(m.aliases) | set(m.objects) | set((m.values or {}).keys()))


def key_census(coll: Collectives, m: Manifest, requested: Iterable[str],
               transforms: Sequence[Any] = ()) -> KeyCensus:
    """Which saved keys of ``m`` (the view after ``transforms``) no rank of
    ``coll`` requested: each rank sends a bitmap of its requested keys to the
    coordinator only; the coordinator broadcasts the bitmap of the others.
    Every rank must call it with the same manifest view."""
    from ..transforms import provided_by

    saved = saved_keys(m)
    available = set(saved) | provided_by(transforms, m)
    return drive(coll, key_census_steps(coll.rank, saved, requested, available))


#: a byte range of a saved chunk: (tensor index in the sorted manifest
#: tensors, chunk index, first byte, end byte) (chunk-relative)
Unit = tuple[int, int, int, int]


@dataclass(frozen=True, kw_only=True)
class Handover:
    """One rank's part in reading replicas once (indices into the rank's own
    list of units, in the order it sent them).

    Attributes:
        recv: unit index -> (the group rank that reads it and sends it here, tag).
        send: unit index -> (the group ranks this rank sends it to after
            reading it, tag).
    """

    recv: dict[int, tuple[int, int]] = field(default_factory=dict)
    send: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)


def assign_readers(units: Sequence[Sequence[Unit]]) -> list[Handover]:
    """The coordinator's choice (pure): for every unit that several ranks
    need, one reader among them; the others receive it from that reader.

    ``units[r]``: rank ``r``'s units. Shared units are taken largest first
    and each goes to the holder that so far reads the fewest bytes (its
    unshared units counted first; ties to the lowest rank), so that storage
    reads are balanced across replica holders. Each shared unit gets a tag
    (its index among the shared units, from 0), the same on its reader and
    its receivers.

    Returns: one :class:`Handover` per rank.
    """
    holders: dict[Unit, list[tuple[int, int]]] = {}
    for r, us in enumerate(units):
        for i, u in enumerate(us):
            holders.setdefault(u, []).append((r, i))
    load = [0] * len(units)
    shared: list[Unit] = []
    for u, hs in holders.items():
        if len(hs) == 1:
            load[hs[0][0]] += u[3] - u[2]
        else:
            shared.append(u)
    shared.sort(key=lambda u: (u[2] - u[3], u))
    out = [Handover() for _ in units]
    for tag, u in enumerate(shared):
        hs = holders[u]
        r0, i0 = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[r0] += u[3] - u[2]
        out[r0].send[i0] = (tuple(r for r, _ in hs if r != r0), tag)
        for r, i in hs:
            if r != r0:
                out[r].recv[i] = (r0, tag)
    return out


def _encode_units(us: Sequence[Unit]) -> bytes:
    return array("q", [x for u in us for x in u]).tobytes()


def _decode_units(raw: bytes) -> list[Unit]:
    a = array("q")
    a.frombytes(raw)
    return [(a[k], a[k + 1], a[k + 2], a[k + 3]) for k in range(0, len(a), 4)]


def _encode_handover(h: Handover) -> bytes:
    """int64 records: ``[0, index, source, tag]`` per receive, ``[1, index,
    tag, n, dst...]`` per send."""
    a = array("q")
    for i, (src, tag) in sorted(h.recv.items()):
        a.extend((0, i, src, tag))
    for i, (dsts, tag) in sorted(h.send.items()):
        a.extend((1, i, tag, len(dsts), *dsts))
    return a.tobytes()


def _decode_handover(raw: bytes) -> Handover:
    a = array("q")
    a.frombytes(raw)
    recv: dict[int, tuple[int, int]] = {}
    send: dict[int, tuple[tuple[int, ...], int]] = {}
    k = 0
    while k < len(a):
        if a[k] == 0:
            recv[a[k + 1]] = (a[k + 2], a[k + 3])
            k += 4
        else:
            n = a[k + 3]
            send[a[k + 1]] = (tuple(a[k + 4:k + 4 + n]), a[k + 2])
            k += 4 + n
    return Handover(recv=recv, send=send)


def read_once_steps(rank: int, units: Sequence[Unit]) -> Generator[Request, Any, Handover]:
    """:func:`read_once` as protocol steps: one gather of every rank's units
    (32 bytes per unit) to the coordinator, one scatter of each rank's own
    :class:`Handover`."""
    got = yield ("gather_bytes", _encode_units(units))
    parts = None
    if got is not None:
        parts = [_encode_handover(h) for h in assign_readers([_decode_units(g) for g in got])]
    mine = yield ("scatter_bytes", parts)
    return _decode_handover(mine)


def read_once(coll: Collectives, units: Sequence[Unit]) -> Handover:
    """This rank's part in reading every range several ranks need from
    storage once (see :func:`assign_readers`); every rank calls it with the
    units it needs (each unit once)."""
    return drive(coll, read_once_steps(coll.rank, units))
