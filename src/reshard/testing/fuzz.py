"""Structure-aware fuzzing of the untrusted inputs a load reads.

Four inputs are untrusted: ``manifest.json`` (parser and validator), the shard
files it points into, a PyTorch DCP ``.metadata`` (read through the restricted
unpickler) and a Hugging Face safetensors header. :mod:`.fuzz_cases` derives
hostile inputs from small valid ones; :func:`run_case` loads one and
classifies the outcome; :func:`fuzz` runs many under a memory ceiling.

The only acceptable outcomes are a valid load (``"ok"``) or a
:class:`~reshard.errors.CheckpointError` subclass (its class name). Anything
else is a crash: another exception, an input running past ``timeout_s``, an
allocation beyond the memory ceiling (``RLIMIT_AS``; also when a
CheckpointError merely wraps the MemoryError), or a load that returns data
other than the saved bytes when only shard-file bytes were changed (checksums
must catch that).

Used by ``reshard fuzz`` and ``tests/test_fuzz.py`` (which drives
:func:`~.fuzz_cases.generate` from hypothesis' ``randoms()`` so failures shrink).
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from .fuzz_cases import (  # noqa: F401 - re-exported for tests and the CLI
    DCP_META,
    HF_FILE,
    MANIFEST,
    Case,
    Corpus,
    FileSpec,
    _dumps,
    _expected,
    _hf_file,
    _paths,
    _set,
    generate,
    target_state,
)


class _Hang(BaseException):
    """Raised by the interval timer when one input runs too long (a
    BaseException, so no ``except Exception`` in the code under test hides it)."""


@dataclass
class FuzzReport:
    """Counts of one fuzzing run.

    Attributes:
        inputs: cases run.
        outcomes: outcome -> count ("ok" or a CheckpointError class name, or
            "CRASH:<type>").
        crashes: (case description, exception type, message) of each crash.
        slowest_s / slowest: the slowest input's time (seconds) and description.
        duration_s: wall time of the run (seconds).
        peak_rss_bytes: peak resident set size of the process at the end (bytes).
        memory_limit_bytes: the address-space ceiling the cases ran under (0: none).
    """

    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[tuple[str, str, str]] = field(default_factory=list)
    slowest_s: float = 0.0
    slowest: str = ""
    duration_s: float = 0.0
    peak_rss_bytes: int = 0
    memory_limit_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.crashes

    @property
    def rate(self) -> float:
        return self.inputs / max(self.duration_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "outcomes": dict(sorted(self.outcomes.items())),
                "crashes": [list(c) for c in self.crashes], "slowest_s": round(self.slowest_s, 4),
                "slowest": self.slowest, "duration_s": round(self.duration_s, 2),
                "inputs_per_s": round(self.rate, 1), "peak_rss_bytes": self.peak_rss_bytes,
                "memory_limit_bytes": self.memory_limit_bytes}


# --------------------------------------------------------------------------- running


def _materialize(d: str, files: dict[str, FileSpec]) -> None:
    if os.path.lexists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    for name, spec in files.items():
        p = os.path.join(d, name)
        if isinstance(spec, bytes):
            with open(p, "wb") as f:
                f.write(spec)
        elif spec[0] == "symlink":
            os.symlink(spec[1], p)
        else:
            os.makedirs(p)


def _load_reshard(d: str, root: str, data_only: bool) -> None:
    from ..load import load
    from ..verify import latest, verify

    # discovery and verification must never crash on it either
    latest(root)
    verify(d)
    tgt = target_state()
    res = load(tgt, d)
    if data_only:
        exp = _expected()
        for k, v in exp.items():
            if not torch.equal(tgt[k], v):
                raise AssertionError(f"load returned wrong data for {k!r} after only shard-file "
                                     "bytes changed (checksums should refuse it)")
        if res.values.get("rng") != {"seed": 7, "state": [1, 2, 3]}:
            raise AssertionError("load returned a wrong object after only shard-file bytes changed")


def _format_fn(module: str, name: str) -> Any:
    """``name`` from ``reshard.formats.<module>`` or, before the move,
    ``reshard.<module>``."""
    import importlib

    for mod in (f"reshard.formats.{module}", f"reshard.{module}"):
        try:
            return getattr(importlib.import_module(mod), name)
        except ModuleNotFoundError:
            continue
    raise ImportError(f"no {module}.{name} in reshard")


def _load_dcp(d: str) -> None:
    from ..load import load

    load({"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16)}, d, strict=False)


def _load_hf(d: str) -> None:
    import_hf = _format_fn("hf_import", "import_hf")
    import_hf({"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16)}, d, strict=False)


def _no_memory_error(e: BaseException) -> None:
    """A CheckpointError that wraps a MemoryError hides an allocation the
    files could not back (the ceiling caught it): a crash all the same."""
    seen = 0
    x: BaseException | None = e
    while x is not None and seen < 20:
        if isinstance(x, MemoryError) or "MemoryError" in str(x) or "can't allocate memory" in str(x):
            raise AssertionError(f"allocation past the memory ceiling, reported as "
                                 f"{type(e).__name__}: {str(e)[:300]}") from e
        x = x.__cause__ or x.__context__
        seen += 1


def run_case(case: Case, corpus: Corpus, *, timeout_s: float = 10.0) -> str:
    """Write ``case`` to disk, load it, and return its outcome: "ok" or the
    CheckpointError subclass name.

    Raises:
        Exception: anything but a CheckpointError (a crash), AssertionError for a
        load that returned wrong data, and ``_Hang`` (a BaseException) past
        ``timeout_s`` seconds.
    """
    root = corpus.root_dir
    d = os.path.join(root, "ckpt")
    _materialize(d, case.files)

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Hang(f"input ran past {timeout_s} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        if case.kind == "reshard":
            _load_reshard(d, root, case.data_only)
        elif case.kind == "dcp":
            _load_dcp(d)
        else:
            _load_hf(d)
        return "ok"
    except CheckpointError as e:
        _no_memory_error(e)
        return type(e).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _vm_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().vms)


@contextlib.contextmanager
def memory_ceiling(headroom_bytes: int = 1 << 30) -> Iterator[int]:
    """Limit this process's address space (``RLIMIT_AS``) to its current
    virtual size plus ``headroom_bytes`` while the block runs (restored after;
    0: no limit). Yields the limit in bytes (0 when none)."""
    if headroom_bytes <= 0:
        yield 0
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + headroom_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def fuzz(count: int, *, seed: int = 0, workdir: str, memory_headroom_bytes: int = 1 << 30,
         timeout_s: float = 10.0, progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
    """Run ``count`` hostile inputs derived with ``random.Random(seed)``.

    Every case runs under an address-space ceiling of the process's current
    virtual size plus ``memory_headroom_bytes`` (``RLIMIT_AS``; restored at
    the end), so an allocation the files cannot back fails instead of
    succeeding, and under a ``timeout_s`` per input.

    Returns:
        FuzzReport (``ok`` is False when any case crashed).
    """
    import psutil

    corpus = Corpus(workdir)
    rng = random.Random(seed)
    rep = FuzzReport()
    # warm up every path once (imports, thread pools) before the ceiling is set
    for kind in ("reshard", "dcp", "hf"):
        files = {"reshard": corpus.reshard, "dcp": corpus.dcp, "hf": corpus.hf}[kind]
        if run_case(Case(kind, "seed", dict(files)), corpus) != "ok":
            raise RuntimeError(f"the {kind} seed input does not load")
    ceiling = memory_ceiling(memory_headroom_bytes)
    rep.memory_limit_bytes = ceiling.__enter__()
    t0 = time.perf_counter()
    try:
        for i in range(count):
            case = generate(rng, corpus)
            t1 = time.perf_counter()
            try:
                out = run_case(case, corpus, timeout_s=timeout_s)
            except BaseException as e:  # noqa: BLE001 - a crash is recorded, not raised
                if isinstance(e, KeyboardInterrupt):
                    raise
                out = f"CRASH:{type(e).__name__}"
                where = traceback.extract_tb(e.__traceback__)[-1:]
                msg = f"{str(e)[:400]} (at {where[0].filename}:{where[0].lineno})" if where else str(e)[:400]
                if isinstance(e, _Hang):  # a stalled machine or a real hang: run it once more
                    t2 = time.perf_counter()
                    try:
                        run_case(case, corpus, timeout_s=timeout_s)
                        msg += f"; did not reproduce (rerun took {time.perf_counter() - t2:.2f} s)"
                    except BaseException as e2:  # noqa: BLE001
                        msg += f"; rerun: {type(e2).__name__}"
                rep.crashes.append((f"#{i} {case.kind}: {case.desc}", type(e).__name__, msg))
            dt = time.perf_counter() - t1
            rep.inputs += 1
            rep.outcomes[f"{case.kind}:{out}"] += 1
            if dt > rep.slowest_s:
                rep.slowest_s, rep.slowest = dt, f"{case.kind}: {case.desc}"
            if progress is not None and (i + 1) % 1000 == 0:
                rep.duration_s = time.perf_counter() - t0
                progress(rep)
    finally:
        ceiling.__exit__(None, None, None)
        rep.duration_s = time.perf_counter() - t0
        rep.peak_rss_bytes = int(getattr(psutil.Process().memory_info(), "rss", 0))
    return rep
