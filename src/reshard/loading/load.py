"""Load: discover -> verify -> requests from the target state -> load plan ->
read exact byte ranges -> place into targets -> all ranks agree -> return."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ..adapters.model import ModelState
from ..collectives import Arrival, Collectives, Tries, get_collectives, timed_collectives, watch
from ..commit.leases import ReaderLease
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ShardingError,
)
from ..ondisk import codec
from ..ondisk.committed import read_manifest
from ..ondisk.manifest import FORMAT_VERSION, PATH_KEYS_VERSION, Manifest
from ..options import LoadOptions, hmac_key_of
from ..planning.coordination_load import key_census, read_shared
from ..state.sharding import ShardedTensor
from ..state.tree import HANDLED, flatten, join, positions, scoped_manifest, v1_rules
from ..storage import Storage, resolve
from ..transforms import consumed_by, extra_allow_missing, manifest_view
from .check import LoadContext, _check, _Plan
from .handover import _hand_over, _Handover, _plan_handover, _raise_after_writes
from .reading import Groups, read_once_wanted


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """What a load did.

    Attributes:
        path: the checkpoint loaded.
        step: the step recorded in its manifest.
        missing: requested keys the checkpoint does not hold (allowed by
            ``allow_missing`` or ``strict=False``); their targets are untouched
            unless an initialisation rule filled them.
        unexpected: saved keys no rank requested (only with ``strict=False``).
        initialized: missing keys filled by an ``allow_missing`` rule.
        values: common values by tree path, and object elements this rank
            requested by key.
        objects: every object element this rank requested, by ``(key,
            global_offset)`` (``values`` keeps one element per key).
        bytes_read: bytes this rank read from storage (everything: chunks,
            checksum tables, objects, the manifest on the coordinator).
        chunk_bytes_read: the part of ``bytes_read`` that is saved tensor
            chunks. With replicas read once, the sum over the ranks is the
            bytes of the distinct chunk ranges the ranks need (each read by
            one rank), plus the whole checksum blocks at the edges of a
            range that starts or ends inside one.
        bytes_received: chunk bytes this rank received from the ranks that
            read them (replicas read once), instead of reading them.
        bytes_sent: chunk bytes this rank read and sent to other ranks.
        duration_s: seconds the call took on this rank.
        manifest: the checkpoint's manifest.
        notes: what adapters report about the load (e.g. parameters of an
            optimizer that had no saved state, RNG streams re-derived).
        timings: seconds per phase on this rank: "manifest" (read, verify,
            target declared, ranks agreed), "plan" (load plan and every check
            before writing, agreed), "read" (read, verify checksums and place
            the bytes into the targets), "place" (the rest: finishing steps,
            agreement and the Stateful ``load_state_dict``).
    """

    path: str
    step: int | None
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    initialized: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    objects: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)
    bytes_read: int = 0
    chunk_bytes_read: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    duration_s: float = 0.0
    manifest: Manifest | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


#: ``LoadResult.notes`` entry of a checkpoint of an earlier format version
#: whose names were migrated: ``{"from_format_version": 1, "renamed": {new: old}}``.
MIGRATED = "reshard.format_migration"

#: ``LoadResult.notes`` entry of a load whose replica handover failed:
#: ``{"fallback": "<the failure>"}``; every rank then read what it was to
#: receive from storage itself.
READ_ONCE = "reshard.read_once"

MissingRule = str | Callable[[str, torch.Tensor], None]


def load(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    strict: bool = True,
    allow_missing: Sequence[Any] = (),
    transforms: Sequence[Any] = (),
    options: LoadOptions | None = None,
    storage: Storage | None = None,
    manifest: Manifest | None = None,
) -> LoadResult:
    """Fill the tensors of ``state`` in place from the checkpoint at ``path``.

    The target state declares what each rank needs: its ShardedTensors (with
    destination buffers in any layout), plain tensors ("the whole tensor"),
    DTensors, ShardedObjects and plain values; the load plan intersects each
    request with the saved chunks and reads only the byte ranges needed.

    Args:
        strict: missing and unexpected keys are errors (default).
        allow_missing: fqn patterns (glob str, compiled regex, or
            ``(pattern, rule)`` with rule "keep", "zeros" or a callable) that
            may be absent from the checkpoint.
        transforms: schema migrations applied to the saved view before planning
            (see :mod:`reshard.transforms`).
        options: :class:`LoadOptions`.
        storage: a backend to use instead of resolving ``path``.
        manifest: read through this manifest instead of ``path/manifest.json``
            (foreign formats: a DCP checkpoint or a Hugging Face directory
            presented as a reshard manifest over a storage that serves their
            bytes; see :mod:`reshard.ondisk.dcp` and :mod:`reshard.formats.hf_export`).

    Transactional up to the reads: everything that can be checked without
    reading data (the manifest, presence and size of every file this rank
    needs (all at once), coverage, dtypes, shapes, strictness, target devices,
    objects and values) is checked on every rank and agreed before any rank
    writes any target, so such a failure leaves every target unchanged on
    every rank. A failure found only while reading (a checksum mismatch)
    raises after some targets were written: the error names, on each rank,
    the targets that rank had already written (they must be reloaded).
    ``LoadOptions(verify_first=True)`` verifies every needed block first, at
    the cost of a second read, so that bit rot too leaves targets unchanged.
    Stateful objects get ``load_state_dict`` only once every rank succeeded.

    Replicas are read once (``LoadOptions.read_once``, by default on
    remote storage: an object store, a network file system): a
    chunk range that several ranks need (DP replicas, a TP shard every PP
    stage or DP rank of a new layout wants) is read from storage by one of
    them, the coordinator balancing the bytes each rank reads, and sent to
    the others point to point over ``group`` (one gather of every rank's
    ranges to the coordinator and one scatter of each rank's part, then the
    transfers; DESIGN.md section 1's budget holds). The reader verifies the
    checksums; the receivers place the bytes as they came. When a transfer
    fails on any rank, every rank reads the ranges it was to receive from
    storage itself and ``LoadResult.notes[READ_ONCE]`` names the failure.

    Readers hold leases: the coordinator holds a reader lease on the
    checkpoint (one per load group, :mod:`reshard.commit.leases`) from before
    the manifest is read until the load returns, so retention and gc keep
    it; where the lease cannot be written the load warns once and reads
    unprotected (``LoadOptions(require_lease=True)``: refuses). A load whose
    files are deleted anyway (by hand) fails with one CheckpointNotFoundError
    saying so and whether this rank's targets are unchanged or must be
    reloaded. Chunks saved without checksums are loaded with one warning
    naming the checkpoint (``LoadOptions(unchecked=...)``). With an HMAC key
    (``LoadOptions.hmac_key`` or the environment's) an unsigned or
    mis-signed manifest is refused.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        ManifestError, IntegrityError: the checkpoint is invalid or corrupt
            (a needed file missing, of another size, or a symbolic link; a
            checksum mismatch).
        ShardingError: missing/unexpected keys (strict), shape or dtype
            mismatch (nothing is cast silently), a load that matches no key,
            a target on device ``meta`` (materialise with ``to_empty()`` first).
        Every failure is raised on every rank of ``group``.
    """
    opts = options or LoadOptions()
    if opts.hmac_key is None or not opts.hmac_key:  # the environment's key (NO_HMAC_KEY: none)
        opts = dataclasses.replace(opts, hmac_key=hmac_key_of(opts.hmac_key))
    lease, lease_err = None, None
    if manifest is None and get_collectives(group).rank == 0:  # one lease per load group
        st, key = resolve(path, storage)
        storage, path = st, key
        try:
            lease = ReaderLease(st, key, what="load").acquire(required=opts.require_lease)
            lease.confirm()
        except Exception as e:  # noqa: BLE001 - agreed on every rank by _load
            lease_err = e
    return load_leased(state, path, lease=lease, lease_err=lease_err, group=group, strict=strict,
                       allow_missing=allow_missing, transforms=transforms, options=opts,
                       storage=storage, manifest=manifest)


def load_leased(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    lease: ReaderLease | None,
    lease_err: BaseException | None = None,
    group: Any = None,
    strict: bool = True,
    allow_missing: Sequence[Any] = (),
    transforms: Sequence[Any] = (),
    options: LoadOptions | None = None,
    storage: Storage | None = None,
    manifest: Manifest | None = None,
) -> LoadResult:
    """:func:`load` under a reader lease the caller took on the checkpoint
    (rank 0's, None on the other ranks or where none could be written;
    :func:`reshard.catalog.newest.load_latest` takes it while choosing the
    checkpoint). ``lease_err``: rank 0's failure to take it, raised on every
    rank (agreed) before anything is read. The lease is released when the
    load returns or raises. ``options`` as :func:`load` resolved them: their
    HMAC key already chosen (:func:`reshard.options.hmac_key_of` applied
    once). Same arguments, result and errors as :func:`load`."""
    try:
        return _load(state, path, group=group, strict=strict, allow_missing=allow_missing,
                     transforms=transforms, options=options or LoadOptions(), storage=storage, manifest=manifest,
                     lease=lease, lease_err=lease_err)
    finally:
        if lease is not None:
            lease.release()


def _load(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    group: Any,
    strict: bool,
    allow_missing: Sequence[Any],
    transforms: Sequence[Any],
    options: LoadOptions,
    storage: Storage | None,
    manifest: Manifest | None,
    lease: Any = None,
    lease_err: BaseException | None = None,
) -> LoadResult:
    """The body of :func:`load` (the lease is the caller's): the manifest
    phase (:func:`_open`), the check (:func:`_checked_reads`), the reads
    (:func:`_read_and_place`), then the Stateful objects
    (:func:`_load_statefuls`), each agreed by every rank."""
    opts = options or LoadOptions()
    # every rank checks in first: a load called on some ranks only fails there, naming the others
    coll = timed_collectives(group, opts.timeout_s, arrival=Arrival(
        kind="load", what=f"load of {os.fspath(path)}", timeout_s=opts.arrival_timeout_s))
    # progress lines and collective failures name the load and its phase
    doing = {"what": f"load of {path}", "phase": "manifest"}
    watch(coll, lambda: (doing["what"], doing["phase"]))
    if coll.rank != 0 and opts.progress is not False:  # one progress bar: rank 0's
        opts = dataclasses.replace(opts, progress=False)
    t0 = time.perf_counter()
    st, key = resolve(path, storage)
    base, before = st, st.bytes_read  # (a DCP checkpoint is read through `base`)
    st, ctx = _open(coll, state, st, key, opts, transforms, manifest, Tries(lease_err))
    doing.update(what=f"load of step {ctx.manifest.step}", phase="plan")
    t_plan = time.perf_counter()
    reads = _checked_reads(coll, ctx, st, base, key, opts, strict, allow_missing, transforms)
    t_read = time.perf_counter()
    doing["phase"] = "read"
    result = _read_and_place(coll, reads, ctx, key, lease)
    t_placed = time.perf_counter()
    # hand loaded plain values to Stateful objects, only once every rank succeeded
    doing["phase"] = "load_state_dict"
    tries = Tries()
    with tries:
        _load_statefuls(ctx.leaves.statefuls)
    tries.agree(coll, "load (load_state_dict)")
    total = time.perf_counter() - t0
    timings = {"manifest": t_plan - t0, "plan": t_read - t_plan, "read": t_placed - t_read}
    timings["place"] = total - sum(timings.values())
    hand = reads.hand
    return dataclasses.replace(result, path=base.url(key), bytes_read=base.bytes_read - before,
                               chunk_bytes_read=reads.plan.reader.chunk_bytes,
                               bytes_received=hand.received if hand is not None else 0,
                               bytes_sent=hand.sent if hand is not None else 0,
                               duration_s=total, timings=timings)


#: what a failure agreed before any target was written says
_UNCHANGED = "load (checked before writing: every target is unchanged)"


@dataclass(frozen=True, kw_only=True)
class _Reads:
    """What the check phase of a load hands the reads: the checked plan,
    the replica handover (None: every rank reads all it needs) and the read
    groups this rank reads from storage itself."""

    plan: _Plan
    hand: _Handover | None
    local: Groups


def _open(coll: Collectives, state: Mapping[str, Any], st: Storage, key: str, opts: LoadOptions,
          transforms: Sequence[Any], manifest: Manifest | None,
          tries: Tries) -> tuple[Storage, LoadContext]:
    """The manifest phase: the manifest read once and shared (unless given),
    its structure checked on the coordinator, the target tree walked
    (:func:`_prepare`); agreed (one all-reduce). Returns the storage the
    checkpoint is read through (a DCP checkpoint's own) and the context."""
    if manifest is None:
        with tries:
            st, manifest = _read_shared(coll, st, key, opts)
    ctx: LoadContext | None = None
    if tries.ok:
        with tries:
            if coll.rank == 0 and manifest is not None:  # what verify and inspect refuse, load refuses
                _check_structure(manifest, st.join(key, "manifest.json"))
            ctx = _prepare(state, st, key, opts, transforms, coll, manifest)
    # agree on the manifest (one all-reduce); the coordinator finds the keys no
    # rank requested from every rank's key bitmap (gather, then one broadcast)
    tries.agree(coll, "load")
    assert ctx is not None
    return st, ctx


def _checked_reads(coll: Collectives, ctx: LoadContext, st: Storage, base: Storage, key: str,
                   opts: LoadOptions, strict: bool, allow_missing: Sequence[Any],
                   transforms: Sequence[Any]) -> _Reads:
    """The check phase: the key census, every check that needs no target
    write (files, coverage, shapes, dtypes, strictness, devices) and, with
    ``verify_first``, every block this rank reads; agreed before any rank
    changes any target. Decides whether replicas are read once (and plans
    the handover)."""
    census = key_census(coll, ctx.manifest, ctx.requested, transforms)
    tries = Tries()
    plan: _Plan | None = None
    with tries:
        plan = _check(ctx, census, st, key, opts, strict,
                      [*allow_missing, *extra_allow_missing(transforms)], transforms)
    # read_once ("auto": on for remote storage) rides along (max of "off"): on only when every rank asks for it
    off = tries.agree(coll, _UNCHANGED, values=[0 if read_once_wanted(opts.read_once, base, key) else 1])
    assert plan is not None
    share = coll.world_size > 1 and not off[0]
    hand: _Handover | None = None
    local = plan.groups
    if share:
        hand = _plan_handover(coll, plan, opts.read_once_min_bytes)
        local = {k: v for k, v in plan.groups.items() if k not in hand.recv}
    if opts.verify_first:  # every block this rank reads, before any target is written
        with tries:
            plan.reader.verify_only(local)
        tries.agree(coll, _UNCHANGED)
    return _Reads(plan=plan, hand=hand, local=local)


def _read_and_place(coll: Collectives, reads: _Reads, ctx: LoadContext, key: str,
                    lease: Any) -> LoadResult:
    """The read phase: this rank's reads, the replica handover (or, when it
    failed on any rank, the fallback reads), the finishing steps and
    ``allow_missing`` rules; each agreed, a failure naming the targets this
    rank had already written."""
    plan, hand = reads.plan, reads.hand

    def after_writes(agreed: CheckpointError, mine: BaseException | None) -> None:
        _raise_after_writes(coll.rank, agreed, mine, plan.reader.written)

    tries = Tries()
    with tries:
        try:
            plan.reader.run(reads.local, keep=hand.send if hand is not None else ())
        except Exception as e:  # noqa: BLE001 - a deleted file named as such, agreed below
            gone = _vanished(e, key, lease)
            if gone is e:
                raise
            raise gone from e
    tries.agree(coll, "load", on_fail=after_writes)
    fallback = _hand_over(coll, plan, hand) if hand is not None else None
    # finishing steps and allow_missing rules: only once every rank's reads succeeded
    result: LoadResult | None = None
    with tries:
        if fallback is not None and hand is not None:  # every rank reads what it was to receive
            plan.reader.run({k: plan.groups[k] for k in hand.recv})
            ctx.notes[READ_ONCE] = {"fallback": fallback}
        result = _finish(plan, ctx, key)
    tries.agree(coll, "load", on_fail=after_writes)
    assert result is not None
    return result


def _load_statefuls(statefuls: Sequence[tuple[str, Any, Callable[[], Any]]]) -> None:
    """Hand the loaded state to the Stateful objects of the tree (once
    every rank's reads succeeded), with their hooks around it."""
    peers = [obj for _path, obj, _ in statefuls]
    # a Stateful with reshard_before_load(peers) sees every other one as constructed
    # (OptimizerState notes its LR schedulers' constructed per-group lists)
    for _path, obj, _ in statefuls:
        hook = getattr(obj, "reshard_before_load", None)
        if callable(hook):
            hook(peers)
    for _path, _obj, restore in statefuls:  # post-order: a leaf restored before its holder
        restore()  # (a Stateful's load_state_dict, a handler's Tree.restore: reshard.state.kinds)
    # then a Stateful with reshard_finish_load(peers) sees every other one loaded
    # (OptimizerState(hyperparams="current") rebases the LR schedulers of its optimizer)
    for _path, obj, _ in statefuls:
        hook = getattr(obj, "reshard_finish_load", None)
        if callable(hook):
            hook(peers)


def _check_structure(m: Manifest, where: str) -> None:
    """The structural validation :func:`reshard.verify` and
    :func:`reshard.inspect` share (:func:`reshard.planning.validation.structure_problems`),
    on the coordinator; every rank raises what it finds (agreed).

    Raises:
        CoverageError: a tensor's chunks do not tile it. ManifestError: any other problem."""
    from ..errors import CoverageError, ManifestError
    from ..planning.validation import structure_problems

    bad = structure_problems(m, where=where)
    if bad:
        cls = CoverageError if all(p.startswith("coverage:") for p in bad) else ManifestError
        raise cls(f"{where}: {len(bad)} structural problem(s), nothing was loaded: " + "; ".join(bad[:5]))


def _vanished(e: BaseException, key: str, lease: Any) -> BaseException:
    """A data file gone while the load read it (deleted by hand, or by a
    tool that ignores reader leases): one clear CheckpointNotFoundError (the
    caller's agreement adds which targets are unchanged or must be reloaded)."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)) and not isinstance(e, CheckpointError):
        held = ("this load held a reader lease on it, so something that ignores leases deleted it "
                "(a person, by hand)" if lease is not None and lease.held
                else "no reader lease protected it")
        out = CheckpointNotFoundError(f"{key}: {getattr(e, 'filename', None) or e} was deleted while "
                                      f"this load was reading the checkpoint ({held})")
        out.__cause__ = e
        return out
    return e


def _read_shared(coll: Collectives, st: Storage, key: str, opts: LoadOptions) -> tuple[Storage, Manifest]:
    """The manifest read once by the coordinator and broadcast, with the
    check that every rank names the coordinator's checkpoint (see
    :func:`reshard.planning.coordination_load.read_shared`); a DCP checkpoint, or any
    failure, is opened by every rank itself (:func:`_read_or_dcp`)."""
    m = read_shared(coll, st, key, hmac_key=opts.hmac_key, limits=opts.limits)
    if m is None:
        return _read_or_dcp(st, key, opts)
    return st, m


def _read_or_dcp(st: Storage, key: str, opts: LoadOptions) -> tuple[Storage, Manifest]:
    """The manifest at ``key``; where there is none but a PyTorch DCP
    ``.metadata``, the DCP checkpoint presented by :func:`reshard.ondisk.dcp.open_dcp`
    (unsigned: refused when an HMAC key is given)."""
    try:
        return st, read_manifest(st, key, hmac_key=opts.hmac_key, limits=opts.limits)
    except CheckpointNotFoundError:
        from ..ondisk.dcp import DCP_METADATA, open_dcp

        if not st.exists(st.join(key, DCP_METADATA)):
            raise
        if opts.hmac_key is not None:
            raise IntegrityError(f"{key}: a DCP checkpoint carries no HMAC, but an HMAC key was "
                                 "given") from None
        return open_dcp(key, storage=st, limits=opts.limits)


def _prepare(state: Mapping[str, Any], st: Storage, key: str, opts: LoadOptions,
             transforms: Sequence[Any], coll: Collectives,
             manifest: Manifest | None = None) -> LoadContext:
    from ..adapters.dtensor import dtensor_shards

    if manifest is None:
        manifest = read_manifest(st, key, hmac_key=opts.hmac_key, limits=opts.limits)
    m = manifest_view(manifest, transforms)
    if opts.schema_version is not None and m.schema_version != opts.schema_version:
        raise ShardingError(f"{key}: checkpoint schema_version {m.schema_version!r} differs from the "
                            f"expected {opts.schema_version!r}; pass a migration in transforms")
    notes: dict[str, Any] = {}
    _prepare_hooks(state, m, notes)
    loaded_values: dict[str, Any] = {}
    loaded_objects: dict[tuple[str, tuple[int, ...]], Any] = {}
    leaves = flatten(state, loaded_values=loaded_values, loaded_objects=loaded_objects,
                     module_adapter=ModelState)
    if m.format_version < PATH_KEYS_VERSION:
        version = m.format_version
        m, moved = _migrate_v1(m, leaves.legacy)
        notes[MIGRATED] = {"from_format_version": version, "renamed": moved}
    if "dcp_values" in m.extra:  # a DCP checkpoint (or one converted from DCP): its leaf values
        from ..ondisk.dcp_values import regroup  # grouped into the paths this state asks for

        m = regroup(m, set(leaves.values))
    sts: list[ShardedTensor] = list(leaves.tensors)
    for p, t in leaves.plain.items():
        sts.append(ShardedTensor(p, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim()))
    for p, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(p, dt))
    # destinations are filled in place: an nn.Parameter (a leaf that requires
    # grad) is written through a detached alias of the same storage
    sts = [dataclasses.replace(s, data=s.data.detach()) if s.data.requires_grad else s for s in sts]
    sts, as_tensor, as_number = _kind_changes(m, leaves, sts)
    requested: dict[str, str] = {}
    for s in sts:
        requested[s.fqn] = "tensor"
    for ob in leaves.objects:
        requested[ob.key] = "object"
    for p in leaves.values:
        requested[p] = "value"
    for p in as_tensor:
        requested[p] = "tensor"
    for p in as_number:
        requested[p] = "value"
    for k in notes.pop(HANDLED, ()):
        requested.setdefault(k, "handled")
    for k in consumed_by(transforms, requested, m):
        requested.setdefault(k, "handled")
    return LoadContext(manifest=m, leaves=leaves, sts=sts, requested=requested,
                       loaded_values=loaded_values, loaded_objects=loaded_objects, notes=notes,
                       as_tensor=as_tensor, as_number=as_number)


def _kind_changes(m: Manifest, leaves: Any, sts: list[ShardedTensor]
                  ) -> tuple[list[ShardedTensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A leaf saved as a tensor and requested as a plain value, or the other
    way round (a trainer counter such as TorchTitan's ``train_state.step``,
    an int in one version and a 0-dim tensor in another): the value
    round-trips as it was saved instead of being left as the template had it.
    Returns the tensor targets to read, the values to hand over as the tensors
    saved (read whole, on CPU, into new tensors added to the targets) and the
    tensor targets to fill with the number saved (a one-element target of a
    saved int, float or bool; taken off the reads)."""
    from ..state.sharding import torch_dtype

    values = m.values or {}
    as_tensor: dict[str, torch.Tensor] = {}
    for p in leaves.values:
        e = m.tensors.get(p)
        if e is None or p in values:
            continue
        t = torch.empty(tuple(e.global_shape), dtype=torch_dtype(e.dtype))
        as_tensor[p] = t
        sts = [*sts, ShardedTensor(p, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]
    as_number: dict[str, torch.Tensor] = {}
    for s in sts:
        if s.fqn in values and s.fqn not in m.tensors and s.fqn not in m.aliases:
            v = codec.from_json(values[s.fqn])
            if not isinstance(v, (int, float, bool)) or s.data.numel() != 1 \
                    or tuple(s.global_shape) != tuple(s.data.shape):
                raise ShardingError(
                    f"{s.fqn}: saved as a value ({type(v).__name__}), requested as a tensor of global "
                    f"shape {list(s.global_shape)}: only a number loads into a one-element tensor")
            as_number[s.fqn] = s.data
    if as_number:
        sts = [s for s in sts if s.fqn not in as_number]
    return sts, as_tensor, as_number


def _prepare_hooks(state: Any, m: Manifest, notes: dict[str, Any]) -> None:
    """Let adapters see the manifest before they declare what they need: an
    object with ``reshard_prepare_load(manifest) -> dict | None`` (e.g. an
    OptimizerState that creates the state tensors of a fresh optimizer, or an
    RNGState that must re-derive streams for another grid) is called once,
    before the state tree is walked, with the manifest as seen from its
    position in the tree (:func:`reshard.state.tree.scoped_manifest`: names relative
    to it). The notes it returns are relative too: they are merged into
    ``LoadResult.notes`` under its path (its ``HANDLED`` keys likewise)."""
    for path, x in positions(state):
        hook = getattr(x, "reshard_prepare_load", None)
        if not callable(hook) or isinstance(x, type):
            continue
        out = hook(scoped_manifest(m, path, v1_rules(x)))
        for k, v in (out or {}).items():
            if k == HANDLED:
                notes.setdefault(HANDLED, []).extend(join(path, h) for h in v)
            else:
                notes[join(path, k)] = v


def _migrate_v1(m: Manifest, legacy: dict[str, str]) -> tuple[Manifest, dict[str, str]]:
    """A format-version-1 manifest with its names moved to those of the
    target tree (version 1 named a ShardedTensor or ShardedObject by its fqn
    alone, without its container's path). ``legacy``: new key -> old name.
    Returns the migrated view and the names it moved (new -> old)."""
    moved = {new: old for new, old in legacy.items()
             if new not in m.tensors and new not in m.objects
             and (old in m.tensors or old in m.objects or old in m.aliases)}
    if not moved:
        return msgspec.structs.replace(m, format_version=FORMAT_VERSION), {}
    kept = set(legacy)  # an old name that is also a key of the target stays as it is
    first: dict[str, str] = {}
    for new, old in moved.items():
        first.setdefault(old, new)

    def rn(k: str) -> str:
        return k if k in kept else first.get(k, k)

    def move(d: dict[str, Any]) -> dict[str, Any]:
        out = {rn(k): v for k, v in d.items()}
        out.update({new: d[old] for new, old in moved.items() if old in d})
        return out

    aliases = {rn(k): rn(t) for k, t in m.aliases.items()}
    aliases.update({new: rn(m.aliases[old]) for new, old in moved.items() if old in m.aliases})
    return msgspec.structs.replace(m, format_version=FORMAT_VERSION, tensors=move(m.tensors),
                                   objects=move(m.objects), aliases=aliases), moved


def _finish(plan: _Plan, ctx: LoadContext, key: str) -> LoadResult:
    """What follows the reads of a checked plan: transforms' finishing steps,
    then the ``allow_missing`` rules; hand objects and values to the tree."""
    m = plan.manifest
    for fn in plan.finalize:
        fn()
    initialized: list[str] = []
    for fqn, rule, t in plan.rules:
        plan.reader.mark_written(fqn)
        if rule == "zeros":
            t.zero_()
        elif callable(rule):
            rule(fqn, t)
        if fqn not in initialized:
            initialized.append(fqn)
    ctx.loaded_objects.update(plan.objects)
    for p in m.values or {}:
        if p in ctx.leaves.values:
            ctx.loaded_values[p] = plan.values[p]
    for p, t in ctx.as_tensor.items():  # saved as a tensor, requested as a value
        ctx.loaded_values[p] = t
    for p, t in ctx.as_number.items():  # saved as a number, requested as a tensor
        t.fill_(plan.values[p])
    return LoadResult(path=key, step=m.step, missing=plan.missing, unexpected=plan.unexpected,
                      initialized=tuple(initialized), values=plan.values, objects=dict(plan.objects),
                      manifest=m,
                      notes=dict(ctx.notes))


