"""``reshard plan CKPT --layout L``: a dry run of a load into another layout
(engine: :mod:`reshard.planning.dryrun`)."""

from __future__ import annotations

import time
from typing import Any

import click

from ..errors import CoverageError
from .support import CHECK_FAILED, USAGE, fail, human_bytes, json_option, table, write_json

#: rows of the per-rank table printed at most (--json has every rank)
MAX_ROWS = 32


def measure_read_rate(path: str, files: list[str], sample_bytes: int) -> tuple[float, int]:
    """Bytes per second of one sequential reader of the checkpoint's own data
    files through its storage backend (4 MiB reads into one preallocated
    buffer, files in order, at most ``sample_bytes``). Returns (rate, bytes read).
    A local file system may serve them from the page cache."""
    from ..storage import resolve

    st, key = resolve(path)
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    done = 0
    t0 = time.perf_counter()
    for name in files:
        p = st.join(key, name)
        size = st.size(p)
        off = 0
        while off < size and done < sample_bytes:
            n = min(len(buf), size - off, sample_bytes - done)
            st.read_into(p, off, mv[:n])
            off += n
            done += n
        if done >= sample_bytes:
            break
    secs = time.perf_counter() - t0
    return (done / secs if secs > 0 and done else 0.0), done


@click.command("plan")
@click.argument("ckpt")
@click.option("--layout", "layout_text", required=True, metavar="L",
              help="Target layout: 'tp2,pp2,dp2' (any order, missing degrees 1), 'dp4', 'fsdp8' "
                   "or a world size ('8': FSDP).")
@click.option("--read-rate", type=click.FloatRange(0, None, min_open=True), default=None,
              metavar="MB/S", help="The store's read rate per rank (MB/s) instead of measuring it.")
@click.option("--sample", "sample_mib", type=click.IntRange(1, None), default=64, show_default=True,
              help="MiB of the checkpoint's files read to measure the store's read rate.")
@click.option("--read-once-min-bytes", type=click.IntRange(0, None), default=64 << 10, show_default=True,
              help="As LoadOptions.read_once_min_bytes: smaller ranges are read by every rank needing them.")
@json_option
def plan_cmd(ckpt: str, layout_text: str, read_rate: float | None, sample_mib: int,
             read_once_min_bytes: int, json_path: str | None) -> None:
    """Without loading anything: whether a load of CKPT into layout L is
    covered, and per target rank the bytes and files it reads (replicas read
    once: a range several ranks need is read by one), the largest rank, and
    an estimated time from the store's read rate (measured on the
    checkpoint's own files, or --read-rate).

    Exits 0 when covered, 1 when the layout needs a region no saved chunk
    holds (the first one is named), 2 on a usage error.
    """
    from ..planning.dryrun import parse_target_layout, plan_layout
    from .support import _manifest

    try:
        layout = parse_target_layout(layout_text)
    except ValueError as bad:
        fail(USAGE, str(bad))
    m = _manifest(ckpt)
    try:
        lp = plan_layout(m, layout, read_once_min_bytes=read_once_min_bytes)
    except CoverageError as why:
        write_json(json_path, {"checkpoint": ckpt, "layout": str(layout), "world": layout.world,
                               "covered": False, "error": str(why)})
        fail(CHECK_FAILED, f"{ckpt}: not covered: {why}")
    measured = read_rate is None
    sampled = 0
    if read_rate is None:
        try:
            rate, sampled = measure_read_rate(ckpt, sorted(m.files), sample_mib << 20)
        except (OSError, ValueError) as err:
            fail(USAGE, f"{ckpt}: cannot measure the store's read rate ({err}); pass --read-rate")
    else:
        rate = read_rate * 1e6
    big = lp.ranks[lp.largest] if lp.ranks else None

    def est(n: int) -> float | None:
        return n / rate if rate > 0 else None

    click.echo(f"{ckpt} (step {m.step}) into {lp.layout} ({lp.world} ranks): covered")
    rows: list[list[Any]] = []
    for r in lp.ranks[:MAX_ROWS]:
        e = est(r.read_bytes)
        rows.append([r.rank, " ".join(f"{k}{v}" for k, v in r.coords.items()), human_bytes(r.needed_bytes),
                     human_bytes(r.read_bytes), f"{r.received}/{r.ranges}", len(r.files),
                     "-" if e is None else f"{e:.3f}"])
    table(["rank", "coords", "needs", "reads", "received", "files", "est. s"], rows, right=(0, 2, 3, 4, 5, 6))
    if len(lp.ranks) > MAX_ROWS:
        click.echo(f"  ... and {len(lp.ranks) - MAX_ROWS} more ranks (--json has every rank)")
    how = (f"measured on {human_bytes(sampled)} of its files" if measured else "given")
    click.echo(f"store read rate: {rate / 1e6:.1f} MB/s per rank ({how})")
    if big is not None:
        e = est(big.read_bytes)
        click.echo(f"largest rank: {big.rank} reads {human_bytes(big.read_bytes)} from {len(big.files)} "
                   f"file(s)" + ("" if e is None else f", est. {e:.3f} s (every rank reading at once at "
                                 "that rate)"))
        worst = max(lp.ranks, key=lambda r: r.read_bytes_alone)
        alone = est(worst.read_bytes_alone)
        click.echo(f"all ranks read {human_bytes(lp.total_read_bytes)} from storage; without replicas read "
                   f"once the largest "
                   f"rank reads {human_bytes(worst.read_bytes_alone)}"
                   + ("" if alone is None else f" (est. {alone:.3f} s)"))
    write_json(json_path, {
        "checkpoint": ckpt, "step": m.step, "layout": lp.layout, "world": lp.world, "covered": True,
        "total_read_bytes": lp.total_read_bytes, "largest_rank": lp.largest,
        "read_rate_bytes_per_s": rate, "read_rate_measured": measured, "read_rate_sample_bytes": sampled,
        "est_seconds": None if big is None else est(big.read_bytes),
        "ranks": [{"rank": r.rank, "coords": r.coords, "needed_bytes": r.needed_bytes,
                   "read_bytes": r.read_bytes, "read_bytes_alone": r.read_bytes_alone,
                   "files": list(r.files), "ranges": r.ranges, "received": r.received,
                   "est_seconds": est(r.read_bytes)} for r in lp.ranks],
    })
