"""The check of one load before any byte is read (:func:`reshard.load`): every destination
placeable (no meta or fake tensor), on one device kind, and the saved keys against the target's
(missing, unexpected, shape, dtype, the allow rules and the hooks' own keys), agreed on every
rank through the key census; the outcome is the :class:`_Plan` the reads follow.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..errors import (
    IntegrityError,
    ManifestError,
    ShardingError,
)
from ..ondisk import codec
from ..ondisk.manifest import Manifest, ObjectChunk, TensorEntry
from ..ondisk.shardfile import BlockTables
from ..options import LoadOptions
from ..planning.coordination_load import KeyCensus
from ..planning.planner import check_entry_coverage
from ..planning.read_plan import Request, plan_reads
from ..state.sharding import ShardedObject, ShardedTensor
from ..state.tree import Leaves, join
from ..storage import Storage
from ..transforms import provided_by
from ..transforms import resolve as resolve_target
from .reading import Groups, Reader, Target


@dataclass(frozen=True, kw_only=True)
class LoadContext:
    """What the manifest phase of a load hands the check (:func:`_check`)
    and the reads: the manifest as this rank sees it (through the
    transforms, migrated, DCP values regrouped), the target tree's leaves
    (:class:`reshard.state.tree.Leaves`), every target tensor as
    ShardedTensors (detached: filled in place), what this rank requests by
    key ("tensor", "object", "value" or "handled"), and the containers the
    load fills: the loaded values and objects the tree's leaves read back,
    and ``LoadResult.notes``; the leaves whose kind changed between the
    save and the load (:func:`reshard.loading.load._kind_changes`)."""

    manifest: Manifest
    leaves: Leaves
    sts: list[ShardedTensor]
    requested: dict[str, str]
    loaded_values: dict[str, Any]
    loaded_objects: dict[tuple[str, tuple[int, ...]], Any]
    notes: dict[str, Any]
    #: saved as a tensor, requested as a plain value: read whole into these
    #: new CPU tensors (among ``sts``), handed over as the value
    as_tensor: dict[str, torch.Tensor] = field(default_factory=dict)
    #: saved as a number, requested as a one-element tensor: filled with it
    as_number: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What :func:`_check` found, for :func:`_apply` to write: read groups by
    (saved fqn, chunk index), ``allow_missing`` rules to run, transforms'
    finishing steps, and the already read and verified objects and values."""

    manifest: Manifest
    reader: Reader
    groups: Groups
    rules: list[tuple[str, Any, torch.Tensor]]
    finalize: list[Callable[[], None]]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    objects: dict[tuple[str, tuple[int, ...]], Any]
    values: dict[str, Any]


def _unplaceable(t: torch.Tensor) -> bool:
    """A tensor whose elements have no memory to fill: on device ``meta``, or a
    fake tensor (``torch._subclasses.FakeTensor``) standing in for one."""
    if t.is_meta:
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(is_fake(t))


def _check_devices(sts: Sequence[ShardedTensor], key: str) -> None:
    bad = [(s.fqn, str(s.data.device)) for s in sts if _unplaceable(s.data)]
    if bad:
        names = ", ".join(f"{f!r} on device {d!r}" for f, d in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ShardingError(f"{key}: cannot load into {names}{more}: the target has no memory to "
                            "fill; materialise with `to_empty()` first (e.g. "
                            "model.to_empty(device='cpu'))")


def _check(ctx: LoadContext, census: KeyCensus, st: Storage, key: str,
           opts: LoadOptions, strict: bool, allow_missing: Sequence[Any],
           transforms: Sequence[Any]) -> _Plan:
    """Everything that can be checked before any target is written: keys
    (strictness), target devices, shapes and dtypes (through the
    transforms), coverage, every needed file at once (presence, size, no
    symbolic link), objects (read and verified: they are small and go to
    ``LoadResult.values``, not into targets) and values. Writes nothing (the
    checksums of ``verify_first`` are checked by the caller, once it knows
    which blocks this rank reads)."""
    m = ctx.manifest
    allow = _compile_allow(allow_missing)
    missing, unexpected = _check_keys(ctx, census, key, allow, strict, transforms)
    _check_devices(ctx.sts, key)
    missing_set = set(missing)
    tensors = _plan_tensors(ctx, missing_set, allow, transforms)
    wanted = _wanted_objects(ctx, missing_set)
    _check_unchecked(m, tensors.groups, wanted, key, opts)
    reader = Reader(st, key, m, opts)
    reader.check_files(tensors.files | {oc.file for _, oc in wanted})
    objects, values = _read_objects(st, key, m, reader, wanted, opts)
    _check_hooks(ctx.leaves.statefuls, objects, ctx.notes, values)
    return _Plan(manifest=m, reader=reader, groups=tensors.groups, rules=tensors.rules,
                 finalize=tensors.finalize, missing=tuple(missing), unexpected=tuple(unexpected),
                 objects=objects, values=values)


Allow = list[tuple[Callable[[str], bool], Any]]


def _check_keys(ctx: LoadContext, census: KeyCensus, key: str, allow: Allow, strict: bool,
                transforms: Sequence[Any]) -> tuple[list[str], list[str]]:
    """The requested keys against the saved ones (through the transforms):
    returns the missing and the unexpected keys, or raises when nothing
    matches, a requested value was refused by the DCP reader, or a strict
    load misses keys that no ``allow_missing`` rule allows."""
    m = ctx.manifest
    saved = set(m.tensors) | set(m.aliases) | set(m.objects) | set((m.values or {}).keys())
    # names a Split/Merge fills are available, but are not saved keys: one that no
    # rank requests is not "unexpected" (its source is reported if nothing reads it)
    available = saved | provided_by(transforms, m)
    requested = ctx.requested
    missing = sorted(k for k in requested if k not in available)
    unexpected = list(census.unexpected)
    if census.any_requested and not census.any_matched:
        raise ShardingError(
            f"{key}: no requested key matches the checkpoint (requested e.g. "
            f"{sorted(requested)[:3]}, saved e.g. {sorted(saved)[:3]}); "
            "check prefixes or pass a rename transform"
        )
    refused = m.extra.get("dcp_skipped_values") or {}
    def refused_as(k: str) -> str | None:  # k, or the DCP value group holding it, was refused
        parts = k.split(".")
        return next((p for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                     if p in refused), None) if refused else None

    unsafe = sorted({g for g in map(refused_as, requested) if g is not None})
    if unsafe:  # present in the source, but only an unrestricted unpickler could read them
        raise IntegrityError(f"{key}: value(s) {unsafe[:5]} need more than torch.load(weights_only="
                             f"True) and are refused: {[refused[k] for k in unsafe[:2]]}")
    not_allowed = [k for k in missing if not any(match(k) for match, _ in allow)]
    if strict and (not_allowed or unexpected):
        parts = []
        if not_allowed:
            parts.append(f"missing from the checkpoint: {not_allowed[:20]}")
        if unexpected:
            parts.append(f"unexpected (saved but not requested): {unexpected[:20]}")
        raise ShardingError(f"{key}: strict load: " + "; ".join(parts))
    return missing, unexpected


@dataclass(frozen=True, kw_only=True)
class _TensorReads:
    """The tensor part of a load plan (:func:`_plan_tensors`): read groups by
    (saved fqn, chunk index), the ``allow_missing`` rules of missing
    targets, the transforms' finishing steps and the data files read."""

    groups: Groups
    rules: list[tuple[str, Any, torch.Tensor]]
    finalize: list[Callable[[], None]]
    files: set[str]


def _plan_tensors(ctx: LoadContext, missing: set[str], allow: Allow,
                  transforms: Sequence[Any]) -> _TensorReads:
    """Plan every target tensor's reads (through the transforms), checking
    the coverage of each saved tensor read from."""
    m = ctx.manifest
    groups: Groups = defaultdict(list)
    rules: list[tuple[str, Any, torch.Tensor]] = []
    finalize: list[Callable[[], None]] = []
    covered: set[str] = set()
    files: set[str] = set()
    for s in ctx.sts:
        res = None if s.fqn in missing else resolve_target(s, m, transforms)
        if res is None:
            rule = next((r for match, r in allow if match(s.fqn)), "keep")
            if rule != "keep":
                rules.append((s.fqn, rule, s.data))
            continue
        finalize.extend(res.finalize)
        for pc in res.pieces:
            entry: TensorEntry = m.tensors[pc.saved]
            if pc.saved not in covered:
                check_entry_coverage(pc.saved, entry)
                covered.add(pc.saved)
            req = Request(fqn=s.fqn, global_offset=pc.offset, local_shape=pc.shape,
                          flattened_range=pc.flattened_range)
            tgt = Target(req=req, dst=pc.dst, saved=pc.saved)
            for item in plan_reads(entry, req):
                groups[(pc.saved, item.chunk_index)].append((item, tgt))
                files.add(entry.chunks[item.chunk_index].file)
    return _TensorReads(groups=groups, rules=rules, finalize=finalize, files=files)


def _wanted_objects(ctx: LoadContext, missing: set[str]) -> list[tuple[ShardedObject, ObjectChunk]]:
    """The saved chunk of every requested object element (grid checks; read
    and verified by :func:`_read_objects` before any target is written)."""
    m = ctx.manifest
    wanted: list[tuple[ShardedObject, ObjectChunk]] = []
    for ob in ctx.leaves.objects:
        if ob.key in missing:
            continue
        oe = m.objects.get(ob.key)
        if oe is None:
            raise ShardingError(f"{ob.key}: saved as a tensor or value, requested as an object")
        if tuple(oe.global_shape) != tuple(ob.global_shape):
            raise ShardingError(
                f"object {ob.key}: saved as a grid of shape {list(oe.global_shape)}, requested in a grid "
                f"of shape {list(ob.global_shape)}; per-rank state cannot be resharded without a rule"
            )
        oc = next((c for c in oe.chunks if tuple(c.global_offset) == tuple(ob.global_offset)), None)
        if oc is None:
            raise ShardingError(f"object {ob.key}: element {list(ob.global_offset)} is not saved")
        wanted.append((ob, oc))
    return wanted


def _read_objects(st: Storage, key: str, m: Manifest, reader: Reader,
                  wanted: Sequence[tuple[ShardedObject, ObjectChunk]],
                  opts: LoadOptions) -> tuple[dict[tuple[str, tuple[int, ...]], Any], dict[str, Any]]:
    """Read, verify and decode the wanted object elements (each bounded by
    ``LoadLimits.value_bytes`` before it is read), and decode the saved
    values; returns the objects by ``(key, global_offset)`` and the values
    by key or tree path."""
    objects: dict[tuple[str, tuple[int, ...]], Any] = {}
    values: dict[str, Any] = {}
    from ..ondisk.limits import default_limits, too_large

    cap = (opts.limits if opts.limits is not None else default_limits()).value_bytes
    for ob, oc in wanted:
        if oc.length > cap:  # an encoded value is parsed whole: bounded before it is read
            raise ManifestError(too_large(f"{st.join(key, oc.file)}: object {ob.key!r} element "
                                          f"{list(ob.global_offset)}", "the encoded value",
                                          oc.length, cap, "value_bytes"))
    raw_of = _object_reader(st, key, [oc for _, oc in wanted])
    for ob, oc in wanted:
        raw = raw_of(oc)
        if opts.checksums and BlockTables.has(oc):
            b = m.checksum_block_bytes
            for k, digest in enumerate(reader.tables.sums(oc)):
                if xxhash.xxh3_64_hexdigest(raw[k * b:(k + 1) * b]) != digest:
                    raise IntegrityError(f"{st.join(key, oc.file)}: checksum mismatch in object "
                                         f"{ob.key!r} element {list(ob.global_offset)}")
        v = codec.decode(raw)
        objects[(ob.key, tuple(ob.global_offset))] = v
        values[ob.key] = v
    for p, enc in (m.values or {}).items():
        values[p] = codec.from_json(enc)
    return objects, values


def _object_reader(st: Storage, key: str, chunks: Sequence[Any]) -> Any:
    """``raw(oc)``: the bytes of wanted object chunk ``oc``. Per data file,
    the range from the first to the end of the last wanted object is read at
    once when the objects fill most of it (they are written side by side,
    last in a shard file: one read instead of one per object, and an
    optimizer has one per parameter); sparse ones are read one by one."""
    bounds: dict[str, list[int]] = {}
    for oc in chunks:
        b = bounds.setdefault(oc.file, [oc.offset, oc.offset + oc.length, 0])
        b[0], b[1], b[2] = min(b[0], oc.offset), max(b[1], oc.offset + oc.length), b[2] + oc.length
    spans = {name: (lo, st.read_bytes(st.join(key, name), lo, hi - lo))
             for name, (lo, hi, used) in bounds.items() if hi - lo <= 2 * used + (64 << 10)}

    def raw(oc: Any) -> bytes:
        got = spans.get(oc.file)
        if got is None:
            return st.read_bytes(st.join(key, oc.file), oc.offset, oc.length)
        return got[1][oc.offset - got[0]:oc.offset - got[0] + oc.length]

    return raw


_UNCHECKED_WARNED: set[str] = set()


def _check_unchecked(m: Manifest, groups: Groups, wanted: Sequence[tuple[ShardedObject, ObjectChunk]],
                     key: str, opts: LoadOptions) -> None:
    """Say so when what this rank reads carries no checksum (saved with
    ``checksums=False``, or its digests were removed from the manifest): one
    warning per checkpoint and process (``LoadOptions(unchecked="warn")``), an
    IntegrityError before any target is written (``"refuse"``), or nothing
    (``"accept"``; and with ``checksums=False``, the caller's own choice). A
    DCP checkpoint or a Hugging Face directory records no checksums at all:
    refused only on request."""
    if opts.unchecked == "accept" or not opts.checksums:
        return
    foreign = m.extra.get("source") in ("dcp", "huggingface")  # formats that record no checksum
    if foreign and opts.unchecked != "refuse":
        return
    bare = sorted({fqn for fqn, ci in groups if not BlockTables.has(m.tensors[fqn].chunks[ci])}
                  | {ob.key for ob, oc in wanted if not BlockTables.has(oc)})
    if not bare:
        return
    msg = (f"{key}: {len(bare)} tensor(s)/object(s) this load reads carry no checksum "
           f"(e.g. {bare[:3]}): their bytes cannot be verified (saved with checksums=False, or its "
           "manifest was edited to drop them; without an HMAC key the two look alike)")
    if opts.unchecked == "refuse":
        raise IntegrityError(f"{msg}; refused (LoadOptions(unchecked='refuse')), nothing was loaded")
    if key not in _UNCHECKED_WARNED:
        import logging
        import warnings

        _UNCHECKED_WARNED.add(key)
        logging.getLogger("reshard.loading").warning("%s; loaded unchecked (warned once)", msg)
        warnings.warn(f"{msg}; loaded unchecked", RuntimeWarning, stacklevel=4)


def _check_hooks(statefuls: Sequence[tuple[str, Any, Any]],
                 objects: Mapping[tuple[str, tuple[int, ...]], Any], notes: dict[str, Any],
                 values: Mapping[str, Any] | None = None) -> None:
    """Before any target is written, a Stateful with ``reshard_check_load(objects)``
    (e.g. an OptimizerState that must refuse saved hyperparameters its param
    groups cannot hold) sees the objects loaded for it (and the common values
    below it: a DCP checkpoint's ``param_groups``), by key relative to its
    position in the tree, and may raise; a mapping it returns is merged into
    ``notes`` under its path (as ``reshard_prepare_load``'s)."""
    for path, obj, _ in statefuls:
        hook = getattr(obj, "reshard_check_load", None)
        if not callable(hook):
            continue
        pre = f"{path}." if path else ""
        mine = {k[len(pre):]: v for k, v in (values or {}).items() if k.startswith(pre)}
        mine.update({k[len(pre):]: v for (k, _off), v in objects.items() if k.startswith(pre)})
        got = hook(mine)
        for k, v in (got or {}).items():
            notes[join(path, k)] = v


def _compile_allow(allow: Sequence[Any]) -> list[tuple[Callable[[str], bool], Any]]:
    """``allow_missing`` entries: a glob pattern (str), a compiled regex, or a
    ``(pattern, rule)`` pair where rule is "keep", "zeros" or a callable
    ``(fqn, tensor) -> None`` filling the tensor in place."""
    out: list[tuple[Callable[[str], bool], Any]] = []
    for a in allow:
        pat, rule = (a if isinstance(a, tuple) else (a, "keep"))
        if isinstance(pat, re.Pattern):
            def by_regex(k: str, p: re.Pattern[str] = pat) -> bool:
                return p.fullmatch(k) is not None

            out.append((by_regex, rule))
        else:
            def by_glob(k: str, p: str = str(pat)) -> bool:
                return fnmatch.fnmatchcase(k, p)

            out.append((by_glob, rule))
    return out
