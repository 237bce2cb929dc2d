"""A TorchTitan config registry that selects reshard as the checkpoint component
(``--module _torchtitan_registry --config llama3_debugmodel_reshard``), as docs/integrations.md shows."""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from reshard.integrations.torchtitan import ReshardCheckpointManager


def llama3_debugmodel_reshard() -> Trainer.Config:
    config = llama3_debugmodel()
    config.checkpoint = ReshardCheckpointManager.Config(
        enable=True, interval=10, keep_latest_k=3, async_mode="async", last_save_model_only=False)
    return config
