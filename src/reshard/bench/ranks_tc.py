"""torch_checkpointing (PyPI ``torch-checkpointing``, an optional peer) on the ranks of
``reshard bench io``: its state wrapper, its sync and async savers (made once per workload),
its loader.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist

from .ranks_base import (
    _W,
    _w,
)


def _tc_checkpoint(state: dict[str, Any]) -> Any:
    """``state`` (the DCP-style state dict) as torch_checkpointing's
    ``CheckpointBase``: one item, written with its default layout
    (``torch.save`` of this rank's part, ``state_<rank>.pt``)."""
    import torch_checkpointing as tc

    class State(tc.CheckpointBase):
        def get_items(self) -> dict[str, Any]:
            return {"state": tc.CheckpointItem(value=state)}

        def load_state_dict(self, state_dict: Any) -> None:  # tensors are filled in place
            pass

    return State()


def _tc_storage() -> Any:
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    return LocalFileSystemStorageConfig(use_direct_io=_W.get("tc_direct_io", True))


def _tc_sync_saver() -> Any:
    if "tc_sync" not in _W:
        import torch_checkpointing as tc

        _W["tc_sync"] = tc.make_sync_checkpoint_saver(storage_config=_tc_storage())
    return _W["tc_sync"]


def _tc_async_saver() -> Any:
    """Its asynchronous saver (staging into its reused shared-memory buffers,
    writing from its checkpoint process); made once per workload."""
    if "tc_async" not in _W:
        import multiprocessing

        import torch_checkpointing as tc

        # it starts its checkpoint process; a pool worker is daemonic, which
        # multiprocessing forbids to have children (as for DCP's process mode)
        multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
        _W["tc_async"] = tc.make_async_checkpoint_saver(storage_config=_tc_storage())
    return _W["tc_async"]


def end_tc() -> None:
    """Close torch_checkpointing's savers (its checkpoint process and buffers)."""
    for k in ("tc_async", "tc_sync"):
        saver = _W.pop(k, None)
        if saver is not None:
            saver.close()
    gc.collect()


def _tc_load(path: str) -> None:
    import torch_checkpointing as tc
    from torch.distributed.checkpoint.state_dict import set_state_dict

    w = _w()
    if "tc_loader" not in _W:
        reader = tc.CheckpointReader(rank_info=tc.builder._get_default_rank_info(), storage_config=_tc_storage())
        _W["tc_loader"] = tc.CheckpointLoader(reader=reader)
    sd = w.dcp_state()
    _W["tc_loader"].load(path, _tc_checkpoint(sd))
    set_state_dict(w.model, w.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _tc_load_small(p: str) -> None:
    """torch_checkpointing's loader made and used once on a tiny state."""
    import torch_checkpointing as tc

    _tc_sync_saver().save(p, _tc_checkpoint({"w": torch.ones(4, 4)}))
    dist.barrier()  # its coordinator renames the checkpoint into place after the others returned
    if "tc_loader" not in _W:
        reader = tc.CheckpointReader(rank_info=tc.builder._get_default_rank_info(), storage_config=_tc_storage())
        _W["tc_loader"] = tc.CheckpointLoader(reader=reader)
    _W["tc_loader"].load(p, _tc_checkpoint({"w": torch.zeros(4, 4)}))
