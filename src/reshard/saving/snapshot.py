"""The save pipeline's collect phase: the state flattened into a :class:`Snapshot`
(every local tensor chunk, object element and common value described, the
bytes held as views, copies or a staging run's pieces) and the digests that
the plan and the replica comparison need (:func:`finish_digests`).

Called by :func:`reshard.saving.save.save` (a synchronous save, on the
caller's thread) and :mod:`reshard.saving.staging` (an asynchronous save:
the walk on the caller's thread, the digests in the background); the write
phase (:mod:`reshard.saving.persist`) reads the snapshot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from ..adapters.model import ModelState
from ..errors import ShardingError
from ..ondisk import codec
from ..ondisk.shardfile import block_digests, content_digest, digest_of, tensor_bytes
from ..options import SaveOptions
from ..planning.planner import LocalObjectItem, LocalTensorItem
from ..state.sharding import ShardedTensor, dtype_name
from ..state.tree import Leaves, flatten


@dataclass
class Snapshot:
    """The state to write, flattened and held in memory the save owns (or, for
    a synchronous save, that the caller promises not to mutate until return)."""

    tensors: list[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None]]
    objects: list[tuple[LocalObjectItem, bytes]]
    values: dict[str, Any]
    values_json: Any
    aliases: dict[str, str]
    value_digests: dict[str, str]
    plain: set[str] = field(default_factory=set)
    #: tree path -> kind of what saved it (Manifest.adapters)
    adapters: dict[str, str] = field(default_factory=dict)
    #: the staging run of an asynchronous save whose tensors are staged piece
    #: by piece (:class:`reshard.saving.staging_run.StagingRun`): their bytes
    #: come from ``source.chunk(i)`` (``tensors[i]`` holds an empty view) and
    #: their digests are computed while they are written
    source: Any = None
    #: block digests computed (finish_digests); else they are computed while writing
    hashed: bool = False
    #: index into ``tensors`` -> xxh3_128 of the chunk's bytes (incremental
    #: saves: the chunks that get a file of their own; :func:`finish_digests`,
    #: or the writer of the chunk's file, or the staging run)
    content: dict[int, str] = field(default_factory=dict)
    #: seconds :func:`finish_digests` took (``SaveResult.timings["hash"]``)
    hash_s: float = 0.0


def _alias_key(st: ShardedTensor) -> tuple[Any, ...] | None:
    d = st.data
    if d.numel() == 0:
        return None
    return (d.untyped_storage().data_ptr(), d.storage_offset(), tuple(d.shape), tuple(d.stride()),
            d.dtype, d.device, st.global_shape, st.global_offset, st.local_shape,
            st.flat_bounds)


@dataclass(frozen=True, kw_only=True)
class _TensorItems:
    """The tensors of one rank's state, described (the collect phase's
    result for tensors).

    Attributes:
        tensors: ``(item, bytes, block checksums)`` per chunk written or
            compared, in the order of the flattened state; the bytes are an
            empty view where a staging run holds them; checksums None (they
            are computed later).
        aliases: fqn -> the fqn whose chunk is the same memory viewed the
            same way (tied weights: saved once).
    """

    tensors: tuple[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None], ...]
    aliases: Mapping[str, str]


@dataclass(frozen=True, kw_only=True)
class _Values:
    """The common values of one rank's state, encoded (the collect phase's
    result for values).

    Attributes:
        as_json: tree path -> the value as JSON (``Manifest.values``).
        digests: what every rank must agree on: tree path -> xxh3_64 of its
            JSON, and ``<tensor><path>`` -> ``"<shape>:<dtype>"`` of every
            plain tensor (a replica every rank must hold).
    """

    as_json: Mapping[str, Any]
    digests: Mapping[str, str]


def collect(
    state: Mapping[str, Any],
    rank: int,
    options: SaveOptions,
    *,
    copy: Any = None,
    stage: Any = None,
    digests: bool = True,
) -> Snapshot:
    """Flatten ``state`` and describe every local item.

    ``copy`` (``tensor -> tensor``): copies each tensor into library-owned
    memory; None keeps views of the caller's memory. ``stage`` (a
    :class:`~reshard.saving.staging_run.StagingRun`): each tensor is handed
    to ``stage.add(index, fqn, tensor)`` instead, which stages it under the
    budget; the snapshot then holds no bytes of it (``Snapshot.source``).
    ``digests=False``: the views' block digests are left to the writer, which
    computes them while it writes (a synchronous save: hashing then costs no
    time of its own on two cores).

    Raises:
        ShardingError: a chunk twice in this rank's state, a value that
            cannot be saved, or a name used both for a tensor and a
            value/object.
    """
    leaves = flatten(state, module_adapter=ModelState)
    tensors = _collect_tensors(_sharded_tensors(leaves, rank), rank, options, copy=copy, stage=stage)
    objects = _collect_objects(leaves)
    values = _collect_values(leaves)
    clash = (set(values.as_json) | {o.key for o, _ in objects}) & {t.fqn for t, _, _ in tensors.tensors}
    if clash:
        raise ShardingError(f"names used both for a tensor and a value/object: {sorted(clash)[:5]}")
    snap = Snapshot(tensors=list(tensors.tensors), objects=objects, values=leaves.values,
                    values_json=dict(values.as_json), aliases=dict(tensors.aliases),
                    value_digests=dict(values.digests), plain=set(leaves.plain),
                    adapters=leaves.adapters, source=stage)
    if copy is None and stage is None and digests:
        finish_digests(snap, options)
    return snap


def _sharded_tensors(leaves: Leaves, rank: int) -> list[ShardedTensor]:
    """Every tensor chunk of ``leaves``: its sharded tensors, its plain
    tensors (whole, replica ``rank``) and its DTensors' local shards."""
    from ..adapters.dtensor import dtensor_shards

    sts: list[ShardedTensor] = list(leaves.tensors)
    for path, t in leaves.plain.items():
        sts.append(ShardedTensor(path, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim(),
                                 replica_id=rank))
    for path, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(path, dt))
    return sts


def _collect_tensors(sts: list[ShardedTensor], rank: int, options: SaveOptions, *,
                     copy: Any, stage: Any) -> _TensorItems:
    """Describe each chunk of ``sts`` (see :func:`collect` for ``copy`` and
    ``stage``); a chunk that is another fqn's memory viewed the same way
    becomes an alias.

    Raises:
        ShardingError: the same chunk (fqn, offset, shape, flat range) twice.
    """
    own = options.own_file_bytes if options.incremental else 0  # chunks that get a file of their own
    tensors: list[tuple[LocalTensorItem, memoryview, tuple[str, ...] | None]] = []
    seen: dict[tuple[Any, ...], int] = {}
    by_view: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for st in sts:
        fqn = st.fqn
        ak = _alias_key(st)
        if ak is not None and by_view.get(ak, fqn) != fqn:
            # the same memory, viewed the same way, under another fqn: tied weights
            aliases[fqn] = by_view[ak]
            continue
        if ak is not None:
            by_view[ak] = fqn
        key = (fqn, st.global_offset, st.local_shape, st.flat_bounds)
        if key in seen:
            raise ShardingError(f"{fqn}: the same chunk at offset {list(st.global_offset)} appears "
                                f"twice in rank {rank}'s state")
        seen[key] = len(tensors)
        if stage is not None:
            nbytes = st.data.numel() * st.data.element_size()
            stage.add(len(tensors), fqn, st.data, content=bool(own) and nbytes >= own)
            mv = _NO_BYTES
        else:
            mv = tensor_bytes(st.data if copy is None else copy(st.data))
            nbytes = len(mv)
        item = LocalTensorItem(
            fqn=fqn, dtype=dtype_name(st.data.dtype), global_shape=st.global_shape,
            global_offset=st.global_offset, local_shape=st.local_shape,
            flattened_range=st.flat_bounds, replica_id=st.replica_id, nbytes=nbytes,
        )
        tensors.append((item, mv, None))
    return _TensorItems(tensors=tuple(tensors), aliases=aliases)


def _collect_objects(leaves: Leaves) -> list[tuple[LocalObjectItem, bytes]]:
    """Each object element of ``leaves`` with its encoded bytes; one value
    under many keys (an optimizer group's hyperparameters, per parameter) is
    encoded once."""
    objects: list[tuple[LocalObjectItem, bytes]] = []
    encoded: dict[int, tuple[bytes, str]] = {}
    for ob in leaves.objects:
        got = encoded.get(id(ob.value))
        if got is None:
            raw = codec.encode(ob.value, path=ob.key)
            got = encoded[id(ob.value)] = (raw, xxhash.xxh3_64_hexdigest(raw))
        raw, digest = got
        objects.append((LocalObjectItem(key=ob.key, global_shape=ob.global_shape,
                                        global_offset=ob.global_offset, replica_id=ob.replica_id,
                                        nbytes=len(raw), digest=digest), raw))
    return objects


def _collect_values(leaves: Leaves) -> _Values:
    """The common values of ``leaves`` as JSON with their digests, and the
    presence of its plain tensors.

    Raises:
        ShardingError: a value that cannot be saved as JSON.
    """
    # plain tensors are replicas: every rank must hold the same ones (a tensor
    # held by one rank only is not a replica), compared like the common values
    digests = {f"<tensor>{p}": f"{tuple(t.shape)}:{t.dtype}" for p, t in leaves.plain.items()}
    as_json = {}
    for path, v in leaves.values.items():
        try:
            j = codec.to_json(v, path=path)
        except TypeError as e:
            raise ShardingError(str(e)) from None
        as_json[path] = j
        digests[path] = xxhash.xxh3_64_hexdigest(msgspec.json.encode(j))
    return _Values(as_json=as_json, digests=digests)


_NO_BYTES = memoryview(b"")


def wants_digest(snap: Snapshot, item: LocalTensorItem, options: SaveOptions) -> bool:
    """Whether ``item``'s digest is computed: with checksums, replica
    verification, or for a plain tensor (always compared across ranks)."""
    return options.checksums or options.verify_replicas or item.fqn in snap.plain


def finish_digests(snap: Snapshot, options: SaveOptions) -> None:
    """Compute block checksums (and replica digests) of the snapshot's tensors,
    and, in an incremental save, the xxh3_128 of every chunk that gets a
    file of its own (``Snapshot.content``: what decides that it is unchanged).

    Runs on the caller's thread for a synchronous save and in the background
    for an asynchronous one (the stall then only covers the copies), on up
    to ``staging_threads`` threads (default: every CPU the process may use,
    at most 4) when there is more than 64 MiB to hash (xxhash releases the
    GIL: the chunks hash in parallel). A snapshot staged piece by piece
    (``Snapshot.source``) is hashed while it is written instead."""
    if snap.source is not None:
        return
    snap.hashed = True
    block = options.checksum_block_bytes
    own = options.own_file_bytes if options.incremental else 0

    def one(i: int) -> None:
        item, mv, _ = snap.tensors[i]
        compare = options.checksums or options.verify_replicas or item.fqn in snap.plain
        if own and len(mv) >= own:
            # a chunk with a file of its own: one pass, its xxh3_128, which decides the link and
            # stands for it among replicas; its block checksums are computed where it is written
            # (or read from the parent's block table where it is linked)
            c = snap.content[i] = content_digest(mv)
            if compare:
                snap.tensors[i] = (msgspec.structs.replace(item, digest=f"x128:{c}"), mv, None)
            return
        # every holder must compute the digest when replicas are compared: replica_id 0
        # does not mean "not replicated" (another rank may hold the same chunk), and a
        # holder without a digest ("") would disagree with one that has it
        if compare:
            sums = block_digests(mv, block)
            item = msgspec.structs.replace(item, digest=digest_of(sums, len(mv)))
            snap.tensors[i] = (item, mv, sums if options.checksums else None)

    t0 = time.perf_counter()
    n = len(snap.tensors)
    total = sum(len(mv) for _, mv, _ in snap.tensors)
    threads = min(options.staging_threads or _cpus(), n)
    if threads <= 1 or total < _PARALLEL_HASH_BYTES:
        for i in range(n):
            one(i)
    else:
        order = sorted(range(n), key=lambda i: -len(snap.tensors[i][1]))  # largest first: balanced
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-hash") as ex:
            list(ex.map(one, order))
    snap.hash_s = time.perf_counter() - t0


#: hashing on several threads only pays beyond this many bytes
_PARALLEL_HASH_BYTES = 64 << 20


def _cpus() -> int:
    """The CPUs this process may run on, at most 4."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))
