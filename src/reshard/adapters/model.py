"""ModelState: a module's parameters and persistent buffers, keyed by fqn."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from ..state.kinds import Tree, Where, handler_for, is_plain_tensor
from ..state.sharding import ShardedObject, ShardedTensor
from ..state.tree import is_dtensor
from .names import canonical_names, canonical_parameters

#: ``layout(fqn, tensor)`` -> the ShardedTensor(s) describing this rank's
#: ``tensor`` (several views of one local buffer for fused layouts), or None
#: for the default (DTensor as is, plain tensor replicated).
Layout = Callable[[str, torch.Tensor], "ShardedTensor | list[ShardedTensor] | None"]

EXTRA_STATE_SUFFIX = "_extra_state"
#: the common value under which ``ModelState(trainable_only=True)`` records the base's identity
BASE_KEY = "_reshard_base"


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

    * A tensor subclass (a quantized or float8 weight) that ``layout`` does not
      describe stands at its own key, saved and loaded as the handler
      registered for its type says (:mod:`reshard.state.kinds`); without one
      the save or load is refused, naming its key and type.

    * A DTensor is saved as its placements say; a plain tensor is a replica
      (identical on every rank) unless ``layout`` describes its sharding.
    * Tied weights (two names, one tensor) are stored once with an alias
      record; a model whose config claims tying but whose tensors differ is
      saved as two tensors.
    * Opaque extra state (``get_extra_state``) is stored as an object of the
      size recorded at save; at load it is allocated from the checkpoint and
      handed to ``set_extra_state``; it is never resharded, and must be equal
      on all ranks that hold it.

    * ``trainable_only=True`` (adapters on a frozen base: LoRA/PEFT): only
      parameters with ``requires_grad`` are saved (an ``OptimizerState`` over
      this adapter then saves their state only), with the identity of the
      base they were trained on: every other ``state_dict`` entry's dtype,
      global shape and a layout-independent digest of its elements
      (:mod:`reshard.adapters.peft`; one gather and one broadcast on
      ``group``, at every save and load). A load into a model whose base
      differs (another tensor, value, dtype or shape) is refused, before any
      target is written, with one line naming what differs.

    Args:
        model: the module (wrapped or not).
        layout: ``layout(fqn, tensor) -> ShardedTensor | list | None``, called
            with the canonical fqn; the ShardedTensors it returns are named
            relative to the adapter (the parameter's fqn, or the canonical
            tensors it is a view of). For LoRA weights on a tensor-parallel
            base, :func:`reshard.adapters.peft.lora_layout` applies the rule.
        trainable_only: save the trainable parameters and the base's
            identity only (see above).
        group: the process group of the base identity's collectives (default:
            the default group); only with ``trainable_only``.

    Raises:
        ShardingError: at save, a ``state_dict()`` entry that is not a tensor;
            a tensor subclass no handler takes (at save and load).
        CheckpointError: at load with ``trainable_only``, a checkpoint trained
            on another base, or one that records no base identity.
    """

    def __init__(self, model: nn.Module, *, layout: Layout | None = None, trainable_only: bool = False,
                 group: Any = None):
        self.model = model
        self.layout = layout
        self.trainable_only = trainable_only
        self.group = group
        self._sums: dict[Any, tuple[int, int]] = {}
        self._identity: dict[str, Any] | None = None  # computed by a load's prepare hook

    def shards(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        """How ``t`` (named by its canonical ``fqn``) is described in the tree."""
        got = self._laid_out(fqn, t)
        return got if got is not None else self._default_shards(fqn, t)

    def _laid_out(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor] | None:
        """What ``layout`` says of ``t``; None: the default."""
        out = self.layout(fqn, t) if self.layout is not None else None
        if out is None:
            return None
        return [out] if isinstance(out, ShardedTensor) else list(out)

    def _default_shards(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        if is_dtensor(t):
            from .dtensor import dtensor_shards

            return dtensor_shards(fqn, t)
        return [ShardedTensor(fqn, t, global_shape=tuple(t.shape), global_offset=(0,) * t.dim())]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(canonical fqn, parameter)`` of every parameter of the model."""
        return canonical_parameters(self.model)

    def trainable(self) -> set[str]:
        """Canonical fqns of the parameters that require gradients."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def base_identity(self) -> dict[str, Any]:
        """The identity of the base (every ``state_dict`` entry that is not a
        trainable parameter), equal on every rank of ``group``; collective
        (:func:`reshard.adapters.peft.base_identity`)."""
        from ..collectives import timed_collectives
        from ..options import DEFAULT_TIMEOUT_S
        from .peft import base_identity

        sd = self.model.state_dict()
        names = canonical_names(self.model, sd)
        keep = self.trainable()
        chunks = [st for key, t in sd.items() if isinstance(t, torch.Tensor) and names[key] not in keep
                  and names[key].rsplit(".", 1)[-1] != EXTRA_STATE_SUFFIX
                  for st in self._identity_shards(names[key], t)]
        coll = timed_collectives(self.group, DEFAULT_TIMEOUT_S)
        if not any(is_dtensor(t) for t in sd.values()) and self.layout is None:
            # a plain base is replicated: the coordinator alone hashes it
            chunks = chunks if coll.rank == 0 else []
        return base_identity(chunks, coll, self._sums)

    def reshard_prepare_load(self, m: Any) -> None:
        """With ``trainable_only``: refuse a checkpoint trained on another
        base before anything is written (every rank computes the same
        identity, so every rank refuses)."""
        if not self.trainable_only:
            return
        from ..ondisk import codec
        from .peft import differences, refuse

        saved_raw = (m.values or {}).get(BASE_KEY) if isinstance(m.values, dict) else None
        if saved_raw is None:
            raise refuse("ModelState(trainable_only=True)", "the checkpoint records no base identity "
                         "(it was not saved with trainable_only=True)")
        saved = codec.from_json(saved_raw)
        self._identity = self.base_identity()
        why = differences(saved, self._identity)
        if why is not None:
            raise refuse("ModelState(trainable_only=True)", why)

    def _identity_shards(self, fqn: str, t: torch.Tensor) -> list[ShardedTensor]:
        """The chunks that base tensor ``t`` adds to the base's identity: as
        :meth:`shards` describes it, or, for a tensor subclass, the plain
        tensors that the handler registered for its type saves
        (:mod:`reshard.state.kinds`: a ``Tree`` of a plain tensor, or of a
        mapping of plain tensors and ``ShardedTensor`` chunks), never its raw
        storage.

        Raises:
            ShardingError: a subclass no handler takes, or one whose handler
                saves something else (its key and type named).
        """
        got = self._laid_out(fqn, t)
        if got is not None or is_plain_tensor(t) or is_dtensor(t):
            return got if got is not None else self._default_shards(fqn, t)
        handler = handler_for(t)  # a subclass without a handler: the refusal, which raises
        at = Where(key=fqn, container="", loading=False, module_adapter=type(self))
        form = handler.save(t, at) if handler is not None else None
        sub = form.subtree if isinstance(form, Tree) else None
        out: list[ShardedTensor] = []
        for k, v in (sub.items() if isinstance(sub, Mapping) else [("", sub)]):
            if isinstance(v, ShardedTensor) and is_plain_tensor(v.data):
                out.append(replace(v, fqn=f"{fqn}.{v.fqn}"))  # named below the leaf, as the walk names it
            elif isinstance(v, torch.Tensor) and is_plain_tensor(v):
                out.extend(self._default_shards(f"{fqn}.{k}" if k else fqn, v))
            else:
                raise ShardingError(
                    f"{fqn}: the identity of the base (trainable_only) cannot be computed for a "
                    f"{type(t).__qualname__}: the handler {getattr(handler, 'name', None)!r} saves it as "
                    f"{type(sub).__name__}, not plain tensors or a mapping of them")
        return out

    def state_dict(self) -> dict[str, Any]:
        tensors: list[ShardedTensor] = []
        extra: list[ShardedObject] = []
        own: dict[str, torch.Tensor] = {}
        sd = self.model.state_dict()
        names = canonical_names(self.model, sd)
        keep = self.trainable() if self.trainable_only else None
        for key, t in sd.items():
            fqn = names[key]
            if keep is not None and fqn not in keep:
                continue
            if fqn.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
                extra.append(ShardedObject(fqn, t))
                continue
            if not isinstance(t, torch.Tensor):
                raise ShardingError(f"{fqn}: state_dict entry of type {type(t).__name__}")
            got = self._laid_out(fqn, t)
            if got is None and not is_plain_tensor(t) and not is_dtensor(t):
                # a tensor subclass (a quantized weight) stands at its own key: the handler
                # registered for its type says what it is (reshard.state.kinds), or the walk refuses it
                own[fqn] = t
                continue
            tensors.extend(got if got is not None else self._default_shards(fqn, t))
        # no entry for an empty list: it would be saved as a common value that is not a key of
        # the module's state_dict, and on a rank that holds nothing (a pipeline stage without
        # parameters) one that the other ranks do not have
        out: dict[str, Any] = {"tensors": tensors} if tensors else {}
        if extra:
            out["extra_state"] = extra
        clash = sorted(own.keys() & {"tensors", "extra_state", BASE_KEY})
        if clash:
            raise ShardingError(f"{clash[0]}: a tensor subclass under a name ModelState gives its own "
                                "entries; rename that parameter or buffer")
        out.update(own)
        if keep is not None:  # a load's prepare hook computed it already (one collective per load)
            ident, self._identity = self._identity, None
            out[BASE_KEY] = ident if ident is not None else self.base_identity()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # tensors were filled in place; hand extra state to its modules
        sd = {k: v for k, v in sd.items() if k != BASE_KEY}  # checked before anything was written
        if not sd.get("extra_state"):
            return
        names = canonical_names(self.model, self.model.state_dict())
        original = {fqn: key for key, fqn in names.items()}
        for ob in sd["extra_state"]:
            name = original.get(ob.key, ob.key)
            mod_name = name.rsplit(".", 1)[0] if "." in name else ""
            mod = self.model.get_submodule(mod_name)
            mod.set_extra_state(ob.value)
