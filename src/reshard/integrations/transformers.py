"""Hugging Face: :class:`ReshardTrainer` (or :class:`ReshardTrainerMixin` for
your own ``Trainer`` subclass) saves the whole training state with reshard and
resumes from it; :func:`accelerate_state` is the state tree of a plain
accelerate loop.

Why a Trainer subclass and not a callback: ``train(resume_from_checkpoint=True)``
finds folders named ``checkpoint-N`` and opens ``trainer_state.json``,
``optimizer.pt``, ``rng_state_N.pth`` as files; a callback sees none of that.

    trainer = ReshardTrainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=trainer.last_checkpoint)   # None on a fresh start

What changes against the stock Trainer:

* **Where**: checkpoints are reshard checkpoints ``step-%08d`` under
  ``checkpoint_dir`` (default ``<output_dir>/checkpoints``), made by a
  :class:`reshard.CheckpointManager` (its own root; created when ``train``
  starts). ``save_steps`` / ``save_strategy`` decide when, as before.
* **What**: one commit holds the model and the optimizer
  (:class:`~reshard.adapters.torch_native.TorchState`: DDP, FSDP2 and plain
  models, resharded at load), the LR scheduler, accelerate's GradScaler,
  every rank's RNG streams (:class:`~reshard.RNGState`), the Trainer's state
  (the text of ``trainer_state.json``, callback states included) and the
  batch geometry. ``trainer_state.json`` is a value inside the checkpoint,
  written before the manifest (the commit); nothing is ever added to a
  committed checkpoint.
* **Resume**: ``resume_from_checkpoint=True`` is ``reshard.latest(checkpoint_dir)``,
  else (no reshard checkpoint yet) the stock Trainer's newest ``checkpoint-N``
  of ``output_dir`` (``ValueError`` naming both when there is none, as the
  stock Trainer); a path is that reshard checkpoint (a root of them: its
  newest); a stock ``checkpoint-N`` folder (it holds ``trainer_state.json``)
  is resumed by the stock code, so a run can switch its backend mid-way; any
  other path is refused naming what is expected. The Trainer's own resume logic runs unchanged: it
  reads the restored ``trainer_state.json`` from a temporary folder holding
  that one file (removed when ``train`` returns), skips the batches of the
  resumed epoch (``ignore_data_skip`` honoured) and restores callback states.
* **Retention**: ``save_total_limit`` is the manager's ``keep_last`` (with
  its rules: nothing deleted before a newer checkpoint verified, the resume
  source kept while ``train`` runs); no folder is ever removed by its name.
* **Best model**: ``load_best_model_at_end`` is supported: each save carries
  the step's ``metric_for_best_model`` value, retention keeps the best
  checkpoint too (``keep_best=1``, on top of ``save_total_limit``), and at the
  end the model's weights are loaded from it.
* **RNG timing**: the restored streams are applied where the Trainer applies
  its own: mid-epoch, once the first resumed batches are fetched (the
  loader's iterator is created by that first fetch and draws its base seed
  from the global generator: applied before it, the streams would be one
  draw off), and at an epoch boundary before the epoch's iterator exists (the
  uninterrupted run also creates it after the save). Also with
  ``ignore_data_skip``, where the stock Trainer restores none. Not bitwise:
  a collator that draws random numbers in the main process (masked-LM
  collators), since accelerate's loader fetches one batch ahead, so the
  uninterrupted run collated the first resumed batch before the save (the
  stock Trainer has the same limit).
* **Another world size**: the saved global batch (per-device batch x data
  ranks x accumulation) is kept: the per-device batch becomes ``global /
  (ranks x accumulation)`` (logged once), so with the Trainer's
  seed-determined sampler every step trains the same samples and every
  sample of the epoch is seen once.
* **Refused**: ``save_only_model=True`` (a model-only checkpoint cannot
  resume; use ``reshard export``), hyperparameter search trials, DeepSpeed.

The private Trainer methods this module overrides or calls are listed in one
place, :data:`TRAINER_INTERNALS`, and checked when the Trainer is made.
"""

from __future__ import annotations

import dataclasses
import inspect as _inspect
import json
import logging
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from typing import Any

from ._common import quiet_torchao_import

try:
    with quiet_torchao_import():  # the Trainer imports transformers' quantizers, which import torchao
        import transformers
        from transformers import Trainer, TrainerCallback
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy, get_last_checkpoint
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("reshard.integrations.transformers needs transformers "
                      "(`pip install transformers accelerate`)") from e

import torch

from ..adapters.data import DataCursor
from ..adapters.rng import RNGState, derive_seed
from ..adapters.torch_native import TorchState
from ..catalog.verify import inspect as read_manifest
from ..catalog.verify import latest
from ..collectives import SingleProcess
from ..errors import CheckpointError
from ..loading.load import load
from ..manager.manager import CheckpointManager
from ..ondisk.manifest import MANIFEST_NAME
from ..options import SaveOptions
from ..saving.staging import SaveHandle
from ..state.sharding import ShardedObject
from ._common import DeferredRNG, Internal, missing_internals, wait_staged

__all__ = ["TRAINER_INTERNALS", "ReshardTrainer", "ReshardTrainerMixin", "SchedulerPace",
           "accelerate_state", "cursor_loader", "missing_trainer_internals"]

log = logging.getLogger("reshard.integrations.transformers")

TRAINER_STATE_NAME = "trainer_state.json"


def _method(name: str, *params: str) -> Any:
    def probe(cls: Any) -> bool:
        fn = getattr(cls, name, None)
        return callable(fn) and all(p in _inspect.signature(fn).parameters for p in params)
    return probe


#: Every private ``Trainer`` method this module overrides or calls, with what
#: for; :func:`missing_trainer_internals` probes them on a Trainer class.
TRAINER_INTERNALS: tuple[Internal, ...] = (
    Internal("Trainer._save_checkpoint(model, trial)",
             "overridden: the whole state saved as one reshard checkpoint", _method("_save_checkpoint",
                                                                                   "model", "trial")),
    Internal("Trainer._load_from_checkpoint(resume_from_checkpoint, model)",
             "overridden: nothing (the model is loaded with the optimizer once both exist)",
             _method("_load_from_checkpoint", "resume_from_checkpoint", "model")),
    Internal("Trainer._load_optimizer_and_scheduler(checkpoint)",
             "overridden: the one reshard load of model, optimizer, scheduler, scaler and RNG",
             _method("_load_optimizer_and_scheduler", "checkpoint")),
    Internal("Trainer._load_scaler(checkpoint)", "overridden: nothing (loaded with the rest)",
             _method("_load_scaler", "checkpoint")),
    Internal("Trainer._load_rng_state(checkpoint)",
             "overridden: the restored streams applied where the Trainer restores RNG at an epoch "
             "boundary", _method("_load_rng_state", "checkpoint")),
    Internal("Trainer._load_best_model()", "overridden: the best checkpoint's weights loaded",
             _method("_load_best_model")),
    Internal("Trainer._inner_training_loop(batch_size, args, resume_from_checkpoint, ...)",
             "overridden: the per-device batch scaled before the loader is made",
             _method("_inner_training_loop", "batch_size", "args", "resume_from_checkpoint")),
    Internal("Trainer._train_batch_size", "the per-device batch size the train loader is made with",
             lambda cls: "_train_batch_size" in cls.get_train_dataloader.__code__.co_names),
    Internal("Trainer.callback_handler.on_pre_optimizer_step",
             "the event before optimizer.step() where the pre-mutation hook runs",
             lambda cls: callable(getattr(transformers.trainer_callback.CallbackHandler,
                                          "on_pre_optimizer_step", None))),
)


def missing_trainer_internals(trainer_cls: type = Trainer) -> list[str]:
    """The :data:`TRAINER_INTERNALS` that ``trainer_cls`` lacks (as
    ``"name (what for)"``); empty when all are there. For a class made with
    :class:`ReshardTrainerMixin`, the Trainer classes after the mixin are
    probed (what its overrides call and stand in for)."""
    subject: Any = trainer_cls
    if isinstance(trainer_cls, type) and issubclass(trainer_cls, ReshardTrainerMixin):
        subject = super(ReshardTrainerMixin, trainer_cls)
    return missing_internals(TRAINER_INTERNALS, subject)


class _TrainerValues:
    """The Trainer's state (the text of ``trainer_state.json``: each rank saves
    its own, every rank loads rank 0's, as the stock Trainer writes the file on
    rank 0 and reads it on all) and the batch geometry (a common value)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None
        self._saved: tuple[int, ...] | None = None

    def reshard_prepare_load(self, m: Any) -> None:
        oe = m.objects.get("state")
        self._saved = None if oe is None else tuple(oe.global_shape)

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        saved, self._saved = self._saved, None
        if saved is not None:  # a load: rank 0's element
            return {"state": ShardedObject("state", None, global_shape=saved,
                                           global_offset=(0,) * len(saved)), "batch": {}}
        rank, world = int(t.args.process_index), max(1, int(t.args.world_size))
        return {"state": ShardedObject("state", _state_json(t.state), global_shape=(world,),
                                       global_offset=(rank,)),
                "batch": _geometry(t)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = {"state_json": sd["state"].value, "batch": sd["batch"]}


def _state_json(state: Any) -> str:
    """What ``TrainerState.save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _dp_size(t: Any) -> int:
    return max(1, int(t.args.world_size)) // t.get_tp_size() // t.get_cp_size() // t.get_sp_size()


def _geometry(t: Any) -> dict[str, int]:
    dp, acc = _dp_size(t), int(t.args.gradient_accumulation_steps)
    return {"per_device": int(t._train_batch_size), "dp_size": dp, "accumulation": acc,
            "global": int(t._train_batch_size) * dp * acc}


class _Hooks(TrainerCallback):
    def __init__(self, trainer: ReshardTrainerMixin):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.before_state_mutation()


class ReshardTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it in the bases:
    ``class MyTrainer(ReshardTrainerMixin, SFTTrainer)``) to checkpoint with
    reshard (module docstring: what changes, what is kept, what is refused).

    Args (keyword, besides the Trainer's):
        checkpoint_dir: the reshard root; None: ``<output_dir>/checkpoints``.
        reshard_async: save in the background (:func:`reshard.async_save`);
            the optimizer step waits for staging only
            (:meth:`before_state_mutation`).
        reshard_timeout_s: seconds each collective of a save or restore may
            wait (``CheckpointManager(timeout_s=...)``).
        reshard_options: SaveOptions of every save.

    Raises:
        CheckpointError: the installed transformers lacks an internal of
            :data:`TRAINER_INTERNALS`; ``save_only_model=True``; DeepSpeed.
    """

    def __init__(self, *args: Any, checkpoint_dir: str | os.PathLike[str] | None = None,
                 reshard_async: bool = False, reshard_timeout_s: float | None = None,
                 reshard_options: SaveOptions | None = None, **kwargs: Any):
        missing = missing_trainer_internals(type(self))
        if missing:
            raise CheckpointError(
                f"ReshardTrainer: the installed transformers ({transformers.__version__}) lacks "
                f"what this integration relies on: {'; '.join(missing)}. Pin a transformers release "
                "it supports (tests/integrations/test_transformers.py names the one it is tested with)")
        super().__init__(*args, **kwargs)
        t: Any = self
        if t.args.save_only_model:
            raise CheckpointError("ReshardTrainer: save_only_model=True makes checkpoints a run cannot "
                                  "resume from; reshard saves the whole state (export the weights with "
                                  "`reshard export CKPT DIR --format hf`)")
        if t.is_deepspeed_enabled:
            raise CheckpointError("ReshardTrainer: DeepSpeed keeps its own engine state; use the stock "
                                  "Trainer checkpoints with DeepSpeed")
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.reshard_async = reshard_async
        self.reshard_timeout_s = reshard_timeout_s
        self.reshard_options = reshard_options
        self.manager: CheckpointManager | None = None
        #: the checkpoint the last train() resumed from
        self.resumed_from: str | None = None
        self._resume: str | None = None
        self._resume_values: dict[str, Any] | None = None
        self._rng: DeferredRNG | None = None
        self._inflight: SaveHandle | None = None
        t.add_callback(_Hooks(self))

    # ------------------------------------------------------------ where
    @property
    def checkpoint_root(self) -> str:
        """The reshard root of this Trainer's checkpoints."""
        t: Any = self
        return self.checkpoint_dir or os.path.join(t.args.output_dir, "checkpoints")

    @property
    def last_checkpoint(self) -> str | None:
        """The newest committed checkpoint under :attr:`checkpoint_root`
        (:func:`reshard.latest`), None when there is none: pass it to
        ``train(resume_from_checkpoint=...)`` to resume when possible."""
        return latest(self.checkpoint_root) if os.path.isdir(self.checkpoint_root) else None

    # ------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train`` with reshard checkpoints (module docstring)."""
        t: Any = self
        if trial is not None or t.hp_search_backend is not None:
            raise CheckpointError("ReshardTrainer: hyperparameter search trials are not supported")
        resume_from_checkpoint = self._resolve_resume(resume_from_checkpoint)
        stock = resume_from_checkpoint is not None and os.path.isfile(
            os.path.join(os.fspath(resume_from_checkpoint), TRAINER_STATE_NAME))
        self.manager = CheckpointManager(
            self.checkpoint_root, keep_last=t.args.save_total_limit,
            keep_best=1 if t.args.load_best_model_at_end and t.args.metric_for_best_model else 0,
            metric_mode="max" if t.args.greater_is_better else "min", use_async=self.reshard_async,
            preempt_signals=(), options=self.reshard_options, timeout_s=self.reshard_timeout_s)
        self._rng = DeferredRNG(RNGState(rank=int(t.args.process_index),
                                         world_size=max(1, int(t.args.world_size)),
                                         base_seed=int(t.args.seed)))
        self._resume, self._resume_values, self.resumed_from = None, None, None
        view = None
        try:
            if resume_from_checkpoint is None or stock:
                return super().train(  # type: ignore[misc]
                    resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                    ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            path = os.fspath(resume_from_checkpoint)
            if "trainer.state" not in read_manifest(path).objects:
                raise CheckpointError(f"{path}: not a checkpoint of ReshardTrainer (no trainer.state); "
                                      "pass one of its checkpoint_dir")
            tv = _TrainerValues(self)  # read first, on every rank alone: the Trainer needs it early
            load({"trainer": tv}, path, strict=False, group=SingleProcess())
            assert tv.loaded is not None
            self._resume, self._resume_values = path, tv.loaded
            # the Trainer's own resume code reads trainer_state.json from a folder: a view
            # holding that one file, outside every checkpoint
            view = tempfile.mkdtemp(prefix="reshard-hf-resume-")
            with open(os.path.join(view, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                f.write(tv.loaded["state_json"])
            return super().train(  # type: ignore[misc]
                resume_from_checkpoint=view, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs)
        except BaseException:
            self._close(raising=False)  # the training's own exception is the one to raise
            raise
        finally:
            if view is not None:
                shutil.rmtree(view, ignore_errors=True)
            self._close(raising=True)

    def _resolve_resume(self, given: str | os.PathLike[str] | bool | None) -> str | None:
        """What ``train(resume_from_checkpoint=given)`` resumes: ``True`` is the
        newest reshard checkpoint of :attr:`checkpoint_root`, else (none there)
        the stock Trainer's newest ``checkpoint-N`` of ``output_dir`` (resumed
        by the stock code: a run switching its backend); a root of reshard
        checkpoints is its newest one; a reshard checkpoint or a stock
        ``checkpoint-N`` folder is itself.

        Raises:
            ValueError: ``True`` and no checkpoint in either place; a path that
                is none of these (naming what was expected)."""
        t: Any = self
        if given is None or given is False:
            return None
        if given is True:
            mine = self.last_checkpoint
            if mine is not None:
                return mine
            stock = get_last_checkpoint(t.args.output_dir) if os.path.isdir(t.args.output_dir) else None
            if stock is not None:
                log.warning("no reshard checkpoint in %s: resuming the stock Trainer checkpoint %s "
                            "(with the stock code; reshard checkpoints follow)", self.checkpoint_root, stock)
                return str(stock)
            raise ValueError(f"No valid checkpoint found in {self.checkpoint_root} (reshard.latest found no "
                             f"committed checkpoint) nor in {t.args.output_dir} (no stock checkpoint-N "
                             "folder): pass resume_from_checkpoint=None for a fresh start")
        path = os.fspath(given)
        if os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)) or \
                os.path.isfile(os.path.join(path, MANIFEST_NAME)) or "://" in path:
            return path
        newest = latest(path) if os.path.isdir(path) else None
        if newest is not None:
            log.warning("resume_from_checkpoint=%s is a root of reshard checkpoints: resuming its "
                        "newest, %s", path, newest)
            return newest
        raise ValueError(
            f"resume_from_checkpoint={path!r} is not a checkpoint: expected a reshard checkpoint (a "
            f"folder with {MANIFEST_NAME}, e.g. one under {self.checkpoint_root}), a root of them, a "
            f"stock Trainer checkpoint-N folder (with {TRAINER_STATE_NAME}), or True for the newest")

    def _close(self, *, raising: bool) -> None:
        """Close the manager (it waits for the saves in flight); its failure is
        raised, or logged when another exception is already on its way."""
        mgr, self.manager = self.manager, None
        self._inflight = None
        if mgr is None:
            return
        try:
            mgr.close()
        except CheckpointError as e:
            if raising:
                raise
            log.warning("ReshardTrainer: closing the checkpoint manager after a failed train(): %s", e)

    def _inner_training_loop(self, batch_size: int | None = None, args: Any = None,
                             resume_from_checkpoint: str | None = None, trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> Any:
        t: Any = self
        saved = (self._resume_values or {}).get("batch")
        if self._resume is not None and saved:
            dp, acc = _dp_size(t), int(t.args.gradient_accumulation_steps)
            g = int(saved["global"])
            if g % (dp * acc):
                raise CheckpointError(
                    f"ReshardTrainer: the checkpoint's global batch of {g} samples does not divide into "
                    f"{dp} data ranks x {acc} accumulation steps; resume with a geometry that divides it")
            per = g // (dp * acc)
            if per != t._train_batch_size and t.is_world_process_zero():
                log.warning("global batch %d kept: per-device batch %d -> %d on %d data ranks x %d "
                            "accumulation steps (saved: %d x %d x %d)", g, t._train_batch_size, per, dp,
                            acc, saved["per_device"], saved["dp_size"], saved["accumulation"])
            t._train_batch_size = per
        return super()._inner_training_loop(  # type: ignore[misc]
            batch_size=t._train_batch_size if self._resume is not None else batch_size, args=args,
            resume_from_checkpoint=resume_from_checkpoint, trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval)

    # ------------------------------------------------------------ the state
    def reshard_state(self) -> dict[str, Any]:
        """The state tree saved and restored (after the optimizer, scheduler
        and accelerator are made)."""
        t: Any = self
        assert self._rng is not None
        opt = getattr(t.optimizer, "optimizer", t.optimizer)  # accelerate's wrapper holds the torch one
        state: dict[str, Any] = {
            "model": TorchState(t.model, [opt] if opt is not None else []),
            "rng": self._rng.rng,
            "trainer": _TrainerValues(self),
        }
        if t.lr_scheduler is not None:
            state["scheduler"] = getattr(t.lr_scheduler, "scheduler", t.lr_scheduler)
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        assert self.manager is not None
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        step = int(t.state.global_step)
        if (t.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and t.state.best_global_step):
            t.state.best_model_checkpoint = self.manager.path_for(int(t.state.best_global_step))
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control]
                   if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks.get(name), list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        out = self.manager.save(step, self.reshard_state(), metric=self._metric(step))
        if isinstance(out, SaveHandle):
            self._inflight = out

    def _metric(self, step: int) -> float | None:
        t: Any = self
        name = t.args.metric_for_best_model
        if not name:
            return None
        name = name if name.startswith("eval_") else f"eval_{name}"
        for rec in reversed(t.state.log_history):
            if rec.get("step") == step and name in rec:
                return float(rec[name])
        return None

    # ------------------------------------------------------------ resume
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # reshard: the model is loaded with the optimizer, once both exist

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        assert self.manager is not None and self._rng is not None
        name = os.path.basename(os.path.normpath(self._resume))
        same_root = os.path.realpath(os.path.dirname(os.path.normpath(self._resume))) == \
            os.path.realpath(self.checkpoint_root)
        if same_root:
            res = self.manager.restore(self.reshard_state(), name=name)
        else:  # a checkpoint of another root: read it, this root's lineage starts here
            res = load(self.reshard_state(), self._resume)
        assert res is not None
        self._rng.loaded()  # applied just before the first resumed batch is fetched
        self.resumed_from = res.path
        if self.is_world_process_zero():  # type: ignore[attr-defined]
            log.warning("resuming from %s (step %s)", res.path, res.step)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resume is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif self._rng is not None:
            self._rng.apply()  # at an epoch boundary: before the epoch's iterator, as the Trainer does

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], Any]:
        out = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if self._rng is not None:
            # mid-epoch: once the first resumed batches are fetched (the loader's iterator is made
            # lazily by the first fetch and draws its base seed then), as the Trainer's own
            # rng_to_sync does; also with ignore_data_skip, where the Trainer restores none
            self._rng.apply()
        return out

    def _load_best_model(self) -> None:
        t: Any = self
        if self.manager is None or not t.state.best_global_step:
            super()._load_best_model()  # type: ignore[misc]
            return
        path = self.manager.path_for(int(t.state.best_global_step))
        log.warning("loading the best model from %s (score: %s)", path, t.state.best_metric)
        load({"model": TorchState(t.model, [])}, path, strict=False)

    # ------------------------------------------------------------ overlap
    def before_state_mutation(self) -> None:
        """The one call before the training loop mutates the state (from the
        ``on_pre_optimizer_step`` event, just before ``optimizer.step()``):
        waits until a background save in flight has staged its copy
        (``SaveHandle.staged``). A no-op when no save is in flight, and in the
        default mode, where ``async_save`` returns once staged."""
        wait_staged(self._inflight)


class ReshardTrainer(ReshardTrainerMixin, Trainer):
    """``transformers.Trainer`` checkpointing with reshard
    (:class:`ReshardTrainerMixin`; module docstring)."""


# ---------------------------------------------------------------- accelerate
def _paced_step(self: Any, *args: Any, **kwargs: Any) -> None:
    """``AcceleratedScheduler.step`` (accelerate 1.x) with ``self._reshard_pace``
    scheduler steps per optimizer step in place of ``num_processes``."""
    if not self.step_with_optimizer:
        self.scheduler.step(*args, **kwargs)
        return
    if not self.gradient_state.sync_gradients:
        if self.gradient_state.adjust_scheduler:
            self.scheduler._step_count += 1
        return
    if any(opt.step_was_skipped for opt in self.optimizers):
        return
    for _ in range(self._reshard_pace):
        if not hasattr(self.scheduler, "total_steps") or \
                self.scheduler._step_count <= self.scheduler.total_steps:
            self.scheduler.step(*args, **kwargs)


class SchedulerPace:
    """How many times accelerate steps the LR scheduler per optimizer step, a
    Stateful of :func:`accelerate_state` (the entry ``scheduler_pace``).

    accelerate's prepared scheduler (``AcceleratedScheduler``, without
    ``split_batches``) steps ``num_processes`` times per optimizer step: its
    schedule is counted in per-process batches. reshard keeps the global batch
    across a world-size change (a :class:`~reshard.DataCursor`), so the
    schedule must keep its pace too: restored on another number of processes,
    the scheduler is made to step as many times per optimizer step as the run
    that saved it (logged once), and every LR is the one the uninterrupted run
    has. A scheduler accelerate does not multiply (``split_batches=True``,
    ``step_scheduler_with_optimizer=False``, an unprepared one) keeps its pace.
    """

    def __init__(self, scheduler: Any, num_processes: int):
        self.scheduler, self.num_processes = scheduler, int(num_processes)

    def _natural(self) -> int | None:
        """The pace accelerate gives the scheduler (None: it is not stepped by
        accelerate with the optimizer, so it keeps no pace of accelerate's)."""
        s = self.scheduler
        if not hasattr(s, "gradient_state") or not getattr(s, "step_with_optimizer", False):
            return None
        return 1 if s.split_batches else self.num_processes

    @property
    def pace(self) -> int:
        """Scheduler steps per optimizer step now."""
        natural = self._natural()
        return 1 if natural is None else int(getattr(self.scheduler, "_reshard_pace", natural))

    def state_dict(self) -> dict[str, Any]:
        return {"steps_per_optimizer_step": self.pace}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        saved, natural, s = int(sd["steps_per_optimizer_step"]), self._natural(), self.scheduler
        if saved == self.pace:
            return
        if natural is None:
            raise CheckpointError(
                f"accelerate_state: the checkpoint's LR scheduler stepped {saved} times per optimizer "
                f"step (accelerate's prepared scheduler) and this run's {type(s).__name__} steps once "
                "(not prepared by accelerate, or step_scheduler_with_optimizer=False): pass the "
                "scheduler accelerator.prepare returned, with the settings of the run that saved it")
        if saved == natural:
            s.__dict__.pop("_reshard_pace", None)
            s.__dict__.pop("step", None)
            return
        s._reshard_pace = saved
        s.step = types.MethodType(_paced_step, s)
        log.warning("accelerate_state: the LR scheduler keeps the pace of the checkpoint: %d "
                    "scheduler steps per optimizer step (accelerate would step it %d times on %d "
                    "processes); the global batch is kept, so is the schedule", saved, natural,
                    self.num_processes)


class _Remainder(torch.utils.data.Sampler[int]):
    """This data-parallel rank's sample indices of the global batches left in
    the cursor's epoch, from its position when iteration starts."""

    def __init__(self, cursor: DataCursor):
        self.cursor = cursor
        self.start = (cursor.epoch, cursor.consumed)

    def __iter__(self) -> Iterator[int]:
        c = self.cursor
        epoch, start = self.start
        order = c.epoch_order(epoch)
        g, per = c.global_batch_size, c.global_batch_size // c.dp_size
        lo = c.dp_rank * per
        for pos in range(start, c.dataset_len - g + 1, g):
            yield from order[pos + lo:pos + lo + per].tolist()

    def __len__(self) -> int:
        c = self.cursor
        epoch, start = self.start
        return (c.dataset_len - start) // c.global_batch_size * (c.global_batch_size // c.dp_size)


def cursor_loader(dataset: Any, cursor: DataCursor, **loader_kwargs: Any) -> Iterator[Any]:
    """This rank's batches of ``dataset`` in the order of ``cursor``, epoch
    after epoch, exact with DataLoader worker processes: each epoch's
    ``torch.utils.data.DataLoader`` is made when iteration reaches it (so
    after a restore, from the restored position), and the cursor advances by
    one global batch as each batch is handed to training, never as the
    workers fetch ahead. A checkpoint saved after step ``k`` resumes at batch
    ``k + 1``.

    The loader gets a generator of its own, seeded from the cursor's seed and
    the epoch, so making it draws nothing from the global torch generator
    (the restored RNG streams stay exact); randomness inside the workers
    restarts at a resume, since each epoch's workers are seeded from it.

    Args:
        dataset: a map-style dataset of ``cursor.dataset_len`` samples.
        cursor: the run's :class:`~reshard.DataCursor` (saved in the state tree).
        loader_kwargs: DataLoader options (``num_workers``, ``collate_fn``,
            ``pin_memory``, ...); the batch size, sampler, shuffling,
            ``drop_last`` and ``generator`` are the cursor's.

    Raises:
        ValueError: an option the cursor decides, or a dataset of another length.
    """
    taken = sorted({"batch_size", "sampler", "batch_sampler", "shuffle", "drop_last", "generator"}
                   & set(loader_kwargs))
    if taken:
        raise ValueError(f"cursor_loader: {taken} are the cursor's to decide (its global batch, order "
                         "and drop-last epochs); pass the other DataLoader options only")
    if len(dataset) != cursor.dataset_len:
        raise ValueError(f"cursor_loader: the dataset has {len(dataset)} samples, the cursor "
                         f"{cursor.dataset_len}")
    return _cursor_batches(dataset, cursor, loader_kwargs)


def _cursor_batches(dataset: Any, cursor: DataCursor, kwargs: dict[str, Any]) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    per = cursor.global_batch_size // cursor.dp_size
    while True:
        epoch = cursor.epoch
        gen = torch.Generator().manual_seed(derive_seed(cursor.seed, epoch, {"dp_rank": cursor.dp_rank},
                                                        "loader"))
        handed = 0
        for batch in DataLoader(dataset, batch_size=per, sampler=_Remainder(cursor), drop_last=True,
                                generator=gen, **kwargs):
            cursor.next_global_batch()
            handed += 1
            yield batch
        if not handed and cursor.epoch == epoch:  # nothing left of it: the next epoch
            cursor.epoch, cursor.consumed = epoch + 1, 0


def accelerate_state(accelerator: Any, model: Any, optimizer: Any = None, scheduler: Any = None,
                     *, rng: RNGState | None = None, **extra: Any) -> dict[str, Any]:
    """The state tree of a plain accelerate loop, after ``accelerator.prepare``:
    the unwrapped model and the optimizer's torch optimizer
    (:class:`~reshard.adapters.torch_native.TorchState`), the scheduler (its
    torch scheduler), accelerate's GradScaler, RNG streams and ``extra``
    entries (a :class:`~reshard.DataCursor`, a step counter, ...). With a
    scheduler, ``scheduler_pace`` (:class:`SchedulerPace`) keeps the LR
    schedule's pace across a change of the number of processes.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model, optimizer, scheduler: as ``prepare`` returned them (or None).
        rng: the run's :class:`~reshard.RNGState` (restore it after the
            DataLoader iterator exists: docs/integrations.md); None: one for
            this process is made.
    """
    opt = getattr(optimizer, "optimizer", optimizer)
    state: dict[str, Any] = {
        "model": TorchState(accelerator.unwrap_model(model), [opt] if opt is not None else []),
        "rng": rng if rng is not None else RNGState(rank=accelerator.process_index,
                                                    world_size=accelerator.num_processes),
    }
    if scheduler is not None:
        state["scheduler"] = getattr(scheduler, "scheduler", scheduler)
        state["scheduler_pace"] = SchedulerPace(scheduler, accelerator.num_processes)
    if getattr(accelerator, "scaler", None) is not None:
        state["scaler"] = accelerator.scaler
    state.update(extra)
    return state
