"""PyTorch Lightning: :class:`ReshardCheckpoint`, a checkpoint callback that
saves the whole training state with reshard every N steps and resumes from the
newest committed checkpoint when ``fit`` starts.

    trainer = lightning.Trainer(callbacks=[ReshardCheckpoint("ckpt", every_n_train_steps=50)])
    trainer.fit(model, train_loader)        # the same line resumes after a crash

What one checkpoint holds (``reshard inspect`` shows the names):

* ``model``: the LightningModule's parameters and buffers and every optimizer's
  state (:class:`~reshard.adapters.torch_native.TorchState`: plain, DDP and
  FSDP2 / DTensor models, resharded at load);
* ``schedulers``: every LR scheduler (``trainer.lr_scheduler_configs``);
* ``precision``: the precision plugin (its GradScaler under ``16-mixed``);
* ``rng``: every rank's Python, NumPy, torch (and CUDA) streams (:class:`~reshard.RNGState`);
* ``data``: the global data position (a :class:`~reshard.DataCursor`'s);
* ``loops``: Lightning's loop counters (``trainer.fit_loop.state_dict()``:
  epoch, batch and optimizer-step progress), so ``global_step``,
  ``current_epoch``, ``batch_idx``, logging and validation cadence continue;
* ``callbacks`` / ``datamodule``: the ``state_dict()`` of the other callbacks
  (EarlyStopping, Timer, ...) and of the data module, rank 0's copy, as
  Lightning's own checkpoint holds.

**Resume.** In ``on_fit_start`` (model, optimizers and schedulers exist, the
model is wrapped or sharded), the callback restores from the newest
committed checkpoint of ``dirpath`` through
:meth:`reshard.CheckpointManager.restore` (fallback past a torn checkpoint),
logs ``resuming from PATH (step N)`` on rank 0, and loads the loop counters
so Lightning continues mid-epoch as it does from its own checkpoint.

**What wins when ``fit(ckpt_path=...)`` is also given.** The explicit
argument: Lightning restores that checkpoint its own way, this callback does
not resume from ``dirpath`` for that ``fit`` (one line says so) and its saves
continue from the restored step. The data position then comes from this
callback's state in that checkpoint (Lightning saves every callback's
``state_dict()``), else it is derived from the restored loop counters. To
start a fine-tuning from a Lightning checkpoint and resume it later from
reshard's, pass ``ckpt_path`` only when ``reshard.latest(dirpath)`` is None.
A ``ckpt_path`` naming a reshard checkpoint (or a root of them) is refused
when ``fit`` starts, in one line saying to call ``fit`` without it (the
callback resumes by itself), instead of Lightning failing to open it.

**RNG timing.** The restored streams are applied after the DataLoader
iterators exist, just before the first resumed batch is fetched (the
callback's own loader, fetching in the main process: before the dataset's
``__getitem__`` runs) or, with worker processes or ``manage_data=False``, in
the first resumed ``on_train_batch_start``. Restored in ``on_fit_start`` they
would be off by the draws of the iterators Lightning creates after that hook
(``iter(DataLoader)`` draws its base seed from the global torch generator):
the validation loader's, when a resume at a validation step makes Lightning
fast-forward that validation, and the training loader's with
``manage_data=False`` (the callback's own loader has a generator of its own
and draws nothing); see :class:`reshard.integrations._common.DeferredRNG`.
Validation during ``fit`` runs on a copy of the streams (restored at
``on_validation_end``, as Lightning's sanity check does), so a resume at a
validation step, which Lightning does not repeat, stays bitwise equal.

**Data position.** With ``manage_data=True`` (default), the training
DataLoader as written (a map-style dataset; the default sampler, shuffled or
not; batch size; collate function; workers) is rebuilt with a sampler that
follows a global :class:`~reshard.DataCursor`: epoch ``e`` is one
permutation of the dataset (seed ``+ e``; dataset order when the loader did
not shuffle), cut into global batches of ``per-device batch x data-parallel
size`` samples, data-parallel rank ``r`` taking the ``r``-th slice. It
replaces Lightning's ``DistributedSampler`` (which pads the dataset to a
multiple of the world size and shuffles even a ``shuffle=False`` loader).
Same world size: the same samples every step. Another world size: the
saved global batch is kept (the per-device batch becomes ``global /
data-parallel size``, logged once) and every sample of the epoch is seen
exactly once. An epoch ends at its last full global batch (drop-last: the
``N mod global`` samples left are not trained that epoch; a warning names
them). The loader gets its own generator, so creating its iterator draws
nothing from the global torch generator.

**Lightning internals** this module relies on are listed in one place,
:data:`LIGHTNING_INTERNALS`, and checked in ``setup`` (a missing one raises
naming it and the installed Lightning version).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Checkpoint
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError("reshard.integrations.lightning needs PyTorch Lightning 2.x "
                      "(`pip install lightning`)") from e

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ..adapters.data import DataCursor
from ..adapters.rng import RNGState, derive_seed
from ..adapters.torch_native import TorchState
from ..catalog.verify import latest
from ..errors import CheckpointError
from ..manager.manager import CheckpointManager
from ..ondisk.manifest import MANIFEST_NAME
from ..options import SaveOptions
from ..saving.staging import SaveHandle
from ._common import DeferredRNG, Internal, RankZeroObjects, missing_internals, wait_staged

__all__ = ["LIGHTNING_INTERNALS", "ReshardCheckpoint", "missing_lightning_internals"]

log = logging.getLogger("reshard.integrations.lightning")


def _run_has_ckpt_path(trainer: Any) -> bool:
    return "ckpt_path" in inspect.signature(pl.Trainer._run).parameters


def _has_data_source(trainer: Any) -> bool:
    src = trainer.fit_loop._data_source
    return callable(getattr(src, "dataloader", None)) and hasattr(src, "__dict__")


def _has_loop_state(trainer: Any) -> bool:
    loop = trainer.fit_loop
    return callable(loop.state_dict) and callable(loop.load_state_dict) and isinstance(
        loop.state_dict(), dict)


def _has_batch_progress(trainer: Any) -> bool:
    return isinstance(trainer.fit_loop.epoch_loop.batch_progress.current.processed, int)


#: Every Lightning internal (an underscored or undocumented name) this module
#: relies on; :func:`missing_lightning_internals` probes them on a Trainer.
LIGHTNING_INTERNALS: tuple[Internal, ...] = (
    Internal("Trainer._run(ckpt_path=...)",
             "the ckpt_path given to fit, read from the _run frame in setup, before Lightning "
             "restores it: an explicit ckpt_path wins over dirpath",
             _run_has_ckpt_path),
    Internal("Trainer.fit_loop._data_source.dataloader()",
             "where the training DataLoader comes from: wrapped for the fit so the loader gets the "
             "cursor's sampler before Lightning creates its iterator",
             _has_data_source),
    Internal("Trainer.fit_loop.state_dict() / load_state_dict()",
             "the loop counters (epoch, batch and optimizer-step progress) saved and restored",
             _has_loop_state),
    Internal("Trainer.fit_loop.epoch_loop.batch_progress.current.processed",
             "the batches of the epoch a restored Lightning checkpoint has trained (the data position "
             "when fit(ckpt_path=...) restores a checkpoint without this callback's state)",
             _has_batch_progress),
)


def missing_lightning_internals(trainer: Any) -> list[str]:
    """The :data:`LIGHTNING_INTERNALS` that ``trainer`` (a ``lightning.Trainer``)
    lacks, as ``"name (what for)"``; empty when all are there."""
    return missing_internals(LIGHTNING_INTERNALS, trainer)


def _fit_ckpt_path() -> Any:
    """The ``ckpt_path`` argument of the ``Trainer._run`` call on the stack
    (``setup`` runs inside it), None when there is none."""
    code = pl.Trainer._run.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return f.f_locals.get("ckpt_path")
        f = f.f_back  # type: ignore[assignment]
    return None


class _Progress:
    """Lightning's loop counters, a Stateful (one plain value); ``fixed``: the
    counters to save instead of the loops' current ones."""

    def __init__(self, trainer: Any, fixed: dict[str, Any] | None = None):
        self.trainer, self.fixed = trainer, fixed

    def state_dict(self) -> dict[str, Any]:
        if self.fixed is not None:
            return self.fixed
        sd = self.trainer.fit_loop.state_dict()
        # a stateful loader's position would be per rank: the cursor holds the data position
        sd.get("state_dict", {}).pop("combined_loader", None)
        return {"fit_loop": sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(sd["fit_loop"])


class _Position:
    """The data cursor's global position, a Stateful of plain values (the
    cursor itself is made when Lightning asks for the training loader, after
    the restore)."""

    KEYS = ("seed", "epoch", "consumed", "global_batch_size", "dataset_len", "shuffle")

    def __init__(self, owner: ReshardCheckpoint):
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.owner._position()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.owner._saved_position = sd["position"]


class CursorSampler(DistributedSampler):
    """This data-parallel rank's sample indices of the remaining global
    batches of the cursor's current epoch, in order: for each global batch
    ``order[c : c + G]`` (``G`` the global batch), the slice
    ``[c + r*B, c + (r+1)*B)`` of rank ``r`` (``B = G / dp_size``).

    A pure function of the cursor's position when iteration starts: the
    cursor itself is advanced by :class:`ReshardCheckpoint` as batches are
    trained (a DataLoader with workers draws indices ahead of training). A
    ``DistributedSampler`` subclass so that Lightning keeps it (it replaces
    any other sampler by its own under DDP); ``set_epoch`` is ignored (the
    cursor counts its epochs). ``len()`` is a whole epoch's samples of this
    rank, so Lightning counts a resumed epoch's batches as it does its own.
    """

    def __init__(self, cursor: DataCursor, *, on_first_index: Callable[[], None] | None = None):
        # DistributedSampler.__init__ is not called: it needs a dataset and reads the world
        self.cursor = cursor
        self.on_first_index = on_first_index
        self.num_replicas, self.rank = cursor.dp_size, cursor.dp_rank
        self.shuffle, self.seed, self.epoch, self.drop_last = cursor.shuffle, cursor.seed, 0, True
        self.per_rank = cursor.global_batch_size // cursor.dp_size
        self.num_samples = cursor.batches_per_epoch * self.per_rank
        self.total_size = self.num_samples * self.num_replicas
        #: the cursor's epoch when the current iteration started
        self.iter_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        c = self.cursor
        epoch, start = c.epoch, c.consumed
        self.iter_epoch = epoch
        order = c.epoch_order(epoch)
        g, lo = c.global_batch_size, c.dp_rank * self.per_rank
        first = True
        for pos in range(start, c.dataset_len - g + 1, g):
            if first and self.on_first_index is not None:
                self.on_first_index()
            first = False
            yield from order[pos + lo:pos + lo + self.per_rank].tolist()


class ReshardCheckpoint(Checkpoint):
    """A Lightning checkpoint callback that saves the whole training state with
    reshard every ``every_n_train_steps`` optimizer steps and resumes from the
    newest committed checkpoint under ``dirpath`` when ``fit`` starts (module
    docstring: what is saved, when RNG is restored, the data position, what
    wins over ``fit(ckpt_path=...)``).

    A :class:`lightning.pytorch.callbacks.Checkpoint`, so Lightning adds no
    default ``ModelCheckpoint`` beside it (``enable_checkpointing`` stays
    True). Its :class:`reshard.CheckpointManager` is made in ``setup`` (the
    process group exists) and closed in ``teardown``.

    Args:
        dirpath: the checkpoint root (a directory or URL prefix), owned by this
            run's manager.
        every_n_train_steps: save when ``trainer.global_step`` is a multiple
            of it (at the batch that completed the optimizer step, after the
            scheduler stepped); None: only at the end of ``fit``.
        every_seconds: also save when this many seconds passed since the
            last save (the coordinator's clock decides, agreed across ranks).
        keep_last, keep_every, keep_best: retention (:class:`reshard.CheckpointManager`:
            nothing is deleted before a newer checkpoint verified; the
            checkpoint the run resumed from is kept while the fit runs).
        monitor, mode: with ``keep_best``, the metric of ``trainer.callback_metrics``
            each save carries (its value at the save: the last validation's)
            and whether higher (``"max"``) or lower (``"min"``) is better.
        use_async: save in the background (:func:`reshard.async_save`); the
            step waits for staging only (:meth:`before_state_mutation`).
        save_on_train_end: save the last step when ``fit`` ends normally (if
            it was not just saved), so a later ``fit`` with a larger
            ``max_steps`` continues from it: a fit that stops in the middle of
            an epoch (``max_steps``, a stop) saves that epoch's position and
            the loop counters of its last batch, so the next fit takes the
            epoch's next batch, as the uninterrupted run does.
        manage_data: replace the training loader's sampler by the cursor's
            (module docstring); False leaves the loader as Lightning makes it
            (then the data position after a resume is Lightning's: the epoch
            restarts from its first batch).
        data_seed: the cursor's shuffling seed; None: ``PL_GLOBAL_SEED`` (set
            by ``seed_everything``), else 0.
        base_seed: the seed of the rule that re-derives RNG streams at another
            world size (:class:`reshard.RNGState`); None: as ``data_seed``.
        timeout_s: seconds each collective of a save or restore may wait
            (``CheckpointManager(timeout_s=...)``).
        options: SaveOptions of every save.

    Raises:
        ValueError: a bad cadence or retention option (from the manager).
        CheckpointError: in ``setup``, the installed Lightning lacks an
            internal of :data:`LIGHTNING_INTERNALS`; when the loader is made,
            one the cursor cannot follow (``manage_data=False`` then), or a
            global batch the new data-parallel size does not divide.
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_train_steps: int | None = None,
                 every_seconds: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: int = 0, monitor: str | None = None,
                 mode: str = "min", use_async: bool = False, save_on_train_end: bool = True, manage_data: bool = True,
                 data_seed: int | None = None, base_seed: int | None = None,
                 timeout_s: float | None = None, options: SaveOptions | None = None):
        super().__init__()
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool) or not
                                                isinstance(every_n_train_steps, int)
                                                or every_n_train_steps < 1):
            raise ValueError(f"ReshardCheckpoint(every_n_train_steps=...) must be an int >= 1 or None, "
                             f"got {every_n_train_steps!r}")
        if keep_best and not monitor:
            raise ValueError("ReshardCheckpoint(keep_best=...) needs monitor= (a key of "
                             "trainer.callback_metrics, e.g. 'val_loss')")
        if mode not in ("min", "max"):
            raise ValueError(f"ReshardCheckpoint(mode=...) must be 'min' or 'max', got {mode!r}")
        self.dirpath = os.fspath(dirpath)
        self.every_n_train_steps, self.every_seconds = every_n_train_steps, every_seconds
        self.keep_last, self.keep_every = keep_last, keep_every
        self.keep_best, self.monitor, self.mode = keep_best, monitor, mode
        self.use_async, self.save_on_train_end = use_async, save_on_train_end
        self.manage_data = manage_data
        self.data_seed, self.base_seed = data_seed, base_seed
        self.timeout_s, self.options = timeout_s, options
        self.manager: CheckpointManager | None = None
        #: the checkpoint this fit resumed from (None: a fresh start or Lightning's ckpt_path)
        self.resumed_from: str | None = None
        self._ckpt_path: Any = None
        self._rng: DeferredRNG | None = None
        self._cursor: DataCursor | None = None
        self._sampler: CursorSampler | None = None
        self._saved_position: dict[str, Any] | None = None  # restored, applied when the loader is made
        self._lightning_restored = False
        self._last_step: int | None = None  # the global_step of the last maybe_save call
        self._saved_step: int | None = None
        self._inflight: SaveHandle | None = None
        self._rng_before_val: dict[str, Any] | None = None
        #: the loop counters at the last batch's end (what the end-of-fit save keeps when
        #: the fit stops in the middle of an epoch)
        self._loops_at_batch_end: dict[str, Any] | None = None
        self._stopped_mid_epoch = False
        self._unpatch: Callable[[], None] | None = None
        self._warned_drop = False

    # ------------------------------------------------------------ the state
    def _seed(self) -> int:
        if self.data_seed is not None:
            return int(self.data_seed)
        return int(os.environ.get("PL_GLOBAL_SEED", 0) or 0)

    def _position(self) -> dict[str, Any] | None:
        c = self._cursor
        if c is None:
            return self._saved_position  # not made yet (a save before the loader): as restored
        sd = {k: getattr(c, k) for k in _Position.KEYS}
        sd["dp_size"] = c.dp_size
        return sd

    def _state(self, trainer: Any, loops: dict[str, Any] | None = None) -> dict[str, Any]:
        """The state tree of a save or restore of ``trainer`` (``loops``: the
        loop counters to save, default the loops' current ones)."""
        assert self._rng is not None
        rank, world = trainer.global_rank, trainer.world_size
        optimizers = list(trainer.optimizers)
        state: dict[str, Any] = {
            "model": TorchState(trainer.lightning_module, optimizers),
            "schedulers": {str(i): cfg.scheduler for i, cfg in enumerate(trainer.lr_scheduler_configs)},
            "precision": trainer.precision_plugin,
            "rng": self._rng.rng,
            "data": _Position(self),
            "loops": _Progress(trainer, loops),
            "callbacks": RankZeroObjects(
                lambda: {cb.state_key: cb for cb in trainer.callbacks if cb is not self},
                rank=rank, world_size=world, what="callback"),
        }
        if trainer.datamodule is not None:
            dm = trainer.datamodule
            state["datamodule"] = RankZeroObjects(lambda: {type(dm).__qualname__: dm}, rank=rank,
                                                  world_size=world, what="data module")
        return state

    # ------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        missing = missing_lightning_internals(trainer)
        if missing:
            raise CheckpointError(
                f"ReshardCheckpoint: the installed Lightning ({pl.__version__}) lacks what this "
                f"integration relies on: {'; '.join(missing)}. Pin a Lightning release it supports "
                "(tests/integrations/test_lightning.py names the one it is tested with)")
        self._ckpt_path = _fit_ckpt_path()
        self._refuse_reshard_ckpt_path(self._ckpt_path)
        self._lightning_restored = False
        self.resumed_from = None
        self._saved_position = None
        self._cursor, self._sampler = None, None
        self._last_step = self._saved_step = None
        self._inflight = None
        self._loops_at_batch_end, self._stopped_mid_epoch = None, False
        seed = self._seed()
        self._rng = DeferredRNG(RNGState(rank=trainer.global_rank, world_size=trainer.world_size,
                                         base_seed=seed if self.base_seed is None else self.base_seed))
        # the manager takes the root when it is made: here, once the process group exists
        self.manager = CheckpointManager(
            self.dirpath, every_steps=self.every_n_train_steps, every_seconds=self.every_seconds,
            keep_last=self.keep_last, keep_every=self.keep_every, keep_best=self.keep_best,
            metric_mode=self.mode, use_async=self.use_async, preempt_signals=(),
            options=self.options, timeout_s=self.timeout_s)
        if self.manage_data:
            src = trainer.fit_loop._data_source
            made = src.dataloader

            def dataloader() -> Any:
                return self._install(trainer, made())

            src.dataloader = dataloader

            def unpatch() -> None:
                if src.__dict__.get("dataloader") is dataloader:
                    del src.__dict__["dataloader"]

            self._unpatch = unpatch

    def _refuse_reshard_ckpt_path(self, ckpt_path: Any) -> None:
        """``fit(ckpt_path=...)`` naming a reshard checkpoint (or a root of
        them) is refused before anything is made: Lightning's own restore would
        open it as one of its ``.ckpt`` files and fail with an error that says
        nothing of reshard.

        Raises:
            CheckpointError: naming the path, what it is and how to resume."""
        if not isinstance(ckpt_path, (str, os.PathLike)) or not os.path.isdir(ckpt_path):
            return  # "last", a Lightning .ckpt file, a URL: Lightning's
        path = os.fspath(ckpt_path)
        if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            what, parent = "a reshard checkpoint", os.path.dirname(os.path.normpath(path))
        elif latest(path, include_model_only=True) is not None:
            what, parent = "a root of reshard checkpoints", path
        else:
            return  # a folder of Lightning's (a distributed checkpoint): Lightning's
        here = os.path.realpath(parent) == os.path.realpath(self.dirpath)
        newest = latest(self.dirpath) if os.path.isdir(self.dirpath) else None
        how = (f"call fit without ckpt_path: ReshardCheckpoint resumes by itself from the newest "
               f"committed checkpoint under its dirpath {self.dirpath!r}"
               + (f" (now {newest})" if newest else ""))
        if not here:
            how += f"; to resume from {parent!r}, make it the dirpath: ReshardCheckpoint({parent!r}, ...)"
        raise CheckpointError(
            f"ReshardCheckpoint: fit(ckpt_path={path!r}) names {what}, which Lightning's own restore "
            f"cannot read (it loads Lightning .ckpt files): {how}. fit(ckpt_path=...) is for "
            "Lightning's checkpoints (a run starting from one)")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        assert self.manager is not None and self._rng is not None
        if self._ckpt_path:
            self._lightning_restored = True
            rank_zero_info(f"fit(ckpt_path={str(self._ckpt_path)!r}) given: Lightning restores it; "
                           f"not resuming from {self.dirpath}")
            return
        res = self.manager.restore(self._state(trainer))
        if res is None:
            return
        self._rng.loaded()  # applied just before the first resumed batch
        self.resumed_from = res.path
        rank_zero_info(f"resuming from {res.path} (step {res.step})")
        self._last_step = self._saved_step = trainer.global_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores this callback's state from its own checkpoint
        (``fit(ckpt_path=...)``): the data position saved in it."""
        if state_dict.get("position") is not None:
            self._saved_position = dict(state_dict["position"])

    def state_dict(self) -> dict[str, Any]:
        """What Lightning's own checkpoint (another ``ModelCheckpoint``) keeps
        of this callback: the data position."""
        return {"position": self._position()}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        s = self._sampler
        if s is not None and self._loader_workers(trainer) == 0:
            s.on_first_index = self._apply_rng  # fetched in this process: restored before the fetch
        elif s is not None:
            s.on_first_index = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._apply_rng()  # workers or an unmanaged loader: before the step's first draw

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before_state_mutation()

    def before_state_mutation(self) -> None:
        """The one call before the training loop mutates the state (called
        by ``on_before_optimizer_step``): waits until a background save in
        flight has staged its copy (``SaveHandle.staged``). A no-op when no
        save is in flight, and in the default mode, where ``async_save``
        returns once staged."""
        wait_staged(self._inflight)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.manager is not None and self._rng is not None
        if self._cursor is not None:
            self._cursor.next_global_batch()
            if batch_idx + 1 >= trainer.num_training_batches and self._cursor.consumed:
                self._next_epoch()  # Lightning ends this epoch early (limit_train_batches)
        # validation after this batch runs on a copy of the streams
        self._rng_before_val = self._rng.rng.capture()
        if self.save_on_train_end:  # what a save at this batch would keep of the loops
            self._loops_at_batch_end = copy.deepcopy(_Progress(trainer).state_dict())
        step = trainer.global_step
        if step == self._last_step:  # inside gradient accumulation, or no optimizer step
            return
        self._last_step = step
        out = self.manager.maybe_save(step, self._state(trainer), metric=self._metric(trainer))
        if out is not None:
            self._saved_step = step
            if isinstance(out, SaveHandle):
                self._inflight = out

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        s, c = self._sampler, self._cursor
        if c is None or s is None or c.epoch != s.iter_epoch or not c.consumed:
            return  # the epoch ran to its end (the cursor is at the next one already)
        if self._fit_stops(trainer):
            # the fit ends in the middle of the epoch (max_steps, a stop): the epoch is not over
            # for the run that continues it, which takes the epoch's next batch
            self._stopped_mid_epoch = True
            return
        self._next_epoch()  # the epoch ended before its last batch (on_train_batch_start -> -1)

    @staticmethod
    def _fit_stops(trainer: Any) -> bool:
        """The fit ends after this epoch end because ``max_steps`` is reached or
        it was asked to stop (EarlyStopping, ``max_time``), not because the
        epoch ran out of batches."""
        max_steps = trainer.max_steps
        return bool(trainer.should_stop) or (max_steps is not None and max_steps >= 0
                                             and trainer.global_step >= max_steps)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if (self._rng is not None and self._rng_before_val is not None and not trainer.sanity_checking
                and trainer.state.fn == TrainerFn.FITTING):
            self._rng.rng.restore(self._rng_before_val)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        assert self.manager is not None
        step = trainer.global_step
        if self.save_on_train_end and step and step != self._saved_step:
            # stopped in the middle of an epoch: the loops as they were at the last batch's end
            # (Lightning has closed the epoch since), so a resume continues the epoch at its next
            # batch as the uninterrupted run does; the cursor was left there (on_train_epoch_end)
            loops = self._loops_at_batch_end if self._stopped_mid_epoch else None
            self.manager.save(step, self._state(trainer, loops), sync=True, metric=self._metric(trainer))
            self._saved_step = step

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != TrainerFn.FITTING.value:
            return
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        try:
            self._close()
        except CheckpointError as e:  # the fit's own exception is the one to raise
            log.warning("ReshardCheckpoint: closing the manager after %s: %s",
                        type(exception).__name__, e)

    def _close(self) -> None:
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None
        mgr, self.manager = self.manager, None
        self._inflight = None
        if mgr is not None:
            mgr.close()

    def _metric(self, trainer: Any) -> float | None:
        if not self.monitor:
            return None
        v = trainer.callback_metrics.get(self.monitor)
        return None if v is None else float(v)

    # ------------------------------------------------------------ RNG
    def _apply_rng(self) -> None:
        if self._rng is not None and self._rng.apply() and self._sampler is not None:
            self._sampler.on_first_index = None

    # ------------------------------------------------------------ data
    @staticmethod
    def _loader_workers(trainer: Any) -> int:
        dl = trainer.train_dataloader
        return int(getattr(dl, "num_workers", 0) or 0)

    def _next_epoch(self) -> None:
        c = self._cursor
        assert c is not None
        c.epoch, c.consumed = c.epoch + 1, 0

    def _install(self, trainer: Any, loader: Any) -> Any:
        """The training loader Lightning asked for, rebuilt around the
        cursor's sampler (called from Lightning's ``setup_data``, after the
        restore)."""
        why = _unmanageable(loader)
        if why:
            raise CheckpointError(
                f"ReshardCheckpoint: the training loader cannot follow a data cursor: {why}. Pass "
                "ReshardCheckpoint(..., manage_data=False) to keep it as it is (the data position "
                "after a resume is then Lightning's)")
        kw = trainer.distributed_sampler_kwargs or {}
        dp_size, dp_rank = int(kw.get("num_replicas", 1)), int(kw.get("rank", 0))
        n = len(loader.dataset)
        per_device = int(loader.batch_size)
        shuffle = isinstance(loader.sampler, RandomSampler)
        # made again (reload_dataloaders_every_n_epochs): the cursor continues where it is
        saved = self._position() if self._cursor is not None else self._saved_position
        if saved is None and self._lightning_restored:
            saved = self._derived_position(trainer, n, per_device * dp_size, shuffle)
        g = int(saved["global_batch_size"]) if saved else per_device * dp_size
        if g % dp_size:
            raise CheckpointError(
                f"ReshardCheckpoint: the checkpoint's global batch of {g} samples does not divide "
                f"into {dp_size} data-parallel ranks; resume on a data-parallel size that divides it")
        per = g // dp_size
        if per != per_device and trainer.is_global_zero:
            rank_zero_info(f"global batch {g} kept: per-device batch {per_device} -> {per} on "
                           f"{dp_size} data-parallel ranks (saved on {saved.get('dp_size') if saved else '?'})")
        seed = int(saved["seed"]) if saved else self._seed()
        cursor = DataCursor(n, g, seed=seed, dp_rank=dp_rank, dp_size=dp_size, shuffle=shuffle)
        if saved:
            cursor.load_state_dict({k: saved[k] for k in _Position.KEYS} | {"pending": []})
        if n % g and not self._warned_drop:
            self._warned_drop = True
            warnings.warn(f"ReshardCheckpoint: {n} samples in global batches of {g}: the last "
                          f"{n % g} samples of each epoch's order are not trained (drop-last)",
                          RuntimeWarning, stacklevel=2)
        self._cursor = cursor
        self._sampler = CursorSampler(cursor)
        gen = torch.Generator().manual_seed(derive_seed(seed, 0, {"dp_rank": dp_rank}, "loader"))
        kwargs: dict[str, Any] = dict(
            batch_size=per, sampler=self._sampler, drop_last=True, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            generator=gen, persistent_workers=loader.persistent_workers,
            in_order=getattr(loader, "in_order", True))
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if loader.pin_memory_device:
            kwargs["pin_memory_device"] = loader.pin_memory_device
        loader_out = _CursorLoader(loader.dataset, **kwargs)
        loader_out.owner = self
        return loader_out

    def _derived_position(self, trainer: Any, n: int, g: int, shuffle: bool) -> dict[str, Any]:
        """The data position of a Lightning checkpoint without this callback's
        state: the restored epoch and the batches of it trained."""
        done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        epoch, consumed = int(trainer.current_epoch), done * g
        if consumed + g > n:
            epoch, consumed = epoch + 1, 0
        rank_zero_info(f"the restored Lightning checkpoint has no data position of ReshardCheckpoint: "
                       f"continuing epoch {epoch} after its first {consumed} samples")
        return {"seed": self._seed(), "epoch": epoch, "consumed": consumed, "global_batch_size": g,
                "dataset_len": n, "shuffle": shuffle, "dp_size": None}


class _CursorLoader(DataLoader):
    """The rebuilt training loader: a plain DataLoader that is resumable in
    Lightning's sense (``state_dict`` / ``load_state_dict``), so Lightning does
    not warn that a mid-epoch resume replays its epoch. Its state is the
    cursor's position, which the callback saves and restores itself."""

    owner: ReshardCheckpoint | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.owner._position() if self.owner is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing: the callback restored the position before this loader was made."""


def _unmanageable(loader: Any) -> str:
    """Why the cursor cannot stand in for ``loader``'s sampler ("" when it can)."""
    if not isinstance(loader, DataLoader):
        return (f"it is a {type(loader).__name__}, not one torch DataLoader (a CombinedLoader or a "
                "collection of loaders)")
    if type(loader) is not DataLoader:
        return f"it is a DataLoader subclass ({type(loader).__qualname__}), rebuilt without its code"
    try:
        math.isfinite(len(loader.dataset))  # type: ignore[arg-type]
    except TypeError:
        return "its dataset has no len() (an IterableDataset)"
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return "its dataset is an IterableDataset"
    if loader.batch_size is None:
        return "it has no batch_size (a custom batch_sampler, or batch_size=None)"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"it has a custom batch sampler ({type(loader.batch_sampler).__qualname__})"
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return (f"it has a custom sampler ({type(loader.sampler).__qualname__}); the cursor knows "
                "the default ones (shuffle=True or False)")
    if isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement or
                                                      loader.sampler._num_samples is not None):
        return "its RandomSampler draws with replacement or a num_samples"
    return ""
