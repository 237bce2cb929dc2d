"""Synchronous save: snapshot -> plan -> persist -> validate -> publish manifest last."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from . import codec
from .collectives import Collectives, get_collectives
from .commit import (
    attempt_path,
    check_attempt,
    check_target,
    create_attempt,
    new_attempt_id,
    publish,
    sign_manifest,
)
from .errors import CheckpointError, ShardingError, StorageError, outcome, raise_agreed
from .manifest import (
    MANIFEST_NAME,
    Chunk,
    FileEntry,
    Manifest,
    ObjectChunk,
    ObjectEntry,
    TensorEntry,
)
from .options import SaveOptions
from .planning import LocalObjectItem, LocalPlan, LocalTensorItem, SavePlan, plan_save
from .shardfile import FileItem, block_digests, digest_of, tensor_bytes, write_shard_file
from .sharding import ShardedTensor, dtype_name
from .storage import Storage, resolve
from .tree import flatten


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What a save did (identical fields on every rank, except ``bytes_written``
    and ``manifest``, which only the coordinator holds).

    Attributes:
        path: the committed checkpoint.
        step: the step recorded in its manifest.
        attempt_id: the attempt that was published.
        bytes_written: data bytes this rank wrote.
        total_bytes: data bytes of the whole checkpoint.
        num_files: data files of the whole checkpoint.
        timings: seconds spent per phase on this rank ("stage", "plan", "write", "commit").
        manifest: the published manifest (coordinator only, else None).
    """

    path: str
    step: int | None
    attempt_id: str
    bytes_written: int
    total_bytes: int
    num_files: int
    timings: dict[str, float] = field(default_factory=dict)
    manifest: Manifest | None = None


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


def _storage_key(item: LocalTensorItem) -> str:
    name = item.fqn
    if item.global_offset:
        name += "@" + ",".join(map(str, item.global_offset))
    if item.flattened_range is not None:
        name += "#{}:{}".format(*item.flattened_range)
    return name


def _alias_key(st: ShardedTensor) -> tuple[Any, ...] | None:
    d = st.data
    if d.numel() == 0:
        return None
    return (d.untyped_storage().data_ptr(), d.storage_offset(), tuple(d.shape), tuple(d.stride()),
            d.dtype, d.device, st.global_shape, st.global_offset, st.local_shape,
            st.flat_bounds)


def collect(
    state: Mapping[str, Any],
    rank: int,
    options: SaveOptions,
    *,
    copy: Any = None,
) -> Snapshot:
    """Flatten ``state`` and describe every local item.

    ``copy`` (``tensor -> tensor``): used by async save to copy each tensor
    into library-owned staging memory; None keeps views of the caller's memory.
    """
    from .adapters.dtensor import dtensor_shards

    leaves = flatten(state)
    sts: list[ShardedTensor] = list(leaves.tensors)
    for path, t in leaves.plain.items():
        sts.append(ShardedTensor(path, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim(),
                                 replica_id=rank))
    for path, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(path, dt))
    plain_fqns = set(leaves.plain)
    # plain tensors are replicas: every rank must hold the same ones (a tensor
    # held by one rank only is not a replica), compared like the common values
    presence = {f"<tensor>{p}": f"{tuple(t.shape)}:{t.dtype}" for p, t in leaves.plain.items()}
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
        data = st.data if copy is None else copy(st.data)
        mv = tensor_bytes(data)
        item = LocalTensorItem(
            fqn=fqn, dtype=dtype_name(st.data.dtype), global_shape=st.global_shape,
            global_offset=st.global_offset, local_shape=st.local_shape,
            flattened_range=st.flat_bounds, replica_id=st.replica_id, nbytes=len(mv),
        )
        tensors.append((item, mv, None))
    objects: list[tuple[LocalObjectItem, bytes]] = []
    for ob in leaves.objects:
        raw = codec.encode(ob.value, path=ob.key)
        objects.append((LocalObjectItem(key=ob.key, global_shape=ob.global_shape,
                                        global_offset=ob.global_offset, replica_id=ob.replica_id,
                                        nbytes=len(raw), digest=xxhash.xxh3_64_hexdigest(raw)), raw))
    values_json = {}
    value_digests: dict[str, str] = dict(presence)
    for path, v in leaves.values.items():
        try:
            j = codec.to_json(v, path=path)
        except TypeError as e:
            raise ShardingError(str(e)) from None
        values_json[path] = j
        value_digests[path] = xxhash.xxh3_64_hexdigest(msgspec.json.encode(j))
    clash = (set(values_json) | {o.key for o, _ in objects}) & {t.fqn for t, _, _ in tensors}
    if clash:
        raise ShardingError(f"names used both for a tensor and a value/object: {sorted(clash)[:5]}")
    snap = Snapshot(tensors=tensors, objects=objects, values=leaves.values, values_json=values_json,
                    aliases=aliases, value_digests=value_digests, plain=plain_fqns)
    if copy is None:
        finish_digests(snap, options)
    return snap


def finish_digests(snap: Snapshot, options: SaveOptions) -> None:
    """Compute block checksums (and replica digests) of the snapshot's tensors.

    Runs on the caller's thread for a synchronous save and in the background
    for an asynchronous one (the stall then only covers the copies)."""
    block = options.checksum_block_bytes
    for i, (item, mv, _) in enumerate(snap.tensors):
        # every holder must compute the digest when replicas are compared: replica_id 0
        # does not mean "not replicated" (another rank may hold the same chunk), and a
        # holder without a digest ("") would disagree with one that has it
        if options.checksums or options.verify_replicas or item.fqn in snap.plain:
            sums = block_digests(mv, block)
            item = msgspec.structs.replace(item, digest=digest_of(sums, len(mv)))
            snap.tensors[i] = (item, mv, sums if options.checksums else None)


def _check_values(plans: list[dict[str, Any]]) -> None:
    ref = plans[0]["value_digests"]
    for r, p in enumerate(plans[1:], start=1):
        d = p["value_digests"]
        if d != ref:
            keys = sorted(k for k in set(d) | set(ref) if d.get(k) != ref.get(k))
            raise ShardingError(
                f"common values differ between rank 0 and rank {r} at {keys[:10]} "
                "(plain values and plain tensors (<tensor>) must be held, equal, by every rank; "
                "per-rank values are ShardedObjects, per-rank tensors ShardedTensors; an empty "
                "list is a plain value: a rank that holds no shard of a tensor leaves its key out)"
            )


def _merge_aliases(plans: list[LocalPlan]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in plans:
        for a, t in p.aliases.items():
            if out.setdefault(a, t) != t:
                raise ShardingError(f"{a}: aliased to {out[a]!r} on one rank and {t!r} on rank {p.rank}")
    # a name aliased on one rank (it shares memory with another) but saved as a tensor of its
    # own elsewhere would be both in the manifest, its replicas never compared
    saved = {it.fqn: p.rank for p in plans for it in p.tensors}
    for a, t in out.items():
        if a in saved:
            raise ShardingError(
                f"{a}: shares memory with {t!r} on one rank (a tie) but is a tensor of its own on "
                f"rank {saved[a]}; declare it the same way on every rank (distinct names that "
                "must not be tied need memory of their own)")
    return out


def persist(storage: Storage, attempt: str, snap: Snapshot, plan: SavePlan, rank: int,
            options: SaveOptions) -> dict[str, Any]:
    """Write this rank's files of ``plan``; returns what the coordinator needs
    for the manifest (JSON-safe)."""
    files: dict[str, list[tuple[str, int]]] = {}
    for w in plan.writes.get(rank, ()):
        files.setdefault(w.file, []).append((w.kind, w.index))

    def write_one(name: str) -> dict[str, Any]:
        entries = files[name]
        items: list[FileItem] = []
        for kind, i in entries:
            if kind == "tensor":
                it, mv, sums = snap.tensors[i]
                from .sharding import itemsize as isz

                shape = (it.flattened_range[1] - it.flattened_range[0],) if it.flattened_range else it.local_shape
                items.append(FileItem(name=_storage_key(it), dtype=it.dtype, shape=tuple(shape), data=mv,
                                      itemsize=isz(it.dtype), checksums=sums))
            else:
                ob, raw = snap.objects[i]
                key = "__object__/" + ob.key + "@" + ",".join(map(str, ob.global_offset))
                items.append(FileItem(name=key, dtype="uint8", shape=(len(raw),),
                                      data=memoryview(raw), itemsize=1))
        size, checksum, written = write_shard_file(
            storage, storage.join(attempt, name), items, block_bytes=options.checksum_block_bytes,
            checksums=options.checksums, durable=options.durable)
        return {"name": name, "size": size, "checksum": checksum,
                "items": [[kind, i, w.offset, w.length, list(w.checksums)]
                          for (kind, i), w in zip(entries, written, strict=True)]}

    names = list(files)
    if len(names) <= 1:
        results = [write_one(n) for n in names]
    else:
        with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="reshard-write") as ex:
            results = list(ex.map(write_one, names))
    return {"files": results}


def build_manifest(
    plans: list[LocalPlan], written: list[dict[str, Any]], *, attempt_id: str, step: int | None,
    options: SaveOptions, values_json: Any, aliases: dict[str, str], world_size: int,
) -> Manifest:
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    files: dict[str, FileEntry] = {}
    for rank, rep in enumerate(written):
        lp = plans[rank]
        for f in rep["files"]:
            files[f["name"]] = FileEntry(size=f["size"], checksum=f["checksum"])
            for kind, i, off, length, sums in f["items"]:
                if kind == "tensor":
                    it = lp.tensors[i]
                    e = tensors.setdefault(it.fqn, {"dtype": it.dtype, "global_shape": it.global_shape,
                                                    "chunks": []})
                    e["chunks"].append(Chunk(global_offset=it.global_offset, local_shape=it.local_shape,
                                             flattened_range=it.flattened_range, file=f["name"],
                                             offset=off, length=length, checksums=tuple(sums)))
                else:
                    ob = lp.objects[i]
                    oe = objects.setdefault(ob.key, {"global_shape": ob.global_shape, "chunks": []})
                    oe["chunks"].append(ObjectChunk(global_offset=ob.global_offset, file=f["name"],
                                                    offset=off, length=length, checksums=tuple(sums)))
    m = Manifest(
        attempt_id=attempt_id, created_at=round(time.time(), 3), world_size=world_size,
        checksum_block_bytes=options.checksum_block_bytes, schema_version=options.schema_version,
        step=step, mesh=options.mesh,
        tensors={k: TensorEntry(dtype=v["dtype"], global_shape=v["global_shape"],
                                chunks=tuple(sorted(v["chunks"], key=lambda c: (c.global_offset, c.flattened_range or (0, 0)))))
                 for k, v in sorted(tensors.items())},
        objects={k: ObjectEntry(global_shape=v["global_shape"],
                                chunks=tuple(sorted(v["chunks"], key=lambda c: c.global_offset)))
                 for k, v in sorted(objects.items())},
        values=values_json, aliases=dict(sorted(aliases.items())),
        files=dict(sorted(files.items())), extra=dict(options.extra),
        parent=options.parent, lineage=options.lineage,
    )
    if options.hmac_key is not None:
        m = sign_manifest(m, options.hmac_key)
    return m


def check_step(step: Any) -> int | None:
    """``step`` as an int (Python, NumPy or 0-dim torch integers), or None.

    Raises:
        TypeError: anything else (bool, float, str, ...), before any data is written.
    """
    import numbers

    if step is None:
        return None
    if hasattr(step, "item") and getattr(step, "shape", None) == () and not isinstance(step, bool):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")
    return int(step)


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    group: Any = None,
    options: SaveOptions | None = None,
    storage: Storage | None = None,
) -> SaveResult:
    """Save ``state`` as one committed checkpoint at ``path``.

    Every rank of ``group`` calls it with its own local state. Each rank writes
    its own shard files; one writer per logical element (replicas deduplicated,
    written bytes balanced); the coordinator (rank 0) writes ``manifest.json``
    last and publishes the attempt.

    One call saves one checkpoint: the coordinator decides its location
    (``path`` made canonical: absolute, symbolic links resolved) and creates
    the attempt with a random nonce in it; before any rank writes data, every
    rank checks that its own ``path`` names the same location and reads the
    nonce back through its own storage. Before publishing, the coordinator
    checks every data file is there at the size its writer reported.

    Args:
        state: the state tree (see DESIGN.md section 2); not mutated.
        path: the checkpoint (local path, ``file://`` or ``memory://`` URL),
            the same location on every rank (spellings may differ: relative
            or absolute, through symbolic links). Missing parent directories
            are created.
        step: recorded in the manifest; ``latest`` orders by it.
        group: process group (default: the default group, or single-process).
        options: :class:`SaveOptions`.
        storage: a backend to use instead of resolving ``path``.

    Returns:
        SaveResult on every rank.

    Raises:
        CheckpointError (or the common subclass of every rank's failure, e.g.
        ShardingError): on every rank when any rank failed (among them: ranks
        naming different checkpoints, a rank that cannot see the
        coordinator's attempt (node-local storage), an IntegrityError for a
        data file missing or short at publish); nothing is published, the
        attempt is discarded and no older checkpoint is touched.
    """
    from .staging import raise_pending_error

    step = check_step(step)
    coll = get_collectives(group)
    opts = options or SaveOptions()
    raise_pending_error(group, wait=True)
    st, key = resolve(path, storage)
    t0 = time.perf_counter()
    snap = None
    err: BaseException | None = None
    try:
        snap = collect(state, coll.rank, opts)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        err = e
    return run_save(coll, st, key, snap, err, step=step, options=opts, t0=t0)


def run_save(
    coll: Collectives, st: Storage, key: str, snap: Snapshot | None, err: BaseException | None, *,
    step: int | None, options: SaveOptions, t0: float, on_attempt: Any = None, abort: Any = None,
) -> SaveResult:
    """Plan, persist, validate and publish a collected snapshot (shared by
    ``save`` and the background thread of ``async_save``)."""
    timings: dict[str, float] = {"stage": time.perf_counter() - t0}
    rank = coll.rank
    local: dict[str, Any] = {}
    try:
        if err is not None:
            raise err
        assert snap is not None
        if rank == 0:
            local.update(open_attempt(st, key, options))
        lp = LocalPlan(rank=rank, tensors=tuple(t for t, _, _ in snap.tensors),
                       objects=tuple(o for o, _ in snap.objects), aliases=snap.aliases)
        local["plan"] = msgspec.to_builtins(lp)
        local["value_digests"] = snap.value_digests
    except Exception as e:  # noqa: BLE001
        err = e
    t1 = time.perf_counter()
    gathered = coll.all_gather_json(outcome(rank, err, **local))
    if gathered[0].get("error") is None:
        attempt, target = gathered[0]["attempt_path"], gathered[0]["target"]
    else:
        attempt = target = None
    try:
        raise_agreed("save", gathered, err)
    except CheckpointError:
        if attempt is not None:
            discard_attempt(coll, st, attempt)
        raise
    assert snap is not None and attempt is not None and target is not None
    attempt_id = gathered[0]["attempt"]
    try:
        # deterministic over the gathered plans: every rank computes (or fails) the same
        plans = [msgspec.convert(g["plan"], LocalPlan) for g in gathered]
        _check_values(gathered)
        aliases = _merge_aliases(plans)
        plan = plan_save(plans, files_per_rank=options.files_per_rank)
    except Exception:
        discard_attempt(coll, st, attempt)
        raise
    agree_attempt_location(coll, st, key, gathered[0])
    timings["plan"] = time.perf_counter() - t1
    if on_attempt is not None:
        on_attempt(attempt)
    t2 = time.perf_counter()
    written: dict[str, Any] | None = None
    err = None
    try:  # into the coordinator's attempt, which this rank has been shown to see
        written = persist(st, attempt, snap, plan, rank, options)
    except OSError as e:  # a backend that raised a bare OSError: the store failed
        err = StorageError(f"{key}: writing rank {rank}'s files failed: {type(e).__name__}: {e}")
        err.__cause__ = e
    except Exception as e:  # noqa: BLE001
        err = e
    timings["write"] = time.perf_counter() - t2
    reports = agree_or_discard(coll, st, attempt, "save", outcome(rank, err, written=written), err)
    t3 = time.perf_counter()
    manifest = None
    err = None
    if rank == 0:
        try:
            if abort is not None and abort.is_set():
                raise CheckpointError(f"{key}: save abandoned before publishing")
            manifest = build_manifest(plans, [r["written"] for r in reports], attempt_id=attempt_id,
                                      step=step, options=options, values_json=snap.values_json,
                                      aliases=aliases, world_size=coll.world_size)
            publish(st, attempt, target, manifest, overwrite=options.overwrite,
                    durable=options.durable)
        except Exception as e:  # noqa: BLE001
            err = e
    agree_or_discard(coll, st, attempt, "save (publish)", outcome(rank, err), err)
    timings["commit"] = time.perf_counter() - t3
    total = sum(f["size"] for r in reports for f in r["written"]["files"])
    nfiles = sum(len(r["written"]["files"]) for r in reports)
    mine = sum(f["size"] for f in reports[rank]["written"]["files"])
    return SaveResult(path=key, step=step, attempt_id=attempt_id, bytes_written=mine,
                      total_bytes=total, num_files=nfiles, timings=timings, manifest=manifest)


def open_attempt(st: Storage, key: str, options: SaveOptions) -> dict[str, Any]:
    """Coordinator, before any rank writes: decide where the checkpoint goes.

    ``key`` is made canonical (``Storage.canonical``: absolute, symbolic
    links resolved), checked (:func:`~reshard.commit.check_target`), and the
    attempt is created with a nonce in it (:func:`~reshard.commit.create_attempt`).
    Returns what every rank needs (JSON-safe): ``target`` (the canonical
    checkpoint location), ``attempt`` (id), ``attempt_path`` and ``nonce``.
    """
    target = st.canonical(key)
    check_target(st, target, overwrite=options.overwrite)
    attempt_id = new_attempt_id()
    attempt = attempt_path(st, target, attempt_id)
    try:
        nonce = create_attempt(st, attempt, attempt_id)
    except Exception:
        try:  # nothing was published: the attempt (or the empty prefix) goes
            st.delete_tree(attempt)
        except Exception:  # noqa: BLE001, S110 - best effort; the creation error is what matters
            pass
        raise
    return {"target": target, "attempt": attempt_id, "attempt_path": attempt, "nonce": nonce}


def agree_attempt_location(coll: Collectives, st: Storage, key: str, coord: dict[str, Any]) -> None:
    """Every rank, before writing any data: the checkpoint this rank named is
    the coordinator's (same canonical spelling), and this rank sees the
    coordinator's attempt (it reads the nonce back through its own storage).
    Agreed: on any rank's failure every rank raises and the attempt is
    discarded, before any data is written.

    Args:
        coord: the coordinator's :func:`open_attempt` result.

    Raises:
        CheckpointError: ranks name different checkpoints, or a rank cannot
            see the coordinator's attempt (node-local storage).
    """
    err: BaseException | None = None
    try:
        mine = st.canonical(key)
        if mine != coord["target"]:
            raise CheckpointError(
                f"rank {coll.rank} names checkpoint {mine!r}, the coordinator (rank 0) names "
                f"{coord['target']!r}: every rank must pass the same checkpoint path (no per-rank "
                "names, relative paths resolved in one directory)")
        check_attempt(st, coord["attempt_path"], coord["nonce"], rank=coll.rank)
    except Exception as e:  # noqa: BLE001 - agreed below
        err = e
    agree_or_discard(coll, st, coord["attempt_path"], "save (attempt location)",
                     outcome(coll.rank, err), err)


def agree_or_discard(coll: Collectives, st: Storage, attempt: str, what: str,
                     mine: dict[str, Any], err: BaseException | None) -> list[dict[str, Any]]:
    """Gather every rank's outcome of a save phase; if any failed, discard the
    attempt (coordinator) and raise the agreed error on every rank. Returns the
    gathered outcomes."""
    gathered = coll.all_gather_json(mine)
    try:
        raise_agreed(what, gathered, err)
    except CheckpointError:
        discard_attempt(coll, st, attempt)
        raise
    return gathered


def discard_attempt(coll: Collectives, st: Storage, attempt: str) -> None:
    """Remove a failed attempt (coordinator only, after every rank stopped
    writing). Never touches a committed checkpoint: on rename-capable stores
    the attempt is its own directory; on others nothing was published."""
    if coll.rank != 0:
        return
    try:
        if st.capabilities.atomic_rename or not st.exists(st.join(attempt, MANIFEST_NAME)):
            st.delete_tree(attempt)
    except Exception:  # noqa: BLE001 - best effort; abandoned attempts are ignored anyway
        pass
