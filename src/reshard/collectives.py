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
* :class:`reshard.bench.simulate.SimWorld` (N ranks in one process, for the
  scale simulator), and :class:`Counting`, a wrapper that counts the bytes
  each call moves.

The coordinator is rank 0 of the group.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from .collectives_base import (
    MAX_SHIPPED_FAILURES,
    MAX_SHIPPED_TRACEBACK,
    OPS,
    STORE_CALL_TIMEOUT_S,
    Collectives,
    Counting,
    OnFail,
    Request,
    SingleProcess,
    Tries,
    agree_steps,
    bounded_store,
    drive,
)
from .errors import CheckpointError, rank_ranges
from .timeouts import DefaultSeconds

__all__ = ["MAX_SHIPPED_FAILURES", "MAX_SHIPPED_TRACEBACK", "OPS", "Collectives", "Counting",
           "OnFail", "Request", "SingleProcess", "TorchCollectives", "Tries", "agree_steps", "drive",
           "Arrival", "arrive", "checkpoint_timeout_s", "get_collectives", "group_key", "group_timeout_s",
           "new_checkpoint_group",
           "is_broken", "on_new_world", "timed_collectives", "timed_keys", "wait_report_s", "watch"]


F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("reshard.collectives")

#: seconds one wait of a checkpoint collective blocks before it looks for
#: news in the job's store: a failure another rank of the group published (a
#: lost peer, a timeout: the wait then ends within about this long), its own
#: arrival mark, and on the coordinator the progress line. A wait that ends
#: sooner costs nothing more than the collective.
WAIT_SLICE_S = 1.0
#: seconds between the coordinator's lines about a collective still waiting
#: for other ranks ("save of step S: waiting N s for ranks [2] in phase P");
#: the environment variable ``RESHARD_WAIT_REPORT_S`` overrides it
WAIT_REPORT_S = 30.0


def wait_report_s() -> float:
    """:data:`WAIT_REPORT_S`, or ``RESHARD_WAIT_REPORT_S`` (seconds) if set."""
    v = os.environ.get("RESHARD_WAIT_REPORT_S")
    return float(v) if v else WAIT_REPORT_S


class PeerFailed(RuntimeError):
    """Another rank of the checkpoint group published the failure of one of
    its collectives (a lost peer, a timeout) while this rank waited, or the
    job's store became unreachable: the group is unusable."""


#: group name -> why it is unusable (a collective of it failed or was
#: abandoned); later collectives on it raise at once
_BROKEN: dict[str, tuple[str, tuple[int, ...]]] = {}
#: collectives issued per group name (the same sequence on every rank)
_SEQ: dict[str, int] = {}
#: abandoned gloo work (and its group), kept alive on purpose: destroying the
#: group joins gloo's worker thread, which stays in the abandoned collective
#: until the group's timeout, so the process could not exit before it
_ABANDONED: list[Any] = []


def _keep_forever(obj: Any) -> None:
    """Never free ``obj``, not even at interpreter exit (one reference more
    than anyone holds: module dictionaries are cleared at exit)."""
    import ctypes

    _ABANDONED.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _lost_rank_errors(fn: F) -> F:
    """A collective of the backend that fails (gloo's "Connection closed by
    peer", a timeout: RuntimeErrors), or whose wait learns that another rank
    of the group failed (:class:`PeerFailed`), raises CheckpointError on this
    rank, naming the cause, what the group was doing (``activity``: the save
    or load and its phase) and, where :func:`_lost_ranks` can tell, the lost
    rank(s) (also in the error's ``lost_ranks``), with the backend's error as
    its ``__cause__``. The failure is first published in the job's store, so
    the other ranks' waits on the group end within :data:`WAIT_SLICE_S`; the
    group is unusable afterwards (later calls raise at once)."""

    @functools.wraps(fn)
    def wrapper(self: TorchCollectives, *args: Any, **kwargs: Any) -> Any:
        broken = _BROKEN.get(self.name)
        if broken is not None:  # the first failure of the group, again
            err = CheckpointError(f"{broken[0]} (then {fn.__name__} was refused: the group is "
                                  "unusable)")
            err.lost_ranks = broken[1]  # type: ignore[attr-defined]
            raise err
        _SEQ[self.name] = _SEQ.get(self.name, 0) + 1
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as e:  # DistBackendError and gloo/NCCL failures are RuntimeErrors
            msg = (str(e).strip().splitlines() or [""])[0][:300]
            _BROKEN.setdefault(self.name, (f"{fn.__name__} failed on rank {self.rank} ({msg[:120]})", ()))
            if not isinstance(e, PeerFailed):
                self._publish_failure(f"{fn.__name__} failed on rank {self.rank}: {msg[:200]}")
            lost, why = _lost_ranks(self)
            err = CheckpointError(
                f"{fn.__name__} over the {self.world_size} ranks of the checkpoint group failed on "
                f"rank {self.rank}{self._doing()}: {why} ({type(e).__name__}: {msg})")
            err.lost_ranks = tuple(lost)  # type: ignore[attr-defined]
            _BROKEN[self.name] = (str(err), tuple(lost))
            raise err from e

    return wrapper  # type: ignore[return-value]


#: at most this long (seconds; the group's timeout when shorter) the survivors
#: of a failed collective wait for one another's reports (see _lost_ranks);
#: the failure is published first, so every survivor waiting on the group
#: reports within WAIT_SLICE_S of it
LOST_RANK_WAIT_S = 2.0


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
    to W + 1.5 seconds for it (and count themselves as having read it, so a
    coordinator hosting the store stays up to 1.5 s for them), and name the
    coordinator when it never comes. The failure was published before (see
    :func:`_lost_rank_errors`), so every survivor waiting on the group comes
    here within ``WAIT_SLICE_S``; a survivor busy elsewhere (writing its
    files) for longer than W is named among the ranks that did not report.
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
        store = coll._store()
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
            deadline, poll, alive = time.monotonic() + min(wait, 1.5), 0.01, coll.world_size - 1 - len(lost)
            while alive and store.add(f"{prefix}read/{vid}", 0) < alive and time.monotonic() < deadline:
                time.sleep(poll)
                poll = min(poll * 2, 0.1)
        else:
            deadline, poll, verdict = time.monotonic() + wait + 1.5, 0.01, None
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
                             f"report within {wait + 1.5:.0f} s of the failure (killed, or "
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

    Waits: every collective (not the point-to-point transfers, whose waits
    cannot be cut without closing gloo's connections) is waited for in
    slices of :data:`WAIT_SLICE_S` (see :meth:`_wait`): a failure on any
    rank of the group ends every other rank's wait within about a second,
    and the coordinator names the ranks that have not arrived. Each wait is
    bounded by the group's timeout (``SaveOptions.timeout_s``).
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
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._pg = pg
        #: the process group's name: the same on every rank, unique per group
        self.name = str(getattr(pg, "group_name", "") or repr(self._global))
        self._prefix = f"reshard/group/{self.name}/"
        #: what the group is doing, for progress lines and errors: a callable
        #: returning (what, phase), e.g. ("save of step 2", "write"); see watch()
        self.activity: Callable[[], tuple[str, str]] | None = None
        self._store_obj: Any = None
        self._sliced = backend == "gloo"

    def _store(self) -> Any:
        if self._store_obj is None:
            self._store_obj = bounded_store(self._dist.distributed_c10d._get_default_store())
        return self._store_obj

    def _doing(self) -> str:
        """`` (save of step 2, phase write)`` from ``activity``, or ""."""
        if self.activity is None:
            return ""
        try:
            what, phase = self.activity()
        except Exception:  # noqa: BLE001 - a label must never fail a collective
            return ""
        return f" ({what}, phase {phase})"

    def _publish_failure(self, why: str) -> None:
        """Tell the other ranks of the group (through the job's store) that a
        collective of it failed here; best effort (the store may be gone)."""
        try:
            self._store().set(self._prefix + "failed", why)
        except Exception:  # noqa: BLE001 - the store host is gone: the others see it too
            pass

    def _abandon(self, work: Any, why: str) -> None:
        _BROKEN.setdefault(self.name, (why, ()))
        _keep_forever(work)
        if self._pg not in _ABANDONED:
            _keep_forever(self._pg)

    def _wait(self, work: Any) -> None:
        """Wait for ``work`` in slices of :data:`WAIT_SLICE_S`; between
        slices, mark this rank's arrival in the store, end the wait when
        another rank published a failure of the group (:class:`PeerFailed`,
        the work is then abandoned: see :data:`_ABANDONED`), and on the
        coordinator log one line per :func:`wait_report_s` naming the ranks
        that have not arrived and the phase. The collective's own failure
        (the group's timeout, a lost peer) is raised as it is. Gloo groups
        only (the checkpoint groups are): other backends wait as they do."""
        if not self._sliced:  # NCCL: a wait with a timeout aborts the communicator
            work.wait()
            return
        seq = _SEQ.get(self.name, 0)
        t0, every, reported, marked = time.monotonic(), wait_report_s(), 0, False
        while True:
            try:
                work.wait(timeout=timedelta(seconds=WAIT_SLICE_S))
                return
            except RuntimeError:
                if work.is_completed():
                    raise
            store = self._store()
            try:
                if not marked:
                    store.set(f"{self._prefix}at/{self.rank}", str(seq))
                    marked = True
                failed = store.get(self._prefix + "failed").decode() if store.check(
                    [self._prefix + "failed"]) else None
            except Exception as e:  # noqa: BLE001 - the process hosting the store is gone
                failed = f"the job's store is unreachable ({type(e).__name__}: {str(e)[:120]})"
            if failed is not None:
                self._abandon(work, failed)
                raise PeerFailed(f"the wait ended: {failed}")
            waited = time.monotonic() - t0
            if self.rank == 0 and waited >= (reported + 1) * every:
                reported = int(waited // every)
                self._report(seq, waited)

    def _report(self, seq: int, waited: float) -> None:
        """The coordinator's progress line for a collective waiting ``waited`` s."""
        try:
            store, missing = self._store(), []
            for r in range(1, self.world_size):
                k = f"{self._prefix}at/{r}"
                if not store.check([k]) or int(store.get(k)) < seq:
                    missing.append(r)
        except Exception:  # noqa: BLE001 - the line says what is known
            missing = []
        who = (f"ranks {missing}" if 0 < len(missing) <= 16 else
               f"{len(missing)} ranks ({rank_ranges(missing)})" if missing else "the other ranks")
        what, phase = ("a checkpoint collective", "?") if self.activity is None else self.activity()
        log.warning("%s: waiting %.0f s for %s in phase %s", what, waited, who, phase)

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
        self._wait(dist.gather(size, sizes, dst=self._global[dst], group=self.group, async_op=True))
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
            self._wait(dist.scatter(mine, sizes, src=self._global[src], group=self.group, async_op=True))
            works = [dist.isend(self._u8(parts[r]), dst=self._global[r], group=self.group)
                     for r in range(n) if r != src and parts[r]]
            for w in works:
                w.wait()
            return bytes(parts[src])
        self._wait(dist.scatter(mine, None, src=self._global[src], group=self.group, async_op=True))
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
        self._wait(dist.broadcast(size, src=self._global[src], group=self.group, async_op=True))
        k = int(size.item())
        if not k:
            return b""
        buf = self._u8(payload) if self.rank == src else torch.empty(k, dtype=torch.uint8, device=dev)
        self._wait(dist.broadcast(buf, src=self._global[src], group=self.group, async_op=True))
        return bytes(payload) if self.rank == src else self._bytes(buf)

    @_lost_rank_errors
    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        dist = self._dist
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        t = torch.tensor(list(values), dtype=torch.int64, device=self._device)
        if t.numel():
            rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
            self._wait(dist.all_reduce(t, op=rop, group=self.group, async_op=True))
        return [int(v) for v in t.cpu().tolist()]

    @_lost_rank_errors
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        dist, dev, n = self._dist, self._device, self.world_size
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True))
        lens = [int(s.item()) for s in sizes]
        width = max(max(lens), 1)
        buf = torch.zeros(width, dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = self._u8(data)
        outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        self._wait(dist.all_gather(outs, buf, group=self.group, async_op=True))
        return [self._bytes(o[:k]) for o, k in zip(outs, lens, strict=True)]

    @_lost_rank_errors
    def barrier(self) -> None:
        self._wait(self._dist.barrier(group=self.group, async_op=True))

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


#: the default process group the per-process state of this module (and of
#: the modules that registered with :func:`on_new_world`) belongs to
_WORLD: list[Any] = [None]
#: what forgets the state of a destroyed default group (see :func:`on_new_world`)
_ON_NEW_WORLD: list[Callable[[], None]] = []


def on_new_world(forget: Callable[[], None]) -> None:
    """Register ``forget()``, called once when this process's default group
    is found to be another than the one its state was made with (a process
    that destroyed its default group and initialised a new one): it drops
    what was made from the old group (:mod:`reshard.saving.pending`: the
    background savers)."""
    _ON_NEW_WORLD.append(forget)


def _check_world() -> None:
    """Forget the per-process state made from a destroyed default process
    group: the checkpoint groups (``_TIMED_GROUPS``), the broken-group marks
    and collective counts (keyed by group names, which a new default group
    hands out again from the start), the arrival counts, the bounded store
    wrappers, and what :func:`on_new_world` registered. Every group of the
    old world went with it (``destroy_process_group()`` destroys them all).
    One comparison when nothing changed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.distributed_c10d._get_default_group()
    if world is _WORLD[0]:
        return
    if _WORLD[0] is not None:
        _TIMED_GROUPS.clear()
        _BROKEN.clear()
        _SEQ.clear()
        _ARRIVED.clear()
        from .collectives_base import _BOUNDED

        _BOUNDED.clear()
        for forget in _ON_NEW_WORLD:
            forget()
    _WORLD[0] = world  # (held: the identity of a group object is never reused while held)


def get_collectives(group: Any = None) -> Collectives:
    """Collectives for ``group``; single-process when torch.distributed is not
    initialised and no group is given."""
    if isinstance(group, Collectives):
        return group
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    _check_world()
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
    return _new_group_within(timeout_s, "a background checkpoint group", ranks=ranks, **kwargs)


def _new_group_within(timeout_s: float | None, what: str, **kwargs: Any) -> Any:
    """``dist.new_group(**kwargs)`` that gives up after ``timeout_s`` +
    :data:`STORE_CALL_TIMEOUT_S` seconds, not only on its gloo connections.

    Group creation reads the other ranks' addresses from the job's store,
    whose client, when the store's host (rank 0 of a TCP store) is stopped
    (SIGSTOP, a debugger), neither answers nor fails for the training
    group's timeout (minutes; lowering the store's timeout does not bound
    it: the rendezvous retries). A rank that finished its part of the group
    and then stopped left the others blocked there, past the checkpoint's
    timeout (the fault matrix's ``sigstop-load/load--/manifest/stop/rank0/
    timeout3s``, now and then under load). The group is made on a daemon
    thread; past the bound the caller raises and the thread is left blocked
    in the store (as :class:`~reshard.collectives_base.BoundedStore`'s is).
    Unbounded (``timeout_s`` None): made on the caller's thread.

    Raises:
        CheckpointError: the group was not made within the bound, or its
            creation failed (names ``what``, the phase ``group`` and the cause).
    """
    import torch.distributed as dist

    if timeout_s is None:
        return dist.new_group(**kwargs)
    bound = float(timeout_s) + STORE_CALL_TIMEOUT_S
    fut: Future[Any] = Future()

    def make() -> None:
        try:
            fut.set_result(dist.new_group(**kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    threading.Thread(target=make, name="reshard-new-group", daemon=True).start()
    try:
        return fut.result(bound)
    except FutureTimeout:
        cause = f"not made within {bound:g} s (its timeout {float(timeout_s):g} s + {STORE_CALL_TIMEOUT_S:g} s)"
    except (dist.DistError, RuntimeError) as e:
        cause = f"not made: {type(e).__name__}: {e}"
    raise CheckpointError(f"{what}: the checkpoint group was {cause} (phase group: a rank stopped or ended "
                          "while the ranks connected, or the job's store did not answer)")


_TIMED_GROUPS: dict[tuple[Any, float | None], Any] = {}


def watch(coll: Collectives, activity: Callable[[], tuple[str, str]]) -> None:
    """Label what ``coll``'s collectives do from now on: ``activity()``
    returns (what, phase), e.g. ("save of step 2", "write"), read when a wait
    is reported and when a collective fails. A no-op for collectives that are
    not over a process group."""
    inner = coll.inner if isinstance(coll, Counting) else coll
    if isinstance(inner, TorchCollectives):
        inner.activity = activity


def is_broken(coll: Collectives) -> bool:
    """Whether a collective of ``coll``'s group failed or was abandoned (the
    group is unusable: make a new one)."""
    inner = coll.inner if isinstance(coll, Counting) else coll
    return isinstance(inner, TorchCollectives) and inner.name in _BROKEN


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """What a save or load checks before its first collective (:func:`arrive`).

    Attributes:
        kind: the call (``"save"``, ``"async_save"``, ``"load"``): ranks meet
            only at the same kind of call.
        what: the call as the error names it (``"save of step 3 at /ckpt/x"``).
        timeout_s: seconds to wait for every rank of the group (None: no
            check); capped at the call's checkpoint timeout.
    """

    kind: str
    what: str
    timeout_s: float | None


#: (kind, global ranks) -> (the job's store, arrivals completed with it): the same on every
#: rank of a group (a failed arrival is not counted); counted again from 0 with a new store
_ARRIVED: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = {}


def arrive(group: Any, arrival: Arrival, timeout_s: float | None = None) -> None:
    """Every rank of ``group`` checks in through the job's key-value store
    before a save or load issues its first collective or creates its
    checkpoint group, and waits at most ``arrival.timeout_s`` seconds (or
    ``timeout_s``, the call's checkpoint timeout, when shorter) for the other
    ranks to arrive at the same kind of call. A call made on some ranks only
    (a plug-in point that runs on rank 0 alone, such as Lightning's
    ``CheckpointIO.save_checkpoint``) then fails on the ranks that called it,
    within that bound, instead of hanging in ``dist.new_group`` or in its first
    collective for the checkpoint timeout.

    Store traffic: one ``set``, one ``add`` and, until every rank arrived, one
    ``check`` per poll (every 1 ms at first, backing off to 50 ms, and to
    250 ms after 2 s) per rank; O(world) reads only on a failure (to name the
    absent ranks) and on the progress line. A rank that gives up takes its
    arrival back atomically (``add -1``; if every rank had arrived by then it
    goes ahead instead), so the ranks stay usable: the next call of every
    rank meets as usual. A no-op for one rank, no process group, a
    :class:`Collectives` passed as ``group``, or ``arrival.timeout_s`` None.

    Raises:
        CheckpointError: ranks did not arrive within the bound (the error
            names them, in the group and globally, the call and the phase
            "arrival"; their ranks in ``absent_ranks``), or the job's store
            did not answer (its host is stopped) or went away (its host ended).
    """
    if arrival.timeout_s is None or isinstance(group, Collectives):
        return
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return
    _check_world()
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
        range(dist.get_world_size()))
    n = len(ranks)
    if n <= 1:
        return
    bound = float(arrival.timeout_s) if timeout_s is None else min(float(arrival.timeout_s), float(timeout_s))
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    raw = dist.distributed_c10d._get_default_store()
    ident = (arrival.kind, ranks)
    known = _ARRIVED.get(ident)
    seq = (known[1] if known is not None and known[0] is raw else 0) + 1
    prefix = f"reshard/arrive/{arrival.kind}/{zlib.crc32(repr(ranks).encode()):08x}-{n}/{seq}/"
    store = bounded_store(raw)

    def absent() -> list[int]:
        return [r for r in range(n) if r != me and not (
            store.check([f"{prefix}r{r}"]) and store.get(f"{prefix}r{r}") == b"1")]

    try:
        store.set(f"{prefix}r{me}", "1")
        if store.add(f"{prefix}n", 1) == n:  # the last to arrive tells the others
            store.set(f"{prefix}done", "1")
        t0 = time.monotonic()
        poll, every, reported = 0.001, wait_report_s(), 0
        while not store.check([f"{prefix}done"]):
            waited = time.monotonic() - t0
            if waited >= bound:
                if store.add(f"{prefix}n", -1) == n - 1:  # every rank had arrived: go ahead
                    store.add(f"{prefix}n", 1)
                    break
                store.set(f"{prefix}r{me}", "0")
                missing = absent()
                names = _arrival_names(ranks, missing)
                err = CheckpointError(
                    f"{arrival.what}: {names} of the {n} ranks of the group did not arrive within "
                    f"{bound:g} s (phase arrival: before any collective or checkpoint group). save, "
                    "async_save and load are collective: every rank of the group calls them. A plug-in "
                    "point called on one rank only (Lightning's CheckpointIO.save_checkpoint runs on "
                    "rank 0 alone) must pass group=reshard.collectives.SingleProcess() (and read with "
                    "reshard.read_state); a rank that arrives later than this on purpose needs a larger "
                    "SaveOptions/LoadOptions(arrival_timeout_s=...)")
                err.absent_ranks = tuple(missing)  # type: ignore[attr-defined]
                raise err
            if waited >= (reported + 1) * every:
                reported = int(waited // every)
                late = absent()  # as the collectives' progress line words it
                who = (f"ranks {late}" if 0 < len(late) <= 16 else
                       f"{len(late)} ranks ({rank_ranges(late)})" if late else "the other ranks")
                log.warning("%s: waiting %.0f s for %s in phase arrival", arrival.what, waited, who)
            time.sleep(poll)
            poll = min(poll * 2, 0.05 if waited < 2.0 else 0.25)
    except TimeoutError as e:  # BoundedStore: the store's host is stopped or gone
        raise CheckpointError(f"{arrival.what}: the job's store did not answer while the ranks "
                              f"checked in (phase arrival): {e}") from None
    except (dist.DistError, ConnectionError) as e:  # the store's host ended (its connection closed)
        raise CheckpointError(f"{arrival.what}: the job's store went away while the ranks checked in "
                              f"(phase arrival: the process hosting it, rank 0 of a TCP store, ended?): "
                              f"{type(e).__name__}: {e}") from None
    _ARRIVED[ident] = (raw, seq)


def _arrival_names(ranks: tuple[int, ...], group_ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 1-3`` (group ranks), with their global ranks where they differ."""
    if not group_ranks:
        return "no rank"
    text = f"rank {rank_ranges(group_ranks)}" if len(group_ranks) == 1 else f"ranks {rank_ranges(group_ranks)}"
    glob = [ranks[r] for r in group_ranks]
    return text if glob == group_ranks else f"{text} (global {rank_ranges(glob)})"


def timed_collectives(group: Any, timeout_s: float | None, *,
                      arrival: Arrival | None = None) -> Collectives:
    """Collectives for a save or load of ``group`` bounded by ``timeout_s``
    seconds: over a gloo checkpoint group created (once per group and
    timeout, every rank of ``group`` calling) with that timeout, so neither
    the training group's timeout nor its traffic governs the checkpoint's
    collectives. A group made unusable by a failure (a lost peer, a
    timeout) is replaced by a new one at the next call, so a failed save
    never costs the next. Plain :func:`get_collectives` when ``timeout_s`` is
    None, ``group`` is already a :class:`Collectives` (used as it is: the
    caller chose it, e.g. a counting wrapper) or there is no process group
    (a single process). With ``arrival``, every rank first checks in
    (:func:`arrive`): a call made on some ranks only fails on those within
    ``arrival.timeout_s``, before any group is created.

    A group whose backend is not gloo (NCCL training, or any other) always
    gets a gloo checkpoint group, ``timeout_s`` None included (then with the
    group's own timeout where the backend tells it, else gloo's default):
    every checkpoint collective runs on gloo, over the CPU, never on the
    training backend."""
    base = get_collectives(group)
    if arrival is not None and isinstance(base, TorchCollectives) and base.world_size > 1:
        arrive(group, arrival, checkpoint_timeout_s(group, timeout_s))
    if (isinstance(group, Collectives) or not isinstance(base, TorchCollectives)
            or base.world_size == 1):  # a Collectives the caller made is used as it is
        return base
    if timeout_s is None:
        if base._sliced:  # a gloo group, used as it is
            return base
        timeout_s = group_timeout_s(group)
    else:
        timeout_s = checkpoint_timeout_s(group, timeout_s)
    import torch.distributed as dist

    key = (group if group is not None else "default", None if timeout_s is None else float(timeout_s))
    pg = _TIMED_GROUPS.get(key)
    if pg is None or str(getattr(pg, "group_name", "")) in _BROKEN:  # (again, after a failure)
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        kw: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
        pg = _TIMED_GROUPS[key] = _new_group_within(
            timeout_s, arrival.what if arrival is not None else "a checkpoint collective",
            ranks=ranks, backend="gloo", use_local_synchronization=group is not None, **kw)
    return TorchCollectives(pg)


def checkpoint_timeout_s(group: Any, timeout_s: float | None) -> float | None:
    """The timeout (seconds) of the checkpoint group for ``timeout_s``: the
    value as given, except the default (:data:`reshard.options.DEFAULT_TIMEOUT_S`,
    600 s), which is capped at ``group``'s own timeout when that is shorter."""
    if not isinstance(timeout_s, DefaultSeconds):
        return timeout_s
    own = group_timeout_s(group)
    return float(timeout_s) if own is None else min(float(timeout_s), own)


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
