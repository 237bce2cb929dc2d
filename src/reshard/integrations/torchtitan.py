"""TorchTitan's checkpoint component on reshard: :class:`ReshardCheckpointManager`.

A backend behind TorchTitan's ``BaseCheckpointManager`` seam (torchtitan 0.3.0:
``torchtitan.components.checkpointer.base``), selected as TorchTitan selects
every component, by a config-registry function::

    from reshard.integrations.torchtitan import ReshardCheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def llama3_debugmodel_reshard():
        config = llama3_debugmodel()
        config.checkpoint = ReshardCheckpointManager.Config(enable=True, interval=10)
        return config

(``torchrun ... -m torchtitan.train --module my_registry --config
llama3_debugmodel_reshard``). The Trainer builds it with the same arguments as
its DCP ``CheckpointManager`` and calls the same hooks: ``load`` before the
loop, ``save(step, last_step)`` after every step, ``maybe_wait_for_staging``
before every optimizer step, ``close`` at the end.

**What a checkpoint holds** (a reshard checkpoint under ``<dump_folder>/<folder>``,
named ``step-%08d`` by :class:`reshard.CheckpointManager`; keys are tree paths):

* ``model.<fqn>``: the model parts' state dict as TorchTitan's ``ModelWrapper``
  gives it (canonical names: a fused ``wqkv`` as ``wq``/``wk``/``wv``), DTensors
  as their placements say, so it loads into any FSDP/TP layout; loading goes
  back through ``ModelWrapper.load_state_dict`` (which fuses them again).
* ``optimizer.*``: ``OptimizersContainer.state_dict()`` (flat and keyed by
  parameter name: ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``).
* ``lr_scheduler.*``: ``LRSchedulersContainer.state_dict()`` (``last_epoch``).
* ``train_state.*`` (and any other state the Trainer passes in ``states``):
  the Trainer's ``step`` and ``ntokens_seen``.
* ``dataloader.state``: TorchTitan's dataloader state (one pickled blob per DP
  rank) as element ``(dp_rank,)`` of a ``(dp_size,)`` :class:`~reshard.ShardedObject`
  grid; the blob is decoded *at save* into plain values by a restricted
  unpickler (no class is resolved: :func:`decode_loader_blob`) and stored in
  reshard's typed, pickle-free encoding, so a load unpickles nothing. A state
  that is not plain data is kept as the blob and loaded only with
  ``Config.trust_pickled_dataloader=True``. It resumes at the same DP size only
  (another is refused in one line naming the remedies); a loader that is a
  :class:`reshard.DataCursor` is saved as its global position instead and
  resumes at any DP size.

Each manifest records ``extra["torchtitan"] = {"content": "full" | "model_only"}``.
The resume takes the newest *full* checkpoint of the root's lineage
(:meth:`reshard.CheckpointManager.restore` with ``accept=``): a model-only save
(``last_save_model_only``, a seed checkpoint) is never resumed as a full state.

**TorchTitan DCP checkpoints** (``step-N`` folders TorchTitan's own
``CheckpointManager`` wrote into the same folder) are resumed with no flag: the
step of each is read from its ``train_state.step`` value (never from its
name), the newest full one wins over reshard's own when its step is higher,
and it is loaded through :func:`reshard.load` in DCP's layout (TorchTitan
flattens the model's keys to the top level of the DCP state dict). Its
dataloader blobs are decoded by the same restricted unpickler; a blob that
holds anything but plain data needs ``trust_pickled_dataloader=True``.

Every field of TorchTitan's checkpoint config is honoured, or refused with one
line when the Config is built: :data:`FIELDS` says how each is treated.

The TorchTitan internals this module relies on are named in :data:`TORCHTITAN_SEAMS`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from ..adapters.data import DataCursor
from ..collectives import Tries
from ..errors import CheckpointError, CheckpointNotFoundError, ShardingError
from ..loading.load import LoadResult, load
from ..manager.manager import CheckpointManager
from ..ondisk import codec
from ..ondisk.manifest import Manifest
from ..options import LoadOptions, SaveOptions
from ..storage import resolve
from .torchtitan_data import (
    DCPLoaderState,
    LoaderState,
    _decode_loader_state,  # noqa: F401 - (tests reach the dataloader helpers here too)
    _encode_loader_state,  # noqa: F401
    decode_loader_blob,
)

log = logging.getLogger("reshard.integrations.torchtitan")

__all__ = ["FIELDS", "TORCHTITAN_SEAMS", "ReshardCheckpointManager", "decode_loader_blob"]

#: The TorchTitan internals this integration relies on, in one place (a test
#: checks each against the installed torchtitan).
TORCHTITAN_SEAMS: dict[str, str] = {
    "torchtitan.components.checkpointer.base.BaseCheckpointManager":
        "the seam: public load/save/maybe_wait_for_staging/maybe_wait_for_saving/close call the "
        "hooks _load, _save, _maybe_wait_for_staging, _wait_for_saving, _close; attributes "
        "enable and save_future",
    "torchtitan.components.checkpointer.base.BaseCheckpointManager.Config":
        "the shared checkpoint fields (FIELDS), a @dataclass(kw_only=True, slots=True)",
    "torchtitan.components.checkpointer.base.ModelWrapper":
        "the model parts' canonical state dict and its load_state_dict (fused-weight hooks)",
    "torchtitan.components.dataloader.ParallelAwareDataloader.state_dict":
        "{'dp_rank_<r>': pickle.dumps(StatefulDataLoader.state_dict()), 'world_size': dp} and "
        "the attributes dp_rank and dp_world_size",
    "torchtitan.trainer.Trainer.state_dict":
        "{'step': int, 'ntokens_seen': int}, passed as states={'train_state': trainer}; a DCP "
        "checkpoint's step is read from train_state.step",
    "torchtitan.components.checkpointer.dcp.CheckpointManager":
        "its DCP layout: model keys flattened to the top, the other states under their names",
}

#: Every field of TorchTitan's ``BaseCheckpointManager.Config`` (0.3.0) and of
#: this Config, and how it is treated ("honoured: ..." or "refused: ...").
FIELDS: dict[str, str] = {
    "enable": "honoured: a disabled manager does nothing (TorchTitan's public methods check it)",
    "folder": "honoured: the reshard root, joined to the Trainer's dump_folder (local or s3://)",
    "interval": "honoured: a full save when step % interval == 0",
    "initial_load_path": "honoured: loaded when the folder holds no checkpoint (a reshard checkpoint, "
                         "a DCP folder, or with initial_load_in_hf a Hugging Face directory)",
    "initial_load_model_only": "honoured: the initial load fills the model only",
    "initial_load_in_hf": "honoured: the initial load reads Hugging Face safetensors "
                          "(initial_load_path, else the sd_adapter's hf_assets_path) through "
                          "the model's sd_adapter (to_hf / from_hf) and reshard.formats.import_hf",
    "initial_load_in_hf_quantized": "refused: reshard reads no quantized Hugging Face checkpoint",
    "last_save_model_only": "honoured: the last save holds the model only, marked model_only in "
                            "its manifest (never resumed as a full state)",
    "last_save_in_hf": "honoured: the last (model-only) save is also written as Hugging Face "
                       "safetensors (sd_adapter.to_hf names) in <folder>/step-<N>",
    "export_dtype": "honoured: floating-point tensors of a model-only last save are cast to it",
    "keep_latest_k": "honoured: CheckpointManager(keep_last=k) retention (0: keep all); never "
                     "deletes a DCP folder, nor the resume source while the job runs",
    "load_step": "honoured: load(step) resumes that step (reshard's or a DCP checkpoint's)",
    "exclude_from_loading": "honoured: those states are neither read nor required",
    "enable_first_step_checkpoint": "honoured: a full save after step 1",
    "create_seed_checkpoint": "honoured: the Trainer's seed save (step 0) is model-only, and "
                              "loaded as the model's initial weights",
    "load_only": "honoured: loads, never saves",
    "async_mode": "honoured: 'async' and 'async_with_pinned_mem' save with reshard.async_save "
                  "(the staging wait waits on the handle's staged future); the last save is "
                  "synchronous",
    "trust_pickled_dataloader": "reshard's: unpickle dataloader state that is not plain data",
    "timeout_s": "reshard's: the checkpoint collectives' timeout (default 600 s)",
}

_CONTENT = "torchtitan"
_FULL, _MODEL_ONLY = "full", "model_only"


# ----------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class _Exclude:
    """Load-time transform: the saved state under these top-level keys is not
    read and not required (TorchTitan's ``exclude_from_loading``); with
    ``keep_only``, everything but the state under these keys."""

    keys: tuple[str, ...]
    keep_only: bool = False

    def _out(self, k: str) -> bool:
        under = any(k == x or k.startswith(x + ".") for x in self.keys)
        return not under if self.keep_only else under

    def apply_manifest(self, m: Manifest) -> Manifest:
        import msgspec

        extra = dict(m.extra)
        table = extra.get("dcp_values")
        if isinstance(table, dict):
            extra["dcp_values"] = {k: v for k, v in table.items() if not self._out(k)}
        return msgspec.structs.replace(
            m, tensors={k: v for k, v in m.tensors.items() if not self._out(k)},
            objects={k: v for k, v in m.objects.items() if not self._out(k)},
            aliases={k: v for k, v in m.aliases.items() if not self._out(k)},
            values={k: v for k, v in (m.values or {}).items() if not self._out(k)}, extra=extra)


def _content(m: Manifest) -> str | None:
    rec = (m.extra or {}).get(_CONTENT)
    return rec.get("content") if isinstance(rec, dict) else None


def _full_state(m: Manifest) -> bool:
    """A checkpoint resumable as a full training state (not a model-only save)."""
    return _content(m) != _MODEL_ONLY


def _cast(sd: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
            and v.dtype != dtype else v for k, v in sd.items()}


# ----------------------------------------------------------------------------- the manager


def _tensor_step(st: Any, path: str, m: Any) -> int | None:
    """A DCP checkpoint's ``train_state.step`` saved as a one-element integer
    tensor (``torch.tensor(step)``, as older TorchTitan and other trainers
    save it), read as an int; None when it is not one."""
    from ..loading.read_state import read_state
    from ..state.sharding import torch_dtype

    e = m.tensors.get("train_state.step")
    if e is None or math.prod(e.global_shape) != 1:
        return None
    dt = torch_dtype(e.dtype)
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        return None

    try:
        got = read_state(st.url(path), keys="train_state.step")
    except CheckpointError as err:
        log.warning("%s: its train_state.step tensor is unreadable (%s)", path, err)
        return None
    t = got.get("train_state", {}).get("step") if isinstance(got.get("train_state"), dict) \
        else got.get("train_state.step")
    return int(t.item()) if isinstance(t, torch.Tensor) else None


class ReshardCheckpointManager(BaseCheckpointManager):
    """TorchTitan checkpoint manager that saves and resumes with reshard (see the module docstring).

    Built by TorchTitan (``Config.build(...)``) with the arguments of its DCP
    ``CheckpointManager``: ``dataloader``, ``model_parts``, ``optimizers``,
    ``lr_schedulers``, ``states`` (``{"train_state": trainer}``), ``sd_adapter``
    and ``base_folder`` (the Trainer's ``dump_folder``).

    Call order (TorchTitan's Trainer, on every rank): ``load(step)`` once before
    the loop; per step ``maybe_wait_for_staging()`` before the optimizer step and
    ``save(step, last_step)`` after it; ``close()`` at the end (it waits for the
    saves in flight). With ``async_mode`` other than "disabled", ``save`` returns
    once the state is staged (``SaveHandle.staged``); ``maybe_wait_for_staging``
    waits on that future (the call an overlap mode needs before the loop
    mutates the state); ``save_future`` is the handle's ``committed`` future.

    Raises:
        CheckpointError: (from ``load``) checkpoints exist but none loads; only
            model-only checkpoints exist (nothing to resume the training state
            from); a dataloader blob that needs trust; ``load_step`` not found.
        ShardingError: the saved state does not fit this job (a DP size change
            of TorchTitan's dataloader state, a shape mismatch, missing keys).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """'disabled': synchronous saves; 'async' / 'async_with_pinned_mem': reshard.async_save
        (training resumes once the state is staged; the last save is synchronous)."""

        trust_pickled_dataloader: bool = False
        """Unpickle dataloader state that is not plain data (a checkpoint you trust)."""

        timeout_s: float | None = None
        """Seconds each checkpoint collective may wait for the other ranks (None: 600)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"ReshardCheckpointManager: unknown async_mode {self.async_mode!r}")
            if self.initial_load_in_hf_quantized:
                raise ValueError("ReshardCheckpointManager: initial_load_in_hf_quantized is refused: "
                                 "reshard reads no quantized Hugging Face checkpoint")
            if self.export_dtype not in ("float16", "bfloat16", "float32"):
                raise ValueError(f"ReshardCheckpointManager: unknown export_dtype {self.export_dtype!r}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.interval = config.interval
        self.dataloader = dataloader
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("ReshardCheckpointManager: last_save_in_hf needs the model's "
                             "sd_adapter (its state_dict_adapter), and none was given")
        self.export_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                             "float32": torch.float32}[config.export_dtype]
        self._mgr = CheckpointManager(
            self.folder, keep_last=config.keep_latest_k or None,
            use_async=config.async_mode != "disabled", preempt_signals=(),
            timeout_s=config.timeout_s,
            writer=not config.load_only)  # a load_only job (an evaluation) never owns the root
        self._handle: Any = None
        self._resumed_from: str | None = None
        log.info("reshard checkpoints in %s (every %d steps%s)", self.folder, self.interval,
                 ", async" if config.async_mode != "disabled" else "")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - nothing to raise to from a finalizer
            pass

    # ------------------------------------------------------------------ the state tree
    @property
    def manager(self) -> CheckpointManager:
        """The :class:`reshard.CheckpointManager` of the folder."""
        return self._mgr

    def _dp(self) -> tuple[int, int, int]:
        """``(dp_rank, dp_size, replica)`` of this rank's dataloader state."""
        coll = self._mgr.coll
        dl = self.dataloader
        rank = getattr(dl, "dp_rank", None)
        size = getattr(dl, "dp_world_size", None)
        if not isinstance(rank, int) or not isinstance(size, int):
            rank, size = coll.rank, coll.world_size
        # the ranks of one DP rank (TP, PP, CP) hold the same state: replicas, numbered by global rank
        return rank, size, coll.rank

    def _loader_node(self) -> Any:
        if isinstance(self.dataloader, DataCursor):
            return self.dataloader
        rank, size, replica = self._dp()
        return LoaderState(self.dataloader, rank, size, replica, self.config.trust_pickled_dataloader)

    def _tree(self, *, model_only: bool = False, exclude: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tree, model state dict)``: what a save writes and a load fills."""
        msd = self.states[MODEL].state_dict()
        tree: dict[str, Any] = {"model": msd}
        if model_only:
            return tree, msd
        for k, v in self.states.items():
            if k == MODEL or k in exclude or v is None:
                continue
            tree[k] = self._loader_node() if k == DATALOADER else v
        return tree, msd

    # ------------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _extra(self, content: str, **more: Any) -> dict[str, Any]:
        rec: dict[str, Any] = {"content": content, **more}
        if self._resumed_from:
            rec["resumed_from_dcp"] = self._resumed_from
        # the generic mark (reshard.latest and CheckpointManager.restore pass a model-only one over)
        generic = {"content": content} if content == _MODEL_ONLY else {}
        return {**{k: v for k, v in self._mgr.options.extra.items() if k != "content"}, **generic,
                _CONTENT: rec}

    def _save_as(self, step: int, tree: dict[str, Any], extra: dict[str, Any], *, sync: bool) -> Any:
        opts = self._mgr.options
        self._mgr.options = replace(opts, extra=extra)
        try:
            return self._mgr.save(step, tree, sync=sync)
        finally:
            self._mgr.options = opts

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        t0 = time.monotonic()
        seed = curr_step == 0  # the Trainer's create_seed_checkpoint save
        if last_step or seed:
            self._wait_for_saving()  # the last save is synchronous, after those in flight
            if self.config.last_save_model_only or seed:
                tree, msd = self._tree(model_only=True)
                tree = {"model": _cast(msd, self.export_dtype)}
                self._save_as(curr_step, tree, self._extra(_MODEL_ONLY, export_dtype=self.config.export_dtype,
                                                           seed=seed), sync=True)
                if self.config.last_save_in_hf and not seed:
                    self._save_hf(curr_step, tree["model"])
            else:
                tree, _ = self._tree()
                self._save_as(curr_step, tree, self._extra(_FULL), sync=True)
            log.info("saved the last checkpoint (step %d) in %.2f s", curr_step, time.monotonic() - t0)
            return True
        tree, _ = self._tree()
        out = self._save_as(curr_step, tree, self._extra(_FULL), sync=False)
        if self._mgr.use_async:
            self._handle = out
            self.save_future = out.committed
        log.info("%s the checkpoint of step %d in %.2f s", "staged" if self._mgr.use_async else "saved",
                 curr_step, time.monotonic() - t0)
        return True

    def _save_hf(self, step: int, model_sd: dict[str, Any]) -> None:
        """``last_save_in_hf``: the model under the sd_adapter's Hugging Face
        names (``to_hf``: renamed and permuted as the adapter does), as
        safetensors in ``<folder>/step-<step>`` (TorchTitan's path for it; not
        a reshard checkpoint, so never listed, resumed or collected): saved
        sharded by every rank as a reshard checkpoint outside the root, then
        streamed into the Hugging Face files by rank 0 and deleted."""
        from ..formats.hf_export import export_hf
        from ..saving.save import save

        hf_sd = self.sd_adapter.to_hf(model_sd)
        tmp = f"{self.folder.rstrip('/')}.hf-staging-step-{step}"
        out = filesystem.join(self.folder, f"step-{step}")
        save({"hf": hf_sd}, tmp, step=step, group=self._mgr.group,
             options=SaveOptions(overwrite=True, timeout_s=self._mgr.timeout_s))
        tries = Tries()
        if self._mgr.coll.rank == 0:
            with tries:
                export_hf(tmp, out, subtree="hf", overwrite=True)
                st, key = resolve(tmp)
                st.delete_tree(key)
        tries.agree(self._mgr.coll, f"last_save_in_hf export to {out}")

    # ------------------------------------------------------------------ waits
    def _maybe_wait_for_staging(self) -> None:
        h = self._handle
        if h is not None:
            h.staged.result()  # the state may be mutated once staged (SaveHandle.staged)

    def _wait_for_saving(self) -> None:
        self._mgr.wait()  # every save in flight; raises a failure not yet reported, once
        self._handle = None
        self.save_future = None

    def _close(self) -> None:
        try:
            self._mgr.close()
        finally:
            self._handle = None
            self.save_future = None

    # ------------------------------------------------------------------ load
    def _exclude(self) -> tuple[str, ...]:
        ex = tuple(self.config.exclude_from_loading)
        for k in ex:
            if k not in self.states:
                raise ValueError(f"exclude_from_loading: {k!r} is not a state of this job "
                                 f"({sorted(self.states)})")
        return ex

    def _listing(self, step: int) -> dict[str, Any]:
        """Coordinator: what the folder holds: reshard's newest full and
        model-only checkpoints of the lineage, and the DCP checkpoints with the
        step each records in ``train_state.step``."""
        from ..commit.lineage import Head, lineage_of, resume_order
        from ..commit.listing import committed, read_head
        from ..ondisk.dcp import dcp_checkpoints, open_dcp

        st, root = self._mgr.storage, self._mgr.root
        entries = committed(st, root)
        order = resume_order(entries, lineage_of(entries, Head.from_record(read_head(st, root))))
        full = [e for e in order if e.manifest is not None and _full_state(e.manifest)]
        partial = [e for e in order if e.manifest is not None and not _full_state(e.manifest)]
        dcps: list[dict[str, Any]] = []
        for name, mtime in dcp_checkpoints(st, root):
            try:
                _, m = open_dcp(st.join(root, name), storage=st)
            except CheckpointError as e:
                log.warning("%s: skipped (not a loadable DCP checkpoint: %s)", st.join(root, name), e)
                continue
            s = (m.values or {}).get("train_state.step")
            s = codec.from_json(s) if s is not None else _tensor_step(st, st.join(root, name), m)
            has_optim = any(k.startswith(f"{OPTIMIZER}.") for k in m.tensors)
            dcps.append({"name": name, "step": s if type(s) is int else None, "mtime": mtime or 0.0,
                         "full": type(s) is int and has_optim})
        return {"full": [[e.name, e.step] for e in full], "partial": [[e.name, e.step] for e in partial],
                "dcp": dcps, "abandoned": bool([e for e in entries if e.abandoned])}

    def _agreed_listing(self, step: int) -> dict[str, Any]:
        import json

        coll = self._mgr.coll
        out = None
        tries = Tries()
        if coll.rank == 0:
            with tries:
                out = self._listing(step)
        tries.agree(coll, f"listing {self.folder}")
        return json.loads(coll.broadcast_bytes(json.dumps(out).encode() if coll.rank == 0 else None))

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        t0 = time.monotonic()
        lst = self._agreed_listing(step)
        full_dcp = [d for d in lst["dcp"] if d["full"]]
        if step != -1:
            mine = [n for n, s in lst["full"] if s == step] + [n for n, s in lst["partial"] if s == step]
            dcp = [d for d in full_dcp if d["step"] == step]
            if mine:
                done = self._load_reshard(step=step, model_only=not any(s == step for _, s in lst["full"]))
            elif dcp:
                done = self._load_dcp(self._mgr.storage.join(self._mgr.root, dcp[-1]["name"]))
            else:
                raise CheckpointNotFoundError(f"checkpoint.load_step={step}: no checkpoint of step {step} "
                                              f"under {self.folder}")
        else:
            best_reshard = max((s for _, s in lst["full"] if s is not None), default=None)
            if lst["full"] and best_reshard is None:
                best_reshard = -1  # committed, no step recorded: still reshard's newest
            best_dcp = max(full_dcp, key=lambda d: (d["step"], d["mtime"]), default=None)
            if best_dcp is not None and (best_reshard is None or best_dcp["step"] > best_reshard):
                done = self._load_dcp(self._mgr.storage.join(self._mgr.root, best_dcp["name"]))
            elif lst["full"]:
                done = self._load_reshard()
            elif lst["partial"] or [d for d in lst["dcp"] if not d["full"]]:
                seeds = [n for n, s in lst["partial"] if s == 0]
                if seeds:
                    done = self._load_reshard(name=seeds[0], model_only=True)
                else:
                    shown = [n for n, _ in lst["partial"]] + [d["name"] for d in lst["dcp"] if not d["full"]]
                    raise CheckpointError(
                        f"{self.folder}: only model-only checkpoints ({', '.join(shown[:3])}): no training "
                        "state to resume; start from their weights with checkpoint.initial_load_path "
                        "in another folder")
            elif lst["abandoned"]:
                raise CheckpointNotFoundError(
                    f"{self.folder}: no committed checkpoint, but abandoned attempts: refusing a silent "
                    "fresh start (reshard gc collects them)")
            else:
                return self._initial_load()
        log.info("loaded the checkpoint in %.2f s", time.monotonic() - t0)
        return done

    def _load_reshard(self, *, step: int | None = None, name: str | None = None,
                      model_only: bool = False) -> bool:
        ex = () if model_only else self._exclude()
        tree, msd = self._tree(model_only=model_only, exclude=ex)
        # a load_only job (an evaluation reading a live root) leaves the root's HEAD alone
        res = self._mgr.restore(tree, step=step, name=name, transforms=[_Exclude(ex)] if ex else [],
                                accept=None if model_only or name is not None else _full_state,
                                record_head=not self.config.load_only)
        if res is None:
            return False
        self.states[MODEL].load_state_dict(msd)
        log.info("resumed from %s (step %s%s)", res.path, res.step, ", model only" if model_only else "")
        return True

    def _load_dcp(self, path: str) -> bool:
        """Resume from TorchTitan's DCP checkpoint at ``path``: its layout has the
        model's keys at the top level; its dataloader blobs are decoded first
        (every rank agrees before anything is loaded)."""
        st = self._mgr.storage
        ex = self._exclude()
        msd = self.states[MODEL].state_dict()
        tree: dict[str, Any] = dict(msd)
        node: Any = None
        tries = Tries()
        if DATALOADER not in ex and self.dataloader is not None:
            if isinstance(self.dataloader, DataCursor):
                node = self.dataloader
            else:
                with tries:
                    node = self._dcp_loader(path)
        tries.agree(self._mgr.coll, f"dataloader state of {path}")
        for k, v in self.states.items():
            if k == MODEL or k in ex or v is None:
                continue
            tree[k] = node if k == DATALOADER else v
        res: LoadResult = load(tree, path, group=self._mgr.group, storage=st,
                               transforms=[_Exclude(ex)] if ex else [],
                               options=LoadOptions(timeout_s=self._mgr.timeout_s))
        self.states[MODEL].load_state_dict(msd)
        self._resumed_from = os.path.basename(path.rstrip("/"))
        log.info("resumed from TorchTitan's DCP checkpoint %s (step %s); the next saves are reshard's",
                 path, res.step)
        return True

    def _dcp_loader(self, path: str) -> DCPLoaderState:
        from ..ondisk.dcp import open_dcp

        rank, size, _ = self._dp()
        _, m = open_dcp(path, storage=self._mgr.storage)
        vals = m.values or {}
        ws = vals.get(f"{DATALOADER}.world_size")
        ws = codec.from_json(ws) if ws is not None else None
        if ws is not None and ws != size:
            raise ShardingError(
                f"{path}: TorchTitan dataloader state was saved by {ws} DP ranks and this run has "
                f"{size}: its per-rank state cannot be resharded; resume at {ws} DP ranks, "
                "exclude_from_loading=['dataloader'] (the data restarts), or use a reshard.DataCursor "
                "loader")
        key = f"{DATALOADER}.dp_rank_{rank}"
        if key not in vals:
            skipped = (m.extra.get("dcp_skipped_values") or {}).get(key)
            raise CheckpointError(f"{path}: no dataloader state for DP rank {rank} ({key}"
                                  f"{': ' + skipped if skipped else ''})")
        blob = codec.from_json(vals[key])
        if not isinstance(blob, bytes):
            raise CheckpointError(f"{path}: {key} is a {type(blob).__name__}, not the pickled state "
                                  "TorchTitan's dataloader writes")
        return DCPLoaderState(self.dataloader, rank, size,
                               decode_loader_blob(blob, trust=self.config.trust_pickled_dataloader,
                                                  where=f"{path}: {key}"))

    def _initial_load(self) -> bool:
        """The folder holds no checkpoint: ``initial_load_path`` (or, with
        ``initial_load_in_hf``, the sd_adapter's ``hf_assets_path``)."""
        c = self.config
        path = c.initial_load_path
        if c.initial_load_in_hf:
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if self.sd_adapter is None or not path:
                raise ValueError("initial_load_in_hf needs the model's sd_adapter and an "
                                 "initial_load_path (or model.hf_assets_path)")
            from ..formats.hf_import import import_hf

            msd = self.states[MODEL].state_dict()
            hf_sd = self.sd_adapter.to_hf(msd)
            import_hf(hf_sd, path, group=self._mgr.group)
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_sd))
            log.info("loaded the model from Hugging Face safetensors in %s", path)
            return True
        if not path:
            log.info("no checkpoint in %s: a fresh start", self.folder)
            return False
        from ..ondisk.dcp import is_dcp_checkpoint

        dcp = is_dcp_checkpoint(path)
        if c.initial_load_model_only:
            msd = self.states[MODEL].state_dict()
            others = tuple(k for k in self.states if k != MODEL)
            # DCP: the model's keys at the top, the other states under their names
            tree, only = (dict(msd), _Exclude(others)) if dcp else ({"model": msd}, _Exclude(("model",), True))
            load(tree, path, group=self._mgr.group, transforms=[only],
                 options=LoadOptions(timeout_s=self._mgr.timeout_s))
            self.states[MODEL].load_state_dict(msd)
            log.info("loaded the model (initial_load_model_only) from %s", path)
            return True
        if dcp:
            return self._load_dcp(path)
        ex = self._exclude()
        tree, msd = self._tree(exclude=ex)
        load(tree, path, group=self._mgr.group, transforms=[_Exclude(ex)] if ex else [],
             options=LoadOptions(timeout_s=self._mgr.timeout_s))
        self.states[MODEL].load_state_dict(msd)
        log.info("loaded the full state from %s (initial_load_path)", path)
        return True

