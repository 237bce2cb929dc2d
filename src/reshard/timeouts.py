"""The default timeouts of a save or load, and the mark that tells a default
from the caller's own value.

On the lowest floor so that :mod:`reshard.collectives` (which caps the
default at the process group's own timeout) and :mod:`reshard.options` (which
holds them as the options' defaults) both read them from here; the public
paths stay :data:`reshard.options.DEFAULT_TIMEOUT_S` and
:data:`reshard.options.DEFAULT_ARRIVAL_TIMEOUT_S`."""

from __future__ import annotations


class DefaultSeconds(float):
    """A number of seconds that is a default, not the caller's choice: the
    checkpoint timeout's default is capped at the process group's own
    timeout when that is shorter; a value the caller passes is used as it is."""


#: seconds one collective of a save or load waits for the other ranks by
#: default (``SaveOptions.timeout_s``, ``LoadOptions.timeout_s``): ten
#: minutes, as Orbax's ``AsyncOptions.timeout_secs`` and NCCL's default
#: process-group timeout, or the group's own timeout when that is shorter (a
#: job that set a short training timeout keeps it for its checkpoints). A
#: save whose slowest rank finishes writing more than this after the fastest
#: needs a larger value.
DEFAULT_TIMEOUT_S: float = DefaultSeconds(600.0)


#: seconds a save or load waits, before its first collective, for every rank
#: of its group to arrive at the same call (``SaveOptions.arrival_timeout_s``,
#: ``LoadOptions.arrival_timeout_s``): a call made on some ranks only (a
#: plug-in point run on rank 0 alone) fails on those ranks after this long,
#: naming the absent ranks, instead of waiting the checkpoint timeout. A
#: minute: far above the skew between ranks reaching a save at a step
#: boundary, far below ``DEFAULT_TIMEOUT_S``.
DEFAULT_ARRIVAL_TIMEOUT_S: float = 60.0
