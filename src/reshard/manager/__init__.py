"""The training-loop facade: CheckpointManager (manager), the collective resume
(resume), two storage tiers (tiers).

``from reshard.manager import CheckpointManager`` (the path before the
package layout) keeps working; the manager is imported when first named, so
that importing :mod:`reshard.manager.retention` alone (``reshard ls``) imports
no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import CheckpointManager


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointManager"]
