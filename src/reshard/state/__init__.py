"""The in-memory state model: the walk of a state tree into named leaves (tree) and
the sharded leaves themselves, chunks and offsets (sharding).
"""
