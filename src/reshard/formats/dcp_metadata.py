"""Public path of :mod:`reshard.ondisk.dcp_metadata` (the module lives there)."""

from reshard.ondisk.dcp_metadata import (  # noqa: F401
    DCP_METADATA,
    MAX_FRAME_ITEMS,
    MAX_MARK_DEPTH,
    MAX_METADATA_BYTES,
    read_dcp_metadata,
)

__all__ = [
    "DCP_METADATA",
    "MAX_METADATA_BYTES",
    "MAX_MARK_DEPTH",
    "MAX_FRAME_ITEMS",
    "read_dcp_metadata",
]
