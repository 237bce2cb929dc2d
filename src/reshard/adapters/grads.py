"""Is the optimizer at a step boundary? Gradients seen by the last ``step()``.

A save in the middle of gradient accumulation would lose the partial sums,
so :class:`~reshard.OptimizerState` refuses it (unless ``save_grads=True``).
But gradients left over after ``step()`` (``zero_grad(); backward(); step();
save()``, the tutorial loop) were consumed by that step and block nothing.

One global optimizer step post-hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``) records, per parameter, which gradient
tensor the step consumed and its version counter (bumped by every in-place
accumulation). ``import reshard`` installs it as soon as
``torch.optim.optimizer`` is imported (at once when it already is; a
post-import hook of ``wrapt`` otherwise), so ``import reshard`` itself imports
no torch and still sees every step taken afterwards, whether or not the
script touched a reshard adapter before its first ``step()``. A gradient accumulated since the
last step is one that is not that tensor (a new one after ``zero_grad``) or
has another version (``backward`` added into it). Nonzero gradients of an
optimizer that never stepped since the import are accumulated.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_lock = threading.Lock()
#: optimizer -> {id(param): (weakref to the grad the last step consumed, its version)}
_seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[Any, int]]] = (
    weakref.WeakKeyDictionary())
#: the handle of the installed step post-hook (None until installed)
_handle: Any = None


def _local(t: torch.Tensor) -> torch.Tensor:
    # torch-free at import: a DTensor can only exist once its module is imported
    mod = sys.modules.get("torch.distributed.tensor")
    dt = getattr(mod, "DTensor", None) if mod is not None else None
    return t.to_local() if dt is not None and isinstance(t, dt) else t


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    rec: dict[int, tuple[Any, int]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if grad is not None:
                rec[id(p)] = (weakref.ref(grad), _local(grad)._version)
    with _lock:
        _seen[optimizer] = rec


def install(optimizer_module: ModuleType | None = None) -> None:
    """Install the step post-hook once (idempotent). ``optimizer_module`` is
    ``torch.optim.optimizer`` as handed over by the post-import hook that
    ``reshard/__init__.py`` registers (it may run while ``torch`` itself is
    still being imported, so nothing else of torch is touched here)."""
    global _handle
    with _lock:
        if _handle is not None:
            return
        mod: Any = optimizer_module
        if mod is None:
            from torch.optim import optimizer as mod
        _handle = mod.register_optimizer_step_post_hook(_after_step)


def accumulated_since_step(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """True when ``p.grad`` holds nonzero gradients that the optimizer's last
    ``step()`` has not consumed (gradient accumulation in progress)."""
    grad = p.grad
    if grad is None:
        return False
    with _lock:
        rec = _seen.get(optimizer)
    seen = rec.get(id(p)) if rec is not None else None
    if seen is not None and seen[0]() is grad and seen[1] == _local(grad)._version:
        return False
    return bool(_local(grad).count_nonzero())


def stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer stepped since reshard's adapters were imported."""
    with _lock:
        return optimizer in _seen
