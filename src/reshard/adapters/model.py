"""ModelState: a module's parameters and persistent buffers, keyed by fqn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..state.sharding import ShardedObject, ShardedTensor
from ..state.tree import is_dtensor
from .names import canonical_names

#: ``layout(fqn, tensor)`` -> the ShardedTensor(s) describing this rank's
#: ``tensor`` (several views of one local buffer for fused layouts), or None
#: for the default (DTensor as is, plain tensor replicated).
Layout = Callable[[str, torch.Tensor], "ShardedTensor | list[ShardedTensor] | None"]

EXTRA_STATE_SUFFIX = "_extra_state"


class ModelState:
    """Stateful adapter for an ``nn.Module``.

    Saved keys are the keys of ``module.state_dict()`` (so buffers registered
    ``persistent=False`` are not saved and keep their constructed value),
    relative to the adapter's position in the state tree: under ``"model"``,
    ``model.<fqn>``. Wrapper components (DDP ``module.``, FSDP1
    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, torch.compile
    ``_orig_mod.``) are left out of the fqn, as DCP's ``get_state_dict`` does,
    so a wrapped model loads into the plain one and back. Parameters and
    buffers are filled in place at load.

    * A DTensor is saved as its placements say; a plain tensor is a replica
      (identical on every rank) unless ``layout`` describes its sharding.
    * Tied weights (two names, one tensor) are stored once with an alias
      record; a model whose config claims tying but whose tensors differ is
      saved as two tensors.
    * Opaque extra state (``get_extra_state``) is stored as an object of the
      size recorded at save; at load it is allocated from the checkpoint and
      handed to ``set_extra_state``; it is never resharded, and must be equal
      on all ranks that hold it.

    Args:
        model: the module (wrapped or not).
        layout: ``layout(fqn, tensor) -> ShardedTensor | list | None``, called
            with the canonical fqn; the ShardedTensors it returns are named
            relative to the adapter (the parameter's fqn, or the canonical
            tensors it is a view of).

    Raises:
        ShardingError: at save, a ``state_dict()`` entry that is not a tensor.
    """

    def __init__(self, model: nn.Module, *, layout: Layout | None = None):
        self.model = model
        self.layout = layout

    def shards(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        """How ``t`` (named by its canonical ``fqn``) is described in the tree."""
        if self.layout is not None:
            out = self.layout(fqn, t)
            if out is not None:
                return [out] if isinstance(out, ShardedTensor) else list(out)
        if is_dtensor(t):
            from .dtensor import dtensor_shards

            return dtensor_shards(fqn, t)
        return [ShardedTensor(fqn, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(canonical fqn, parameter)`` of every parameter of the model."""
        params = list(self.model.named_parameters())
        names = canonical_names(self.model, [n for n, _ in params])
        return [(names[n], p) for n, p in params]

    def state_dict(self) -> dict[str, Any]:
        tensors: list[ShardedTensor] = []
        extra: list[ShardedObject] = []
        sd = self.model.state_dict()
        names = canonical_names(self.model, sd)
        for key, t in sd.items():
            fqn = names[key]
            if fqn.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
                extra.append(ShardedObject(fqn, t))
                continue
            if not isinstance(t, torch.Tensor):
                raise ShardingError(f"{fqn}: state_dict entry of type {type(t).__name__}")
            tensors.extend(self.shards(fqn, t))
        # no entry for an empty list: it would be saved as a common value that is not a key of
        # the module's state_dict, and on a rank that holds nothing (a pipeline stage without
        # parameters) one that the other ranks do not have
        out: dict[str, Any] = {"tensors": tensors} if tensors else {}
        if extra:
            out["extra_state"] = extra
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # tensors were filled in place; hand extra state to its modules
        if not sd.get("extra_state"):
            return
        names = canonical_names(self.model, self.model.state_dict())
        original = {fqn: key for key, fqn in names.items()}
        for ob in sd["extra_state"]:
            name = original.get(ob.key, ob.key)
            mod_name = name.rsplit(".", 1)[0] if "." in name else ""
            mod = self.model.get_submodule(mod_name)
            mod.set_extra_state(ob.value)
