"""Reading a load plan: exact byte ranges of the shard files, checksums
verified block by block, copied into the targets.

Who calls what (:mod:`reshard.load`, on each rank, on the caller's thread):
``Reader.check_files`` (every needed file at once: presence, size, no symbolic
link) and, with ``LoadOptions.verify_first``, ``Reader.verify_only`` run before
any target is written; ``Reader.run`` then reads and writes the targets from
up to ``LoadOptions.threads`` threads, recording in ``Reader.written`` the
fqns of the targets it has started to write.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import xxhash

from ..errors import IntegrityError, ManifestError
from ..ondisk.manifest import Chunk, Manifest
from ..ondisk.shardfile import BlockTables, note_rotten
from ..options import LoadOptions
from ..planning.read_plan import ReadItem, Request, _strides
from ..state.sharding import box_intersection, flat_range_boxes, torch_dtype
from ..storage import Storage

#: file system types (``/proc/self/mounts``) whose reads cross a network: the
#: default ``read_once="auto"`` reads replicas once there
REMOTE_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
                       "glusterfs", "9p", "afs", "pvfs2", "orangefs", "wekafs", "panfs", "davfs", "sshfs"})


def _fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (its longest mount
    point in ``/proc/self/mounts``); None where that cannot be read."""
    import os

    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [ln.split()[1:3] for ln in f if len(ln.split()) >= 3]
    except OSError:
        return None
    p = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for mnt, fstype in mounts:
        mnt = mnt.replace("\\040", " ")
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > best[0]):
            best = (len(mnt), fstype)
    return None if best is None else best[1]


def read_once_wanted(option: bool | str, st: Storage, key: str) -> bool:
    """Whether this rank asks for replicas read once (``LoadOptions.read_once``):
    True and False as given; ``"auto"``: on for storage that is not a local
    disk: an object store (any backend but the local file system and
    ``memory://``), or a local path on a network or FUSE file system
    (:data:`REMOTE_FS`, ``fuse.*``), off otherwise."""
    if option != "auto":
        return bool(option)
    from ..storage.local import LocalStorage
    from ..storage.memory import MemoryStorage

    if isinstance(st, MemoryStorage):
        return False
    if not isinstance(st, LocalStorage):
        return True
    fs = _fs_type(key)
    return fs is not None and (fs in REMOTE_FS or fs.startswith("fuse"))


@dataclass(frozen=True)
class Target:
    """One destination of a read: a request and the tensor (or a view, or a
    temporary) that receives it."""

    req: Request
    dst: torch.Tensor
    saved: str  # fqn in the manifest (differs from req.fqn for aliases)


def _view_u8(buf: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    part = buf[start:stop]
    isz = dtype.itemsize
    if isz > 1 and (part.storage_offset() % isz or part.data_ptr() % isz):
        part = part.clone()
    return part.view(dtype)


def _copy(item: ReadItem, chunk: Chunk, t: Target, src1d: torch.Tensor) -> None:
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


def _flat_boxes(off: Sequence[int], shape: Sequence[int],
                fr: tuple[int, int] | None) -> list[tuple[Sequence[int], Sequence[int]]]:
    """The global boxes holding elements ``fr`` of the row-major flattening of
    the box at ``off`` of ``shape`` (the whole box when ``fr`` is None)."""
    if fr is None:
        return [(off, shape)]
    return [(tuple(o + d for o, d in zip(off, bo, strict=True)), bs)
            for bo, bs in flat_range_boxes(shape, *fr)]


def _gather_copy(item: ReadItem, chunk: Chunk, t: Target, src1d: torch.Tensor) -> None:
    """Copy the overlap of a chunk and a request whose boxes differ, either
    side flattened: each flat range is cut into at most ``2 * ndim - 1``
    boxes (:func:`flat_range_boxes`) and every overlap of a chunk box and a
    request box is one strided copy (no per-element index tensors)."""
    req, dst = t.req, t.dst
    cst, rst = _strides(chunk.local_shape), _strides(req.local_shape)
    first = (chunk.flattened_range[0] if chunk.flattened_range is not None else 0) + (
        item.byte_start // src1d.element_size())
    rbase = req.flattened_range[0] if req.flattened_range is not None else 0
    s0, ss = src1d.storage_offset(), src1d.stride(0) if src1d.dim() else 1
    for co, cs in _flat_boxes(chunk.global_offset, chunk.local_shape, chunk.flattened_range):
        cb = box_intersection(co, cs, item.box_offset, item.box_shape)
        if cb is None:
            continue
        for ro, rs in _flat_boxes(req.global_offset, req.local_shape, req.flattened_range):
            x = box_intersection(cb[0], cb[1], ro, rs)
            if x is None:
                continue
            xo, xs = x
            fc = sum((g - o) * s for g, o, s in zip(xo, chunk.global_offset, cst, strict=True)) - first
            src = torch.as_strided(src1d, xs, [s * ss for s in cst], s0 + fc * ss)
            if req.flattened_range is not None:
                fr = sum((g - o) * s for g, o, s in zip(xo, req.global_offset, rst, strict=True)) - rbase
                d0 = dst.stride(0) if dst.dim() else 1
                region = torch.as_strided(dst, xs, [s * d0 for s in rst], dst.storage_offset() + fr * d0)
            else:
                region = dst[tuple(slice(g - o, g - o + n)
                                   for g, o, n in zip(xo, req.global_offset, xs, strict=True))]
            region.copy_(src)


#: direct reads go in segments of about this many bytes (whole checksum blocks);
#: verify-first reads into one scratch buffer of this size per reader thread
_SEGMENT_BYTES = 4 << 20
#: verified direct reads go in segments of about this many bytes (whole
#: checksum blocks): one block is hashed right after it is read, while it is
#: still in the core's L2 cache
_VERIFY_SEGMENT_BYTES = 1 << 20
#: a direct read of a large chunk is cut into jobs of about this many bytes,
#: which the reader threads share
_SPLIT_BYTES = 16 << 20

Groups = dict[tuple[str, int], list[tuple[ReadItem, Target]]]


class Reader:
    """Executes read items: verified, coalesced, direct where possible.

    Attributes:
        written: fqns of the targets this reader has started to write (a
            direct read fills its destination before the block checksums are
            compared), in the order first written.
        chunk_bytes: bytes of saved chunks read from storage (not counting
            checksum tables, objects or the manifest).
        kept: for the groups :meth:`run` was asked to keep that are not
            direct reads, the unit's bytes (``unit_range``) of the span read,
            to hand to other ranks.
    """

    def __init__(self, st: Storage, ckpt: str, m: Manifest, opts: LoadOptions):
        self.st, self.ckpt, self.m, self.opts = st, ckpt, m, opts
        self.written: list[str] = []
        self.chunk_bytes = 0
        self.kept: dict[tuple[str, int], torch.Tensor] = {}
        self.tables = BlockTables(st, ckpt, m)
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bounce: Any = None  # the pinned bounce buffers of CUDA targets (made when first needed)

    def _count(self, n: int) -> None:
        with self._lock:
            self.chunk_bytes += n

    def mark_written(self, fqn: str) -> None:
        with self._lock:
            if fqn not in self._seen:
                self._seen.add(fqn)
                self.written.append(fqn)

    # -- checks before anything is written
    def check_files(self, names: Iterable[str]) -> None:
        """Every named data file exists, is not a symbolic link, and has the
        size the manifest declares; all files are checked before this
        returns or raises (one ``size`` call per file).

        Raises:
            ManifestError: a data file is a symbolic link.
            IntegrityError: files missing or of another size (all listed).
        """
        names = sorted(set(names))

        def one(name: str) -> tuple[str, str] | None:
            p = self.st.join(self.ckpt, name)
            if self.st.is_link(p):
                return "link", f"{p}: data file is a symbolic link (refused)"
            try:
                size = self.st.size(p)
            except (FileNotFoundError, NotADirectoryError):
                return "missing", f"{p}: data file named by the manifest is missing"
            except IntegrityError as e:  # a store that checks more than a size (DCP items)
                return "size", str(e)
            except ManifestError as e:  # a FIFO, a socket, a device: refused, never opened
                return "link", str(e)
            want = self.m.files[name].size
            if size != want:
                return "size", f"{p}: file is {size} bytes, the manifest declares {want}"
            return None

        if self.opts.threads > 1 and len(names) > 8:
            with ThreadPoolExecutor(max_workers=self.opts.threads, thread_name_prefix="reshard-stat") as ex:
                found = list(ex.map(one, names))
        else:
            found = [one(n) for n in names]
        bad = [f for f in found if f is not None]
        if not bad:
            return
        text = "; ".join(msg for _, msg in bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        if any(kind == "link" for kind, _ in bad):
            raise ManifestError(text)
        raise IntegrityError(f"{len(bad)} of {len(names)} needed data file(s) unusable, nothing "
                             f"was loaded: {text}")

    def verify_only(self, groups: Groups) -> None:
        """Read and check the checksums of every block the plan needs, without
        writing any target: each (block-aligned) span is read in segments of
        at most 4 MiB into one scratch buffer per thread.

        Raises:
            IntegrityError: a checksum mismatch, or a needed chunk that was
                saved without checksums (nothing to verify it against).
        """
        b = self.m.checksum_block_bytes
        seg = b * max(1, _SEGMENT_BYTES // b)
        spans: list[tuple[str, Chunk, int, int]] = []
        for (fqn, ci), items in groups.items():
            c = self.m.tensors[fqn].chunks[ci]
            if not BlockTables.has(c):
                raise IntegrityError(
                    f"{self.st.join(self.ckpt, c.file)}: {fqn!r} chunk at {list(c.global_offset)} was "
                    "saved without checksums: LoadOptions(verify_first=True) cannot verify it")
            lo, hi = self.span(c, items)
            spans.append((fqn, c, lo, hi))
        local = threading.local()

        def check(fqn: str, c: Chunk, lo: int, hi: int) -> None:
            scratch = getattr(local, "buf", None)
            if scratch is None:
                scratch = local.buf = torch.empty(min(seg, max(hi - lo, 1)), dtype=torch.uint8)
            elif scratch.numel() < min(seg, hi - lo):
                scratch = local.buf = torch.empty(min(seg, hi - lo), dtype=torch.uint8)
            path = self.st.join(self.ckpt, c.file)
            for a in range(lo, hi, seg):
                n = min(seg, hi - a)
                part = scratch[:n]
                self.st.read_into(path, c.offset + a, memoryview(part.numpy().data))
                self._count(n)
                self.verify(fqn, c, a, part)

        self._execute([partial(check, *sp) for sp in spans])

    # -- reading and writing
    def verify(self, fqn: str, c: Chunk, lo: int, data: torch.Tensor) -> None:
        """Check the blocks of chunk ``c`` that ``data`` (chunk bytes from
        ``lo``, block aligned) holds."""
        if not self.opts.checksums or not BlockTables.has(c):
            return
        sums = self.tables.sums(c)
        b = self.m.checksum_block_bytes
        mv = memoryview(data.numpy().data) if data.numel() else memoryview(b"")
        n = len(mv)
        for k in range(lo // b, -(-(lo + n) // b)):
            a = k * b - lo
            seg = mv[a:min(a + b, n)]
            if xxhash.xxh3_64_hexdigest(seg) != sums[k]:
                note_rotten(self.st, self.st.join(self.ckpt, c.file))  # never linked again
                raise IntegrityError(
                    f"{self.st.join(self.ckpt, c.file)}: checksum mismatch in {fqn!r} (chunk at "
                    f"{list(c.global_offset)}, block {k}, file bytes [{c.offset + k * b}, "
                    f"{c.offset + k * b + len(seg)}))"
                )

    def span(self, c: Chunk, items: list[tuple[ReadItem, Target]]) -> tuple[int, int]:
        lo = min(i.byte_start for i, _ in items)
        hi = max(i.byte_stop for i, _ in items)
        if self.opts.checksums and BlockTables.has(c):
            b = self.m.checksum_block_bytes
            lo = lo // b * b
            hi = min(-(-hi // b) * b, c.length)
        return lo, hi

    def _execute(self, jobs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``jobs`` (on up to ``threads`` threads); after the first failure
        no further job starts, and the first error is raised once every
        running job has finished (so ``written`` is final)."""
        def guarded(j: Callable[[], Any]) -> Any:
            if self._stop.is_set():
                return 0
            try:
                return j()
            except BaseException:
                self._stop.set()
                raise

        if self.opts.threads <= 1 or len(jobs) <= 1:
            return [guarded(j) for j in jobs]
        # many small jobs (thousands of small tensors): several per task, so that
        # scheduling a task does not cost more than the job itself
        per = max(1, len(jobs) // (self.opts.threads * 8))
        tasks = [jobs[i:i + per] for i in range(0, len(jobs), per)]
        with ThreadPoolExecutor(max_workers=min(self.opts.threads, len(tasks)),
                                thread_name_prefix="reshard-read") as ex:
            futs = [ex.submit(lambda js: [guarded(j) for j in js], task) for task in tasks]
            for f in futs:
                f.exception()  # wait for all
        errs = [f.exception() for f in futs if f.exception() is not None]
        if errs:
            raise errs[0]  # type: ignore[misc]
        return [r for f in futs for r in f.result()]

    def run(self, groups: Groups, keep: Iterable[tuple[str, int]] = ()) -> None:
        """Read every group into its targets. Groups named in ``keep`` are
        handed to other ranks afterwards: a direct read leaves their bytes
        in the destination (:meth:`hand_buffer`); any other is read on its
        own (not coalesced) and its unit's bytes stay in ``kept``."""
        keep = set(keep)
        per_file: dict[str, list[tuple[int, int, str, Chunk, list[tuple[ReadItem, Target]]]]] = (
            defaultdict(list))
        direct: list[tuple[str, Chunk, ReadItem, Target]] = []
        jobs: list[Callable[[], None]] = []
        bounce: list[tuple[str, Chunk, ReadItem, Target]] = []
        for (fqn, ci), items in groups.items():
            c = self.m.tensors[fqn].chunks[ci]
            if self.is_direct(items):
                direct.append((fqn, c, *items[0]))
            elif (fqn, ci) not in keep and self._bounce_ok(items):
                bounce.append((fqn, c, *items[0]))
            else:
                lo, hi = self.span(c, items)
                r = (c.offset + lo, c.offset + hi, fqn, c, items)
                if (fqn, ci) in keep:
                    jobs.append(partial(self._read_span, c.file, [r], (fqn, ci)))
                else:
                    per_file[c.file].append(r)
        for a in sorted(direct, key=lambda a: -(a[2].byte_stop - a[2].byte_start)):  # the largest first
            jobs.extend(self._direct_jobs(*a))
        jobs.extend(partial(self._read_bounce, *a) for a in bounce)
        if bounce:  # made on the caller's thread: its current streams are the ones to follow
            from .bounce import BOUNCE_BYTES, Bounce

            b = self.m.checksum_block_bytes
            self._bounce = Bounce(b * max(1, BOUNCE_BYTES // b), {t.dst.device for _, _, _, t in bounce})
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
        from ..progress import bar, wanted

        with bar(len(jobs), "load", enabled=wanted(self.opts.progress), unit="reads") as pb:
            def counted(j: Callable[[], None]) -> None:
                j()
                pb.update(1)

            try:
                self._execute([partial(counted, j) for j in jobs])
            finally:
                if self._bounce is not None:
                    self._bounce.finish()
                    self._bounce = None

    def _bounce_ok(self, items: list[tuple[ReadItem, Target]]) -> bool:
        """A group read into one contiguous region of a CUDA target: through
        pinned bounce buffers on the device's load stream
        (:mod:`reshard.loading.bounce`)."""
        if len(items) != 1 or items[0][1].dst.device.type != "cuda":
            return False
        region = self._dst_region(*items[0])
        n = items[0][0].byte_stop - items[0][0].byte_start
        return region is not None and region.numel() * region.element_size() == n

    def _read_bounce(self, fqn: str, c: Chunk, item: ReadItem, t: Target) -> None:
        """Read the item's bytes of chunk ``c`` (whole checksum blocks when
        verified) segment by segment into a pinned bounce buffer, verify
        each segment there, and copy its part of the item to the CUDA
        destination on the load stream while the next segment is read."""
        path = self.st.join(self.ckpt, c.file)
        region = self._region_u8(item, t)
        bs, be = item.byte_start, item.byte_stop
        lo, hi = bs, be
        verified = self.opts.checksums and BlockTables.has(c)
        b = self.m.checksum_block_bytes
        if verified:
            lo, hi = bs // b * b, min(-(-be // b) * b, c.length)
        bounce = self._bounce
        seg = bounce.seg
        self.mark_written(t.req.fqn)
        for a in range(lo, hi, seg):
            n = min(seg, hi - a)
            buf = bounce.buffer()[:n]
            self.st.read_into(path, c.offset + a, memoryview(buf.numpy().data))
            self._count(n)
            self.verify(fqn, c, a, buf)
            x0, x1 = max(a, bs), min(a + n, be)
            bounce.copy_into(region[x0 - bs:x1 - bs], buf[x0 - a:x1 - a])

    def is_direct(self, items: list[tuple[ReadItem, Target]]) -> bool:
        """A group read straight into its one destination (see :meth:`_direct_ok`)."""
        return len(items) == 1 and self._direct_ok(*items[0])

    @staticmethod
    def unit_range(items: list[tuple[ReadItem, Target]]) -> tuple[int, int]:
        """The chunk bytes [first, end) a group's targets need."""
        return min(i.byte_start for i, _ in items), max(i.byte_stop for i, _ in items)

    def hand_buffer(self, items: list[tuple[ReadItem, Target]]) -> tuple[torch.Tensor, bool]:
        """A contiguous uint8 tensor of the group's unit bytes: the
        destination region itself for a direct read (True), else a new
        buffer (False) whose bytes :meth:`place` copies into the targets."""
        if self.is_direct(items):
            return self._region_u8(*items[0]), True
        lo, hi = self.unit_range(items)
        return torch.empty(hi - lo, dtype=torch.uint8), False

    def place(self, fqn: str, ci: int, items: list[tuple[ReadItem, Target]], buf: torch.Tensor) -> None:
        """Copy a group's unit bytes, received from the rank that read them
        (and verified them there), into its targets."""
        c = self.m.tensors[fqn].chunks[ci]
        lo, _ = self.unit_range(items)
        dtype = torch_dtype(self.m.tensors[fqn].dtype)
        for item, t in items:
            self.mark_written(t.req.fqn)
            _copy(item, c, t, _view_u8(buf, item.byte_start - lo, item.byte_stop - lo, dtype))

    def _region_u8(self, item: ReadItem, t: Target) -> torch.Tensor:
        region = self._dst_region(item, t)
        assert region is not None
        flat = region.reshape(-1)
        if flat.stride(0) != 1:  # one element with any stride counts as contiguous
            flat = torch.as_strided(flat, (flat.numel(),), (1,))
        return flat.view(torch.uint8)

    def _direct_ok(self, item: ReadItem, t: Target) -> bool:
        """The item's bytes go straight into its destination: they are the
        elements of one contiguous region of it, in order (a whole chunk, or
        a run of whole rows of one: a 2 -> 4 reshard reads half a chunk), of
        at least ``direct_read_min_bytes``, on the CPU."""
        n = item.byte_stop - item.byte_start
        if n < self.opts.direct_read_min_bytes or t.dst.device.type != "cpu":
            return False
        region = self._dst_region(item, t)
        return region is not None and region.numel() * region.element_size() == n

    def _dst_region(self, item: ReadItem, t: Target) -> torch.Tensor | None:
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

    def _direct_jobs(self, fqn: str, c: Chunk, item: ReadItem, t: Target) -> list[Callable[[], None]]:
        """The reads of an item that goes straight into its destination
        region, as jobs of at most about ``_SPLIT_BYTES`` each (so the reader
        threads share one large chunk instead of one thread reading it while
        the others idle): its whole blocks in parts, and the blocks only
        partly inside the item (its first and last, when it starts or ends
        inside a block) as one more job."""
        bs, be = item.byte_start, item.byte_stop
        edges: list[int] = []  # chunk offsets of blocks only partly inside [bs, be)
        d0, d1 = bs, be  # chunk bytes read straight into the region
        if self.opts.checksums and BlockTables.has(c):
            b = self.m.checksum_block_bytes
            if bs % b:
                edges.append(bs // b * b)
                d0 = min(edges[0] + b, be)
            if be % b and be != c.length and (be - 1) // b * b >= d0:
                edges.append((be - 1) // b * b)
                d1 = edges[-1]
        seg = self._segment(c)
        step = seg * max(1, _SPLIT_BYTES // seg)
        jobs: list[Callable[[], None]] = [partial(self._read_direct, fqn, c, item, t, a, min(a + step, d1))
                                          for a in range(d0, d1, step)]
        if edges:
            jobs.append(partial(self._read_edges, fqn, c, item, t, edges))
        if not jobs:  # an empty item
            jobs.append(partial(self.mark_written, t.req.fqn))
        return jobs

    def _read_direct(self, fqn: str, c: Chunk, item: ReadItem, t: Target, d0: int, d1: int) -> None:
        """Read chunk bytes [d0, d1) of the item (whole blocks when verified)
        straight into the destination region; verified blocks are hashed one
        segment at a time, right after it is read."""
        path = self.st.join(self.ckpt, c.file)
        u8 = self._region_u8(item, t)
        mv = memoryview(u8.numpy().data)
        bs = item.byte_start
        seg = self._segment(c)
        self.mark_written(t.req.fqn)  # its bytes arrive before they are verified
        starts = range(d0, d1, seg)
        reads = ((c.offset + a, mv[a - bs:min(a + seg, d1) - bs]) for a in starts)
        with closing(self.st.read_parts(path, reads)) as parts:
            for i in parts:
                a = starts[i]
                self._count(min(a + seg, d1) - a)
                self.verify(fqn, c, a, u8[a - bs:min(a + seg, d1) - bs])

    def _read_edges(self, fqn: str, c: Chunk, item: ReadItem, t: Target, edges: list[int]) -> None:
        """The blocks only partly inside the item: each read whole into a
        scratch block, verified, and its part copied."""
        path = self.st.join(self.ckpt, c.file)
        u8 = self._region_u8(item, t)
        bs, be = item.byte_start, item.byte_stop
        self.mark_written(t.req.fqn)
        for e in edges:
            n = min(self.m.checksum_block_bytes, c.length - e)
            scratch = torch.empty(n, dtype=torch.uint8)
            self.st.read_into(path, c.offset + e, memoryview(scratch.numpy().data))
            self._count(n)
            self.verify(fqn, c, e, scratch)
            a, z = max(e, bs), min(e + n, be)
            u8[a - bs:z - bs].copy_(scratch[a - e:z - e])

    def _segment(self, c: Chunk) -> int:
        """Bytes of one direct read of chunk ``c``: an object store's request
        size; whole checksum blocks of about ``_VERIFY_SEGMENT_BYTES`` when
        they are verified (each is hashed while it is still in the CPU cache);
        else ``_SEGMENT_BYTES``."""
        b = self.m.checksum_block_bytes
        if self.st.read_segment_bytes:
            return b * max(1, self.st.read_segment_bytes // b)
        if self.opts.checksums and BlockTables.has(c):
            return b * max(1, _VERIFY_SEGMENT_BYTES // b)
        return b * max(1, _SEGMENT_BYTES // b)

    def _read_span(self, name: str, reads: list[tuple[int, int, str, Chunk, list[Any]]],
                   keep: tuple[str, int] | None = None) -> None:
        path = self.st.join(self.ckpt, name)
        start, stop = reads[0][0], max(r[1] for r in reads)
        buf = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            self.st.read_into(path, start, memoryview(buf.numpy().data))
            self._count(stop - start)
        for a, b, fqn, c, items in reads:
            lo = a - c.offset
            data = buf[a - start:b - start]
            self.verify(fqn, c, lo, data)
            dtype = torch_dtype(self.m.tensors[fqn].dtype)
            for item, t in items:
                src = _view_u8(buf, a - start + item.byte_start - lo, a - start + item.byte_stop - lo, dtype)
                self.mark_written(t.req.fqn)
                _copy(item, c, t, src)
            if keep is not None:
                ulo, uhi = self.unit_range(items)
                with self._lock:
                    self.kept[keep] = buf[a - start + ulo - lo:a - start + uhi - lo]
