"""The training-loop facade: CheckpointManager (manager), the collective resume
(resume), two storage tiers (tiers).
"""
