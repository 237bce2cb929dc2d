"""reshard inside the trainers people use, one module per trainer.

Each module imports its framework when it is imported itself (``import reshard``
imports none of them): :mod:`reshard.integrations.torchtitan` (TorchTitan's
checkpoint component). See docs/integrations.md.
"""
