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

The steps are generators of collective requests (like
:func:`reshard.coordination.save_steps`), driven by
:func:`reshard.collectives.drive`, so the simulator runs the same code.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .collectives import Collectives, Request, drive
from .commit import check_signature
from .errors import CheckpointError
from .manifest import MANIFEST_NAME, Manifest, decode_manifest
from .storage import Storage


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
                ) -> Manifest | None:
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

    def read() -> bytes:
        if st.is_link(mpath):
            return b""
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
        m = decode_manifest(raw, where=mpath)
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
    from .transforms import provided_by

    saved = saved_keys(m)
    available = set(saved) | provided_by(transforms, m)
    return drive(coll, key_census_steps(coll.rank, saved, requested, available))
