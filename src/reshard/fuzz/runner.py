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

Used by ``reshard fuzz`` and ``tests/fuzz/test_fuzz.py`` (which drives
:func:`~.fuzz_cases.generate` from hypothesis' ``randoms()`` so failures shrink).
"""

from __future__ import annotations

import contextlib
import gc
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
from .cases import _hf_file, generate  # noqa: F401 - re-exported for tests and the CLI
from .corpus import (  # noqa: F401 - re-exported for tests and the CLI
    DCP_META,
    HF_FILE,
    MANIFEST,
    Case,
    Corpus,
    FileSpec,
    _dumps,
    _expected,
    _paths,
    _set,
    target_state,
)


class _Hang(BaseException):
    """Raised by the interval timer when one input runs too long (a
    BaseException, so no ``except Exception`` in the code under test hides it)."""


@dataclass
class FamilyTime:
    """Time spent on one family of inputs: wall ``total_s``, CPU ``cpu_s``
    (this process's, all threads), the slowest input's wall ``max_s`` and
    description (seconds)."""

    inputs: int = 0
    total_s: float = 0.0
    cpu_s: float = 0.0
    max_s: float = 0.0
    slowest: str = ""

    def add(self, dt: float, cpu: float, desc: str) -> None:
        self.inputs += 1
        self.total_s += dt
        self.cpu_s += cpu
        if dt > self.max_s:
            self.max_s, self.slowest = dt, desc


@dataclass
class FuzzReport:
    """Counts of one fuzzing run.

    Attributes:
        inputs: cases run.
        outcomes: "<kind>:<outcome>" -> count (outcome "ok" or a CheckpointError
            class name, or "CRASH:<type>").
        crashes: (case description, exception type, message) of each crash.
        slowest_s / slowest: the slowest input's wall time (seconds) and
            description ("#<index> <kind>: <desc>"; the index and the seed
            regenerate it); slowest_cpu_s: that input's CPU time (on a loaded
            machine its wall time is mostly waiting for a core).
        most_cpu_s / most_cpu: the input that used the most CPU time.
        families: "<kind>: <family>" -> FamilyTime (where the time went).
        duration_s: wall time of the run (seconds), worker start-up included.
        jobs: worker processes that ran the inputs (1: this process).
        peak_rss_bytes: the largest resident set size of a process that ran
            inputs, at its end (bytes).
        memory_limit_bytes: the address-space ceiling the cases ran under (0:
            none; with several workers, the largest).
    """

    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    crashes: list[tuple[str, str, str]] = field(default_factory=list)
    slowest_s: float = 0.0
    slowest: str = ""
    slowest_cpu_s: float = 0.0
    most_cpu_s: float = 0.0
    most_cpu: str = ""
    families: dict[str, FamilyTime] = field(default_factory=dict)
    duration_s: float = 0.0
    jobs: int = 1
    peak_rss_bytes: int = 0
    memory_limit_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.crashes

    @property
    def rate(self) -> float:
        return self.inputs / max(self.duration_s, 1e-9)

    def merge(self, other: FuzzReport) -> None:
        """Add ``other``'s counts (a worker's share) to this report."""
        self.inputs += other.inputs
        self.outcomes.update(other.outcomes)
        self.crashes.extend(other.crashes)
        if other.slowest_s > self.slowest_s:
            self.slowest_s, self.slowest = other.slowest_s, other.slowest
            self.slowest_cpu_s = other.slowest_cpu_s
        if other.most_cpu_s > self.most_cpu_s:
            self.most_cpu_s, self.most_cpu = other.most_cpu_s, other.most_cpu
        for k, f in other.families.items():
            mine = self.families.setdefault(k, FamilyTime())
            mine.inputs += f.inputs
            mine.total_s += f.total_s
            mine.cpu_s += f.cpu_s
            if f.max_s > mine.max_s:
                mine.max_s, mine.slowest = f.max_s, f.slowest
        self.peak_rss_bytes = max(self.peak_rss_bytes, other.peak_rss_bytes)
        self.memory_limit_bytes = max(self.memory_limit_bytes, other.memory_limit_bytes)

    def slowest_families(self, n: int = 10) -> list[tuple[str, FamilyTime]]:
        """The ``n`` families that took the most time in all, slowest first."""
        return sorted(self.families.items(), key=lambda kv: -kv[1].total_s)[:n]

    def to_json(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "outcomes": dict(sorted(self.outcomes.items())),
                "crashes": [list(c) for c in self.crashes], "slowest_s": round(self.slowest_s, 4),
                "slowest": self.slowest, "slowest_cpu_s": round(self.slowest_cpu_s, 4),
                "most_cpu_s": round(self.most_cpu_s, 4), "most_cpu": self.most_cpu,
                "duration_s": round(self.duration_s, 2),
                "inputs_per_s": round(self.rate, 1), "jobs": self.jobs,
                "families": {k: {"inputs": f.inputs, "total_s": round(f.total_s, 3),
                                 "cpu_s": round(f.cpu_s, 3),
                                 "mean_ms": round(f.total_s / max(f.inputs, 1) * 1e3, 3),
                                 "max_ms": round(f.max_s * 1e3, 2), "slowest": f.slowest}
                             for k, f in self.slowest_families(len(self.families))},
                "peak_rss_bytes": self.peak_rss_bytes,
                "memory_limit_bytes": self.memory_limit_bytes}


# --------------------------------------------------------------------------- running


def _materialize(d: str, files: dict[str, FileSpec]) -> None:
    """Make directory ``d`` hold exactly ``files``. The directory itself is
    kept from one case to the next (on ext4 an ``rmdir`` costs milliseconds,
    more than the rest of a case); what is in it is removed first."""
    if os.path.islink(d) or (os.path.lexists(d) and not os.path.isdir(d)):
        os.unlink(d)
    os.makedirs(d, exist_ok=True)
    for e in os.scandir(d):
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)
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
    from ..catalog.verify import latest, verify
    from ..loading.load import load

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
    from ..loading.load import load

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
    env = {f"RESHARD_LIMIT_{k.upper()}": str(v) for k, v in case.limits.items()}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the case's lowered read limits (a size bomb)
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
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


def case_rng(seed: int, index: int) -> random.Random:
    """The generator of input ``index`` of a run seeded ``seed``: each input
    is reproducible from the two numbers alone, whichever worker ran it."""
    return random.Random(f"reshard-fuzz/{seed}/{index}")


def _run_one(i: int, seed: int, corpus: Corpus, rep: FuzzReport, timeout_s: float) -> None:
    case = generate(case_rng(seed, i), corpus)
    t1, c1 = time.perf_counter(), time.process_time()
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
    dt, cpu = time.perf_counter() - t1, time.process_time() - c1
    rep.inputs += 1
    rep.outcomes[f"{case.kind}:{out}"] += 1
    desc = f"#{i} {case.kind}: {case.desc}"
    rep.families.setdefault(f"{case.kind}: {case.family or '-'}", FamilyTime()).add(dt, cpu, desc)
    if dt > rep.slowest_s:
        rep.slowest_s, rep.slowest, rep.slowest_cpu_s = dt, desc, cpu
    if cpu > rep.most_cpu_s:
        rep.most_cpu_s, rep.most_cpu = cpu, desc


def _seeded_corpus(workdir: str) -> Corpus:
    """The corpus under ``workdir``, each seed input loaded once (imports,
    thread pools warm) before any ceiling is set."""
    corpus = Corpus(workdir)
    for kind in ("reshard", "dcp", "hf"):
        files = {"reshard": corpus.reshard, "dcp": corpus.dcp, "hf": corpus.hf}[kind]
        if run_case(Case(kind, "seed", dict(files)), corpus) != "ok":
            raise RuntimeError(f"the {kind} seed input does not load")
    return corpus


#: a worker process's corpus, ceiling and per-input timeout (set by _worker_init)
_WORKER: dict[str, Any] = {}


def _worker_init(workdir: str, memory_headroom_bytes: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    wd = os.path.join(workdir, f"w{os.getpid()}")
    os.makedirs(wd, exist_ok=True)
    _WORKER["corpus"] = _seeded_corpus(wd)
    _WORKER["timeout_s"] = timeout_s
    gc.freeze()  # torch's objects out of the collector's sight: a full collection stays cheap
    ceiling = memory_ceiling(memory_headroom_bytes)  # held until the worker exits
    _WORKER["limit"] = ceiling.__enter__()
    _WORKER["ceiling"] = ceiling


def _worker_run(seed: int, start: int, stop: int) -> FuzzReport:
    import psutil

    rep = FuzzReport(memory_limit_bytes=_WORKER["limit"])
    for i in range(start, stop):
        _run_one(i, seed, _WORKER["corpus"], rep, _WORKER["timeout_s"])
    rep.peak_rss_bytes = int(psutil.Process().memory_info().rss)
    return rep


#: inputs per task handed to a worker (progress is reported per task)
CHUNK = 500


def fuzz(count: int, *, seed: int = 0, workdir: str, memory_headroom_bytes: int = 1 << 30,
         timeout_s: float = 10.0, jobs: int = 1,
         progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
    """Run ``count`` hostile inputs; input ``i`` is derived with
    :func:`case_rng` ``(seed, i)``.

    Every case runs under an address-space ceiling of its process's virtual
    size plus ``memory_headroom_bytes`` (``RLIMIT_AS``; restored at the end
    in this process), so an allocation the files cannot back fails instead
    of succeeding, and under a ``timeout_s`` per input (seconds).

    Args:
        jobs: worker processes (forkserver, torch preloaded; each with its own
            corpus under ``workdir``, one torch thread, and its own ceiling);
            1 runs every input in this process.
        progress: called with the report so far about every 1000 inputs.

    Returns:
        FuzzReport (``ok`` is False when any case crashed).
    """
    import psutil

    rep = FuzzReport(jobs=max(1, jobs))
    t0 = time.perf_counter()
    if jobs <= 1:
        corpus = _seeded_corpus(workdir)
        ceiling = memory_ceiling(memory_headroom_bytes)
        rep.memory_limit_bytes = ceiling.__enter__()
        gc.freeze()  # (as in a worker; undone below)
        t0 = time.perf_counter()
        try:
            for i in range(count):
                _run_one(i, seed, corpus, rep, timeout_s)
                if progress is not None and (i + 1) % 1000 == 0:
                    rep.duration_s = time.perf_counter() - t0
                    progress(rep)
        finally:
            gc.unfreeze()
            ceiling.__exit__(None, None, None)
            rep.duration_s = time.perf_counter() - t0
            rep.peak_rss_bytes = int(getattr(psutil.Process().memory_info(), "rss", 0))
        return rep
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "reshard.fuzz.runner"])
    spans = [(a, min(a + CHUNK, count)) for a in range(0, count, CHUNK)]
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init,
                             initargs=(workdir, memory_headroom_bytes, timeout_s)) as ex:
        futs = {ex.submit(_worker_run, seed, a, b): (a, b) for a, b in spans}
        shown = 0
        for fut in as_completed(futs):
            try:
                rep.merge(fut.result())
            except BrokenProcessPool as e:  # a worker died (killed, out of memory): a crash
                a, b = futs[fut]
                rep.crashes.append((f"#{a} inputs [{a}, {b})", "WorkerDied", str(e)[:400]))
                continue
            rep.duration_s = time.perf_counter() - t0
            if progress is not None and rep.inputs // 1000 > shown:
                shown = rep.inputs // 1000
                progress(rep)
    rep.crashes.sort(key=lambda c: int(c[0].split(" ", 1)[0][1:]))
    rep.duration_s = time.perf_counter() - t0
    return rep
