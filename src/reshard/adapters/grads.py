"""Is the optimizer at a step boundary? Gradients seen by the last ``step()``.

A save in the middle of gradient accumulation would lose the partial sums,
so :class:`~reshard.OptimizerState` refuses it (unless ``save_grads=True``).
But gradients left over after ``step()`` (``zero_grad(); backward(); step();
save()``, the tutorial loop) were consumed by that step and block nothing.

One global optimizer step post-hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``, installed when reshard's adapters are
imported, so it sees every step of every optimizer afterwards) records, per
parameter, which gradient tensor the step consumed and its version counter
(bumped by every in-place accumulation). A gradient accumulated since the
last step is one that is not that tensor (a new one after ``zero_grad``) or
has another version (``backward`` added into it). Nonzero gradients of an
optimizer that never stepped since the import are accumulated.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..state.tree import is_dtensor

_lock = threading.Lock()
#: optimizer -> {id(param): (weakref to the grad the last step consumed, its version)}
_seen: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[Any, int]]] = (
    weakref.WeakKeyDictionary())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    rec: dict[int, tuple[Any, int]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if grad is not None:
                rec[id(p)] = (weakref.ref(grad), _local(grad)._version)
    with _lock:
        _seen[optimizer] = rec


_handle = register_optimizer_step_post_hook(_after_step)


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
