"""The collectives interface and its pure parts: the :class:`Collectives`
interface, the protocol driver (:func:`drive`), the agreement protocol
(:func:`agree_steps`), :class:`SingleProcess` (world size 1) and
:class:`Counting` (a wrapper that counts bytes), :class:`BoundedStore` (the
job's store with a deadline per call). Nothing here calls
torch.distributed: the implementation over process groups is
:class:`reshard.collectives.TorchCollectives` (the only module that does),
which re-exports every name below.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from .errors import (
    CheckpointError,
    RankFailure,
    agreed_error,
    outcome,
    raise_agreed,
    summarize_failures,
)

if TYPE_CHECKING:  # (annotations only: the pure parts need no torch)
    import torch

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
        :mod:`reshard.planning.coordination_load`): ``sends`` and ``recvs`` are
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


#: what :class:`Tries` calls when the ranks agreed on a failure, before the
#: agreed error is raised: ``on_fail(agreed, mine)`` (``mine``: this rank's
#: own exception, or None); it may clean up (discard an attempt) or raise
#: another error in the agreed one's place
OnFail = Callable[[CheckpointError, "BaseException | None"], None]


class Tries:
    """Every rank tries, then all agree: the one way a phase of a collective
    operation fails on every rank or on none.

    Each step of the phase runs under ``with tries:``, which keeps the
    step's exception (the first one; ``Exception`` only, a
    ``KeyboardInterrupt`` still propagates) instead of raising it. Then the
    ranks agree on the phase: :meth:`agree` (one all-reduce on success, see
    :meth:`Collectives.agree`), :meth:`agree_steps` (the same inside a
    protocol generator driven by :func:`drive`) or :meth:`gather` (every
    rank's JSON outcome to every rank, for small groups). On any rank's
    failure every rank raises the same agreed
    :class:`~reshard.errors.CheckpointError`, chained to its own exception,
    after ``on_fail`` (:data:`OnFail`) ran. After an agreement the record is
    empty again, ready for the next phase::

        tries = Tries()
        with tries:
            plan = check(...)
        tries.agree(coll, "load (checked before writing)")

    Not thread-safe: one per rank and operation, used on the caller's thread.
    """

    __slots__ = ("err",)

    def __init__(self, err: BaseException | None = None) -> None:
        #: the first exception of the phase so far (None: every step succeeded)
        self.err = err

    @property
    def ok(self) -> bool:
        """No step of the phase failed so far."""
        return self.err is None

    def __enter__(self) -> Tries:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if isinstance(e, Exception):  # agreed by the caller
            if self.err is None:
                self.err = e
            return True
        return False

    def _take(self) -> BaseException | None:
        err, self.err = self.err, None
        return err

    def agree(self, coll: Collectives, what: str, values: Sequence[int] = (), *,
              on_fail: OnFail | None = None) -> list[int]:
        """Agree on the phase over ``coll``; returns ``values`` reduced by max."""
        err = self._take()
        try:
            return coll.agree(what, err, values)
        except CheckpointError as agreed:
            if on_fail is not None:
                on_fail(agreed, err)
            raise

    def agree_steps(self, rank: int, what: str, values: Sequence[int] = (), *,
                    on_fail: OnFail | None = None) -> Generator[Request, Any, list[int]]:
        """:meth:`agree` as protocol steps (:func:`agree_steps`)."""
        err = self._take()
        try:
            return (yield from agree_steps(rank, what, err, values))
        except CheckpointError as agreed:
            if on_fail is not None:
                on_fail(agreed, err)
            raise

    def gather(self, coll: Collectives, what: str, payload: dict[str, Any] | None = None, *,
               on_fail: OnFail | None = None) -> list[dict[str, Any]]:
        """Agree by gathering every rank's :func:`~reshard.errors.outcome`
        (``payload`` on success) to every rank; returns them in rank order."""
        err = self._take()
        gathered = coll.all_gather_json(outcome(coll.rank, err, **(payload or {})))
        try:
            raise_agreed(what, gathered, err)
        except CheckpointError as agreed:
            if on_fail is not None:
                on_fail(agreed, err)
            raise
        return gathered


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


#: seconds one call of the job's key-value store (set/get/check/add) may take
#: before the store counts as unreachable: its host process (global rank 0
#: under ``tcp://``/``env://`` initialisation) is stopped or gone
STORE_CALL_TIMEOUT_S = 5.0


class BoundedStore:
    """The job's c10d store with a deadline on every call.

    A TCPStore client whose server process is SIGSTOPped neither answers nor
    fails: its calls block until the store's own timeout (minutes). Calls
    here run on one daemon thread of this process, in order; a call that
    has not returned after ``timeout_s`` raises :class:`TimeoutError` naming
    it. The thread stays blocked in it, and until it returns every later
    call raises TimeoutError at once (the store is unreachable: waiting
    again would only add ``timeout_s`` per call). Used only after a
    collective is slow or failed, never on a collective's success path.

    Args:
        store: a ``torch.distributed.Store`` (any object with the methods).
        timeout_s: seconds per call (default :data:`STORE_CALL_TIMEOUT_S`).
    """

    def __init__(self, store: Any, timeout_s: float = STORE_CALL_TIMEOUT_S) -> None:
        self._store, self.timeout_s = store, timeout_s
        self._jobs: queue.SimpleQueue[tuple[Future[Any], str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stuck: tuple[Future[Any], str] | None = None  # a call that timed out, still running

    def _serve(self) -> None:
        while True:
            fut, name, args = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(getattr(self._store, name)(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # first call, or after a fork
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, name="reshard-store", daemon=True)
                self._thread.start()
                self._stuck = None
            if self._stuck is not None:
                if not self._stuck[0].done():
                    raise TimeoutError(f"the job's store is unreachable: its {self._stuck[1]}() call has "
                                       f"not returned after {self.timeout_s:g} s")
                self._stuck = None
        fut: Future[Any] = Future()
        self._jobs.put((fut, name, args))
        try:
            return fut.result(self.timeout_s)
        except FutureTimeout:
            if not fut.cancel():  # running: the thread is blocked in it
                with self._lock:
                    self._stuck = (fut, name)
            raise TimeoutError(f"the job's store did not answer {name}() within {self.timeout_s:g} s "
                               "(its host process is stopped or gone)") from None

    def set(self, key: str, value: str | bytes) -> None:  # noqa: A003 - the store's method names
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))


_BOUNDED: dict[int, BoundedStore] = {}


def bounded_store(store: Any) -> BoundedStore:
    """The one :class:`BoundedStore` of this process for ``store`` (its
    calls share one thread, so a stopped store host costs one timeout)."""
    b = _BOUNDED.get(id(store))
    if b is None or b._store is not store:
        b = _BOUNDED[id(store)] = BoundedStore(store)
    return b
