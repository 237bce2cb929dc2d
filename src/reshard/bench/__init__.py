"""``reshard bench io`` (:mod:`reshard.bench.io`): checkpoint I/O of a real
model state on real gloo ranks, with its peers and the machine's limits.
The ``bench`` click group is :func:`reshard.cli.bench_group`; ``io`` is
attached to it there (``reshard bench scale`` is defined in :mod:`reshard.cli`).
"""
