"""``python -m reshard.cli``: the ``reshard`` command."""

from . import main

main()
