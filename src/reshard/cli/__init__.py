"""The ``reshard`` command: list, inspect, verify, compare, convert and export
checkpoints; run a demo. The root group and its entry point (``reshard.cli:main``); the
commands live by group beside it: :mod:`reshard.cli.ckpt` (ls, gc, inspect, verify),
:mod:`reshard.cli.export` (export, convert, copy, diff), :mod:`reshard.cli.plan`,
:mod:`reshard.cli.bench`, :mod:`reshard.cli.demo`, :mod:`reshard.cli.faults`.

Exit codes (:mod:`reshard.cli.support`): 0 success; 1 a check failed
(``verify`` found a problem, ``diff`` a difference, ``smoke``/``demo`` a
check); 2 a usage or environment error (bad option, missing optional package
or weights, missing path, unreadable checkpoint, refused overwrite). Errors
are one line on stderr, without a traceback. Commands that report figures
take ``--json PATH``. Progress bars (stderr) appear only on a terminal.
"""

from __future__ import annotations

import click

from .bench import advise_cmd, bench_group
from .ckpt import gc_cmd, inspect_cmd, ls_cmd, verify_cmd
from .demo import demo_cmd, smoke_cmd
from .export import convert_cmd, copy_cmd, diff_cmd, export_cmd
from .faults import faults_cmd, fuzz_cmd
from .plan import plan_cmd
from .support import (
    Main,
    human_bytes,
)


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="reshard")
def main() -> None:
    """Distributed training checkpoints that reshard."""


for command in (ls_cmd, gc_cmd, inspect_cmd, verify_cmd, export_cmd, convert_cmd, copy_cmd, diff_cmd):
    main.add_command(command)
main.add_command(demo_cmd)
main.add_command(smoke_cmd)
main.add_command(bench_group)
main.add_command(advise_cmd)
main.add_command(fuzz_cmd)
main.add_command(faults_cmd)
main.add_command(plan_cmd)
__all__ = ["human_bytes", "main"]
