"""Public path of :mod:`reshard.ondisk.dcp_blob` (the module lives there)."""

from reshard.ondisk.dcp_blob import (  # noqa: F401
    decode_tensor_blob,
)

__all__ = [
    "decode_tensor_blob",
]
