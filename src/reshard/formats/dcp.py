"""Public path of :mod:`reshard.ondisk.dcp` (the module lives there)."""

from reshard.ondisk.dcp import (  # noqa: F401
    DCP_METADATA,
    DCPStorage,
    is_dcp_checkpoint,
    open_dcp,
    read_dcp_metadata,
)

__all__ = [
    "DCP_METADATA",
    "DCPStorage",
    "is_dcp_checkpoint",
    "open_dcp",
    "read_dcp_metadata",
]
