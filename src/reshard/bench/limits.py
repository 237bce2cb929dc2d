"""The machine's limits on local storage for ``reshard bench io``: one
writer per rank ``os.write`` + ``fsync`` of as many bytes as reshard wrote
(wrapping around the rank's tensors), and single-thread sequential
``os.preadv`` of the checkpoint's own files from the page cache into
preallocated memory. The S3 limits are :mod:`reshard.bench.objstore`."""

from __future__ import annotations

import os
from collections.abc import Iterator


def _cycle(views: list[memoryview], nbytes: int) -> Iterator[memoryview]:
    """The first ``nbytes`` of ``views`` one after another, wrapping around
    them when they hold fewer bytes (a limit writes as many bytes as reshard did)."""
    views = [mv.cast("B") for mv in views if mv.nbytes]
    done = 0
    while views and done < nbytes:
        for mv in views:
            mv = mv[:nbytes - done]
            if mv:
                yield mv
                done += len(mv)
            if done >= nbytes:
                return


def _write_fsync(path: str, views: list[memoryview], nbytes: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    try:
        for mv in _cycle(views, nbytes):
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
                done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def _read_limit(files: list[str], buf: memoryview) -> None:
    """Read the files one after another (sequential ``os.preadv``, one thread)
    into ``buf`` until it is full, wrapping around the files."""
    off_buf, i = 0, 0
    while off_buf < len(buf):
        fd = os.open(files[i % len(files)], os.O_RDONLY)
        try:
            off = 0
            while off_buf < len(buf):
                n = os.preadv(fd, [buf[off_buf:]], off)
                if n == 0:
                    break
                off += n
                off_buf += n
        finally:
            os.close(fd)
        i += 1
