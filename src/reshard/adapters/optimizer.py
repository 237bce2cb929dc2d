"""OptimizerState: optimizer state keyed by parameter fqn, never by position.

Saved names, relative to the adapter's position in the state tree (under
``"optim"``: ``optim.state.<param fqn>.<key>``, the keys DCP's
``get_state_dict`` gives the same optimizer):

* ``state.{param_fqn}.{key}``: a state tensor (``exp_avg``,
  ``momentum_buffer``, an FP32 master weight, ...). Shaped like its parameter,
  it is sharded exactly like the parameter (same global shape, offsets,
  replica and flattened range); a 0-dim tensor (``step``) keeps its dtype and
  shape; a Python scalar is stored as an object.
* ``param_group.{param_fqn}``: the hyperparameters of the parameter's
  group (``lr``, ``betas``, ...), restored by parameter name at load.
* ``grad.{param_fqn}``: gradients, only with ``save_grads=True``;
  restored into ``.grad`` at load.

At load into a fresh optimizer that has never stepped, the state tensors are
created from the manifest (no dummy optimizer step). Parameters with no saved
state stay without state; ``LoadResult.notes["params_without_state"]``
lists them (``optim.params_without_state`` under ``"optim"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ShardingError
from ..manifest import Manifest
from ..sharding import ShardedObject, ShardedTensor, torch_dtype
from ..tree import is_dtensor
from .model import ModelState

#: ``layout(param_fqn | None, param, key, value)`` -> ShardedTensor(s) for a
#: state tensor whose sharding differs from its parameter's (ZeRO flat
#: buffers), or None for the default.
OptimLayout = Callable[[str | None, torch.Tensor, str, torch.Tensor],
                       "ShardedTensor | list[ShardedTensor] | None"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


class OptimizerState:
    """Stateful adapter for a ``torch.optim.Optimizer``.

    Args:
        model: the module (or its ModelState, whose layout then also shards
            the optimizer state) that names the parameters.
        optimizer: any optimizer whose per-parameter state is tensors shaped
            like the parameter plus scalars (Adam/AdamW, SGD, ...).
        layout: see :data:`OptimLayout` (ZeRO-1: replicated parameters, state
            flat-sharded over DP with ``flattened_range``); the ShardedTensors
            it returns are named relative to the adapter
            (``state.{param_fqn}.{key}``).
        save_grads: save non-zero gradients too. Without it, saving while a
            parameter holds a non-zero gradient (gradient accumulation in
            progress: not a step boundary) raises CheckpointError.
    """

    #: format version 1 named the state ``optim.state.{fqn}.{key}`` wherever the adapter sat
    _reshard_v1_names = (("optim.", ""),)

    def __init__(self, model: nn.Module | ModelState, optimizer: torch.optim.Optimizer, *,
                 layout: OptimLayout | None = None, save_grads: bool = False):
        self.model_state = model if isinstance(model, ModelState) else ModelState(model)
        self.optimizer = optimizer
        self.layout = layout
        self.save_grads = save_grads
        self._loading = False
        self._load_grads: frozenset[str] = frozenset()  # params whose saved grad this load restores
        self.params_without_state: tuple[str, ...] = ()

    # -- naming
    def _fqns(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model_state.named_parameters()}

    def _params(self) -> list[tuple[str | None, torch.Tensor, dict[str, Any]]]:
        names = self._fqns()
        out = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                fqn = names.get(id(p))
                if fqn is None and self.layout is None:
                    raise ShardingError("an optimizer parameter is not a parameter of the model; "
                                        "pass a layout that names its state")
                out.append((fqn, p, g))
        return out

    def _name(self, fqn: str, key: str) -> str:
        return f"state.{fqn}.{key}"

    @staticmethod
    def _view_fqn(view_fqn: str) -> str:
        """A model view's fqn (the parameter's own fqn unless the model layout
        renamed it)."""
        return view_fqn

    def _bases(self, fqn: str, p: torch.Tensor) -> list[str]:
        """The names under which parameter ``fqn``'s state is saved: its own,
        or those of the views a model layout declares (fused [q; k; v])."""
        return list(dict.fromkeys(self._view_fqn(sh.fqn)
                                  for sh in self.model_state.shards(fqn, _local(p)))) or [fqn]

    def _rename(self, name: str, fqn: str, view_fqn: str) -> str:
        """``name`` (of the state of parameter ``fqn``) for the view ``view_fqn``."""
        base = self._view_fqn(view_fqn)
        if base == fqn:
            return name
        head, sep, tail = name.rpartition(f".{fqn}.")
        if sep:  # f"state.{fqn}.{key}"
            return f"{head}.{base}.{tail}"
        assert name.endswith(f".{fqn}")  # f"grad.{fqn}"
        return name[:-len(fqn)] + base

    # -- describing state
    def _state_tensors(self, fqn: str | None, p: torch.Tensor, key: str, v: torch.Tensor,
                       name: str | None = None) -> list[ShardedTensor]:
        if self.layout is not None:
            out = self.layout(fqn, p, key, v)
            if out is not None:
                return [out] if isinstance(out, ShardedTensor) else list(out)
        if fqn is None:
            raise ShardingError(f"state {key!r} of an unnamed optimizer parameter: layout returned None")
        name = name or self._name(fqn, key)
        if is_dtensor(v):
            from .dtensor import dtensor_shards

            return dtensor_shards(name, v)
        lp, lv = _local(p), v
        views = self.model_state.shards(fqn, lp)
        # a model layout may name the parameter's views (fused [q; k; v], a renamed
        # expert tensor): the state of each view is named after the view
        names = {sh.fqn: self._rename(name, fqn, sh.fqn) for sh in views}
        if v.dim() == 0:
            return [ShardedTensor(n, v, global_shape=(), global_offset=()) for n in dict.fromkeys(names.values())]
        if tuple(lv.shape) != tuple(lp.shape):
            raise ShardingError(f"{name}: state of shape {tuple(lv.shape)} is not shaped like its "
                                f"parameter {tuple(lp.shape)}; pass a layout for it")
        out = []
        for sh in views:
            name = names[sh.fqn]
            if sh.data.shape == lp.shape and sh.data.storage_offset() == lp.storage_offset():
                data = lv
            else:
                if lv.stride() != lp.stride():
                    lv = lv.contiguous()
                    if lv.stride() != lp.stride():
                        raise ShardingError(f"{name}: cannot map the parameter's views onto its state")
                data = lv.as_strided(sh.data.shape, sh.data.stride(),
                                     lv.storage_offset() + sh.data.storage_offset() - lp.storage_offset())
            out.append(dataclasses.replace(sh, fqn=name, data=data))
        return out

    def state_dict(self) -> dict[str, Any]:
        tensors: list[ShardedTensor] = []
        objects: list[ShardedObject] = []
        accumulating: list[str] = []
        # the load-time view is taken once, right after reshard_prepare_load: a load
        # that fails before load_state_dict must not disable the check of a later save
        loading, self._loading = self._loading, False
        for fqn, p, g in self._params():
            bases = self._bases(fqn, p) if fqn is not None else []
            for key, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors.extend(self._state_tensors(fqn, p, key, v))
                else:
                    objects.extend(ShardedObject(self._name(b, key), v) for b in bases)
            hp = {k: v for k, v in g.items() if k != "params"}
            objects.extend(ShardedObject(f"param_group.{b}", hp) for b in bases)
            grad = p.grad
            if loading:
                if fqn in self._load_grads and grad is not None:
                    tensors.extend(self._state_tensors(fqn, p, "grad", grad,
                                                       name=f"grad.{fqn}"))
            elif grad is not None and bool(_local(grad).count_nonzero()):
                if not self.save_grads:
                    accumulating.append(fqn or "<unnamed>")
                elif fqn is not None:
                    tensors.extend(self._state_tensors(fqn, p, "grad", grad,
                                                       name=f"grad.{fqn}"))
        if accumulating:
            raise CheckpointError(
                f"parameters {accumulating[:5]} hold gradients: saving in the middle of gradient "
                "accumulation is not a step boundary (step and zero_grad first, or pass "
                "OptimizerState(..., save_grads=True))")
        # no entry for an empty list (a common value only the ranks without state would have)
        return {k: v for k, v in (("state", tensors), ("objects", objects)) if v}

    # -- loading
    def reshard_prepare_load(self, m: Manifest) -> dict[str, Any]:
        """Create the state of parameters that have saved state but none yet."""
        self._loading = True
        pre = "state."
        saved: dict[str, dict[str, Any]] = {}
        keys: dict[str, Any] = {}
        fqn: str | None  # a saved name's owner here; None below for layout-named parameters
        for name, te in m.tensors.items():
            if name.startswith(pre):
                fqn, _, key = name[len(pre):].rpartition(".")
                saved.setdefault(fqn, {})[key] = te
                keys.setdefault(key, te)
        for name in m.objects:
            if name.startswith(pre):
                fqn, _, key = name[len(pre):].rpartition(".")
                saved.setdefault(fqn, {})[key] = None
        for name, target in m.aliases.items():  # e.g. the one `step` of a fused [q; k; v]
            if name.startswith(pre) and target in m.tensors:
                fqn, _, key = name[len(pre):].rpartition(".")
                saved.setdefault(fqn, {}).setdefault(key, m.tensors[target])
        # saved gradients (save_grads=True) are restored: allocate a destination
        gpre = "grad."
        grads = {n[len(gpre):] for n in m.tensors if n.startswith(gpre)}
        with_grad: set[str] = set()
        for fqn, p, _ in self._params() if grads else ():
            if fqn is not None and ({fqn} | {self._view_fqn(sh.fqn) for sh in
                                             self.model_state.shards(fqn, _local(p))}) & grads:
                with_grad.add(fqn)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        self._load_grads = frozenset(with_grad)
        without: list[str] = []
        for fqn, p, _ in self._params():
            st = self.optimizer.state[p]
            if st:
                continue
            if fqn is None:  # a layout-named parameter (ZeRO flat buffer): every saved key
                for key, te in keys.items():
                    st[key] = self._new_state(p, te)
                continue
            entries = dict(saved.get(fqn) or {})
            for sh in self.model_state.shards(fqn, _local(p)):  # views a layout renamed
                entries.update(saved.get(self._view_fqn(sh.fqn)) or {})
            if not entries:
                without.append(fqn)
                continue
            for key, te in entries.items():
                st[key] = None if te is None else self._new_state(p, te)
            for key in [k for k, v in st.items() if v is None]:
                st[key] = 0  # placeholder for a scalar object, replaced at load
        self.params_without_state = tuple(without)
        return {"params_without_state": list(without)} if without else {}

    @staticmethod
    def _new_state(p: torch.Tensor, te: Any) -> torch.Tensor:
        dtype = torch_dtype(te.dtype)
        if len(te.global_shape) == 0:
            return torch.zeros((), dtype=dtype, device=_local(p).device)
        return torch.zeros_like(p, dtype=dtype)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._loading = False
        by_name = {b: (p, g) for fqn, p, g in self._params() if fqn is not None
                   for b in self._bases(fqn, p)}
        pre_state, pre_group = "state.", "param_group."
        for ob in sd.get("objects", []):
            if ob.key.startswith(pre_group):
                p, g = by_name[ob.key[len(pre_group):]]
                for k, v in ob.value.items():
                    g[k] = v
            elif ob.key.startswith(pre_state):
                fqn, _, key = ob.key[len(pre_state):].rpartition(".")
                self.optimizer.state[by_name[fqn][0]][key] = ob.value
