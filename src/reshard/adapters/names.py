"""Canonical parameter names of wrapped modules.

A module wrapped by DDP (``module.``), FSDP1 (``_fsdp_wrapped_module.``),
activation checkpointing (``_checkpoint_wrapped_module.``) or
``torch.compile`` (``_orig_mod.``) names its parameters with the wrapper's
attribute in the path. The canonical fqn leaves those components out, as
``torch.distributed.checkpoint.state_dict`` does (``_get_fqns``: it walks the
name through the module tree and drops the component where the module at that
point is the wrapper), so a checkpoint of a wrapped model loads into the plain
one and back.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
_DDP = "module"
_COMPILED = "_orig_mod"
_FSDP1 = "_fsdp_wrapped_module"
#: components no model's own module is named: always a wrapper's
_WRAPPER_ONLY = frozenset({_CHECKPOINT_WRAPPED, _COMPILED, _FSDP1})


def _wrapper_attr(mod: Any) -> str | None:
    """The attribute through which wrapper ``mod`` holds the wrapped module."""
    if isinstance(mod, nn.parallel.DistributedDataParallel):
        return _DDP
    dyn = sys.modules.get("torch._dynamo.eval_frame")
    opt = getattr(dyn, "OptimizedModule", None) if dyn is not None else None
    if opt is not None and isinstance(mod, opt):
        return _COMPILED
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp_cls = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    if fsdp_cls is not None and isinstance(mod, fsdp_cls):
        return _FSDP1
    return None


def canonical_name(model: nn.Module, name: str) -> str:
    """``name`` (a key of ``model.state_dict()`` or of ``named_parameters()``)
    without the components that name a wrapper's inner module."""
    if "." not in name:
        return name
    parts = name.split(".")
    out: list[str] = []
    cur: Any = model
    for i, part in enumerate(parts):
        if part == _CHECKPOINT_WRAPPED:
            cur = getattr(cur, part, None)
            continue
        attr = _wrapper_attr(cur) if cur is not None else None
        if attr is not None and part == attr:
            cur = getattr(cur, attr, None)
            continue
        out.append(part)
        if i < len(parts) - 1 and cur is not None:
            cur = getattr(cur, part, None)
    return ".".join(out)


def canonical_names(model: nn.Module, names: Any) -> dict[str, str]:
    """``{name: canonical name}`` for ``names`` of ``model`` (cheap when the
    model has no wrapper: nothing is walked)."""
    if not any(_wrapper_attr(m) is not None or hasattr(m, _CHECKPOINT_WRAPPED)
               for m in model.modules()):
        return {n: n for n in names}
    return {n: canonical_name(model, n) for n in names}


def unwrapped_names(names: Any) -> dict[str, str]:
    """``{name: canonical name}`` for the saved ``names`` of one model when
    the module is not at hand (an export reads only the manifest of a saved
    ``ddp.state_dict()`` or ``torch.compile(m).state_dict()``): the
    components only a wrapper uses (``_orig_mod``, ``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``) are left out wherever they are, and a
    leading ``module`` (DDP's) when every name starts with it (a model's own
    submodule named ``module`` holds only some of its names).

    Raises:
        ValueError: two names that become the same (``_orig_mod.w`` and ``w``),
            naming both."""
    names = list(names)
    parts = {n: [c for c in n.split(".")[:-1] if c not in _WRAPPER_ONLY] + n.split(".")[-1:]
             for n in names}
    if names and all(len(p) > 1 and p[0] == _DDP for p in parts.values()):
        parts = {n: p[1:] for n, p in parts.items()}
    out = {n: ".".join(p) for n, p in parts.items()}
    seen: dict[str, str] = {}
    for n, c in out.items():
        if c in seen:
            raise ValueError(f"saved names {seen[c]!r} and {n!r} both name {c!r} once their "
                             "wrapper prefixes are left out")
        seen[c] = n
    return out


def canonical_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(canonical fqn, parameter)`` of every parameter of ``model``
    (:meth:`reshard.ModelState.named_parameters`)."""
    params = list(model.named_parameters())
    names = canonical_names(model, [n for n, _ in params])
    return [(names[n], p) for n, p in params]
