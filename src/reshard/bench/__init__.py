"""``reshard bench io`` (:mod:`reshard.bench.io`): checkpoint I/O of a real
model state on real gloo ranks, with its peers and the machine's limits.
The click commands (``reshard bench io`` and ``reshard bench scale``) are in
:mod:`reshard.cli.bench`; the rank side is :mod:`reshard.bench.ranks`, the
workloads :mod:`reshard.bench.models`, the S3 endpoint and its limits
:mod:`reshard.bench.objstore`, the state check :mod:`reshard.bench.digest`,
the table and plot :mod:`reshard.bench.report`.
"""
