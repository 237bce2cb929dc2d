"""The records of the fault matrix: a cell, its result, and the bounds a
cell is judged live by (shared by the runner, the rank side and every
backend; no I/O here)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

#: the training group's timeout in a cell (seconds): a rank that never
#: arrives is given up on after this long when no checkpoint timeout is set
PG_TIMEOUT_S = 6.0
#: the training group's timeout in a cell with a checkpoint timeout
#: (``timeout_s``): long, so only the checkpoint's own bound can end the cell
LONG_PG_TIMEOUT_S = 300.0
#: the checkpoint timeout (``timeout_s``) of the cells that set one
CELL_TIMEOUT_S = 3.0
WORLD = 2
#: seconds allowed, after a dead or hung peer was detected, for every pending
#: save and the exit on the survivors to end
AFTER_DETECTION_S = 5.0
#: seconds a storage error (or any fault that is not a lost peer) may take to
#: reach every rank (a raise or the error hook), and slack added to the
#: bounds of lost peers (two shared cores run the matrix in CI)
SLACK_S = 5.0

#: the S3 proxy's cells: action -> must the save fail
HTTP_MUST_FAIL = {"http500": True, "slowdown": True, "reset": True, "list500": True,
                  "lost-answer": False, "slowdown-transient": False, "reset-transient": False}

#: cells whose faulted rank is gone (killed) or never arrives (stalled,
#: stopped): the job cannot go on in the same processes; live means a
#: restarted job resumes and commits its next save
PROCESS_ACTIONS = ("kill", "delay", "stop")


@dataclass(frozen=True)
class Cell:
    """One fault at one phase.

    Attributes:
        fault_class: "storage-error", "silent-corruption", "sigkill-save",
            "sigkill-load", "lost-rank", "integrity", the S3 classes
            ("s3-http", "truncated-body") and the continuation cells
            ("enospc-clears", "full-disk", "gc-concurrent", "sigstop-save",
            "sigstop-load", "sigkill-exit", "sigterm-unwinding"); "incremental":
            a state with a frozen part that every save after the first links
            (a rank killed while it links, a retention or an operator's gc
            killed mid-sweep of a checkpoint whose files a kept one links, gc
            --grace 0 --keep-last 1 beside saves that link).
        op: "save" or "load" (the operation that meets the fault),
            "integrity" (corruption of committed step 2, then load latest),
            or "gc" (an operator's gc of the root, killed mid-sweep).
        mode: "sync" / "async" (saves) or "-".
        phase: the phase (a ``faults.PHASES`` name, "stage", "plan",
            "publish-after", "retention-mid", "manifest") or the integrity fault.
        action: FaultStorage action ("enospc", "kill", "stop", "delay", ...) or "-".
        rank: the rank that meets the fault.
        backend: "local" or "s3".
        timeout_s: the checkpoint timeout of the job (``CheckpointManager``
            / ``LoadOptions`` ``timeout_s``), None: the group's timeout.
    """

    fault_class: str
    op: str
    mode: str
    phase: str
    action: str
    rank: int
    backend: str = "local"
    timeout_s: float | None = None

    @property
    def name(self) -> str:
        t = "" if self.timeout_s is None else f"/timeout{self.timeout_s:g}s"
        return f"{self.fault_class}/{self.op}-{self.mode}/{self.phase}/{self.action}/rank{self.rank}{t}"

    @property
    def process_fault(self) -> bool:
        """The faulted rank is gone or never arrives (or every rank was
        signalled): live is judged by a restarted job."""
        return self.action in PROCESS_ACTIONS or self.fault_class in ("sigkill-exit", "sigterm-unwinding")

    @property
    def on_tmpfs(self) -> bool:
        """Runs on a small tmpfs mounted for the cell (skipped where mount is refused)."""
        return self.fault_class in ("enospc-clears", "full-disk")

    @property
    def real_exit(self) -> bool:
        """The ranks are plain interpreters (not forkserver children), so the
        interpreter's exit (atexit, signal handlers) is what is judged."""
        return self.fault_class in ("sigkill-exit", "sigterm-unwinding")


@dataclass
class CellResult:
    """What a cell did and whether it was safe and live.

    ``detect_s``: seconds from the fault until every surviving rank had
    raised, got the error hook, or logged it (None: no rank was to see a
    failure, or one never did); ``exit_s``: seconds from the fault until
    every process that was not the fault's victim had exited;
    ``next_commits``: the next save after the fault committed on every rank
    (in the same processes, or, where a rank was lost, in a restarted job);
    ``bytes_before`` / ``bytes_after``: bytes under the root when the fault
    was armed / when the job had ended, ``stray_bytes``: of those, the bytes
    of attempts no committed checkpoint names (the failed attempt's space),
    ``space_back``: "yes" (nothing stray when the job ended), "restart" (the
    restarted job's housekeeping removed it), "NO", or None (not measured).
    """

    cell: Cell
    ranks: dict[int, str] = field(default_factory=dict)
    latest: str | None = None
    previous_loads: bool = False
    left_behind: list[str] = field(default_factory=list)
    after_gc: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    liveness: list[str] = field(default_factory=list)
    seconds: float = 0.0
    next_commits: bool | None = None
    detect_s: float | None = None
    exit_s: float | None = None
    bytes_before: int | None = None
    bytes_after: int | None = None
    stray_bytes: int | None = None
    space_back: str | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def safe(self) -> bool:
        return not self.problems

    @property
    def live(self) -> bool:
        return not self.liveness and self.next_commits is not False

    def to_json(self) -> dict[str, Any]:
        r = lambda x: None if x is None else round(x, 2)  # noqa: E731
        return {"cell": self.cell.name, **asdict(self.cell), "safe": self.safe, "live": self.live,
                "skipped": self.skipped,
                "ranks": {str(k): v for k, v in self.ranks.items()}, "latest": self.latest,
                "previous_loads_bit_exact": self.previous_loads, "left_behind": self.left_behind,
                "after_gc": self.after_gc, "problems": self.problems, "liveness": self.liveness,
                "next_save_commits": self.next_commits, "detect_s": r(self.detect_s),
                "exit_s": r(self.exit_s), "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "stray_bytes": self.stray_bytes,
                "space_back": self.space_back, "notes": self.notes, "seconds": round(self.seconds, 2)}


def collective_bound_s(cell: Cell) -> float:
    """The seconds a collective of the cell's job waits for a rank that does
    not arrive: the checkpoint timeout, else the training group's."""
    return cell.timeout_s if cell.timeout_s is not None else PG_TIMEOUT_S


def detect_bound_s(cell: Cell) -> float:
    """How soon every survivor must have seen the fault (seconds after it).

    A lost or stopped peer: the collective's bound (:func:`collective_bound_s`:
    how long a hung peer is waited for), plus the wait in which survivors
    name the lost ranks (``reshard.collectives``: at most the same bound),
    plus ``SLACK_S``. Any other fault: ``SLACK_S`` plus the S3 store's
    retry deadline where the cell is on S3."""
    if cell.process_fault:
        return 2 * collective_bound_s(cell) + SLACK_S
    import importlib

    from ..storage import get_scheme

    kit = get_scheme(cell.backend).fault_kit  # the backend's fault kit (faults.ranks.rank_backend)
    return SLACK_S + float(getattr(importlib.import_module(kit), "DETECT_EXTRA_S", 0.0) if kit else 0.0)


_LOST = re.compile(r"\branks? ([\d,-]+)(?: \(global [\d,-]+\))?(?: \(the coordinator\))? (?:was|were) lost")


def named_lost(message: str) -> set[int]:
    """The group ranks an error message names as lost ("rank 1 was lost",
    "ranks 0-2,5 were lost", as :mod:`reshard.collectives` words it)."""
    out: set[int] = set()
    for m in _LOST.finditer(message):
        for part in m[1].split(","):
            if not part:
                continue
            a, _, b = part.partition("-")
            if a.isdigit() and (not b or b.isdigit()):
                out.update(range(int(a), int(b or a) + 1))
    return out


def must_fail(cell: Cell) -> bool:
    """Whether every surviving rank must see the operation fail."""
    if cell.fault_class in ("storage-error", "sigkill-load", "lost-rank", "truncated-body",
                            "enospc-clears", "sigstop-save", "sigstop-load"):
        return True
    if cell.fault_class == "sigkill-save":
        return cell.phase not in ("publish-after", "retention", "retention-mid")
    if cell.fault_class == "incremental":  # a rank killed while it links its unchanged chunks
        return cell.phase == "link"
    if cell.fault_class == "s3-http":
        return HTTP_MUST_FAIL.get(cell.action, not cell.action.endswith("-transient"))
    return False


def must_commit(cell: Cell) -> bool:
    """The operation must succeed on every rank and commit step 2 (a
    transient fault retried, a disk that retention frees, gc beside it)."""
    return (cell.fault_class in ("full-disk", "gc-concurrent") or cell.action == "gc"
            or (cell.fault_class == "s3-http" and cell.op == "save" and cell.action.endswith("-transient")))


def steps(cell: Cell) -> tuple[int, int, int]:
    """``(previous, faulted, next)`` steps of a cell: the committed checkpoint
    before the fault, the operation's, the save after it."""
    if cell.fault_class == "full-disk":
        return (3, 4, 5)
    if cell.fault_class == "incremental" and cell.action == "gc":  # gc deletes step 1 that 2 and 3 link
        return (2, 3, 4)
    return (1, 2, 3)


def quick_subset(out: list[Cell]) -> list[Cell]:
    """The quick matrix of a backend's cells ``out``: the first cell of each
    fault class, and the few of ``_QUICK_EXTRA``."""
    seen: set[str] = set()
    q = []
    for c in out:
        if (c.fault_class not in seen and c.fault_class not in _QUICK_SKIP) or c.name in _QUICK_EXTRA:
            seen.add(c.fault_class)
            q.append(c)
    return q


#: besides the first cell of each fault class, the quick matrix runs these
#: (an async kill, the coordinator killed, an interrupted retention, a rank
#: lost by an async save, a broken manifest, a disk that fills mid-write and
#: clears, a rank stopped in the write phase under a checkpoint timeout)
_QUICK_EXTRA = ("sigkill-save/save-async/data/kill/rank1", "sigkill-save/save-sync/plan/kill/rank0",
                "sigkill-save/save-sync/retention-mid/kill/rank0", "lost-rank/save-async/data/delay/rank1",
                "integrity/integrity--/missing-manifest/-/rank0",
                "enospc-clears/save-async/data/enospc/rank0",
                "sigstop-save/save-sync/data/stop/rank1/timeout3s",
                "integrity/integrity--/shared-shard/-/rank0", "incremental/gc--/sweep-mid/gc-kill/rank0")
#: classes the quick matrix leaves to the full one (a stop cell waits out its
#: timeout twice: one runs, above; the SIGTERM and exit cells start two
#: interpreters each, and tests/faults/test_fault_costs_one_save.py and
#: tests/saving/test_async_exit.py cover them on one)
_QUICK_SKIP = ("sigstop-save", "sigstop-load", "sigterm-unwinding", "sigkill-exit")
