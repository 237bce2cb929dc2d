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

from ..sharding import ShardedObject, ShardedTensor
from ..tree import is_dtensor
from .dtensor import dtensor_shards


def _describe(name: str, t: torch.Tensor) -> list[ShardedTensor]:
    if is_dtensor(t):
        return dtensor_shards(name, t)
    return [ShardedTensor(name, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]


class TorchState:
    """Stateful adapter for a DTensor/FSDP2/TP model and its optimizers.

    Args:
        model: the module (FSDP2 ``fully_shard``-ed, ``parallelize_module``-d, or plain).
        optimizers: optimizers over its parameters (may be empty).
        cpu_offload: ask ``get_state_dict`` for CPU copies (optimizer state
            offloaded to the host); loaded values are copied back by
            ``set_state_dict``.
    """

    #: format version 1 saved the model's tensors without the "model." component
    _reshard_v1_names = (("optim.", "optim."), ("", "model."))

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[Any] = (), *,
                 cpu_offload: bool = False):
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        self.optimizers = tuple(optimizers)
        self.cpu_offload = cpu_offload
        self._msd: dict[str, Any] | None = None
        self._osd: dict[str, Any] | None = None

    def _get(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(cpu_offload=self.cpu_offload)
        msd, osd = get_state_dict(self.model, self.optimizers, options=opts)
        return msd, (osd if self.optimizers else {})

    def state_dict(self) -> dict[str, Any]:
        msd, osd = self._get()
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
        for g in osd.get("param_groups") or []:
            hp = {k: v for k, v in g.items() if k != "params"}
            for fqn in g["params"]:
                objects.append(ShardedObject(f"optim.param_group.{fqn}", hp))
        return {"tensors": tensors, "objects": objects}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        assert self._msd is not None and self._osd is not None
        msd, osd = self._msd, self._osd
        pre_state, pre_group = "optim.state.", "optim.param_group."
        hparams: dict[str, dict[str, Any]] = {}
        for ob in sd.get("objects", []):
            if ob.key.startswith(pre_group):
                hparams[ob.key[len(pre_group):]] = ob.value
            elif ob.key.startswith(pre_state):
                fqn, _, key = ob.key[len(pre_state):].rpartition(".")
                osd["state"][fqn][key] = ob.value
            elif ob.key.startswith("model."):
                msd[ob.key[len("model."):]] = ob.value
        for g in osd.get("param_groups") or []:
            for fqn in g["params"]:
                if fqn in hparams:
                    g.update(hparams[fqn])
                    break
        set_state_dict(self.model, self.optimizers, model_state_dict=msd,
                       optim_state_dict=osd if self.optimizers else {},
                       options=StateDictOptions(cpu_offload=self.cpu_offload))
        self._msd = self._osd = None
