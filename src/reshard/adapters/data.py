"""DataCursor: a resumable, DP-reshardable sampler for map-style datasets.

The checkpoint holds the *global* data position, never per-rank positions:
``(seed, epoch, consumed)`` where ``consumed`` counts samples of the current
epoch already handed out in whole global batches, plus ``pending``: sample
indices drawn but not yet consumed (a sequence-packing buffer). Each epoch's
order is ``torch.randperm(dataset_len)`` from a generator seeded with
``seed + epoch`` (a private generator: the global ones are never touched).

Global batch ``b`` of an epoch is ``order[b*G:(b+1)*G]`` for global batch size
``G`` (the last incomplete batch is dropped); DP rank ``r`` of ``D`` takes the
``r``-th of ``D`` equal contiguous slices (``G`` must divide by ``D``). So
after a restart with another DP size, the concatenation over ranks of every
global batch is unchanged: no sample is duplicated or skipped. When the last
batch of an epoch is consumed the cursor moves to ``(epoch + 1, 0)``, so a
save exactly at an epoch boundary resumes with all batches of the next epoch.

Per-rank state that cannot be resharded (e.g. ``{0: 10, 1: 11, ...}``) must be
saved as a ShardedObject grid; loading it with another DP size raises
ShardingError (reshard never drops or invents per-rank state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ShardingError


class DataCursor:
    """Resumable global data position for a map-style dataset.

    Args:
        dataset_len: samples in the dataset.
        global_batch_size: samples per global batch (all DP ranks together).
        seed: shuffling seed (epoch ``e`` uses ``seed + e``).
        dp_rank, dp_size: this rank's position in the data-parallel group.
        shuffle: shuffle each epoch (else natural order).
    """

    def __init__(self, dataset_len: int, global_batch_size: int, *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True):
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size {global_batch_size} must be a positive multiple of "
                             f"dp_size {dp_size}")
        if global_batch_size > dataset_len:
            raise ValueError("global_batch_size exceeds the dataset")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0
        self.pending: list[int] = []
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (int64 tensor of ``dataset_len``)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=g)
            else:
                order = torch.arange(self.dataset_len)
            self._order = (epoch, order)
        return self._order[1]

    def next_global_batch(self) -> list[int]:
        """The next global batch (all ranks' samples, in DP-rank order), advancing the cursor."""
        order = self.epoch_order(self.epoch)
        g = self.global_batch_size
        batch = order[self.consumed:self.consumed + g].tolist()
        self.consumed += g
        if self.consumed + g > self.dataset_len:
            self.epoch += 1
            self.consumed = 0
        return batch

    def next_batch(self) -> list[int]:
        """This DP rank's slice of the next global batch."""
        batch = self.next_global_batch()
        per = self.global_batch_size // self.dp_size
        return batch[self.dp_rank * per:(self.dp_rank + 1) * per]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "global_batch_size": self.global_batch_size, "dataset_len": self.dataset_len,
                "shuffle": self.shuffle, "pending": list(self.pending)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in ("dataset_len", "global_batch_size", "shuffle"):
            if sd[k] != getattr(self, k):
                raise ShardingError(f"DataCursor: saved {k}={sd[k]!r}, this run has "
                                    f"{getattr(self, k)!r}; the data order would change")
        self.seed, self.epoch, self.consumed = sd["seed"], sd["epoch"], sd["consumed"]
        self.pending = list(sd["pending"])
        self._order = None
