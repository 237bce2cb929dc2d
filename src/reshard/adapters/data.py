"""DataCursor: a resumable, DP-reshardable sampler for map-style datasets.

The checkpoint holds the *global* data position, never per-rank positions:
``(seed, epoch, consumed)`` where ``consumed`` counts samples of the current
epoch already handed out in whole global batches. Each epoch's
order is ``torch.randperm(dataset_len)`` from a generator seeded with
``seed + epoch`` (a private generator: the global ones are never touched).

Global batch ``b`` of an epoch is ``order[b*G:(b+1)*G]`` for global batch size
``G`` (the last incomplete batch is dropped); DP rank ``r`` of ``D`` takes the
``r``-th of ``D`` equal contiguous slices (``G`` must divide by ``D``). So
after a restart with another DP size, the concatenation over ranks of every
global batch is unchanged: no sample is duplicated or skipped. When the last
batch of an epoch is consumed the cursor moves to ``(epoch + 1, 0)``, so a
save exactly at an epoch boundary resumes with all batches of the next epoch.

**Per-rank packing leftovers.** ``pending`` is this DP rank's list of sample
indices drawn but not yet consumed (a sequence-packing buffer: each rank packs
its own samples, so the lists differ per rank). It is saved as element
``(dp_rank,)`` of a ShardedObject grid ``pending`` of shape ``(dp_size,)``:

* same DP size: every rank gets its own leftovers back;
* another DP size and no leftovers on any saved rank: nothing to move, loads;
* another DP size, ``on_dp_change="raise"`` (the default): ShardingError on
  every rank, naming the saved and current DP sizes and the rule to pass;
* another DP size, ``on_dp_change="redistribute"``: the documented rule --
  the saved lists concatenated in saved DP-rank order (rank 0's first, each
  in its own order), then split into ``dp_size`` contiguous parts whose
  lengths differ by at most one (the first ``len % dp_size`` parts one
  longer); new rank ``r`` takes part ``r``. Every leftover sample is kept
  exactly once (none duplicated, none lost); each rank reads every saved
  element of the grid (leftovers are small).

Other per-rank state that cannot be resharded (e.g. ``{0: 10, 1: 11, ...}``)
must be saved as a ShardedObject grid; loading it with another DP size raises
ShardingError (reshard never drops or invents per-rank state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .. import codec
from ..errors import ShardingError
from ..manifest import Manifest
from ..sharding import ShardedObject

_EMPTY = codec.encode([])

#: ``on_dp_change`` rules for per-rank packing leftovers
DP_CHANGE_RULES = ("raise", "redistribute")


def redistribute_pending(saved: list[list[int]], dp_size: int) -> list[list[int]]:
    """The documented rule for packing leftovers at a DP change.

    Args:
        saved: each saved DP rank's leftovers, in saved DP-rank order.
        dp_size: the new DP size.

    Returns:
        ``dp_size`` lists: the concatenation of ``saved`` split into contiguous
        parts whose lengths differ by at most one (the first ``n % dp_size``
        parts one longer). Their concatenation equals that of ``saved``.
    """
    flat = [s for part in saved for s in part]
    base, extra = divmod(len(flat), dp_size)
    out, pos = [], 0
    for r in range(dp_size):
        n = base + (1 if r < extra else 0)
        out.append(flat[pos:pos + n])
        pos += n
    return out


class DataCursor:
    """Resumable global data position for a map-style dataset.

    Args:
        dataset_len: samples in the dataset.
        global_batch_size: samples per global batch (all DP ranks together).
        seed: shuffling seed (epoch ``e`` uses ``seed + e``).
        dp_rank, dp_size: this rank's position in the data-parallel group.
        shuffle: shuffle each epoch (else natural order).
        on_dp_change: what a load at another DP size does with the per-rank
            packing leftovers (``pending``): ``"raise"`` (ShardingError) or
            ``"redistribute"`` (the rule in the module docstring).

    Attributes:
        pending: this DP rank's packing leftovers (sample indices drawn but not
            yet consumed); the caller's packer appends and pops them.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True,
                 on_dp_change: str = "raise"):
        if on_dp_change not in DP_CHANGE_RULES:
            raise ValueError(f"on_dp_change must be one of {DP_CHANGE_RULES}, got {on_dp_change!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
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
        self.on_dp_change = on_dp_change
        self.pending: list[int] = []
        self._order: tuple[int, torch.Tensor] | None = None
        # how the next load reads `pending`: None (this DP size), the saved DP
        # size (redistribute), or "value" (a checkpoint that kept it common)
        self._load_pending: int | str | None = None

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
        sd: dict[str, Any] = {
            "seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
            "global_batch_size": self.global_batch_size, "dataset_len": self.dataset_len,
            "shuffle": self.shuffle}
        saved = self._load_pending
        if saved == "empty":
            pass
        elif saved == "value":
            sd["pending"] = list(self.pending)
        elif isinstance(saved, int):  # read every saved rank's leftovers
            sd["pending"] = [ShardedObject("pending", [], global_shape=(saved,), global_offset=(i,))
                             for i in range(saved)]
        else:
            sd["pending"] = ShardedObject("pending", [int(s) for s in self.pending],
                                          global_shape=(self.dp_size,), global_offset=(self.dp_rank,))
        return sd

    def reshard_prepare_load(self, m: Manifest) -> dict[str, Any] | None:
        """Called by :func:`reshard.load` with the manifest (names relative to
        this cursor) before the state is walked: decides how ``pending`` is read.

        Raises:
            ShardingError: the leftovers were saved at another DP size and
                ``on_dp_change`` is ``"raise"``.
        """
        self._load_pending = None
        oe = m.objects.get("pending")
        if oe is None:
            if "pending" in (m.values or {}):
                self._load_pending = "value"  # saved before leftovers were per rank
            return None
        saved = tuple(oe.global_shape)
        if saved == (self.dp_size,):
            return None
        if len(saved) != 1:
            raise ShardingError(f"DataCursor: pending saved as a grid of {list(saved)}, expected one "
                                "element per DP rank")
        if all(c.length == len(_EMPTY) for c in oe.chunks):  # no leftovers anywhere: nothing to move
            from ..load import HANDLED

            self._load_pending = "empty"
            return {HANDLED: ["pending"]}
        if self.on_dp_change == "raise":
            raise ShardingError(
                f"DataCursor: packing leftovers (pending) were saved by {saved[0]} DP ranks and this "
                f"run has dp_size={self.dp_size}; they cannot follow ranks that no longer exist. "
                "Resume at the saved DP size, or pass DataCursor(..., on_dp_change='redistribute') "
                "to deal them out by the documented rule (saved lists concatenated in DP-rank order, "
                "split into contiguous near-equal parts, none lost or duplicated)")
        self._load_pending = saved[0]
        return {"pending_redistributed": {"from_dp": saved[0], "to_dp": self.dp_size}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._load_pending = None
        for k in ("dataset_len", "global_batch_size", "shuffle"):
            if sd[k] != getattr(self, k):
                raise ShardingError(f"DataCursor: saved {k}={sd[k]!r}, this run has "
                                    f"{getattr(self, k)!r}; the data order would change")
        pend = sd.get("pending", [])
        if isinstance(pend, list) and pend and isinstance(pend[0], ShardedObject):
            parts = [list(ob.value) for ob in sorted(pend, key=lambda o: o.global_offset)]
            mine = redistribute_pending(parts, self.dp_size)[self.dp_rank]
        elif isinstance(pend, ShardedObject):
            mine = list(pend.value)
        else:  # a checkpoint that kept pending as one common list
            mine = list(pend)
        self.seed, self.epoch, self.consumed = sd["seed"], sd["epoch"], sd["consumed"]
        self.pending = mine
        self._order = None
