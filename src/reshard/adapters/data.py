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

**Packing leftovers** (``pending``: sample indices drawn but not yet
consumed, a sequence-packing buffer). Where they live is declared by
``pending_scope``:

* ``"global"``: every DP rank packs the same global stream (it draws
  ``next_global_batch()`` and packs the whole of it), so ``pending`` is one
  list, the same on every rank. It is saved once, as a common value (a save
  where the ranks' lists differ raises ShardingError, as for any common
  value), and restored unchanged at any DP size: each leftover is trained
  exactly once, whatever the DP size of the resumed run.
* ``"rank"`` (the default): each rank packs its own samples, so the lists
  differ per rank. It is saved as element ``(dp_rank,)`` of a ShardedObject
  grid ``pending`` of shape ``(dp_size,)``:

  - same DP size: every rank gets its own leftovers back;
  - another DP size and no leftovers on any saved rank: nothing to move, loads;
  - another DP size, ``on_dp_change="raise"`` (the default): ShardingError on
    every rank, naming the saved and current DP sizes and the rule to pass;
  - another DP size, ``on_dp_change="redistribute"``: the documented rule --
    the saved lists concatenated in saved DP-rank order (rank 0's first, each
    in its own order), then split into ``dp_size`` contiguous parts whose
    lengths differ by at most one (the first ``len % dp_size`` parts one
    longer); new rank ``r`` takes part ``r``. Every leftover sample is kept
    exactly once; each rank reads every saved element of the grid (leftovers
    are small). A sample id held by two saved ranks (global packing saved
    as ``"rank"``: identical lists) raises ShardingError naming
    ``pending_scope='global'`` instead of training it twice.

  A grid whose saved lists are all equal (global packing saved under
  ``"rank"``) loads into ``pending_scope="global"`` as that one list; lists
  that differ are refused there.

**Global batch size and dataset changes.** The checkpoint's
``global_batch_size`` and ``dataset_len`` must equal this run's unless
``on_batch_change="continue"``; then, as Megatron's ``consumed_samples``, the
run continues from the consumed-sample position: batch ``b`` after the resume
is ``order[consumed + b*G' : consumed + (b+1)*G']`` of the same epoch order
with the new size ``G'`` (no sample of the epoch repeated; the epoch ends
when fewer than ``G'`` samples remain, as always: those
``(dataset_len - consumed) mod G'`` samples are the dropped last batch,
as with Megatron's drop-last sampler). A changed
dataset length continues only from an epoch boundary (``consumed == 0``: the
next epoch is a permutation of the new dataset); mid-epoch it is refused
with the exact numbers, since the epoch's order is a permutation of the
saved length. Reported in ``LoadResult.notes`` under ``<path>.batch_change``.

**Saved by DCP.** ``state_dict()`` called by anyone but reshard's walk
(``torch.distributed.checkpoint.save``, user code) returns plain values only:
``pending`` is the list itself (``"global"``) or ``{"dp_size": n,
"dp<rank>": list}`` (``"rank"``: a key per rank, so DCP's de-duplication of
equal keys keeps every rank's; a rank's own state dict round-trips through
its own ``load_state_dict``). ``reshard.load`` of such a DCP checkpoint restores the cursor
strictly, at any DP size, by the rules above.

Other per-rank state that cannot be resharded (e.g. ``{0: 10, 1: 11, ...}``)
must be saved as a ShardedObject grid; loading it with another DP size raises
ShardingError (reshard never drops or invents per-rank state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ShardingError
from ..ondisk import codec
from ..ondisk.manifest import Manifest
from ..state.sharding import ShardedObject
from ..state.tree import walking

_EMPTY = codec.encode([])

#: ``on_dp_change`` rules for per-rank packing leftovers
DP_CHANGE_RULES = ("raise", "redistribute")
#: ``pending_scope``: leftovers of one global packer (the same on every rank) or per rank
PENDING_SCOPES = ("rank", "global")
#: ``on_batch_change`` rules for a changed global batch size or dataset length
BATCH_CHANGE_RULES = ("raise", "continue")


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


def _refuse_workers() -> None:
    """Raise when the caller iterating a cursor is a DataLoader iterator with
    worker processes (it fetches ``prefetch_factor x num_workers`` batches
    ahead of training)."""
    import sys

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    f = sys._getframe(2)
    for _ in range(3):
        if f is None:
            return
        it = f.f_locals.get("self")
        if isinstance(it, _MultiProcessingDataLoaderIter):
            raise ValueError(
                f"DataCursor is the batch sampler of a DataLoader with num_workers={it._num_workers}: "
                "the workers fetch batches ahead of training, so the cursor's position (what a "
                "checkpoint saves) would run ahead and a resume would skip those batches. Use "
                "reshard.integrations.transformers.cursor_loader(dataset, cursor, num_workers=...), "
                "which advances the cursor as batches are handed to training, or num_workers=0")
        f = f.f_back  # type: ignore[assignment]


class DataCursor:
    """Resumable global data position for a map-style dataset.

    Args:
        dataset_len: samples in the dataset.
        global_batch_size: samples per global batch (all DP ranks together).
        seed: shuffling seed (epoch ``e`` uses ``seed + e``).
        dp_rank, dp_size: this rank's position in the data-parallel group.
        shuffle: shuffle each epoch (else natural order).
        on_dp_change: what a load at another DP size does with per-rank
            packing leftovers (``pending``): ``"raise"`` (ShardingError) or
            ``"redistribute"`` (the rule in the module docstring).
        pending_scope: ``"rank"`` (each rank packs its own samples) or
            ``"global"`` (every rank packs the same global stream: ``pending``
            is one list, identical on every rank, resumed at any DP size).
        on_batch_change: ``"raise"`` (default) or ``"continue"``: a load whose
            saved ``global_batch_size`` (or ``dataset_len``, at an epoch
            boundary) differs continues from the consumed-sample position.

    Attributes:
        pending: the packing leftovers (sample indices drawn but not yet
            consumed): this DP rank's, or the global packer's (the same on
            every rank) with ``pending_scope="global"``; the caller's packer
            appends and pops them.

    Raises:
        ValueError: an unknown rule or scope, or a batch geometry that does
            not fit (``global_batch_size`` not a positive multiple of
            ``dp_size``, or larger than the dataset).
    """

    def __init__(self, dataset_len: int, global_batch_size: int, *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True,
                 on_dp_change: str = "raise", pending_scope: str = "rank",
                 on_batch_change: str = "raise"):
        if on_dp_change not in DP_CHANGE_RULES:
            raise ValueError(f"on_dp_change must be one of {DP_CHANGE_RULES}, got {on_dp_change!r}")
        if pending_scope not in PENDING_SCOPES:
            raise ValueError(f"pending_scope must be one of {PENDING_SCOPES}, got {pending_scope!r}")
        if on_batch_change not in BATCH_CHANGE_RULES:
            raise ValueError(f"on_batch_change must be one of {BATCH_CHANGE_RULES}, "
                             f"got {on_batch_change!r}")
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
        self.pending_scope = pending_scope
        self.on_batch_change = on_batch_change
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
        """This rank's batches, advancing the cursor as each is handed out: the
        ``batch_sampler`` of a DataLoader that fetches in the training process.

        Raises:
            ValueError: at the first batch, when the DataLoader has worker
                processes: it draws batches ahead of training, so the saved
                position would run ahead and a resume would skip them."""
        while True:
            _refuse_workers()
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
            "global_batch_size": self.global_batch_size, "dataset_len": self.dataset_len,
            "shuffle": self.shuffle}
        saved = self._load_pending
        if saved is None and not walking():
            # dcp.save or user code: plain values only, which DCP stores as they are (a
            # ShardedObject would be pickled, then refused by a weights_only load); per-rank
            # leftovers under a key of their own rank, so that DCP keeps every rank's
            sd["pending"] = ([int(s) for s in self.pending] if self.pending_scope == "global"
                             else {"dp_size": self.dp_size,
                                   f"dp{self.dp_rank}": [int(s) for s in self.pending]})
        elif saved == "empty":
            pass
        elif saved == "dcp":
            sd["pending"] = {}  # one value: every saved rank's list by "dp<rank>"
        elif saved == "value" or (saved is None and self.pending_scope == "global"):
            sd["pending"] = [int(s) for s in self.pending]  # one list, common to every rank
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
                ``on_dp_change`` is ``"raise"``; a sample id on two saved
                ranks; one global list of leftovers loaded per rank at
                ``dp_size > 1``; a batch size or dataset change the
                ``on_batch_change`` rule refuses.
        """
        self._load_pending = None
        notes: dict[str, Any] = {}
        vals = m.values or {}
        keys = ("epoch", "consumed", "global_batch_size", "dataset_len", "shuffle")
        if all(k in vals for k in keys):  # refused before anything is read or written
            _, _, change = self._batch_change({k: codec.from_json(vals[k]) for k in keys})
            if change:
                notes["batch_change"] = change
        oe = m.objects.get("pending")
        by_rank = {k: v for k, v in vals.items() if k.startswith("pending.dp") and k[10:].isdigit()}
        if oe is None and by_rank and "pending" not in vals:  # saved by dcp.save (state_dict() above)
            self._load_pending = "dcp"
            dp = vals.get("pending.dp_size")
            self._from_parts({int(k[10:]): codec.from_json(v) for k, v in by_rank.items()},
                             None if dp is None else int(codec.from_json(dp)))  # may raise
            return notes or None
        if oe is None:
            if "pending" in (m.values or {}):
                self._load_pending = "value"  # one common list (global scope, or an old checkpoint)
                if self.pending_scope == "rank" and self.dp_size > 1 and codec.from_json(vals["pending"]):
                    raise ShardingError(
                        "DataCursor: packing leftovers (pending) were saved as one global list (a "
                        "global packer's, the same on every rank) and this cursor has "
                        f"pending_scope='rank' with dp_size={self.dp_size}: every rank would train "
                        "them. Pass DataCursor(..., pending_scope='global') if every rank packs the "
                        "global stream")
            return notes or None
        saved = tuple(oe.global_shape)
        if len(saved) != 1:
            raise ShardingError(f"DataCursor: pending saved as a grid of {list(saved)}, expected one "
                                "element per DP rank")
        if self.pending_scope == "global":  # saved per rank: one list only if all are equal
            self._load_pending = saved[0]
            return notes or None
        if saved == (self.dp_size,):
            return notes or None
        if all(c.length == len(_EMPTY) for c in oe.chunks):  # no leftovers anywhere: nothing to move
            from ..state.tree import HANDLED

            self._load_pending = "empty"
            return {**notes, HANDLED: ["pending"]}
        if self.on_dp_change == "raise":
            raise ShardingError(
                f"DataCursor: packing leftovers (pending) were saved by {saved[0]} DP ranks and this "
                f"run has dp_size={self.dp_size}; they cannot follow ranks that no longer exist. "
                "Resume at the saved DP size, or pass DataCursor(..., on_dp_change='redistribute') "
                "to deal them out by the documented rule (saved lists concatenated in DP-rank order, "
                "split into contiguous near-equal parts, none lost or duplicated); if every rank "
                "packs the same global stream, pass pending_scope='global' instead")
        self._load_pending = saved[0]
        return {**notes, "pending_redistributed": {"from_dp": saved[0], "to_dp": self.dp_size}}

    def _from_parts(self, parts: dict[int, list[int]], saved_dp: int | None = None) -> list[int]:
        """This rank's leftovers from every saved DP rank's (``saved rank -> list``;
        a rank missing is one without leftovers; ``saved_dp``: the saved DP
        size, default the highest rank + 1), by the rules of the module
        docstring.

        Raises:
            ShardingError: another DP size under ``on_dp_change="raise"``; a
                sample id on two saved ranks; ``pending_scope="global"`` and
                lists that differ.
        """
        if saved_dp is None:
            saved_dp = max(parts, default=-1) + 1
        lists = [list(parts.get(r, [])) for r in range(saved_dp)]
        if not lists:
            return []
        if self.pending_scope == "global":
            if any(p != lists[0] for p in lists[1:]):
                raise ShardingError(
                    f"DataCursor: pending_scope='global', but the {saved_dp} saved DP ranks' "
                    "packing leftovers differ (they were packed per rank): load with "
                    "pending_scope='rank'")
            return lists[0]
        if saved_dp == self.dp_size:
            return lists[self.dp_rank]
        if not any(lists):
            return []
        if self.on_dp_change == "raise":
            raise ShardingError(
                f"DataCursor: packing leftovers (pending) were saved by {saved_dp} DP ranks and this "
                f"run has dp_size={self.dp_size}; they cannot follow ranks that no longer exist. "
                "Resume at the saved DP size, or pass DataCursor(..., on_dp_change='redistribute') "
                "to deal them out by the documented rule (saved lists concatenated in DP-rank order, "
                "split into contiguous near-equal parts, none lost or duplicated); if every rank "
                "packs the same global stream, pass pending_scope='global' instead")
        _refuse_duplicates(lists)
        return redistribute_pending(lists, self.dp_size)[self.dp_rank]

    def _batch_change(self, sd: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
        """The ``(epoch, consumed)`` to resume from, by ``on_batch_change``,
        and the note of a change (empty without one).

        Raises:
            ShardingError: a changed ``shuffle``; a changed batch size or
                dataset under ``"raise"``; a changed dataset mid-epoch.
        """
        epoch, consumed = int(sd["epoch"]), int(sd["consumed"])
        if sd["shuffle"] != self.shuffle:
            raise ShardingError(f"DataCursor: saved shuffle={sd['shuffle']!r}, this run has "
                                f"{self.shuffle!r}; the data order would change")
        changed = [k for k in ("global_batch_size", "dataset_len") if sd[k] != getattr(self, k)]
        if not changed:
            return epoch, consumed, {}
        what = ", ".join(f"saved {k}={sd[k]!r}, this run has {getattr(self, k)!r}" for k in changed)
        if self.on_batch_change == "raise":
            raise ShardingError(
                f"DataCursor: {what}; the data order would change. Pass DataCursor(..., "
                "on_batch_change='continue') to continue from the consumed-sample position "
                f"(epoch {epoch}, {consumed} samples of it consumed) with this run's sizes")
        if sd["dataset_len"] != self.dataset_len and consumed:
            raise ShardingError(
                f"DataCursor: {what}, and the save was in the middle of epoch {epoch} ({consumed} of "
                f"its {sd['dataset_len']} samples consumed, in an order that is a permutation of "
                f"{sd['dataset_len']} samples): a changed dataset continues only from an epoch "
                "boundary. Resume from a checkpoint saved at the end of an epoch, or with the "
                f"saved dataset_len={sd['dataset_len']}")
        if consumed + self.global_batch_size > self.dataset_len:  # the rest is the dropped last batch
            epoch, consumed = epoch + 1, 0
        note: dict[str, Any] = {k: {"saved": sd[k], "now": getattr(self, k)} for k in changed}
        note["resumed_at"] = {"epoch": epoch, "consumed": consumed}
        return epoch, consumed, note

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._load_pending = None
        epoch, consumed, _ = self._batch_change(sd)
        pend = sd.get("pending", [])
        if isinstance(pend, list) and pend and isinstance(pend[0], ShardedObject):
            mine = self._from_parts({int(ob.global_offset[0]): list(ob.value) for ob in pend})
        elif isinstance(pend, dict):  # saved by dcp.save (or state_dict() outside reshard)
            try:
                dp = pend.get("dp_size")
                parts = {int(str(k)[2:]): list(v) for k, v in pend.items() if k != "dp_size"}
            except (TypeError, ValueError):
                raise ShardingError(f"DataCursor: pending saved as {pend!r}, expected "
                                    "{'dp_size': n, 'dp<rank>': [sample, ...]}") from None
            mine = self._from_parts(parts, None if dp is None else int(dp))
        elif isinstance(pend, ShardedObject):
            mine = list(pend.value)
        else:  # one common list (global scope, or a checkpoint from before per-rank leftovers)
            mine = list(pend)
        self.seed, self.epoch, self.consumed = sd["seed"], epoch, consumed
        self.pending = mine
        self._order = None


def _refuse_duplicates(parts: list[list[int]]) -> None:
    seen: dict[int, int] = {}
    for r, part in enumerate(parts):
        for s in part:
            if seen.setdefault(s, r) != r:
                same = all(p == parts[0] for p in parts[1:])
                raise ShardingError(
                    f"DataCursor: sample {s} is in the packing leftovers of saved DP ranks "
                    f"{seen[s]} and {r}" + (" (every saved rank holds the same list: a global "
                                             "packer's)" if same else "") +
                    "; redistributing would train it twice. If every rank packs the same global "
                    "stream, pass DataCursor(..., pending_scope='global')")
