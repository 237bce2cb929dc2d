"""Load: discover -> verify -> requests from the target state -> load plan ->
read exact byte ranges -> place into targets -> all ranks agree -> return."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import torch
import xxhash

from . import codec
from .collectives import Collectives, get_collectives
from .commit import read_manifest
from .errors import (
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    ShardingError,
    outcome,
    raise_agreed,
)
from .manifest import FORMAT_VERSION, Chunk, Manifest, TensorEntry
from .options import LoadOptions
from .planning import ReadItem, Request, _strides, check_entry_coverage, plan_reads
from .sharding import ShardedTensor, torch_dtype
from .storage import Storage, resolve
from .transforms import consumed_by, extra_allow_missing, manifest_view, provided_by
from .transforms import resolve as resolve_target
from .tree import flatten, join, positions, scoped_manifest, v1_rules


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
        bytes_read: bytes this rank read from storage.
        duration_s: seconds the call took on this rank.
        manifest: the checkpoint's manifest.
        notes: what adapters report about the load (e.g. parameters of an
            optimizer that had no saved state, RNG streams re-derived).
    """

    path: str
    step: int | None
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    initialized: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    duration_s: float = 0.0
    manifest: Manifest | None = None
    notes: dict[str, Any] = field(default_factory=dict)


#: a ``reshard_prepare_load`` hook returns ``{HANDLED: [keys]}`` for saved keys
#: it consumes by a rule of its own (e.g. RNG streams re-derived for another
#: grid), so they are not reported as unexpected.
HANDLED = "reshard.handled_keys"

#: ``LoadResult.notes`` entry of a checkpoint of an earlier format version
#: whose names were migrated: ``{"from_format_version": 1, "renamed": {new: old}}``.
MIGRATED = "reshard.format_migration"

MissingRule = str | Callable[[str, torch.Tensor], None]


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


@dataclass
class _Target:
    req: Request
    dst: torch.Tensor
    saved: str  # fqn in the manifest (differs from req.fqn for aliases)


def _view_u8(buf: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    part = buf[start:stop]
    isz = dtype.itemsize
    if isz > 1 and (part.storage_offset() % isz or part.data_ptr() % isz):
        part = part.clone()
    return part.view(dtype)


def _copy(item: ReadItem, chunk: Chunk, t: _Target, src1d: torch.Tensor) -> None:
    """Copy ``src1d`` (the chunk's elements covering [byte_start, byte_stop))
    into the target's destination."""
    req, dst = t.req, t.dst
    if item.kind == "box":
        if len(item.box_shape) == 0:
            dst.copy_(src1d.reshape(()))
            return
        src = torch.as_strided(src1d, item.box_shape, _strides(chunk.local_shape))
        region = dst[tuple(slice(o - r, o - r + n) for o, r, n in
                           zip(item.box_offset, req.global_offset, item.box_shape, strict=True))]
        region.copy_(src)
        return
    if item.kind == "flat":
        if req.flattened_range is not None:
            a = req.flattened_range[0]
            dst[item.flat_start - a:item.flat_stop - a].copy_(src1d)
            return
        if dst.is_contiguous():
            dst.view(-1)[item.flat_start:item.flat_stop].copy_(src1d)
            return
    _gather_copy(item, chunk, t, src1d)


def _gather_copy(item: ReadItem, chunk: Chunk, t: _Target, src1d: torch.Tensor) -> None:
    req, dst = t.req, t.dst
    grids = torch.meshgrid(*[torch.arange(o, o + n) for o, n in zip(item.box_offset, item.box_shape,
                                                                     strict=True)], indexing="ij")
    cst, rst = _strides(chunk.local_shape), _strides(req.local_shape)
    fc = sum(((g - o) * s for g, o, s in zip(grids, chunk.global_offset, cst, strict=True)),
             torch.zeros((), dtype=torch.int64)).reshape(-1)
    fr = sum(((g - o) * s for g, o, s in zip(grids, req.global_offset, rst, strict=True)),
             torch.zeros((), dtype=torch.int64)).reshape(-1)
    mask = torch.ones_like(fc, dtype=torch.bool)
    cbase = 0
    if chunk.flattened_range is not None:
        mask &= (fc >= chunk.flattened_range[0]) & (fc < chunk.flattened_range[1])
        cbase = chunk.flattened_range[0]
    rbase = 0
    if req.flattened_range is not None:
        mask &= (fr >= req.flattened_range[0]) & (fr < req.flattened_range[1])
        rbase = req.flattened_range[0]
    isz = src1d.element_size()
    first = cbase + item.byte_start // isz
    vals = src1d[fc[mask] - first]
    if req.flattened_range is not None:
        dst[fr[mask] - rbase] = vals
    elif dst.is_contiguous():
        dst.view(-1)[fr[mask]] = vals
    else:
        flat = dst.contiguous()
        flat.view(-1)[fr[mask]] = vals
        dst.copy_(flat)


#: direct reads go in segments of about this many bytes (whole checksum blocks)
_SEGMENT_BYTES = 4 << 20


class _Reader:
    """Executes read items: verified, coalesced, direct where possible."""

    def __init__(self, st: Storage, ckpt: str, m: Manifest, opts: LoadOptions):
        self.st, self.ckpt, self.m, self.opts = st, ckpt, m, opts
        self.checked: set[str] = set()

    def check_file(self, name: str) -> str:
        p = self.st.join(self.ckpt, name)
        if name in self.checked:
            return p
        if self.st.is_link(p):
            raise ManifestError(f"{p}: data file is a symbolic link (refused)")
        try:
            size = self.st.size(p)
        except FileNotFoundError:
            raise IntegrityError(f"{p}: data file named by the manifest is missing") from None
        want = self.m.files[name].size
        if size != want:
            raise IntegrityError(f"{p}: file is {size} bytes, the manifest declares {want}")
        self.checked.add(name)
        return p

    def verify(self, fqn: str, c: Chunk, lo: int, data: torch.Tensor) -> None:
        """Check the blocks of chunk ``c`` that ``data`` (chunk bytes from
        ``lo``, block aligned) holds."""
        if not self.opts.checksums or not c.checksums:
            return
        b = self.m.checksum_block_bytes
        mv = memoryview(data.numpy().data) if data.numel() else memoryview(b"")
        n = len(mv)
        for k in range(lo // b, -(-(lo + n) // b)):
            a = k * b - lo
            seg = mv[a:min(a + b, n)]
            if xxhash.xxh3_64_hexdigest(seg) != c.checksums[k]:
                raise IntegrityError(
                    f"{self.st.join(self.ckpt, c.file)}: checksum mismatch in {fqn!r} (chunk at "
                    f"{list(c.global_offset)}, block {k}, file bytes [{c.offset + k * b}, "
                    f"{c.offset + k * b + len(seg)}))"
                )

    def span(self, c: Chunk, items: list[tuple[ReadItem, _Target]]) -> tuple[int, int]:
        lo = min(i.byte_start for i, _ in items)
        hi = max(i.byte_stop for i, _ in items)
        if self.opts.checksums and c.checksums:
            b = self.m.checksum_block_bytes
            lo = lo // b * b
            hi = min(-(-hi // b) * b, c.length)
        return lo, hi

    def run(self, groups: dict[tuple[str, int], list[tuple[ReadItem, _Target]]]) -> None:
        per_file: dict[str, list[tuple[int, int, str, Chunk, list[tuple[ReadItem, _Target]]]]] = (
            defaultdict(list))
        direct: list[tuple[str, Chunk, ReadItem, _Target]] = []
        for (fqn, ci), items in groups.items():
            c = self.m.tensors[fqn].chunks[ci]
            lo, hi = self.span(c, items)
            if len(items) == 1 and self._direct_ok(c, *items[0], lo, hi):
                direct.append((fqn, c, *items[0]))
            else:
                per_file[c.file].append((c.offset + lo, c.offset + hi, fqn, c, items))
        jobs: list[Callable[[], None]] = [partial(self._read_direct, *a) for a in direct]
        for name, reads in per_file.items():
            reads.sort(key=lambda r: r[0])
            cur: list[Any] = []
            for r in reads:
                if cur and r[0] > cur[-1][1]:
                    jobs.append(partial(self._read_span, name, cur))
                    cur = []
                cur.append(r)
            if cur:
                jobs.append(partial(self._read_span, name, cur))
        from .progress import bar, wanted

        with bar(len(jobs), "load", enabled=wanted(self.opts.progress),
                 unit="reads") as pb:
            if self.opts.threads > 1 and len(jobs) > 1:
                with ThreadPoolExecutor(max_workers=min(self.opts.threads, len(jobs)),
                                        thread_name_prefix="reshard-read") as ex:
                    for f in [ex.submit(j) for j in jobs]:
                        f.result()
                        pb.update(1)
            else:
                for j in jobs:
                    j()
                    pb.update(1)

    def _direct_ok(self, c: Chunk, item: ReadItem, t: _Target, lo: int, hi: int) -> bool:
        if (lo, hi) != (0, c.length) or item.byte_start != 0 or item.byte_stop != c.length:
            return False
        if c.length < self.opts.direct_read_min_bytes or t.dst.device.type != "cpu":
            return False
        return self._dst_region(item, t) is not None

    def _dst_region(self, item: ReadItem, t: _Target) -> torch.Tensor | None:
        req, dst = t.req, t.dst
        if item.kind == "box":
            region = dst[tuple(slice(o - r, o - r + n) for o, r, n in
                               zip(item.box_offset, req.global_offset, item.box_shape, strict=True))]
        elif item.kind == "flat" and req.flattened_range is not None:
            a = req.flattened_range[0]
            region = dst[item.flat_start - a:item.flat_stop - a]
        else:
            return None
        return region if region.is_contiguous() else None

    def _read_direct(self, fqn: str, c: Chunk, item: ReadItem, t: _Target) -> None:
        path = self.check_file(c.file)
        region = self._dst_region(item, t)
        assert region is not None
        flat = region.reshape(-1)
        if flat.stride(0) != 1:  # one element with any stride counts as contiguous
            flat = torch.as_strided(flat, (flat.numel(),), (1,))
        u8 = flat.view(torch.uint8)
        mv = memoryview(u8.numpy().data)
        # read in block-aligned segments and verify each while it is still in cache
        b = self.m.checksum_block_bytes
        seg = b * max(1, _SEGMENT_BYTES // b)
        for a in range(0, max(len(mv), 1), seg):
            self.st.read_into(path, c.offset + a, mv[a:a + seg])
            self.verify(fqn, c, a, u8[a:a + seg])

    def _read_span(self, name: str, reads: list[tuple[int, int, str, Chunk, list[Any]]]) -> None:
        path = self.check_file(name)
        start, stop = reads[0][0], max(r[1] for r in reads)
        buf = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            self.st.read_into(path, start, memoryview(buf.numpy().data))
        for a, b, fqn, c, items in reads:
            lo = a - c.offset
            data = buf[a - start:b - start]
            self.verify(fqn, c, lo, data)
            dtype = torch_dtype(self.m.tensors[fqn].dtype)
            for item, t in items:
                src = _view_u8(buf, a - start + item.byte_start - lo, a - start + item.byte_stop - lo, dtype)
                _copy(item, c, t, src)


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
            bytes; see :mod:`reshard.formats.dcp` and :mod:`reshard.formats.hf_export`).

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``path``.
        ManifestError, IntegrityError: the checkpoint is invalid or corrupt.
        ShardingError: missing/unexpected keys (strict), shape or dtype
            mismatch (nothing is cast silently), a load that matches no key.
        Every failure is raised on every rank of ``group``.
    """
    coll = get_collectives(group)
    opts = options or LoadOptions()
    t0 = time.perf_counter()
    st, key = resolve(path, storage)
    base, before = st, st.bytes_read  # (a DCP checkpoint is read through `base`)
    err: BaseException | None = None
    if manifest is None:
        try:
            st, manifest = _read_or_dcp(st, key, opts)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err = e
    keys: dict[str, Any] = {}
    ctx: dict[str, Any] = {}
    try:
        if err is not None:
            raise err
        ctx = _prepare(state, st, key, opts, transforms, coll, manifest)
        keys = ctx["requested"]
    except Exception as e:  # noqa: BLE001
        err = e
    # agree on the manifest and gather requested keys (to find unexpected ones)
    reports = coll.all_gather_json(outcome(coll.rank, err, keys=sorted(keys)))
    raise_agreed("load", reports, err)
    err = None
    result: LoadResult | None = None
    try:
        requested_anywhere = set().union(*(r["keys"] for r in reports))
        quiet = opts if coll.rank == 0 else dataclasses.replace(opts, progress=False)  # one bar
        result = _execute(ctx, requested_anywhere, st, key, quiet, strict,
                          [*allow_missing, *extra_allow_missing(transforms)], transforms)
    except Exception as e:  # noqa: BLE001
        err = e
    reports = coll.all_gather_json(outcome(coll.rank, err))
    raise_agreed("load", reports, err)
    assert result is not None
    # hand loaded plain values to Stateful objects, only once every rank succeeded
    err = None
    try:
        for _path, obj, rebuild in ctx["leaves"].statefuls:
            obj.load_state_dict(rebuild())
    except Exception as e:  # noqa: BLE001
        err = e
    reports = coll.all_gather_json(outcome(coll.rank, err))
    raise_agreed("load (load_state_dict)", reports, err)
    return LoadResult(**{**result.__dict__, "bytes_read": base.bytes_read - before,
                         "duration_s": time.perf_counter() - t0})


def _read_or_dcp(st: Storage, key: str, opts: LoadOptions) -> tuple[Storage, Manifest]:
    """The manifest at ``key``; where there is none but a PyTorch DCP
    ``.metadata``, the DCP checkpoint presented by :func:`reshard.formats.dcp.open_dcp`
    (unsigned: refused when an HMAC key is given)."""
    try:
        return st, read_manifest(st, key, hmac_key=opts.hmac_key)
    except CheckpointNotFoundError:
        from .formats.dcp import DCP_METADATA, open_dcp

        if not st.exists(st.join(key, DCP_METADATA)):
            raise
        if opts.hmac_key is not None:
            raise IntegrityError(f"{key}: a DCP checkpoint carries no HMAC, but an HMAC key was "
                                 "given") from None
        return open_dcp(key, storage=st)


def _prepare(state: Mapping[str, Any], st: Storage, key: str, opts: LoadOptions,
             transforms: Sequence[Any], coll: Collectives,
             manifest: Manifest | None = None) -> dict[str, Any]:
    from .adapters.dtensor import dtensor_shards

    if manifest is None:
        manifest = read_manifest(st, key, hmac_key=opts.hmac_key)
    m = manifest_view(manifest, transforms)
    if opts.schema_version is not None and m.schema_version != opts.schema_version:
        raise ShardingError(f"{key}: checkpoint schema_version {m.schema_version!r} differs from the "
                            f"expected {opts.schema_version!r}; pass a migration in transforms")
    notes: dict[str, Any] = {}
    _prepare_hooks(state, m, notes)
    loaded_values: dict[str, Any] = {}
    loaded_objects: dict[tuple[str, tuple[int, ...]], Any] = {}
    leaves = flatten(state, loaded_values=loaded_values, loaded_objects=loaded_objects)
    if m.format_version < FORMAT_VERSION:
        version = m.format_version
        m, moved = _migrate_v1(m, leaves.legacy)
        notes[MIGRATED] = {"from_format_version": version, "renamed": moved}
    if "dcp_values" in m.extra:  # a DCP checkpoint (or one converted from DCP): its leaf values
        from .formats.dcp_values import regroup  # grouped into the paths this state asks for

        m = regroup(m, set(leaves.values))
    sts: list[ShardedTensor] = list(leaves.tensors)
    for p, t in leaves.plain.items():
        sts.append(ShardedTensor(p, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim()))
    for p, dt in leaves.dtensors.items():
        sts.extend(dtensor_shards(p, dt))
    # destinations are filled in place: an nn.Parameter (a leaf that requires
    # grad) is written through a detached alias of the same storage
    sts = [dataclasses.replace(s, data=s.data.detach()) if s.data.requires_grad else s for s in sts]
    requested: dict[str, str] = {}
    for s in sts:
        requested[s.fqn] = "tensor"
    for ob in leaves.objects:
        requested[ob.key] = "object"
    for p in leaves.values:
        requested[p] = "value"
    for k in notes.pop(HANDLED, ()):
        requested.setdefault(k, "handled")
    for k in consumed_by(transforms, requested):
        requested.setdefault(k, "handled")
    return {"manifest": m, "leaves": leaves, "sts": sts, "requested": requested,
            "loaded_values": loaded_values, "loaded_objects": loaded_objects, "notes": notes}


def _prepare_hooks(state: Any, m: Manifest, notes: dict[str, Any]) -> None:
    """Let adapters see the manifest before they declare what they need: an
    object with ``reshard_prepare_load(manifest) -> dict | None`` (e.g. an
    OptimizerState that creates the state tensors of a fresh optimizer, or an
    RNGState that must re-derive streams for another grid) is called once,
    before the state tree is walked, with the manifest as seen from its
    position in the tree (:func:`reshard.tree.scoped_manifest`: names relative
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


def _execute(ctx: dict[str, Any], requested_anywhere: set[str], st: Storage, key: str,
             opts: LoadOptions, strict: bool, allow_missing: Sequence[Any],
             transforms: Sequence[Any]) -> LoadResult:
    m: Manifest = ctx["manifest"]
    leaves = ctx["leaves"]
    allow = _compile_allow(allow_missing)
    saved = set(m.tensors) | set(m.aliases) | set(m.objects) | set((m.values or {}).keys())
    # names a Split/Merge fills are available, but are not saved keys: one that no
    # rank requests is not "unexpected" (its source is reported if nothing reads it)
    available = saved | provided_by(transforms, m)
    requested: dict[str, str] = ctx["requested"]
    missing = sorted(k for k in requested if k not in available)
    unexpected = sorted(saved - requested_anywhere)
    if requested_anywhere and not (available & requested_anywhere):
        raise ShardingError(
            f"{key}: no requested key matches the checkpoint (requested e.g. "
            f"{sorted(requested_anywhere)[:3]}, saved e.g. {sorted(saved)[:3]}); "
            "check prefixes or pass a rename transform"
        )
    refused = m.extra.get("dcp_skipped_values") or {}
    unsafe = sorted(k for k in requested if k in refused)
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
    # plan tensor reads (through the transforms), checked before anything is written
    groups: dict[tuple[str, int], list[tuple[ReadItem, _Target]]] = defaultdict(list)
    initialized: list[str] = []
    finalize: list[Callable[[], None]] = []
    missing_set = set(missing)
    covered: set[str] = set()
    for s in ctx["sts"]:
        res = None if s.fqn in missing_set else resolve_target(s, m, transforms)
        if res is None:
            rule = next((r for match, r in allow if match(s.fqn)), "keep")
            if rule == "zeros":
                s.data.zero_()
            elif callable(rule):
                rule(s.fqn, s.data)
            if rule != "keep" and s.fqn not in initialized:
                initialized.append(s.fqn)
            continue
        finalize.extend(res.finalize)
        for pc in res.pieces:
            entry: TensorEntry = m.tensors[pc.saved]
            if pc.saved not in covered:
                check_entry_coverage(pc.saved, entry)
                covered.add(pc.saved)
            req = Request(fqn=s.fqn, global_offset=pc.offset, local_shape=pc.shape,
                          flattened_range=pc.flattened_range)
            tgt = _Target(req=req, dst=pc.dst, saved=pc.saved)
            for item in plan_reads(entry, req):
                groups[(pc.saved, item.chunk_index)].append((item, tgt))
    _Reader(st, key, m, opts).run(groups)
    for fn in finalize:
        fn()
    # objects
    values: dict[str, Any] = {}
    loaded_objects = ctx["loaded_objects"]
    for ob in leaves.objects:
        if ob.key in missing_set:
            continue
        oe = m.objects.get(ob.key)
        if oe is None:
            raise ShardingError(f"{ob.key}: saved as a tensor or value, requested as an object")
        if tuple(oe.global_shape) != tuple(ob.global_shape):
            raise ShardingError(
                f"object {ob.key}: saved as a grid of shape {list(oe.global_shape)}, requested in a grid "
                f"of shape {list(ob.global_shape)}; per-rank state cannot be resharded without a rule"
            )
        oc = next(c for c in oe.chunks if tuple(c.global_offset) == tuple(ob.global_offset))
        raw = st.read_bytes(st.join(key, oc.file), oc.offset, oc.length)
        if opts.checksums and oc.checksums:
            b = m.checksum_block_bytes
            for k, digest in enumerate(oc.checksums):
                if xxhash.xxh3_64_hexdigest(raw[k * b:(k + 1) * b]) != digest:
                    raise IntegrityError(f"{st.join(key, oc.file)}: checksum mismatch in object "
                                         f"{ob.key!r} element {list(ob.global_offset)}")
        v = codec.decode(raw)
        loaded_objects[(ob.key, tuple(ob.global_offset))] = v
        values[ob.key] = v
    # common values
    loaded_values = ctx["loaded_values"]
    for p, enc in (m.values or {}).items():
        v = codec.from_json(enc)
        values[p] = v
        if p in leaves.values:
            loaded_values[p] = v
    return LoadResult(path=key, step=m.step, missing=tuple(missing), unexpected=tuple(unexpected),
                      initialized=tuple(initialized), values=values, manifest=m,
                      notes=dict(ctx["notes"]))
