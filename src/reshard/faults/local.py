"""The local file system rows of the fault matrix: its cells, where its
faults hit, how its committed checkpoints are corrupted, and what counts as
left behind (``.incomplete-*`` / ``.retired-*`` entries of the root)."""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

from .model import CELL_TIMEOUT_S, Cell

INTEGRITY = ("truncated-shard", "flipped-shard", "missing-manifest", "truncated-manifest",
             "corrupted-manifest", "other-attempt-manifest", "other-attempt-shard",
             "missing-file", "extra-file", "shared-shard")

#: phase -> (FaultStorage op, match) on a local root
SPOTS = {"data": ("write", "data-*"), "data-durable": ("fsync", "data-*"),
         "manifest": ("open_write", "manifest.json"), "publish": ("rename", "*.incomplete-*"),
         "publish-after": ("rename", "*.incomplete-*"), "read": ("read", "data-*"),
         "manifest-read": ("read", "manifest.json"),
         # Retention deletes step 1's verification record first, renames the
         # checkpoint out of the committed namespace (``.incomplete-deleting-<id>``),
         # then deletes that tree: "retention" kills at the rename (the record is
         # gone, the checkpoint still listed), "retention-mid" inside the tree's
         # delete (one data file gone). A pattern as loose as "step-*" would fire
         # at the record's delete and test neither.
         "retention": ("rename", "step-00000001"),
         "retention-mid": ("delete", "step-00000001.incomplete-deleting-*"),
         # an incremental save's link of an unchanged chunk's file (the new name in the attempt)
         "link": ("link", "data-c*")}

ROWS = 4  # rows of ``w`` per rank
DISK_ROWS = 2048  # on the tmpfs of the full-disk cells: 512 KiB per rank, 1 MiB a checkpoint
TMPFS = "4m"


def cells() -> list[Cell]:
    """Every local cell, the continuation cells last."""
    b = "local"
    out: list[Cell] = []
    for mode in ("sync", "async"):
        for action in ("enospc", "eio", "edquot", "timeout"):
            for phase, rank in (("data", 1), ("data-durable", 1), ("manifest", 0), ("publish", 0)):
                out.append(Cell("storage-error", "save", mode, phase, action, rank, b))
        for action in ("truncate", "flip"):
            out.append(Cell("silent-corruption", "save", mode, "data-durable", action, 1, b))
        for phase, rank in (("stage", 1), ("plan", 0), ("data", 1), ("data", 0), ("manifest", 0),
                            ("publish", 0), ("publish-after", 0), ("retention", 0),
                            ("retention-mid", 0)):
            out.append(Cell("sigkill-save", "save", mode, phase, "kill", rank, b))
        out.append(Cell("lost-rank", "save", mode, "data", "delay", 1, b))
    out.append(Cell("sigkill-load", "load", "-", "read", "kill", 1, b))
    out.append(Cell("lost-rank", "load", "-", "read", "delay", 1, b))
    out.append(Cell("storage-error", "load", "-", "read", "eio", 1, b))
    for kind in INTEGRITY:
        out.append(Cell("integrity", "integrity", "-", kind, "-", 0, b))
    return out + incremental_cells() + continuation_cells()


def incremental_cells() -> list[Cell]:
    """The cells of a root whose checkpoints share files (incremental saves
    link a frozen ``base``; the shared file's corruption is the integrity
    cell ``shared-shard``): a rank SIGKILLed while it links (sync and
    async, either rank), retention SIGKILLed in the middle of deleting a
    checkpoint whose ``base`` a kept one links, an operator's gc SIGKILLed
    there, and ``reshard gc --grace 0 --keep-last 1`` beside saves that
    link from the checkpoints it deletes."""
    b = "local"
    return [Cell("incremental", "save", "sync", "link", "kill", 1, b),
            Cell("incremental", "save", "async", "link", "kill", 0, b),
            Cell("incremental", "save", "sync", "retention-mid", "kill", 0, b),
            Cell("incremental", "gc", "-", "sweep-mid", "gc-kill", 0, b),
            Cell("incremental", "save", "sync", "data", "gc", 0, b)]


def continuation_cells() -> list[Cell]:
    """The cells that judge what comes after a fault (the README's "When
    things fail"): a disk that fills and clears, a disk retention can free,
    ``gc --grace 0`` beside the saves, a rank stopped (SIGSTOP) in each
    collective phase of a save and a load with and without a checkpoint
    timeout, a rank killed under an asynchronous save followed by the exit,
    SIGTERM while the job unwinds an exception."""
    b = "local"
    out: list[Cell] = []
    for mode in ("sync", "async"):
        for phase in ("plan", "data"):  # full before the save / fills while it writes
            out.append(Cell("enospc-clears", "save", mode, phase, "enospc", 0, b))
        out.append(Cell("full-disk", "save", mode, "plan", "-", 0, b))
        out.append(Cell("gc-concurrent", "save", mode, "data", "gc", 0, b))
    for t in (None, CELL_TIMEOUT_S):
        for phase, rank in (("stage", 1), ("data", 1), ("publish", 0)):  # phases plan, write, publish
            out.append(Cell("sigstop-save", "save", "sync", phase, "stop", rank, b, t))
        out.append(Cell("sigstop-save", "save", "async", "data", "stop", 1, b, t))
        for phase, rank in (("manifest", 0), ("read", 1)):
            out.append(Cell("sigstop-load", "load", "-", phase, "stop", rank, b, t))
    out.append(Cell("sigkill-exit", "save", "async", "data", "kill", 1, b))
    out.append(Cell("sigterm-unwinding", "save", "async", "data", "sigterm", 0, b))
    return out


# --------------------------------------------------------------------------- rank side


def rank_storage() -> Any:
    from ..storage import LocalStorage

    return LocalStorage()


def other_path(st: Any, root: str) -> str:
    return os.path.join(os.path.dirname(root), "other")


def faults_for(cell: Cell, rank: int, cdir: str, spec: dict[str, Any]) -> list[Any]:
    from .ranks import faults_for as generic

    return generic(cell, rank, cdir, spec, SPOTS, _half_delete)


def _half_delete(op: str, path: str) -> None:
    """A kill in the middle of a recursive delete (one data file gone)."""
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    for n in [n for n in names if n.startswith("data-")][:1]:
        os.unlink(os.path.join(path, n))
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt(st: Any, kind: str, ckpt: str, other: str) -> None:
    """Corrupt the committed checkpoint ``ckpt`` the way ``kind`` says."""
    data = sorted(n for n in os.listdir(ckpt) if n.startswith("data-"))
    man = os.path.join(ckpt, "manifest.json")
    f0 = os.path.join(ckpt, data[0])
    if kind == "truncated-shard":
        os.truncate(f0, os.path.getsize(f0) - 7)
    elif kind == "flipped-shard":
        with open(f0, "r+b") as f:
            f.seek(os.path.getsize(f0) - 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    elif kind == "missing-manifest":
        os.unlink(man)
    elif kind == "truncated-manifest":
        os.truncate(man, os.path.getsize(man) // 2)
    elif kind == "corrupted-manifest":
        with open(man, "r+b") as f:
            f.seek(10)
            f.write(b"\x00garbage\xff")
    elif kind == "other-attempt-manifest":
        shutil.copyfile(os.path.join(other, "manifest.json"), man)
    elif kind == "other-attempt-shard":
        shutil.copyfile(os.path.join(other, data[0]), f0)
    elif kind == "missing-file":
        os.unlink(f0)
    elif kind == "extra-file":
        with open(os.path.join(ckpt, "data-r99999-0.safetensors"), "wb") as f:
            f.write(b"junk")
    elif kind == "shared-shard":  # bit rot in a file step 2 links from step 1: both name it
        shared = sorted(n for n in data if n.startswith("data-c") and os.stat(os.path.join(ckpt, n)).st_nlink > 1)
        fs = os.path.join(ckpt, shared[0])
        with open(fs, "r+b") as f:
            f.seek(4096)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    else:
        raise ValueError(kind)


# --------------------------------------------------------------------------- parent side


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(d, n))
            except OSError:
                pass
    return total


def matrix_cells(*, quick: bool = False) -> list[Cell]:
    """This backend's cells of the matrix: its own and the shared-root ones
    (``quick``: :func:`reshard.faults.model.quick_subset` of them)."""
    from .model import quick_subset
    from .shared import cells as shared_cells

    out = cells() + shared_cells(LocalBackend.name)
    return quick_subset(out) if quick else out


def open_backend(server: str = "") -> LocalBackend:
    """The matrix's store for a run (``server``: unused here)."""
    return LocalBackend()


class LocalBackend:
    """The local file system as the matrix's store (a directory per cell, a
    tmpfs of ``TMPFS`` where the cell needs a real full disk)."""

    name = "local"
    env: dict[str, str] = {}

    def rows(self, cell: Cell) -> int:
        return DISK_ROWS if cell.fault_class == "full-disk" else ROWS

    def root(self, cdir: str, cell: Cell) -> str:
        return os.path.join(cdir, "disk" if cell.on_tmpfs else "", "root")

    def storage(self) -> Any:
        return rank_storage()

    def arm(self, cell: Cell, root: str) -> list[Any]:
        return []

    def disarm(self) -> None:
        pass

    def stray(self, st: Any, root: str, res: Any) -> list[str]:
        """Names of the root's entries that are neither committed nor records."""
        return [n for n in sorted(os.listdir(root)) if ".incomplete-" in n or ".retired-" in n]

    def after_gc(self, st: Any, root: str) -> list[str]:
        return self.stray(st, root, None)

    def usage(self, st: Any, root: str) -> tuple[int, int]:
        """``(bytes under root, bytes of its stray entries)``."""
        if not os.path.isdir(root):
            return 0, 0
        return _tree_bytes(root), sum(_tree_bytes(os.path.join(root, n))
                                      for n in self.stray(st, root, None))

    def before_gc(self, st: Any, root: str) -> None:
        pass

    def close(self) -> None:
        pass
