"""The training-loop facade: CheckpointManager (manager), the collective resume
(resume), two storage tiers (tiers).

``from reshard.manager import CheckpointManager`` (the path before the
package layout) keeps working.
"""

from .manager import CheckpointManager

__all__ = ["CheckpointManager"]
