"""ModelState: a module's parameters and persistent buffers, keyed by fqn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..sharding import ShardedObject, ShardedTensor
from ..tree import is_dtensor

#: ``layout(fqn, tensor)`` -> the ShardedTensor(s) describing this rank's
#: ``tensor`` (several views of one local buffer for fused layouts), or None
#: for the default (DTensor as is, plain tensor replicated).
Layout = Callable[[str, torch.Tensor], "ShardedTensor | list[ShardedTensor] | None"]

EXTRA_STATE_SUFFIX = "_extra_state"


class ModelState:
    """Stateful adapter for an ``nn.Module``.

    Saved keys are exactly the keys of ``module.state_dict()`` (so buffers
    registered ``persistent=False`` are not saved and keep their constructed
    value), prefixed by ``prefix``. Parameters and buffers are filled in place
    at load.

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
        model: the module.
        layout: ``layout(fqn, tensor) -> ShardedTensor | list | None``.
        prefix: prepended to every fqn (e.g. "student.").
    """

    def __init__(self, model: nn.Module, *, layout: Layout | None = None, prefix: str = ""):
        self.model = model
        self.layout = layout
        self.prefix = prefix

    def shards(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        """How ``t`` (named ``fqn`` without prefix) is described in the tree."""
        if self.layout is not None:
            out = self.layout(fqn, t)
            if out is not None:
                return [out] if isinstance(out, ShardedTensor) else list(out)
        if is_dtensor(t):
            from .dtensor import dtensor_shards

            return dtensor_shards(self.prefix + fqn, t)
        return [ShardedTensor(self.prefix + fqn, t, global_shape=tuple(t.shape),
                              global_offset=(0,) * t.dim())]

    def state_dict(self) -> dict[str, Any]:
        tensors: list[ShardedTensor] = []
        extra: list[ShardedObject] = []
        for fqn, t in self.model.state_dict().items():
            if fqn.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
                extra.append(ShardedObject(self.prefix + fqn, t))
                continue
            if not isinstance(t, torch.Tensor):
                raise ShardingError(f"{self.prefix}{fqn}: state_dict entry of type {type(t).__name__}")
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
        for ob in sd.get("extra_state", []):
            name = ob.key[len(self.prefix):]
            mod_name = name.rsplit(".", 1)[0] if "." in name else ""
            mod = self.model.get_submodule(mod_name)
            mod.set_extra_state(ob.value)
