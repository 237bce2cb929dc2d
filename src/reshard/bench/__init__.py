"""``reshard bench``: the benchmark commands.

The ``bench`` click group lives here (not in :mod:`reshard.cli`) so that every
benchmark command registers into the same group from its own module
(``reshard bench io``: :mod:`reshard.bench.io`; ``reshard bench scale``
attaches to the same group): a command module decorates its function with
``@bench.command(...)``, and :mod:`reshard.cli` imports the command modules and
adds the group once with ``main.add_command(bench)``.
"""

from __future__ import annotations

import click


@click.group("bench")
def bench() -> None:
    """Benchmarks: reshard against its peers and the machine's limits, measured in one run."""

