"""``reshard demo``: the main job (job) and its rank functions (ranks), the reference
model (model, model_tp) and trainer, its data, the parity checks.
"""
