"""Save plan: pure functions, no I/O and no torch.distributed.

Save planning (runs on the coordinator over the local plans gathered to it;
each rank then receives only its own assignment, see :mod:`reshard.planning.coordination`):

1. every fqn has one dtype and one global_shape across ranks;
2. holders of the same chunk (same global_offset, local_shape and
   flattened_range) are replicas: their digests must agree, and exactly one is
   chosen to write it, balancing written bytes across ranks (greedy, largest
   chunk first, onto the least-loaded holder; after Megatron Core's
   ``distribute_shards_to_ranks``);
3. the distinct chunks of each fqn must tile its global shape: no two overlap
   and their volumes add up to the whole (so there is no hole);
4. each writer's chunks are spread over ``files_per_rank`` files by bytes;
   with ``own_file_bytes`` (incremental saves), a tensor chunk of at least
   that many bytes gets a file of its own, named after the chunk
   (:func:`chunk_file_name`: the same chunk has the same file name whichever
   rank writes it), so that an unchanged chunk's file repeats whole and a
   later save can link it instead of writing it.

The load plan (requested boxes -> read items) is in
:mod:`reshard.planning.read_plan` (re-exported here).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from ..errors import CoverageError, ShardingError
from ..ondisk.manifest import Chunk, TensorEntry
from ..state.geometry import box_intersection, numel
from .read_plan import ReadItem, Request, _flat_span, _strides, chunk_request, plan_reads  # noqa: F401 - their old home

Shape = tuple[int, ...]
Replica = int | tuple[int, ...]


class LocalTensorItem(msgspec.Struct, frozen=True):
    """One rank's description of one tensor shard (gathered to every rank).

    ``nbytes`` in bytes; ``digest`` is a checksum of the shard's bytes used to
    compare replicas ("" when not computed).
    """

    fqn: str
    dtype: str
    global_shape: Shape
    global_offset: Shape
    local_shape: Shape
    flattened_range: tuple[int, int] | None
    replica_id: Replica
    nbytes: int
    digest: str = ""

    @property
    def chunk_key(self) -> tuple[Shape, Shape, tuple[int, int] | None]:
        return (self.global_offset, self.local_shape, self.flattened_range)


class LocalObjectItem(msgspec.Struct, frozen=True):
    """One rank's element of an object grid; ``digest`` of its encoded bytes."""

    key: str
    global_shape: Shape
    global_offset: Shape
    replica_id: Replica
    nbytes: int
    digest: str


class LocalPlan(msgspec.Struct, frozen=True):
    """Everything one rank contributes to planning (JSON-safe, no pickle).

    ``values_digest``: checksum of the rank's encoded common values, compared
    across ranks. ``error``: a failure this rank met before planning (as text),
    so every rank can fail together instead of hanging.
    """

    rank: int
    tensors: tuple[LocalTensorItem, ...] = ()
    objects: tuple[LocalObjectItem, ...] = ()
    values_digest: str = ""
    aliases: dict[str, str] = {}


@dataclass(frozen=True, kw_only=True)
class WriteItem:
    """``index`` into the writing rank's local tensors (kind "tensor") or
    objects (kind "object"), written to ``file``."""

    kind: str
    index: int
    file: str


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    """Result of :func:`plan_save`.

    Attributes:
        writes: rank -> the items that rank writes, in file order.
        files: rank -> the file names that rank writes.
        bytes_per_rank: rank -> bytes of data it writes.
        replicas: ``(kind, [(rank, local index), ...])``: the holders of every
            chunk or object element held by more than one rank (their digests
            are compared at every save, cached or not).
    """

    writes: dict[int, tuple[WriteItem, ...]]
    files: dict[int, tuple[str, ...]]
    bytes_per_rank: dict[int, int]
    replicas: tuple[tuple[str, list[tuple[int, int]]], ...] = ()


def data_file_name(rank: int, index: int) -> str:
    return f"data-r{rank:05d}-{index}.safetensors"


def chunk_file_name(it: LocalTensorItem, salt: int = 0) -> str:
    """The name of the file of its own that a chunk gets in an incremental
    save (``own_file_bytes``): ``data-c<16 hex>.safetensors``, from the
    chunk's fqn, dtype, global shape, box and flat range only (never the
    rank or the plan), so a chunk keeps its file name across saves, plan
    changes and changes of which rank writes it (a DP resize). ``salt``
    tells apart the (astronomically unlikely) chunks whose names collide."""
    key = repr((it.fqn, it.dtype, tuple(it.global_shape), tuple(it.global_offset), tuple(it.local_shape),
                it.flattened_range, salt)).encode()
    return f"data-c{xxhash.xxh3_64_hexdigest(key)}.safetensors"


def _ranks(holders: Iterable[tuple[int, int]]) -> list[int]:
    return sorted({r for r, _ in holders})


# the holders of one chunk or object element: (rank, local index) pairs, in rank order
_Holders = list[tuple[int, int]]


@dataclass(frozen=True, kw_only=True)
class _TensorChunks:
    """The distinct tensor chunks of the gathered local plans (step 1 of :func:`plan_save`).

    A chunk is one distinct ``(fqn, dtype, global_shape, global_offset,
    local_shape, flattened_range)``; chunks are numbered in order of first
    appearance (plans in the order given, then each rank's local order).

    Attributes:
        keys: chunk -> its key, as above.
        holders: chunk -> its holders (rank order); a list, shared as is with
            :attr:`SavePlan.replicas`.
        nbytes: chunk -> its size in bytes (as its first holder declares it).
        differ: the chunks that have a holder whose digest differs from the
            first holder's, in the order met (unsorted; a chunk may repeat).
    """

    keys: tuple[tuple[Any, ...], ...]
    holders: tuple[_Holders, ...]
    nbytes: tuple[int, ...]
    differ: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class _ObjectElements:
    """The object grids of the gathered local plans (step 3 of :func:`plan_save`).

    Attributes:
        grids: key -> (its grid shape, the first rank that declared it).
        holders: key -> grid offset -> the holders of that element; keys and
            offsets in order of first appearance.
    """

    grids: dict[str, tuple[Shape, int]]
    holders: dict[str, dict[Shape, _Holders]]


@dataclass(frozen=True, kw_only=True)
class _WriterChoice:
    """One writer per chunk and object element (step 5 of :func:`plan_save`).

    Attributes:
        chosen: rank -> the ``(kind, local index, nbytes)`` items it writes
            (kind "tensor" or "object"); a rank that writes nothing may be absent.
        load: rank -> the bytes it writes, every rank of the plans present, in
            the order the plans were given.
        replicas: as :attr:`SavePlan.replicas`: the holders of every tensor
            chunk, then every object element, held by more than one rank.
    """

    chosen: dict[int, list[tuple[str, int, int]]]
    load: dict[int, int]
    replicas: tuple[tuple[str, _Holders], ...]


def _collect_tensor_chunks(plans: Sequence[LocalPlan]) -> _TensorChunks:
    """Group every rank's tensor items by chunk, holders in rank order (one
    dict lookup per item); the digests of each chunk's holders are compared
    to its first holder's."""
    gindex: dict[tuple[Any, ...], int] = {}
    gkeys: list[tuple[Any, ...]] = []
    gholders: list[_Holders] = []
    gdigest: list[str] = []
    gbytes: list[int] = []
    differ: list[int] = []
    lookup = gindex.get
    for p in plans:
        r = p.rank
        for i, it in enumerate(p.tensors):
            key = (it.fqn, it.dtype, it.global_shape, it.global_offset, it.local_shape, it.flattened_range)
            g = lookup(key)
            if g is None:
                gindex[key] = len(gkeys)
                gkeys.append(key)
                gholders.append([(r, i)])
                gdigest.append(it.digest)
                gbytes.append(it.nbytes)
            else:
                gholders[g].append((r, i))
                if it.digest != gdigest[g]:
                    differ.append(g)
    return _TensorChunks(keys=tuple(gkeys), holders=tuple(gholders), nbytes=tuple(gbytes), differ=tuple(differ))


def _check_tensor_chunks(by_rank: dict[int, LocalPlan], chunks: _TensorChunks) -> dict[str, tuple[str, Shape, int]]:
    """Validate the tensor chunks (step 2 of :func:`plan_save`), in this order:
    one dtype and global_shape per fqn (chunks in order), replicas' digests
    agree (the first chunk that differs), the chunks of each fqn tile its
    global shape (fqns in order of first appearance).

    Returns:
        fqn -> (dtype, global_shape, the rank of its first chunk's first holder).

    Raises:
        ShardingError: the first failed check, naming the fqn and the ranks.
    """
    meta: dict[str, tuple[str, Shape, int]] = {}
    per_fqn: dict[str, dict[tuple, _Holders]] = defaultdict(dict)
    for g, (fqn, dtype, gshape, off, shape, fr) in enumerate(chunks.keys):
        r0 = chunks.holders[g][0][0]
        prev = meta.get(fqn)
        if prev is None:
            meta[fqn] = (dtype, gshape, r0)
        elif prev[0] != dtype or prev[1] != gshape:
            one, two = (prev, (dtype, gshape, r0)) if prev[2] <= r0 else ((dtype, gshape, r0), prev)
            raise ShardingError(
                f"{fqn}: rank {one[2]} declares dtype {one[0]} global_shape {list(one[1])}, "
                f"rank {two[2]} declares dtype {two[0]} global_shape {list(two[1])}"
            )
        per_fqn[fqn][(off, shape, fr)] = chunks.holders[g]
    if chunks.differ:
        raise _replicas_differ(by_rank, chunks, min(chunks.differ))
    for fqn, boxes in per_fqn.items():
        _check_coverage(fqn, meta[fqn][1], boxes)
    return meta


def _replicas_differ(by_rank: dict[int, LocalPlan], chunks: _TensorChunks, g: int) -> ShardingError:
    """The error for chunk ``g``, whose holders' digests differ: the ranks
    grouped by the value they hold, the largest group first."""
    fqn, _, _, off, shape, _ = chunks.keys[g]
    by_digest: dict[str, list[int]] = defaultdict(list)
    for r, i in chunks.holders[g]:
        by_digest[by_rank[r].tensors[i].digest].append(r)
    parts = sorted(by_digest.values(), key=lambda rs: (-len(rs), rs))
    return ShardingError(
        f"{fqn}: replicas of chunk at offset {list(off)} shape {list(shape)} differ: "
        f"ranks {parts[0]} hold one value, "
        + ", ".join(f"ranks {rs} another" for rs in parts[1:])
        + " (replicated data must be identical on every holder)"
    )


def _collect_objects(plans: Sequence[LocalPlan], tensor_fqns: Container[str]) -> _ObjectElements:
    """Group every rank's object items by key and grid offset (step 3 of
    :func:`plan_save`), checking item by item that a key has one grid and is
    not also a tensor fqn.

    Raises:
        ShardingError: two grids for one key, or a key that is a tensor fqn.
    """
    omap: dict[str, tuple[Shape, int]] = {}
    oholders: dict[str, dict[Shape, _Holders]] = defaultdict(lambda: defaultdict(list))
    for p in plans:
        for i, ob in enumerate(p.objects):
            prev_o = omap.get(ob.key)
            if prev_o is None:
                omap[ob.key] = (ob.global_shape, p.rank)
            elif prev_o[0] != ob.global_shape:
                raise ShardingError(
                    f"object {ob.key}: rank {prev_o[1]} declares grid {list(prev_o[0])}, "
                    f"rank {p.rank} declares {list(ob.global_shape)}"
                )
            if ob.key in tensor_fqns:
                raise ShardingError(f"{ob.key}: used both as a tensor fqn and an object key")
            oholders[ob.key][ob.global_offset].append((p.rank, i))
    return _ObjectElements(grids=omap, holders=oholders)


def _check_objects(by_rank: dict[int, LocalPlan], objects: _ObjectElements) -> None:
    """Every element of each object grid is held, and its holders hold the
    same value (step 4 of :func:`plan_save`; keys in order of first appearance).

    Raises:
        ShardingError: a grid element that no rank holds, or holders of one
            element whose digests differ.
    """
    for okey, elems in objects.holders.items():
        grid = objects.grids[okey][0]
        if len(elems) != numel(grid):
            missing = numel(grid) - len(elems)
            raise ShardingError(
                f"object {okey}: grid {list(grid)} has {missing} element(s) that no rank holds "
                f"(held by ranks {sorted({r for hs in elems.values() for r, _ in hs})})"
            )
        for off, hs in elems.items():
            if len({by_rank[r].objects[i].digest for r, i in hs}) > 1:
                raise ShardingError(
                    f"object {okey}: element {list(off)} is held by ranks {_ranks(hs)} with "
                    "different values (per-rank values need distinct global_offsets)"
                )


def _dedup_save_plans(
    plans: Sequence[LocalPlan], by_rank: dict[int, LocalPlan], tensors: _TensorChunks, objects: _ObjectElements
) -> _WriterChoice:
    """Choose one writer per chunk and object element, balancing written
    bytes (step 5 of :func:`plan_save`): a sole holder writes its own; the
    replicated ones go largest first (ties in gather order: tensor chunks,
    then object elements) to their least-loaded holder, the lowest rank on
    ties (after Megatron Core's ``distribute_shards_to_ranks``)."""
    load: dict[int, int] = {p.rank: 0 for p in plans}
    chosen: dict[int, list[tuple[str, int, int]]] = defaultdict(list)  # rank -> (kind, index, nbytes)
    multi: list[tuple[int, int, str, _Holders]] = []
    replicas: list[tuple[str, _Holders]] = []
    for g, hs in enumerate(tensors.holders):
        if len(hs) == 1:
            r, i = hs[0]
            chosen[r].append(("tensor", i, tensors.nbytes[g]))
            load[r] += tensors.nbytes[g]
        else:
            multi.append((tensors.nbytes[g], len(multi), "tensor", hs))
            replicas.append(("tensor", hs))
    for elems in objects.holders.values():
        for hs in elems.values():
            n = by_rank[hs[0][0]].objects[hs[0][1]].nbytes
            if len(hs) == 1:
                chosen[hs[0][0]].append(("object", hs[0][1], n))
                load[hs[0][0]] += n
            else:
                multi.append((n, len(multi), "object", hs))
                replicas.append(("object", hs))
    multi.sort(key=lambda t: (-t[0], t[1]))  # largest first; ties keep gather order
    for n, _, kind, hs in multi:
        loads = [load[r] for r, _ in hs]
        r, i = hs[loads.index(min(loads))]  # least loaded, lowest rank on ties (holders in rank order)
        chosen[r].append((kind, i, n))
        load[r] += n
    return _WriterChoice(chosen=chosen, load=load, replicas=tuple(replicas))


def _take_own_files(
    local: LocalPlan, items: list[tuple[str, int, int]], own_file_bytes: int, own_names: set[str]
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, str]]]:
    """Split a writer's items (largest first) into those spread over its data
    files and the tensor chunks of at least ``own_file_bytes`` bytes that get a
    file of their own (:func:`chunk_file_name`). ``own_names``: the names given
    so far, over all ranks; a name already given is salted, and added to it.

    Returns:
        (the rest, in the given order; ``(kind, index, file name)`` per own file).
    """
    own: list[tuple[str, int, str]] = []
    rest = []
    for kind, i, n in items:
        if kind == "tensor" and n >= own_file_bytes:
            it = local.tensors[i]
            salt = 0
            name = chunk_file_name(it)
            while name in own_names:  # a collision of two chunks' names: the later one moves
                salt += 1
                name = chunk_file_name(it, salt)
            own_names.add(name)
            own.append((kind, i, name))
        else:
            rest.append((kind, i, n))
    return rest, own


def _spread_over_files(items: list[tuple[str, int, int]], nfiles: int) -> dict[int, list[tuple[str, int]]]:
    """File number -> the ``(kind, index)`` items it holds: ``items`` (largest
    first) each go to the file with the fewest bytes so far, the lowest number
    on ties; with ``nfiles`` 1, all to file 0. A file may get none."""
    per_file: dict[int, list[tuple[str, int]]] = defaultdict(list)
    if nfiles == 1:
        per_file[0] = [(kind, i) for kind, i, _ in items]
    else:
        heap = [(0, k) for k in range(nfiles)]
        for kind, i, n in items:
            b, k = heapq.heappop(heap)
            per_file[k].append((kind, i))
            heapq.heappush(heap, (b + n, k))
    return per_file


def _finish_plan(
    local: LocalPlan,
    chosen: list[tuple[str, int, int]],
    *,
    files_per_rank: int,
    own_file_bytes: int,
    own_names: set[str],
) -> tuple[tuple[WriteItem, ...], tuple[str, ...]]:
    """One writer's write items and file names (step 6 of :func:`plan_save`).

    ``chosen``: the ``(kind, index, nbytes)`` items that ``local.rank``
    writes. Own files first take their chunks (with ``own_file_bytes`` > 0,
    see :func:`_take_own_files`); the rest are spread by bytes over at most
    ``files_per_rank`` data files (:func:`data_file_name`), empty ones
    dropped. Items are listed data file by data file, tensors then objects
    by local index within each, then the own files by local index.

    Returns:
        (the write items in file order, the file names in that order).
    """
    r = local.rank
    items = sorted(chosen, key=lambda t: -t[2])
    own: list[tuple[str, int, str]] = []
    if own_file_bytes > 0:
        items, own = _take_own_files(local, items, own_file_bytes, own_names)
    nfiles = max(1, min(files_per_rank, len(items)))
    per_file = _spread_over_files(items, nfiles)
    out: list[WriteItem] = []
    names: list[str] = []
    for k in range(nfiles):
        if not per_file.get(k):
            continue
        name = data_file_name(r, k)
        names.append(name)
        # keep each file in the rank's local order (deterministic, cache friendly)
        for kind, i in sorted(per_file[k], key=lambda t: (t[0] != "tensor", t[1])):
            out.append(WriteItem(kind=kind, index=i, file=name))
    for kind, i, name in sorted(own, key=lambda t: t[1]):
        names.append(name)
        out.append(WriteItem(kind=kind, index=i, file=name))
    return tuple(out), tuple(names)


def plan_save(plans: Sequence[LocalPlan], *, files_per_rank: int = 1, own_file_bytes: int = 0) -> SavePlan:
    """Deduplicate replicas, validate coverage, balance and assign files.

    Linear in the number of items (one dict lookup per item); the rest is per
    distinct chunk. Runs on the coordinator only, over the gathered plans
    (the global step of PyTorch DCP's ``create_global_plan``), in six steps:
    collect the tensor chunks (:func:`_collect_tensor_chunks`), check them
    (:func:`_check_tensor_chunks`), collect and check the object grids
    (:func:`_collect_objects`, :func:`_check_objects`), choose one writer
    each (:func:`_dedup_save_plans`), then each writer's files
    (:func:`_finish_plan`, ranks ascending).

    Args:
        plans: one LocalPlan per rank, in rank order.
        files_per_rank: how many data files each writer spreads its bytes over.
        own_file_bytes: tensor chunks of at least this many bytes get a file of
            their own (:func:`chunk_file_name`); 0: none do.

    Raises:
        ValueError: ``files_per_rank`` < 1.
        ShardingError: conflicting dtype or global_shape for one fqn, replicas
            whose digests differ, overlapping chunks, holes, conflicting object
            grids or missing grid elements; the message names the fqn/key and
            the ranks involved.
    """
    if files_per_rank < 1:
        raise ValueError("files_per_rank must be >= 1")
    by_rank = plans_by_rank(plans)
    tensors = _collect_tensor_chunks(plans)
    meta = _check_tensor_chunks(by_rank, tensors)
    objects = _collect_objects(plans, meta)
    _check_objects(by_rank, objects)
    choice = _dedup_save_plans(plans, by_rank, tensors, objects)
    writes: dict[int, tuple[WriteItem, ...]] = {}
    files: dict[int, tuple[str, ...]] = {}
    own_names: set[str] = set()  # own-file names given so far, over all ranks
    for r in sorted(choice.load):
        writes[r], files[r] = _finish_plan(
            by_rank[r], choice.chosen.get(r, []),
            files_per_rank=files_per_rank, own_file_bytes=own_file_bytes, own_names=own_names,
        )
    return SavePlan(writes=writes, files=files, bytes_per_rank=dict(choice.load), replicas=choice.replicas)


def plans_by_rank(plans: Sequence[LocalPlan]) -> dict[int, LocalPlan]:
    return {p.rank: p for p in plans}


def _check_coverage(fqn: str, gshape: Shape, chunks: dict[tuple, list[tuple[int, int]]]) -> None:
    """Distinct chunks of one fqn must tile ``gshape`` exactly."""
    boxes: dict[tuple[Shape, Shape], list[tuple[tuple[int, int] | None, list[tuple[int, int]]]]] = (
        defaultdict(list)
    )
    for (off, shape, fr), hs in chunks.items():
        boxes[(off, shape)].append((fr, hs))
    volume = 0
    for (off, shape), entries in boxes.items():
        n = numel(shape)
        volume += n
        if len(entries) == 1 and entries[0][0] is None:
            continue
        if any(fr is None for fr, _ in entries):
            ranks = sorted({r for _, hs in entries for r, _ in hs})
            raise ShardingError(
                f"{fqn}: chunk at offset {list(off)} shape {list(shape)} is saved both whole and as "
                f"flattened ranges (ranks {ranks}): overlapping primaries"
            )
        pos = 0
        for fr, hs in sorted(entries, key=lambda e: e[0]):  # type: ignore[arg-type,return-value]
            assert fr is not None
            if fr[0] < pos:
                raise ShardingError(
                    f"{fqn}: flattened ranges overlap at element {fr[0]} of the chunk at offset "
                    f"{list(off)} (ranks {_ranks(hs)})"
                )
            if fr[0] > pos:
                raise ShardingError(
                    f"{fqn}: hole: elements [{pos}, {fr[0]}) of the chunk at offset {list(off)} shape "
                    f"{list(shape)} are held by no rank"
                )
            pos = fr[1]
        if pos != n:
            raise ShardingError(
                f"{fqn}: hole: elements [{pos}, {n}) of the chunk at offset {list(off)} shape "
                f"{list(shape)} are held by no rank"
            )
    # pairwise overlap of distinct non-empty boxes, swept along dim 0
    nonempty = [(off, shape) for off, shape in boxes if numel(shape) > 0]
    if len(gshape) == 0:
        if len(nonempty) > 1:
            raise ShardingError(f"{fqn}: 0-dim tensor saved as more than one chunk")
    elif _grid_disjoint(nonempty) is not True:
        nonempty.sort()
        active: list[tuple[Shape, Shape]] = []
        for off, shape in nonempty:
            active = [a for a in active if a[0][0] + a[1][0] > off[0]]
            for aoff, ashape in active:
                if box_intersection(aoff, ashape, off, shape) is not None:
                    ranks = sorted(
                        {r for key in chunks if key[0] in (aoff, off) and key[1] in (ashape, shape)
                         for r, _ in chunks[key]}
                    )
                    raise ShardingError(
                        f"{fqn}: overlapping chunks at offsets {list(aoff)} shape {list(ashape)} and "
                        f"{list(off)} shape {list(shape)} (ranks {ranks})"
                    )
            active.append((off, shape))
    if volume != numel(gshape):
        raise ShardingError(
            f"{fqn}: hole: chunks cover {volume} of the {numel(gshape)} elements of global_shape "
            f"{list(gshape)}"
        )


def _grid_disjoint(boxes: list[tuple[Shape, Shape]]) -> bool | None:
    """Fast disjointness test: rasterise the boxes onto the grid of their cut
    coordinates. True when disjoint, False on an overlap, None when that grid
    has too many cells (the caller then sweeps). Linear in the number of boxes
    for the usual product-grid partitions."""
    if not boxes:
        return True
    ndim = len(boxes[0][0])
    cuts = [sorted({o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d in range(ndim)]
    cells = 1
    for c in cuts:
        cells *= max(len(c) - 1, 1)
    if cells > 8 * len(boxes) + 64:
        return None
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    seen: set[tuple[int, ...]] = set()
    for off, shape in boxes:
        ranges = [range(index[d][off[d]], index[d][off[d] + shape[d]]) for d in range(ndim)]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return False
            seen.add(cell)
    return True


def _slabs_tile(gshape: Shape, chunks: Sequence[Chunk]) -> bool:
    """Fast path of :func:`check_entry_coverage` for the usual layouts (one
    whole chunk; row slabs of FSDP / ``Shard(0)``): True when the chunks are
    whole boxes of full trailing dimensions whose rows follow one another
    from 0 to ``gshape[0]`` without a gap or an overlap, which tiles
    ``gshape`` exactly. False: not proven here (the general check decides)."""
    if not gshape or not chunks:
        return False
    rest = tuple(gshape[1:])
    slabs = []
    for c in chunks:
        off = c.global_offset
        if c.flattened_range is not None or tuple(c.local_shape[1:]) != rest or any(off[1:]):
            return False
        slabs.append((off[0], c.local_shape[0]))
    slabs.sort()
    pos = 0
    for start, n in slabs:
        if start != pos or n <= 0:
            return False
        pos += n
    return pos == gshape[0]


def check_entry_coverage(fqn: str, entry: TensorEntry) -> None:
    """The chunks recorded for ``fqn`` tile its global shape exactly (no
    overlap, no hole); ShardingError otherwise. Run at load on every tensor
    read, so a manifest whose offsets were edited can never produce a wrong
    tensor."""
    if _slabs_tile(tuple(entry.global_shape), entry.chunks):
        return
    chunks: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for i, c in enumerate(entry.chunks):
        key = (tuple(c.global_offset), tuple(c.local_shape), c.flattened_range)
        if key in chunks:
            raise CoverageError(f"{fqn}: chunk at {list(c.global_offset)} recorded twice")
        chunks[key].append((0, i))
    try:
        _check_coverage(fqn, tuple(entry.global_shape), chunks)
    except ShardingError as e:
        raise CoverageError(str(e)) from None


# ----------------------------------------------------------------------------- load plan
