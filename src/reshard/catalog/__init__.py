"""Operations on committed checkpoints: verify, inspect, diff, verification records.
"""
