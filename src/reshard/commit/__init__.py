"""Committing a checkpoint: the attempt and publish protocol (manifest last), what
a root holds (scan, HEAD), attempts and their leases, lineage, retention policy.
"""
