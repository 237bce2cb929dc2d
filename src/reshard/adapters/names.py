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


def _wrapper_attr(mod: Any) -> str | None:
    """The attribute through which wrapper ``mod`` holds the wrapped module."""
    if isinstance(mod, nn.parallel.DistributedDataParallel):
        return "module"
    dyn = sys.modules.get("torch._dynamo.eval_frame")
    opt = getattr(dyn, "OptimizedModule", None) if dyn is not None else None
    if opt is not None and isinstance(mod, opt):
        return "_orig_mod"
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    fsdp_cls = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    if fsdp_cls is not None and isinstance(mod, fsdp_cls):
        return "_fsdp_wrapped_module"
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
