"""The only module that calls torch.distributed collectives.

Everything exchanged between ranks is bytes (JSON produced by msgspec), never
pickle. Two implementations share one interface:

* :class:`TorchCollectives` over any process group (gloo on CPU; NCCL groups
  exchange through CUDA tensors);
* :class:`SingleProcess` for plain scripts (world size 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any

import msgspec
import torch

from .errors import CheckpointError, RankFailure, agreed_error


class Collectives(ABC):
    rank: int
    world_size: int

    @abstractmethod
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``; every rank receives all, in rank order."""

    def barrier(self) -> None:
        self.all_gather_bytes(b"")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """``all_gather_bytes`` of msgspec-JSON-encoded objects."""
        return [msgspec.json.decode(b) for b in self.all_gather_bytes(msgspec.json.encode(obj))]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``data`` from ``src`` (others pass anything, e.g. None)."""
        return self.all_gather_bytes(data if self.rank == src and data is not None else b"")[src]

    def agree(self, what: str, exc: BaseException | None) -> None:
        """All ranks report success or their exception; if any failed, every
        rank raises the same :class:`~reshard.errors.CheckpointError` listing
        each failing rank (type, message, traceback as text)."""
        mine = None if exc is None else RankFailure.from_exception(self.rank, exc).to_json()
        reports = self.all_gather_json(mine)
        failures = {
            r: RankFailure.from_json(rep) for r, rep in enumerate(reports) if rep is not None
        }
        if failures:
            err = agreed_error(what, failures)
            if exc is not None:
                raise err from exc
            raise err


class SingleProcess(Collectives):
    """World of one rank: gathers return ``[data]``."""

    rank = 0
    world_size = 1

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]


class TorchCollectives(Collectives):
    """Collectives over a ``torch.distributed`` process group.

    Args:
        group: the process group (None: the default group). Only collectives on
            this group are issued, so a separate group keeps background
            checkpoint traffic apart from training collectives.
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

    def _lost(self, e: RuntimeError) -> CheckpointError:
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        return CheckpointError(
            f"a collective over the {self.world_size} ranks of the checkpoint group failed on rank "
            f"{self.rank}: a rank was lost or did not arrive within the group's timeout "
            f"({type(e).__name__}: {msg})")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Raises CheckpointError when a rank is lost or times out (the backend's
        error, e.g. gloo's "Connection closed by peer", as its cause)."""
        try:
            return self._all_gather_bytes(data)
        except RuntimeError as e:  # DistBackendError and gloo/NCCL failures are RuntimeErrors
            raise self._lost(e) from e

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        dist, dev, n = self._dist, self._device, self.world_size
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
        dist.all_gather(sizes, size, group=self.group)
        lens = [int(s.item()) for s in sizes]
        width = max(max(lens), 1)
        buf = torch.zeros(width, dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        outs = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(n)]
        dist.all_gather(outs, buf, group=self.group)
        return [o[:k].cpu().numpy().tobytes() for o, k in zip(outs, lens, strict=True)]

    def barrier(self) -> None:
        try:
            self._dist.barrier(group=self.group)
        except RuntimeError as e:
            raise self._lost(e) from e


def get_collectives(group: Any = None) -> Collectives:
    """Collectives for ``group``; single-process when torch.distributed is not
    initialised and no group is given."""
    if isinstance(group, Collectives):
        return group
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return SingleProcess()
    return TorchCollectives(group)


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


def group_timeout_s(group: Any = None) -> float | None:
    """The timeout (seconds) of ``group`` (None: the default group) where the
    backend exposes it (gloo does), else None."""
    import torch.distributed as dist

    pg: Any = group if group is not None else dist.group.WORLD
    try:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a backend without CPU options (NCCL): torch's default
        return None
