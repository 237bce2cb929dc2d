"""A checkpoint group made at its first collective (:class:`Deferred`), so
that an object built on one rank only (a manager that lists or collects a
root) creates no process group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .collectives import (
    Collectives,
    TorchCollectives,
    get_collectives,
    is_broken,
    timed_collectives,
)
from .errors import CheckpointError


class Deferred(Collectives):
    """:func:`reshard.collectives.timed_collectives` of ``group`` and ``timeout_s``, made at the
    first collective, not before: ``rank`` and ``world_size`` need none, so a
    manager constructed on one rank only (to list or collect a root) creates
    no process group. Made again when a failure left it unusable."""

    def __init__(self, group: Any, timeout_s: float | None):
        base = get_collectives(group)
        self.rank, self.world_size = base.rank, base.world_size
        self._group, self._timeout_s = group, timeout_s
        # a gloo group without a bound of its own is used as it is; any other
        # backend (NCCL) gets its gloo checkpoint group at the first collective
        plain = timeout_s is None and not (isinstance(base, TorchCollectives) and not base._sliced)
        self._inner: Collectives | None = base if plain or base.world_size == 1 else None

    def _get(self) -> Collectives:
        if self._inner is None or is_broken(self._inner):
            try:
                self._inner = timed_collectives(self._group, self._timeout_s)
            except CheckpointError:
                raise
            except Exception as e:  # a rank that never came to form the group (it failed before)
                raise CheckpointError(
                    f"the checkpoint process group could not be formed ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200] if str(e) else ''}): a rank did not arrive; its "
                    "coordinator may have failed before it (a manager refused ownership of the root, "
                    "say: see that rank's error)") from e
        return self._inner

    def gather_bytes(self, data: bytes, dst: int = 0) -> list[bytes] | None:
        return self._get().gather_bytes(data, dst)

    def scatter_bytes(self, parts: Sequence[bytes] | None, src: int = 0) -> bytes:
        return self._get().scatter_bytes(parts, src)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        return self._get().broadcast_bytes(data, src)

    def all_reduce_ints(self, values: Sequence[int], op: str = "sum") -> list[int]:
        return self._get().all_reduce_ints(values, op)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return self._get().all_gather_bytes(data)

    def barrier(self) -> None:
        self._get().barrier()

    def exchange(self, sends: Sequence[tuple[int, int, torch.Tensor]],
                 recvs: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        self._get().exchange(sends, recvs)
