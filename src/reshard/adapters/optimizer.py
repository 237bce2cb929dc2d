"""OptimizerState: optimizer state keyed by parameter fqn, never by position.

Saved names, relative to the adapter's position in the state tree (under
``"optim"``: ``optim.state.<param fqn>.<key>``, the tensor keys DCP's
``get_state_dict`` gives the same optimizer):

* ``state.{param_fqn}.{key}``: a state tensor (``exp_avg``,
  ``momentum_buffer``, an FP32 master weight, ...). Shaped like its parameter,
  it is sharded exactly like the parameter (same global shape, offsets,
  replica and flattened range); a 0-dim tensor (``step``) keeps its dtype and
  shape; a Python scalar is stored as an object. State of another shape
  (Adafactor's factored ``row_var`` [..., R, 1] / ``col_var`` [..., 1, C],
  per-row statistics, Shampoo-style preconditioners) is saved whole, as a
  replica, when the parameter is not sharded; for a sharded parameter the
  ``layout`` must declare it (else ShardingError naming the fqn and both
  shapes).
* ``param_group.{param_fqn}``: the hyperparameters of the parameter's group
  (``lr``, ``betas``, ...), for every parameter, ZeRO flat buffers included
  (one record per canonical tensor the buffer holds), restored by parameter
  name at load (:mod:`reshard.adapters.hyperparams`: ``hyperparams=`` says
  what happens when the optimizer's groups are partitioned otherwise). DCP
  keeps them by group position (``optim.param_groups``) instead.
* ``grad.{param_fqn}``: gradients, only with ``save_grads=True``;
  restored into ``.grad`` at load.

At load into a fresh optimizer that has never stepped, the state tensors are
created from the manifest (no dummy optimizer step). Parameters with no saved
state stay without state (a model-only checkpoint leaves the optimizer as
constructed); ``LoadResult.notes`` lists them under ``params_without_state``
below the adapter's path (``optim.params_without_state``). State is looked up
by the saved (canonical) names only: after a re-layout (experts moved to
other ranks) a parameter's local name means nothing.

**Step boundary.** A save refuses (CheckpointError) only when gradients were
accumulated since the optimizer's last ``step()`` (:mod:`reshard.adapters.grads`):
gradients left over after ``step()`` were consumed and block nothing, so
``zero_grad(); backward(); step(); save()`` saves. To save in the middle of
gradient accumulation, pass ``save_grads=True``: the partial gradients are
saved and restored into ``.grad`` at load, so the accumulation resumes where it
stopped (at the same layout; they are sharded like their parameters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ShardingError
from ..ondisk.manifest import Manifest
from ..state.sharding import ShardedObject, ShardedTensor, torch_dtype
from ..state.tree import is_dtensor
from .grads import accumulated_since_step
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
        save_grads: save non-zero gradients too (a save in the middle of
            gradient accumulation). Without it, saving while a parameter holds
            nonzero gradients accumulated since the last ``step()`` raises
            CheckpointError; gradients consumed by ``step()`` block nothing.
        hyperparams: ``"error"`` (default), ``"saved"`` or ``"current"``: what
            a load does when a param group holds parameters saved with
            different hyperparameters (:mod:`reshard.adapters.hyperparams`).

    Raises:
        ValueError: an unknown ``hyperparams`` rule.
    """

    #: format version 1 named the state ``optim.state.{fqn}.{key}`` wherever the adapter sat
    _reshard_v1_names = (("optim.", ""),)

    def __init__(self, model: nn.Module | ModelState, optimizer: torch.optim.Optimizer, *,
                 layout: OptimLayout | None = None, save_grads: bool = False,
                 hyperparams: HyperparamRule = "error"):
        self.model_state = model if isinstance(model, ModelState) else ModelState(model)
        self.optimizer = optimizer
        self.layout = layout
        self.save_grads = save_grads
        self.hyperparams = check_rule(hyperparams)
        self._saved_groups: frozenset[str] = frozenset()  # param_group names this load restores
        self._dcp_groups = False  # this load restores DCP's param_groups (by group position)
        self._model_only = False  # this load reads model weights alone (a Hugging Face directory)
        #: id(flat param) -> the canonical tensors its state names (layout-named parameters)
        self._flat_names: dict[int, list[str]] = {}
        self._loading = False
        self._load_grads: frozenset[str] = frozenset()  # params whose saved grad this load restores
        #: state and gradient destinations a load created (id(param) -> ...), installed into the
        #: optimizer and the parameters only by load_state_dict: a load refused before any
        #: target is written leaves a fresh optimizer fresh
        self._pending: dict[int, dict[str, Any]] = {}
        self._pending_grads: dict[int, torch.Tensor] = {}
        self.params_without_state: tuple[str, ...] = ()

    # -- naming
    def _fqns(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model_state.named_parameters()}

    def _params(self) -> list[tuple[str | None, torch.Tensor, dict[str, Any]]]:
        names = self._fqns()
        # ModelState(trainable_only=True): the state of trainable parameters only
        frozen = self.model_state.trainable_only
        out = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if frozen and not p.requires_grad:
                    continue
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
    def _sharded(self, fqn: str, p: torch.Tensor, views: list[ShardedTensor]) -> bool:
        """Whether parameter ``fqn`` is sharded (or fused): anything but one
        view holding the whole tensor."""
        if is_dtensor(p) and any(not pl.is_replicate() for pl in p.placements):  # type: ignore[attr-defined]
            return True
        lp = _local(p)
        return not (len(views) == 1 and views[0].flattened_range is None
                    and tuple(views[0].global_shape) == tuple(lp.shape)
                    and views[0].data.shape == lp.shape)

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
            if not self._sharded(fqn, p, views):  # saved whole: a replica like its parameter
                return [ShardedTensor(names[views[0].fqn], lv, global_shape=tuple(lv.shape),
                                      global_offset=(0,) * lv.dim(), replica_id=views[0].replica_id)]
            gshape = tuple(views[0].global_shape) if len(views) == 1 else [tuple(w.global_shape) for w in views]
            raise ShardingError(
                f"{name}: optimizer state of shape {tuple(lv.shape)} is not shaped like its parameter "
                f"{fqn!r} (local shape {tuple(lp.shape)}, global shape {gshape}), and the parameter is "
                "sharded, so the state's sharding cannot be derived: declare it with "
                "OptimizerState(..., layout=...) (see OptimLayout)")
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

    def _covered(self, fqn: str | None, p: torch.Tensor, sts: list[ShardedTensor], key: str) -> list[str]:
        """The saved names a parameter's state is kept under: its bases, or for a
        layout-named parameter (ZeRO flat buffer) the canonical tensors its
        state tensors name (``state.{name}.{key}``)."""
        if fqn is not None:
            return self._bases(fqn, p)
        tail = f".{key}"
        return [st.fqn[len("state."):-len(tail)] for st in sts
                if st.fqn.startswith("state.") and st.fqn.endswith(tail)]

    def state_dict(self) -> dict[str, Any]:
        tensors: list[ShardedTensor] = []
        objects: list[ShardedObject] = []
        accumulating: list[str] = []
        # the load-time view is taken once, right after reshard_prepare_load: a load
        # that fails before load_state_dict must not disable the check of a later save
        loading, self._loading = self._loading, False
        if not loading:  # what a refused load created is not this optimizer's
            self._pending, self._pending_grads = {}, {}
            self._model_only = False
        elif self._model_only:
            return {}
        for fqn, p, g in self._params():
            bases = self._bases(fqn, p) if fqn is not None else []
            state = self.optimizer.state.get(p) or (self._pending.get(id(p), {}) if loading else {})
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    sts = self._state_tensors(fqn, p, key, v)
                    tensors.extend(sts)
                    if fqn is None:
                        bases.extend(self._covered(None, p, sts, key))
                else:
                    objects.extend(ShardedObject(self._name(b, key), v) for b in bases)
            if fqn is None:  # for load_state_dict: a layout is called once per walk
                self._flat_names[id(p)] = list(dict.fromkeys(bases))
            hp = group_hyperparams(g)
            if not (loading and self._dcp_groups):
                objects.extend(ShardedObject(f"param_group.{b}", hp) for b in dict.fromkeys(bases))
            grad = self._pending_grads.get(id(p), p.grad) if loading else p.grad
            if loading:
                if fqn in self._load_grads and grad is not None:
                    tensors.extend(self._state_tensors(fqn, p, "grad", grad, name=f"grad.{fqn}"))
            elif grad is not None and (self.save_grads or accumulated_since_step(self.optimizer, p)):
                if not self.save_grads:
                    accumulating.append(fqn or "<unnamed>")
                elif fqn is not None and bool(_local(grad).count_nonzero()):
                    tensors.extend(self._state_tensors(fqn, p, "grad", grad, name=f"grad.{fqn}"))
        if accumulating:
            raise CheckpointError(
                f"parameters {accumulating[:5]} hold gradients accumulated since the optimizer's "
                "last step(): saving in the middle of gradient accumulation is not a step boundary "
                "(step first; or pass OptimizerState(..., save_grads=True) to save the partial "
                "gradients and resume the accumulation)")
        # no entry for an empty list (a common value only the ranks without state would have)
        out: dict[str, Any] = {k: v for k, v in (("state", tensors), ("objects", objects)) if v}
        if loading and self._dcp_groups:
            out["param_groups"] = None  # one value: DCP's groups, by position (regrouped at load)
        return out

    # -- loading
    def reshard_prepare_load(self, m: Manifest) -> dict[str, Any]:
        """Create the state of parameters that have saved state but none yet.
        ``m`` is the manifest as seen from this adapter (names relative to it)."""
        self._loading = True
        self._pending, self._pending_grads = {}, {}
        self._model_only = model_only(m)
        if self._model_only:  # model weights alone: nothing of the optimizer's is asked for
            self._saved_groups, self._dcp_groups, self._load_grads = frozenset(), False, frozenset()
            self.params_without_state = ()
            return {}
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
        self._saved_groups = frozenset(n for n in m.objects if n.startswith("param_group."))
        self._dcp_groups = dcp_param_groups_saved(m)
        # saved gradients (save_grads=True) are restored: allocate a destination
        gpre = "grad."
        grads = {n[len(gpre):] for n in m.tensors if n.startswith(gpre)}
        with_grad: set[str] = set()
        for fqn, p, _ in self._params() if grads else ():
            if fqn is not None and set(self._bases(fqn, p)) & grads:
                with_grad.add(fqn)
                if p.grad is None:
                    self._pending_grads[id(p)] = torch.zeros_like(p)
        self._load_grads = frozenset(with_grad)
        without: list[str] = []
        for fqn, p, _ in self._params():
            if self.optimizer.state.get(p):
                continue
            st: dict[str, Any] = {}  # entered into the optimizer by load_state_dict
            if fqn is None:  # a layout-named parameter (ZeRO flat buffer): every saved key
                if keys:
                    self._pending[id(p)] = st
                for key, te in keys.items():
                    st[key] = self._new_state(None, p, te)
                continue
            # by the saved (canonical) names only: after a re-layout the local fqn may be
            # the saved name of another parameter (experts moved to other ranks)
            entries: dict[str, Any] = {}
            bases = self._bases(fqn, p)
            for b in bases:
                entries.update(saved.get(b) or {})
            if not entries:
                without.extend(bases)
                continue
            self._pending[id(p)] = st
            for key, te in entries.items():
                st[key] = None if te is None else self._new_state(fqn, p, te)
            for key in [k for k, v in st.items() if v is None]:
                st[key] = 0  # placeholder for a scalar object, replaced at load
        self.params_without_state = tuple(without)
        return {"params_without_state": list(without)} if without else {}

    def _new_state(self, fqn: str | None, p: torch.Tensor, te: Any) -> torch.Tensor:
        """A destination for saved state ``te`` of parameter ``p``: shaped like
        the parameter's local tensor when the saved tensor is shaped like the
        parameter; the saved shape where the parameter is whole; for a
        statistic reduced over some dims with keepdim (Adafactor's
        ``row_var`` [R, 1]) of a sharded parameter, the parameter's local
        extent along the dims kept; otherwise like the parameter (the load
        then reports the shape mismatch).
        """
        dtype = torch_dtype(te.dtype)
        lp = _local(p)
        gshape = tuple(te.global_shape)
        if len(gshape) == 0:
            return torch.zeros((), dtype=dtype, device=lp.device)
        if fqn is None:  # a layout-named flat buffer: its state is shaped like it
            return torch.zeros_like(p, dtype=dtype)
        views = self.model_state.shards(fqn, lp)
        pshape = tuple(p.shape) if is_dtensor(p) else tuple(views[0].global_shape)
        if gshape == pshape:
            return torch.zeros_like(p, dtype=dtype)
        if not self._sharded(fqn, p, views):
            return torch.zeros(gshape, dtype=dtype, device=lp.device)
        if (len(views) == 1 and views[0].flattened_range is None and len(gshape) == len(pshape)
                and all(g in (1, d) for g, d in zip(gshape, pshape, strict=True))):
            local = tuple(1 if g == 1 and d != 1 else ld
                          for g, d, ld in zip(gshape, pshape, lp.shape, strict=True))
            return torch.zeros(local, dtype=dtype, device=lp.device)
        # anything else is allocated like the parameter: the load then names the
        # tensor and both shapes (a checkpoint of another model, or state whose
        # sharding only an existing optimizer state can show)
        return torch.zeros_like(p, dtype=dtype)

    def _param_names(self) -> dict[int, list[str]]:
        """``id(param) -> the saved names it is kept under`` (its bases; for a
        ZeRO flat buffer the canonical tensors its state named in state_dict())."""
        return {id(p): list(dict.fromkeys(self._bases(fqn, p) if fqn is not None
                                          else self._flat_names.get(id(p), [])))
                for fqn, p, _ in self._params()}

    def _hyperparams(self, objects: Any) -> dict[str, dict[str, Any]]:
        pre = "param_group."
        return {k[len(pre):]: v for k, v in objects
                if k.startswith(pre) and k in self._saved_groups}  # not requests left as they were

    def reshard_check_load(self, objects: dict[str, Any]) -> dict[str, Any]:
        """Before any target is written: raise what restoring the saved
        hyperparameters would raise (``objects``: this adapter's loaded
        objects by relative key); returns the notes of the values a restore
        replaces (``hyperparams_restored``)."""
        hparams = self._hyperparams(objects.items())
        if self._dcp_groups and objects.get("param_groups") is not None:  # DCP's, by group position
            hparams.update(hyperparams_from_dcp(objects["param_groups"], where="OptimizerState"))
        return restore_hyperparams(self.optimizer, self._param_names(), hparams, self.hyperparams,
                                   where="OptimizerState", check_only=True)

    def reshard_before_load(self, peers: list[Any]) -> None:
        """Before any Stateful's ``load_state_dict``: note the constructed
        per-group lists of this optimizer's LR schedulers among ``peers``."""
        self._sched_constructed = snapshot_schedulers(self.optimizer, peers)

    def reshard_finish_load(self, peers: list[Any]) -> None:
        """After every Stateful of the load: the LR schedulers of this
        optimizer among ``peers`` hold one entry per current param group
        (:func:`~reshard.adapters.hyperparams.fit_schedulers`); under
        ``hyperparams="current"`` they continue from the constructed rates."""
        got, self._sched_constructed = getattr(self, "_sched_constructed", {}), {}
        fit_schedulers(self.optimizer, peers, self.hyperparams, got, where="OptimizerState")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._loading = False
        if self._model_only:  # a model-only load leaves the optimizer as it is
            self._model_only = False
            return
        for _fqn, p, _ in self._params():  # what this load created, now filled
            if id(p) in self._pending:
                self.optimizer.state[p] = self._pending[id(p)]
            if id(p) in self._pending_grads:
                p.grad = self._pending_grads[id(p)]
        self._pending, self._pending_grads = {}, {}
        names = self._param_names()
        by_name: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
        for _fqn, p, g in self._params():
            for b in names[id(p)]:
                by_name.setdefault(b, (p, g))
        objs = sd.get("objects", [])
        hparams = self._hyperparams((ob.key, ob.value) for ob in objs)
        for ob in objs:
            if ob.key.startswith("state."):
                fqn, _, key = ob.key[len("state."):].rpartition(".")
                self.optimizer.state[by_name[fqn][0]][key] = ob.value
        if self._dcp_groups:
            self._dcp_groups = False
            hparams.update(hyperparams_from_dcp(sd.get("param_groups"), where="OptimizerState"))
        restore_hyperparams(self.optimizer, names, hparams, self.hyperparams, where="OptimizerState")
