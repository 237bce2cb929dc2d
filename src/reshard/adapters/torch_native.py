"""PyTorch-native state: FSDP2 / tensor-parallel (DTensor) models and their
optimizers, through ``torch.distributed.checkpoint.state_dict`` (DCP's
``get_state_dict`` / ``set_state_dict``) rather than a traversal of our own.

Saved names, relative to the adapter's position in the state tree, are
``model.{fqn}``, ``optim.state.{fqn}.{key}`` and ``optim.param_group.{fqn}``:
those of :class:`~reshard.ModelState` under ``"model"`` beside
:class:`~reshard.OptimizerState` under ``"optim"`` (so ``{"app": TorchState(m,
opt)}`` and ``{"app": {"model": ModelState(m), "optim": OptimizerState(m,
opt)}}`` load each other's checkpoints, and the tensor keys equal DCP's for the
"AppState" of its tutorial, ``{"model": msd, "optim": osd}``). Wrapper
prefixes (DDP, FSDP1, torch.compile) are stripped by ``get_state_dict``. DTensors are saved from their
placements and filled in place at load in their own (possibly different) mesh
and placements; no rank materialises a full tensor.

Loading into a fresh optimizer relies on ``get_state_dict``'s own state
initialisation (a step with zero gradients and ``lr`` 0, DCP's
``_init_optim_state``), then ``set_state_dict`` copies the loaded state in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..state.sharding import ShardedObject, ShardedTensor
from ..state.tree import is_dtensor
from .dtensor import dtensor_shards
from .hyperparams import (
    HyperparamRule,
    check_rule,
    dcp_param_groups_saved,
    fit_schedulers,
    group_hyperparams,
    hyperparams_from_dcp,
    model_only,
    restore_hyperparams,
    snapshot_schedulers,
)
from .names import canonical_names


def _describe(name: str, t: torch.Tensor) -> list[ShardedTensor]:
    if is_dtensor(t):
        return dtensor_shards(name, t)
    return [ShardedTensor(name, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]


class TorchState:
    """Stateful adapter for a DTensor/FSDP2/TP model and its optimizers.

    Hyperparameters are saved per parameter and restored by name exactly as
    :class:`~reshard.OptimizerState` does (same ``hyperparams`` rules). An
    optimizer that has never stepped stays so: its state is neither saved
    (``get_state_dict`` would create zero moments at ``step`` 1 to describe
    it) nor left behind by a load of a checkpoint that holds none of it (a
    model-only checkpoint with ``strict=False`` leaves it as constructed).

    Args:
        model: the module (FSDP2 ``fully_shard``-ed, ``parallelize_module``-d, or plain).
        optimizers: optimizers over its parameters (may be empty).
        cpu_offload: ask ``get_state_dict`` for CPU copies (optimizer state
            offloaded to the host); loaded values are copied back by
            ``set_state_dict``.
        hyperparams: ``"error"`` (default), ``"saved"`` or ``"current"``
            (:mod:`reshard.adapters.hyperparams`).

    Raises:
        ValueError: an unknown ``hyperparams`` rule.
    """

    #: format version 1 saved the model's tensors without the "model." component
    _reshard_v1_names = (("optim.", "optim."), ("", "model."))

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[Any] = (), *,
                 cpu_offload: bool = False, hyperparams: HyperparamRule = "error"):
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        self.optimizers = tuple(optimizers)
        self.cpu_offload = cpu_offload
        self.hyperparams = check_rule(hyperparams)
        self._msd: dict[str, Any] | None = None
        self._osd: dict[str, Any] | None = None
        self._loading = False
        self._saved: frozenset[str] = frozenset()  # names the checkpoint being loaded holds
        self._fresh: tuple[torch.optim.Optimizer, ...] = ()  # never stepped before this call
        self._dcp_groups = False  # this load restores DCP's param_groups (by group position)
        self._model_only = False  # this load reads model weights alone (a Hugging Face directory)

    def _fqns(self) -> dict[int, str]:
        params = list(self.model.named_parameters())
        names = canonical_names(self.model, [n for n, _ in params])
        return {id(p): names[n] for n, p in params}

    def _get(self, loading: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self._fresh = tuple(o for o in self.optimizers if not o.state)
        opts = StateDictOptions(cpu_offload=self.cpu_offload)
        msd, osd = get_state_dict(self.model, self.optimizers, options=opts)
        if self._fresh:
            # get_state_dict made state for them (a zero-gradient step, DCP's
            # _init_optim_state): at save it is neither saved nor kept; at load
            # its tensors are only destinations (set_state_dict installs what
            # was loaded), so a load refused before writing leaves them fresh
            if not loading:
                fqns = self._fqns()
                state: dict[str, Any] = osd.get("state") or {}  # type: ignore[assignment]
                for o in self._fresh:
                    for p in [p for g in o.param_groups for p in g["params"]]:
                        state.pop(fqns.get(id(p), ""), None)
            for o in self._fresh:
                o.state.clear()
        return msd, (osd if self.optimizers else {})

    def reshard_prepare_load(self, m: Any) -> None:
        """Note what the checkpoint holds (``m``: the manifest seen from here)."""
        self._loading = True
        self._saved = frozenset(m.tensors) | frozenset(m.objects) | frozenset(m.aliases)
        self._dcp_groups = dcp_param_groups_saved(m, "optim.")
        self._model_only = model_only(m)

    def state_dict(self) -> dict[str, Any]:
        # the load-time view is taken once, right after reshard_prepare_load: a load
        # that fails before load_state_dict leaves a later save unaffected
        loading, self._loading = self._loading, False
        msd, osd = self._get(loading)
        self._msd, self._osd = msd, osd
        tensors: list[ShardedTensor] = []
        objects: list[ShardedObject] = []
        for fqn, t in msd.items():
            if isinstance(t, torch.Tensor):
                tensors.extend(_describe(f"model.{fqn}", t))
            else:  # extra state
                objects.append(ShardedObject(f"model.{fqn}", t))
        for fqn, st in (osd.get("state") or {}).items():
            for key, v in st.items():
                name = f"optim.state.{fqn}.{key}"
                if isinstance(v, torch.Tensor):
                    tensors.extend(_describe(name, v))
                else:
                    objects.append(ShardedObject(name, v))
        out: dict[str, Any] = {"tensors": tensors, "objects": objects}
        if loading and self._model_only:  # model weights alone: no optimizer state, no empty list
            keep = [t for t in tensors if t.fqn.startswith("model.")]
            return {k: v for k, v in (("tensors", keep),
                                      ("objects", [o for o in objects if o.key in self._saved])) if v}
        if loading and self._dcp_groups:  # DCP's groups, by position: one value (regrouped at load)
            out = {k: v for k, v in out.items() if v}  # no empty list (a value DCP does not hold)
            out["optim"] = {"param_groups": None}
            return out
        for g in osd.get("param_groups") or []:
            hp = group_hyperparams(g)
            for fqn in g["params"]:
                objects.append(ShardedObject(f"optim.param_group.{fqn}", hp))
        return out

    def _hyperparams(self, objects: Any) -> dict[str, dict[str, Any]]:
        pre = "optim.param_group."
        return {k[len(pre):]: v for k, v in objects
                if k.startswith(pre) and k in self._saved}  # not requests left as they were

    def _restore_hyperparams(self, hparams: dict[str, dict[str, Any]], check_only: bool) -> dict[str, Any]:
        fqns = self._fqns()
        notes: dict[str, Any] = {}
        for i, o in enumerate(self.optimizers):
            names = {id(p): [fqns[id(p)]] for g in o.param_groups for p in g["params"] if id(p) in fqns}
            got = restore_hyperparams(o, names, hparams, self.hyperparams, where="TorchState",
                                      check_only=check_only)
            if got:
                notes[f"optim{'' if len(self.optimizers) == 1 else f'[{i}]'}.hyperparams_restored"] = \
                    got["hyperparams_restored"]
        return notes

    def reshard_check_load(self, objects: dict[str, Any]) -> dict[str, Any]:
        """Before any target is written: raise what restoring the saved
        hyperparameters would raise; returns the notes of the values a restore
        replaces."""
        hparams = self._hyperparams(objects.items())
        optim = objects.get("optim")  # DCP's groups, by position: one value {"param_groups": [...]}
        if self._dcp_groups and isinstance(optim, dict) and optim.get("param_groups") is not None:
            hparams.update(hyperparams_from_dcp(optim["param_groups"], where="TorchState"))
        return self._restore_hyperparams(hparams, check_only=True)

    def reshard_before_load(self, peers: list[Any]) -> None:
        """Before any Stateful's ``load_state_dict``: note the constructed
        per-group lists of these optimizers' LR schedulers among ``peers``."""
        self._sched_constructed: list[dict[int, dict[str, list[Any]]]] = [
            snapshot_schedulers(o, peers) for o in self.optimizers]

    def reshard_finish_load(self, peers: list[Any]) -> None:
        """After every Stateful of the load: the LR schedulers of these
        optimizers among ``peers`` hold one entry per current param group
        (:func:`~reshard.adapters.hyperparams.fit_schedulers`); under
        ``hyperparams="current"`` they continue from the constructed rates."""
        got = getattr(self, "_sched_constructed", None) or [{} for _ in self.optimizers]
        self._sched_constructed = []
        for o, c in zip(self.optimizers, got, strict=False):
            fit_schedulers(o, peers, self.hyperparams, c, where="TorchState")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        assert self._msd is not None and self._osd is not None
        msd, osd = self._msd, self._osd
        if self._model_only:  # the optimizers keep their state (fresh ones: none, as constructed)
            self._model_only = False
            for ob in sd.get("objects", []):
                if ob.key.startswith("model."):
                    msd[ob.key[len("model."):]] = ob.value
            set_state_dict(self.model, (), model_state_dict=msd, optim_state_dict={},
                           options=StateDictOptions(cpu_offload=self.cpu_offload))
            for o in self._fresh:
                o.state.clear()
            self._msd = self._osd = None
            self._fresh, self._saved = (), frozenset()
            return
        pre_state, pre_group = "optim.state.", "optim.param_group."
        objs = sd.get("objects", [])
        hparams = self._hyperparams((ob.key, ob.value) for ob in objs)
        for ob in objs:
            if ob.key.startswith(pre_group):
                continue
            if ob.key.startswith(pre_state):
                fqn, _, key = ob.key[len(pre_state):].rpartition(".")
                osd["state"][fqn][key] = ob.value
            elif ob.key.startswith("model."):
                msd[ob.key[len("model."):]] = ob.value
        if self._dcp_groups:
            self._dcp_groups = False
            groups = (sd.get("optim") or {}).get("param_groups")
            hparams.update(hyperparams_from_dcp(groups, where="TorchState"))
        set_state_dict(self.model, self.optimizers, model_state_dict=msd,
                       optim_state_dict=osd if self.optimizers else {},
                       options=StateDictOptions(cpu_offload=self.cpu_offload))
        fqns = self._fqns()
        for o in self._fresh:  # state the checkpoint does not hold: as constructed again
            for g in o.param_groups:
                for p in g["params"]:
                    pre = f"optim.state.{fqns.get(id(p), '')}."
                    if not any(n.startswith(pre) for n in self._saved):
                        o.state.pop(p, None)
        self._restore_hyperparams(hparams, check_only=False)
        self._msd = self._osd = None
        self._fresh, self._saved = (), frozenset()
