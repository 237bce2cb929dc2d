"""Foreign checkpoint formats.

* :mod:`reshard.ondisk.dcp` -- read a PyTorch Distributed Checkpoint (DCP)
  directory through a virtual storage and manifest (no unpickling of data).
* :mod:`reshard.formats.dcp_convert` -- write a committed reshard checkpoint
  from a DCP one.
* :mod:`reshard.formats.hf_export` -- consolidate a reshard checkpoint into a
  Hugging Face safetensors directory.
* :mod:`reshard.formats.hf_import` -- load a Hugging Face safetensors
  directory into a (sharded) target state.

Arrows run one way: ``dcp_convert -> dcp`` and ``hf_import -> hf_export``;
neither ``dcp`` nor ``hf_export`` imports its sibling.
"""

from __future__ import annotations

from ..ondisk.dcp import DCP_METADATA, DCPStorage, is_dcp_checkpoint, open_dcp, read_dcp_metadata
from .dcp_convert import convert_dcp
from .hf_export import ExportResult, export_hf, parse_dtype, parse_size
from .hf_import import hf_manifest, import_hf

__all__ = [
    "DCP_METADATA",
    "DCPStorage",
    "ExportResult",
    "convert_dcp",
    "export_hf",
    "hf_manifest",
    "import_hf",
    "is_dcp_checkpoint",
    "open_dcp",
    "parse_dtype",
    "parse_size",
    "read_dcp_metadata",
]
