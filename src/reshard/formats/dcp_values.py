"""Public path of :mod:`reshard.ondisk.dcp_values` (the module lives there)."""

from reshard.ondisk.dcp_values import (  # noqa: F401
    DCP_VALUES,
    regroup,
)

__all__ = [
    "DCP_VALUES",
    "regroup",
]
