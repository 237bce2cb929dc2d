"""reshard inside the trainers people use: one module per trainer, each
importing its framework only when that module is imported (``import reshard``
never imports any of them).

* :mod:`reshard.integrations.torchtitan`: ``ReshardCheckpointManager``, a
  backend behind TorchTitan's ``BaseCheckpointManager`` seam.
* :mod:`reshard.integrations.lightning`: ``ReshardCheckpoint``, a PyTorch
  Lightning checkpoint callback.
* :mod:`reshard.integrations.transformers`: ``ReshardTrainer`` /
  ``ReshardTrainerMixin`` for the Hugging Face ``Trainer``, and
  ``accelerate_state`` for an accelerate loop without the Trainer.

Recipes and what each keeps or gives up: ``docs/integrations.md``.
"""
