"""The only module that calls torch.distributed collectives.

Everything exchanged between ranks is bytes (msgpack or JSON produced by
msgspec) or small int64 vectors, never pickle, so no ``*_object`` collective
is used. Collectives are chosen by who needs the data (DESIGN.md section 1,
"Coordination budget"): :meth:`Collectives.gather_bytes` to the coordinator,
:meth:`Collectives.scatter_bytes` from it, :meth:`Collectives.broadcast_bytes`,
and :meth:`Collectives.all_reduce_ints` of small flag/counter vectors; the
data a load hands between replica holders moves point to point
(:meth:`Collectives.exchange`, uint8 tensors, no serialisation).
``agree`` is one all-reduce on success. Three implementations share one
interface:

* :class:`TorchCollectives` over any process group (gloo on CPU; NCCL groups
  exchange through CUDA tensors), addressing peers by their global ranks;
* :class:`SingleProcess` for plain scripts (world size 1);
* :class:`reshard.testing.simulate.SimWorld` (N ranks in one process, for the
  scale simulator), and :class:`Counting`, a wrapper that counts the bytes
  each call moves.

The coordinator is rank 0 of the group.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import msgspec
import torch

from .errors import CheckpointError, RankFailure, agreed_error, rank_ranges, summarize_failures

T = TypeVar("T")

#: ops of :meth:`Collectives.all_reduce_ints`
OPS = ("sum", "max", "min")
#: at most this many failures (with tracebacks) travel to non-coordinator ranks
MAX_SHIPPED_FAILURES = 8
#: and each failure's traceback text is cut to this many characters there
MAX_SHIPPED_TRACEBACK = 4000


class Collectives(ABC):
    """Collective operations of one group; rank 0 is the coordinator.

    Every rank of the group must call the same methods in the same order.
    Byte counts below are payload bytes (the 8-byte length headers some
    implementations add are counted by :class:`Counting`).
    """

    rank: int
    world_size: int

    @abstractmethod
    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        """Every rank sends ``data``; rank ``dst`` receives all of them in rank
        order (returns the list), the others receive nothing (return None)."""

    @abstractmethod
    def scatter_bytes(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        """Rank ``src`` passes one payload per rank (``world_size`` of them);
        every rank receives only its own. Others pass None."""

    @abstractmethod
    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``data`` of rank ``src`` (others pass anything, e.g. None) on every rank."""

    @abstractmethod
    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        """Element-wise ``op`` ("sum", "max" or "min") of int64 vectors of equal
        length over every rank; every rank receives the result. For small
        vectors (flags, counters, hashes): it moves ``8 * len(values)`` bytes."""

    @abstractmethod
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``; every rank receives all, in rank
        order. O(world) bytes into every rank: only for small payloads of small
        groups (kept for callers outside the save/load path)."""

    def barrier(self) -> None:
        self.all_reduce_ints([0])

    def exchange(self, sends: Sequence[tuple[int, int, torch.Tensor]],
                 recvs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Point-to-point transfer of data buffers (the bytes a replica's
        reader hands to the other ranks that need them; see
        :mod:`reshard.coordination_load`): ``sends`` and ``recvs`` are
        ``(peer rank in the group, tag, tensor)``; each send must be matched
        by the peer's recv of the same tag and number of bytes. Tensors are
        contiguous uint8 CPU tensors; a recv fills its tensor in place.
        Returns once every transfer of this rank completed.

        Raises:
            NotImplementedError: the implementation moves no data (one rank,
                the simulator).
            CheckpointError: the transport failed (a lost peer, a timeout).
        """
        if sends or recvs:
            raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """``all_gather_bytes`` of msgspec-JSON-encoded objects."""
        return [msgspec.json.decode(b) for b in self.all_gather_bytes(msgspec.json.encode(obj))]

    def agree(self, what: str, exc: BaseException | None,
              values: Sequence[int] = ()) -> list[int]:
        """All ranks report success or their exception in one all-reduce (with
        ``values``, reduced by max, riding along: returns them reduced).

        When some rank failed, the failures (type, message, traceback as text)
        are gathered to the coordinator only, which sends every rank a bounded
        summary (failures deduplicated by type and message, with rank ranges and
        the first few tracebacks); every rank then raises the same
        :class:`~reshard.errors.CheckpointError` (or the common subclass).
        The coordinator's error keeps every rank's failure in ``failures``; the
        others' keep at most ``MAX_SHIPPED_FAILURES``.

        Raises:
            CheckpointError: on every rank when any rank passed an exception.
        """
        return drive(self, agree_steps(self.rank, what, exc, values))


#: a collective request of a protocol written as a generator: the name of a
#: :class:`Collectives` method and its positional arguments
Request = tuple[Any, ...]


def drive(coll: Collectives, steps: Generator[Request, Any, T]) -> T:
    """Run a protocol generator over ``coll``: each yielded ``(method, *args)``
    is called on ``coll`` and its result sent back; returns the generator's
    return value (exceptions propagate). The scale simulator runs the same
    generators of N ranks in lockstep instead."""
    try:
        req = next(steps)
        while True:
            req = steps.send(getattr(coll, req[0])(*req[1:]))
    except StopIteration as stop:
        return stop.value


def agree_steps(rank: int, what: str, exc: BaseException | None,
                values: Sequence[int] = ()) -> Generator[Request, Any, list[int]]:
    """:meth:`Collectives.agree` as protocol steps."""
    red = yield ("all_reduce_ints", [1 if exc is not None else 0, *values], "max")
    if not red[0]:
        return list(red[1:])
    mine = b"" if exc is None else msgspec.json.encode(RankFailure.from_exception(rank, exc).to_json())
    got = yield ("gather_bytes", mine)
    failures: dict[int, RankFailure] = {}
    shipped = b""
    if got is not None:
        failures = {r: RankFailure.from_json(msgspec.json.decode(b)) for r, b in enumerate(got) if b}
        shipped = msgspec.json.encode({"n": len(failures), "groups": summarize_failures(failures),
                                       "failures": [f.to_json() for f in _representatives(failures)]})
    raw = yield ("broadcast_bytes", shipped if got is not None else None)
    if got is None:
        rep = msgspec.json.decode(raw)
        failures = {int(f["rank"]): RankFailure.from_json(f) for f in rep["failures"]}
        err = agreed_error(what, failures, groups=rep["groups"], total=int(rep["n"]))
    else:
        err = agreed_error(what, failures, world_size=len(got))
    if exc is not None:
        raise err from exc
    raise err


def _representatives(failures: dict[int, RankFailure]) -> list[RankFailure]:
    """The first rank of each distinct (type, message), up to MAX_SHIPPED_FAILURES,
    tracebacks cut to MAX_SHIPPED_TRACEBACK characters."""
    seen: set[tuple[str, str]] = set()
    out: list[RankFailure] = []
    for r in sorted(failures):
        f = failures[r]
        if (f.type_name, f.message) in seen:
            continue
        seen.add((f.type_name, f.message))
        tb = f.traceback if len(f.traceback) <= MAX_SHIPPED_TRACEBACK else (
            f.traceback[:MAX_SHIPPED_TRACEBACK // 2] + "\n...\n" + f.traceback[-MAX_SHIPPED_TRACEBACK // 2:])
        out.append(RankFailure(rank=f.rank, type_name=f.type_name, message=f.message[:2000],
                               traceback=tb))
        if len(out) >= MAX_SHIPPED_FAILURES:
            break
    return out


def _reduce(vectors: Sequence[Sequence[int]], op: str) -> list[int]:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    cols = list(zip(*vectors, strict=True))
    if op == "sum":
        return [int(sum(c)) for c in cols]
    return [int(max(c) if op == "max" else min(c)) for c in cols]


class SingleProcess(Collectives):
    """World of one rank: gathers return ``[data]``."""

    rank = 0
    world_size = 1

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        return [bytes(data)]

    def scatter_bytes(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        assert parts is not None and len(parts) == 1
        return bytes(parts[0])

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return bytes(data or b"")

    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        return _reduce([values], op)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def barrier(self) -> None:
        pass


F = TypeVar("F", bound=Callable[..., Any])


def _lost_rank_errors(fn: F) -> F:
    """A collective of the backend that fails (gloo's "Connection closed by
    peer", a timeout: RuntimeErrors) raises CheckpointError on this rank,
    naming the cause and, where :func:`_lost_ranks` can tell, the lost
    rank(s) (also in the error's ``lost_ranks``), with the backend's error as
    its ``__cause__``."""

    @functools.wraps(fn)
    def wrapper(self: TorchCollectives, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as e:  # DistBackendError and gloo/NCCL failures are RuntimeErrors
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            lost, why = _lost_ranks(self)
            err = CheckpointError(
                f"{fn.__name__} over the {self.world_size} ranks of the checkpoint group failed on "
                f"rank {self.rank}: {why} ({type(e).__name__}: {msg})")
            err.lost_ranks = tuple(lost)  # type: ignore[attr-defined]
            raise err from e

    return wrapper  # type: ignore[return-value]


#: at most this long (seconds; the group's timeout when shorter) the survivors
#: of a failed collective wait for one another's reports (see _lost_ranks)
LOST_RANK_WAIT_S = 30.0


def _rank_names(coll: TorchCollectives, ranks: Sequence[int]) -> str:
    text = f"rank {rank_ranges(list(ranks))}" if len(ranks) == 1 else f"ranks {rank_ranges(list(ranks))}"
    glob = [coll._global[r] for r in ranks]
    return text if glob == list(ranks) else f"{text} (global {rank_ranges(glob)})"


def _lost_ranks(coll: TorchCollectives) -> tuple[list[int], str]:
    """Which ranks of ``coll``'s group are lost, found after one of its
    collectives failed (never on the success path). Returns (group ranks,
    the phrase naming them).

    Through the job's key-value store (torch.distributed's default store,
    not the broken collective): every survivor sets ``alive/<rank>`` (its
    wall-clock time); the coordinator waits up to W seconds
    (``LOST_RANK_WAIT_S`` or the group's timeout, whichever is shorter) for
    the others' keys, names the ranks whose key did not come (killed, or
    stalled past the timeout) and publishes that verdict; the others wait up
    to 2W + 1 seconds for it (and count themselves as having read it, so a
    coordinator hosting the store stays up to W seconds for them), and name
    the coordinator when it never comes.
    When the store itself cannot be reached, the process hosting it is
    gone: global rank 0's (``tcp://`` and ``env://`` initialisation start
    the store there) unless torchrun's agent hosts it. Keys older than 2W
    are stale (an earlier failure) and do not count. One store write per
    survivor, and O(world) store reads on the coordinator only.
    """
    import json as _json
    import os
    import time
    import zlib

    timeout = group_timeout_s(coll.group) or LOST_RANK_WAIT_S
    wait = max(0.5, min(LOST_RANK_WAIT_S, timeout))
    unknown = "a rank was lost or did not arrive within the group's timeout"
    try:
        store = coll._dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to ask: say what is known
        return [], unknown
    prefix = f"reshard/lost/{zlib.crc32(repr(coll._global).encode()):08x}/"
    now = time.time()

    def fresh(key: str) -> bool:
        return bool(store.check([key])) and abs(float(store.get(key)) - now) <= 2 * wait

    try:
        store.set(f"{prefix}alive/{coll.rank}", repr(now))
        if coll.rank == 0:
            pending = set(range(1, coll.world_size))
            deadline, poll = time.monotonic() + wait, 0.02
            while pending and time.monotonic() < deadline:
                pending -= {r for r in pending if fresh(f"{prefix}alive/{r}")}
                if pending:
                    time.sleep(poll)
                    poll = min(poll * 2, 0.25)
            lost = sorted(pending)
            vid = os.urandom(6).hex()
            store.set(f"{prefix}verdict", _json.dumps({"t": now, "lost": lost, "id": vid}))
            # the store may live in this process: stay until the survivors have read it
            deadline, poll, alive = time.monotonic() + wait, 0.01, coll.world_size - 1 - len(lost)
            while alive and store.add(f"{prefix}read/{vid}", 0) < alive and time.monotonic() < deadline:
                time.sleep(poll)
                poll = min(poll * 2, 0.1)
        else:
            deadline, poll, verdict = time.monotonic() + 2 * wait + 1, 0.01, None
            while time.monotonic() < deadline:
                if store.check([f"{prefix}verdict"]):
                    v = _json.loads(store.get(f"{prefix}verdict"))
                    if abs(float(v["t"]) - now) <= 2 * wait:
                        verdict = v
                        store.add(f"{prefix}read/{v['id']}", 1)
                        break
                time.sleep(poll)
                poll = min(poll * 2, 0.1)
            if verdict is None:
                return [0], (f"{_rank_names(coll, [0])} (the coordinator) was lost: it did not "
                             f"report within {2 * wait + 1:.0f} s of the failure (killed, or "
                             "stalled past the group's timeout)")
            lost = [int(r) for r in verdict["lost"] if int(r) != coll.rank]
    except Exception:  # noqa: BLE001 - the store is gone with the process that hosted it
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or 0 not in coll._global:
            return [], unknown + " (the job's store is unreachable too)"
        host = coll._global.index(0)
        if host == coll.rank:
            return [], unknown + " (the job's store is unreachable)"
        return [host], (f"{_rank_names(coll, [host])} was lost: the job's store, which its process "
                        "hosts (tcp:// or env:// initialisation), is unreachable too")
    if not lost:
        return [], unknown + " (every rank reported alive after the failure: a timeout)"
    return lost, (f"{_rank_names(coll, lost)} {'was' if len(lost) == 1 else 'were'} lost: "
                  f"{'it' if len(lost) == 1 else 'they'} did not report within {wait:.0f} s of the "
                  "failure (killed, or stalled past the group's timeout)")


class TorchCollectives(Collectives):
    """Collectives over a ``torch.distributed`` process group.

    Args:
        group: the process group (None: the default group). Only collectives on
            this group are issued, so a separate group keeps background
            checkpoint traffic apart from training collectives. Peers are
            addressed by their global ranks (``dist.get_global_rank``).

    Gather and scatter send exact payload sizes: the sizes travel first as
    int64 (one per rank, coordinator only), then the payloads point to point
    between the coordinator and each rank (``isend``/``irecv``), so a
    non-coordinator rank never receives another rank's bytes.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl" and torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._global = (list(range(self.world_size)) if group is None
                        else [dist.get_global_rank(group, r) for r in range(self.world_size)])

    def _u8(self, data: bytes) -> torch.Tensor:
        if not data:
            return torch.empty(0, dtype=torch.uint8, device=self._device)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)

    @staticmethod
    def _bytes(t: torch.Tensor) -> bytes:
        return bytes(t.cpu().numpy().tobytes())

    @_lost_rank_errors
    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        dist, dev, n = self._dist, self._device, self.world_size
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)] if self.rank == dst else None
        dist.gather(size, sizes, dst=self._global[dst], group=self.group)
        if self.rank != dst:
            if data:
                dist.send(self._u8(data), dst=self._global[dst], group=self.group)
            return None
        assert sizes is not None
        lens = [int(s.item()) for s in sizes]
        bufs = [torch.empty(k, dtype=torch.uint8, device=dev) for k in lens]
        works = [dist.irecv(bufs[r], src=self._global[r], group=self.group)
                 for r in range(n) if r != dst and lens[r]]
        for w in works:
            w.wait()
        bufs[dst] = self._u8(data)
        return [self._bytes(b) for b in bufs]

    @_lost_rank_errors
    def scatter_bytes(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        dist, dev, n = self._dist, self._device, self.world_size
        mine = torch.zeros(1, dtype=torch.int64, device=dev)
        if self.rank == src:
            if parts is None or len(parts) != n:
                raise ValueError(f"scatter_bytes: the source passes {n} parts")
            sizes = [torch.tensor([len(p)], dtype=torch.int64, device=dev) for p in parts]
            dist.scatter(mine, sizes, src=self._global[src], group=self.group)
            works = [dist.isend(self._u8(parts[r]), dst=self._global[r], group=self.group)
                     for r in range(n) if r != src and parts[r]]
            for w in works:
                w.wait()
            return bytes(parts[src])
        dist.scatter(mine, None, src=self._global[src], group=self.group)
        k = int(mine.item())
        if not k:
            return b""
        buf = torch.empty(k, dtype=torch.uint8, device=dev)
        dist.recv(buf, src=self._global[src], group=self.group)
        return self._bytes(buf)

    @_lost_rank_errors
    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        dist, dev = self._dist, self._device
        payload = (data or b"") if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=self._global[src], group=self.group)
        k = int(size.item())
        if not k:
            return b""
        buf = self._u8(payload) if self.rank == src else torch.empty(k, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=self._global[src], group=self.group)
        return bytes(payload) if self.rank == src else self._bytes(buf)

    @_lost_rank_errors
    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        dist = self._dist
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        t = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        if t.numel():
            rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            dist.all_reduce(t, op=rop, group=self.group)
        return [int(v) for v in t.cpu().tolist()]

    @_lost_rank_errors
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        dist, dev, n = self._dist, self._device, self.world_size
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        dist.all_gather(sizes, size, group=self.group)
        lens = [int(s.item()) for s in sizes]
        width = max(max(lens), 1)
        buf = torch.zeros(width, dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = self._u8(data)
        outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        dist.all_gather(outs, buf, group=self.group)
        return [self._bytes(o[:k]) for o, k in zip(outs, lens, strict=True)]

    @_lost_rank_errors
    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    @_lost_rank_errors
    def exchange(self, sends: Sequence[tuple[int, int, torch.Tensor]],
                 recvs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """All receives are posted first, then all sends; every transfer is
        one ``isend``/``irecv`` of its tensor as it is (no copy on a CPU
        group). On a group whose device is CUDA (NCCL), each buffer is
        staged through a device tensor of its size (not exercised by the
        tests: no GPU)."""
        dist, dev = self._dist, self._device
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        works = []
        for peer, tag, t in recvs:
            buf = t if dev.type == "cpu" else torch.empty(t.numel(), dtype=torch.uint8, device=dev)
            if buf is not t:
                staged.append((t, buf))
            works.append(dist.irecv(buf, src=self._global[peer], group=self.group, tag=tag))
        for peer, tag, t in sends:
            buf = t if dev.type == "cpu" else t.to(dev)
            works.append(dist.isend(buf, dst=self._global[peer], group=self.group, tag=tag))
        for w in works:
            w.wait()
        for t, buf in staged:
            t.copy_(buf)


class Counting(Collectives):
    """Wraps another Collectives and counts the bytes this rank sends and
    receives per call (payloads plus the 8-byte length headers of the
    gather/scatter/broadcast protocols), in ``sent`` / ``recv`` (bytes) and
    ``calls`` (op name -> count); data handed over by :meth:`exchange` in
    ``data_sent`` / ``data_recv``."""

    def __init__(self, inner: Collectives):
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self.sent = 0
        self.recv = 0
        self.data_sent = 0
        self.data_recv = 0
        self.calls: dict[str, int] = {}

    def _count(self, op: str, sent: int, recv: int) -> None:
        self.sent += sent
        self.recv += recv
        self.calls[op] = self.calls.get(op, 0) + 1

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        out = self.inner.gather_bytes(data, dst)
        if out is None:
            self._count("gather", len(data) + 8, 0)
        else:
            self._count("gather", 0, sum(len(b) + 8 for r, b in enumerate(out) if r != self.rank))
        return out

    def scatter_bytes(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        out = self.inner.scatter_bytes(parts, src)
        if self.rank == src:
            assert parts is not None
            self._count("scatter", sum(len(p) + 8 for r, p in enumerate(parts) if r != src), 0)
        else:
            self._count("scatter", 0, len(out) + 8)
        return out

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        out = self.inner.broadcast_bytes(data, src)
        if self.rank == src:
            self._count("broadcast", len(out) + 8, 0)
        else:
            self._count("broadcast", 0, len(out) + 8)
        return out

    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        out = self.inner.all_reduce_ints(values, op)
        self._count("all_reduce", 8 * len(values), 8 * len(values))
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        out = self.inner.all_gather_bytes(data)
        self._count("all_gather", len(data), sum(len(b) for r, b in enumerate(out) if r != self.rank))
        return out

    def barrier(self) -> None:
        self.inner.barrier()
        self._count("barrier", 0, 0)

    def exchange(self, sends: Sequence[tuple[int, int, torch.Tensor]],
                 recvs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Counted apart from the coordination bytes: ``data_sent`` /
        ``data_recv`` (bytes of the buffers)."""
        self.inner.exchange(sends, recvs)
        self.data_sent += sum(t.numel() for _, _, t in sends)
        self.data_recv += sum(t.numel() for _, _, t in recvs)
        self.calls["exchange"] = self.calls.get("exchange", 0) + 1


def get_collectives(group: Any = None) -> Collectives:
    """Collectives for ``group``; single-process when torch.distributed is not
    initialised and no group is given."""
    if isinstance(group, Collectives):
        return group
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    return TorchCollectives(group)


def group_key(coll: Collectives) -> tuple[Any, ...]:
    """Identifies a group for the plan cache: its size and global ranks."""
    if isinstance(coll, Counting):
        return group_key(coll.inner)
    if isinstance(coll, TorchCollectives):
        return ("torch", coll.world_size, tuple(coll._global), id(coll.group) if coll.group else 0)
    return (type(coll).__name__, coll.world_size, id(coll) if coll.world_size > 1 else 0)


def new_checkpoint_group(group: Any = None, timeout_s: float | None = None) -> Any:
    """A new gloo process group over the ranks of ``group`` (all ranks must
    call it), for background checkpoint traffic that must never interleave
    with training collectives. Its timeout is ``timeout_s`` seconds, by
    default that of ``group`` (so a rank that never arrives fails a background
    save as soon as it would fail the caller's own collectives)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else None
    kwargs: dict[str, Any] = {"backend": "gloo"}
    if timeout_s is None:  # as long as the caller's group waits, not torch's 30-minute default
        timeout_s = group_timeout_s(group)
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    return dist.new_group(ranks=ranks, **kwargs)


_TIMED_GROUPS: dict[tuple[Any, float], Any] = {}


def timed_collectives(group: Any, timeout_s: float | None) -> Collectives:
    """Collectives for a save or load of ``group`` bounded by ``timeout_s``
    seconds: over a gloo checkpoint group created (once per group and
    timeout, every rank of ``group`` calling) with that timeout, so neither
    the training group's timeout nor its traffic governs the checkpoint's
    collectives. Plain :func:`get_collectives` when ``timeout_s`` is None or
    there is no process group (a single process)."""
    base = get_collectives(group)
    if timeout_s is None or not isinstance(base, TorchCollectives) or base.world_size == 1:
        return base
    import torch.distributed as dist

    key = (group if group is not None else "default", float(timeout_s))
    pg = _TIMED_GROUPS.get(key)
    if pg is None:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        pg = _TIMED_GROUPS[key] = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timedelta(seconds=float(timeout_s)),
            use_local_synchronization=group is not None)
    return TorchCollectives(pg)


def timed_keys(group: Any = None) -> list[tuple[Any, ...]]:
    """:func:`group_key` of every checkpoint group :func:`timed_collectives`
    made for ``group``."""
    g = group if group is not None else "default"
    return [group_key(TorchCollectives(pg)) for (k, _), pg in _TIMED_GROUPS.items() if k is g]


def group_timeout_s(group: Any = None) -> float | None:
    """The timeout (seconds) of ``group`` (None: the default group) where the
    backend exposes it (gloo does), else None."""
    import torch.distributed as dist

    pg: Any = group if group is not None else dist.group.WORLD
    try:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a backend without CPU options (NCCL): torch's default
        return None
