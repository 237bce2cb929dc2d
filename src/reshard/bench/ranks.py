"""Rank side of ``reshard bench io``: module-level functions run on every rank
of a :class:`reshard.testing.pool.WorkerPool` group (real gloo ranks, one
torch thread each). The workload stays in the worker between tasks (``_W``).

Every timed call is bracketed by barriers: ``total_s`` is barrier to barrier
(the slowest rank's time, the same on every rank), ``own_s`` this rank's own
call. Each call returns a JSON-safe dict; the parent builds the records.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import reshard

from ..formats.hf_write import _fsync_file
from ..testing.memory import PeakRSS
from . import digest
from .limits import _read_limit, _write_fsync
from .models import GridWorkload, LayoutSpec, build, parse_layout
from .ranks_base import (
    _W,
    _local_dir,
    _malloc_trim,
    _nbytes,
    _owned,
    _rank,
    _reshard_load,
    _timed,
    _views,
    _w,
    drop,
)
from .ranks_tc import (
    _tc_async_saver,
    _tc_checkpoint,
    _tc_load,
    _tc_load_small,
    _tc_sync_saver,
    end_tc,
)
from .usage import Usage

SAVE_METHODS = ("limit-write", "reshard", "reshard-nocheck", "dcp", "tc", "tc+sync", "torch-save",
                "safetensors")
ASYNC_METHODS = ("memcpy", "reshard-async", "dcp-async", "dcp-async-process", "tc-async")
LOAD_METHODS = ("limit-read", "reshard", "reshard-nocheck", "reshard-verify-first", "dcp", "dcp-threads",
                "tc", "torch-load", "safetensors")
#: the methods of torch_checkpointing (meta-pytorch's ``torch-checkpointing``, an optional peer)
TC_METHODS = ("tc", "tc+sync", "tc-async")


# ------------------------------------------------------------------ torch_checkpointing
def tc_available() -> bool:
    """Whether torch_checkpointing (PyPI ``torch-checkpointing``) is installed."""
    import importlib.util

    return importlib.util.find_spec("torch_checkpointing") is not None


def tc_probe(base: str) -> dict[str, Any]:
    """torch_checkpointing's default writer (O_DIRECT) tried first on a small
    state; when it fails (EINVAL on file systems without O_DIRECT), its
    buffered writer is used for every measurement after (``direct_io``
    False, ``error`` the failure)."""
    import torch_checkpointing as tc
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    d = f"{base}-tc-probe-r{_rank()}"
    os.makedirs(d, exist_ok=True)
    err = None
    saver = tc.make_sync_checkpoint_saver(storage_config=LocalFileSystemStorageConfig(use_direct_io=True),
                                          rank_info=tc.RankInfo(global_world_size=1, global_rank=0,
                                                                role_rank=0, role_world_size=1))
    try:
        saver.save(os.path.join(d, "ck"), _tc_checkpoint({"w": torch.ones(1 << 16)}))
    except OSError as e:
        err = f"{type(e).__name__}: {e}"
    finally:
        saver.close()
        shutil.rmtree(d, ignore_errors=True)
    _W["tc_direct_io"] = err is None
    dist.barrier()
    return {"rank": _rank(), "direct_io": err is None, "error": err}


# ------------------------------------------------------------------------------- setup
def setup(model: str, layout: str, synthetic_mib: float, seq_len: int,
          profile_dir: str | None = None, synthetic_width: int | None = None) -> dict[str, Any]:
    """Build this rank's workload (one training step creates the moments);
    with ``profile_dir``, the timed reshard calls are profiled there."""
    _W.clear()
    gc.collect()
    _W["profile_dir"] = profile_dir
    spec: LayoutSpec = parse_layout(layout).on(dist.get_world_size())
    t0 = time.perf_counter()
    w = _W["w"] = build(model, spec, synthetic_mib=synthetic_mib, seq_len=seq_len,
                        synthetic_width=synthetic_width)
    build_s = time.perf_counter() - t0
    ts = w.tensors()
    local = _nbytes(ts)
    _W["bg_pg"] = dist.new_group(backend="gloo")  # DCP's background collectives
    d = digest.state_digest(w.reshard_state())
    params = sum(p.numel() for p in w.model.parameters())
    if isinstance(w, GridWorkload):  # each rank holds its stage's TP shards: the logical count
        n = torch.tensor([params if w.trainer.g.dp_rank == 0 else 0], dtype=torch.int64)
        dist.all_reduce(n)
        params = int(n)
    return {"rank": _rank(), "local_bytes": local, "logical_bytes": d["bytes"], "tensors": len(ts),
            "params": params, "build_s": build_s, "layout": str(spec), "peers": w.peers,
            "fingerprint": d["digest"], "digest_tensors": d["tensors"],
            "replicas_differ": d["replicas_differ"]}


def trim() -> None:
    """Free what the async phases hold: reshard's staging pools, the memcpy
    targets, DCP's stager and its checkpoint process (and the state copies it
    keeps in shared memory)."""
    from ..saving import staging

    staging.wait_all()
    for saver in staging.SAVERS.values():
        saver.pool.trim()
    tca = _W.pop("tc_async", None)  # torch_checkpointing's process and shared-memory buffers
    if tca is not None:
        tca.close()
    _W.pop("copy_dst", None)
    _W.pop("stager", None)
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = ape._CHECKPOINT_PROCESS  # DCP's checkpoint process, if the process mode ran
    if proc is not None:
        proc.__del__()  # asks it to terminate, then SIGTERM
        ape._CHECKPOINT_PROCESS = None
    gc.collect()
    _malloc_trim()


def release() -> None:
    """Free this rank's workload, buffers and async staging pools (between world sizes)."""
    trim()
    end_tc()
    _W.clear()
    gc.collect()


def end_dcp_process() -> None:
    """End DCP's checkpoint process (process-mode ``async_save``) and close
    its stager. Left alive, the process and its shared-memory copy of the
    state stay to the end of the run and slow what is measured after them
    (measured: a warm 1-rank gpt2-small ``reshard.load`` 0.31 s without the
    process, 0.51 s with it idle beside it)."""
    st = _W.pop("stager", None)
    if st is not None:
        st.close()
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:  # a torch without process mode
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    ape._CHECKPOINT_PROCESS = None
    if proc is not None:
        proc.__del__()  # sends TERMINATE and joins (SIGTERM after 5 s); safe to run twice
    gc.collect()


def fingerprint() -> str:
    """The bit-exact, layout-independent digest of the state's tensors
    (:func:`reshard.bench.digest.state_digest`; a collective)."""
    return str(digest.state_digest(_w().reshard_state())["digest"])


# --------------------------------------------------------------------------------- saves
def save(method: str, path: str, limit_bytes: list[int]) -> dict[str, Any]:
    """One timed save of the whole state with ``method`` (see SAVE_METHODS);
    ``limit-write`` writes ``limit_bytes[rank]`` bytes of this rank's tensors."""
    w = _w()
    rank = _rank()
    res: dict[str, Any] = {"rank": rank}
    if method == "limit-write" and path.startswith("s3://"):
        from .objstore import put_limit

        views = _views()
        dist.barrier()
        n, own, total = _timed(lambda: put_limit(f"{path}/r{rank:05d}.bin", views, limit_bytes[rank]))
        res.update(bytes=n, files=1)
    elif method == "limit-write":
        d = _local_dir(path)
        views = _views()
        dist.barrier()
        n, own, total = _timed(lambda: _write_fsync(os.path.join(d, f"r{rank:05d}.bin"), views,
                                                       limit_bytes[rank]))
        res.update(bytes=n, files=1)
    elif method in ("reshard", "reshard-nocheck"):
        opts = reshard.SaveOptions(checksums=method == "reshard")
        state = w.reshard_state()
        out, own, total = _timed(lambda: reshard.save(state, path, step=1, options=opts), f"save-{method}")
        res.update(bytes=out.bytes_written, timings=out.timings, total_bytes=out.total_bytes,
                   files=out.num_files)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        state = w.dcp_state()
        _, own, total = _timed(lambda: dcp.save(state, checkpoint_id=path))
        res.update(bytes=os.path.getsize(os.path.join(path, f"__{rank}_0.distcp")))
    elif method in ("tc", "tc+sync"):  # torch_checkpointing: never fsyncs; "+sync" adds os.sync()
        saver = _tc_sync_saver()
        ck = _tc_checkpoint(w.dcp_state())

        def tc_save() -> None:
            saver.save(path, ck)
            if method == "tc+sync":
                os.sync()

        _, own, total = _timed(tc_save)
        mine = os.path.join(path, f"state_{rank}.pt")
        res.update(bytes=os.path.getsize(mine) if os.path.exists(mine) else 0)
    elif method in ("torch-save", "safetensors"):
        d = _local_dir(path)
        owned = _owned()
        f = os.path.join(d, f"r{rank:05d}." + ("pt" if method == "torch-save" else "safetensors"))

        def run() -> None:
            if method == "torch-save":
                torch.save(owned, f)
            else:
                from safetensors.torch import save_file

                save_file(owned, f)
            _fsync_file(f)

        _, own, total = _timed(run)
        res.update(bytes=os.path.getsize(f), files=1)
    else:
        raise ValueError(f"unknown save method {method!r}")
    res.update(own_s=own, total_s=total)
    return res


def bytes_written_by(path: str) -> int:
    """Bytes of this rank's files in a checkpoint directory (for the stored size)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def quiet(settle: float) -> None:
    """No pending writeback from earlier phases: ``os.sync`` then rest."""
    if _rank() == 0:
        os.sync()
    time.sleep(settle)
    dist.barrier()


# ---------------------------------------------------------------------------------- async
def _memcpy_targets() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if "copy_dst" not in _W:
        src = [t for t in _w().tensors() if t.numel()]
        _W["copy_dst"] = [torch.empty_like(t).fill_(0) for t in src]  # preallocated, touched
    return [t for t in _w().tensors() if t.numel()], _W["copy_dst"]


def _memcpy() -> None:
    src, dst = _memcpy_targets()
    for s, d in zip(src, dst, strict=True):
        d.copy_(s)


def start_async(method: str, path: str, state: Any = None) -> tuple[float, Any]:
    """Start one asynchronous save of the workload's state (or ``state``);
    ``(stall seconds, the handle or future)``."""
    w = _w()
    if method == "reshard-async":
        state = w.reshard_state() if state is None else state
        t0 = time.perf_counter()
        h = reshard.async_save(state, path, step=1)
        return time.perf_counter() - t0, h
    if method == "tc-async":  # stall: until its staging future is done (the caller may mutate)
        saver = _tc_async_saver()
        ck = _tc_checkpoint(w.dcp_state() if state is None else state)
        t0 = time.perf_counter()
        staged, written = saver.save(path, ck)
        staged.result()
        return time.perf_counter() - t0, written
    import torch.distributed.checkpoint as dcp

    state = w.dcp_state() if state is None else state
    if method == "dcp-async":
        t0 = time.perf_counter()
        f = dcp.async_save(state, checkpoint_id=path, process_group=_W["bg_pg"])
        return time.perf_counter() - t0, f
    if method == "dcp-async-process":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if "stager" not in _W:  # DCP's pinned-memory stager (pinned only where CUDA is)
            cuda = torch.cuda.is_available()
            _W["stager"] = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                        use_async_staging=cuda,
                                                        use_non_blocking_copy=cuda))
        import multiprocessing

        # DCP starts its checkpoint process on the first call (from a thread of
        # its own); a pool worker is a daemonic process, which multiprocessing
        # forbids to have children: this worker stops calling itself daemonic
        # (the pool still kills it; release() ends DCP's process)
        multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        f = dcp.async_save(state, checkpoint_id=path, process_group=_W["bg_pg"],
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                           async_stager=_W["stager"])
        return time.perf_counter() - t0, f
    raise ValueError(f"unknown async method {method!r}")


def _done(h: Any) -> bool:
    if isinstance(h, reshard.SaveHandle):
        return h.done()
    f = getattr(h, "upload_completion", h)
    return bool(f.done())


def _all_done(h: Any) -> bool:
    """Whether the save is done on every rank (one all-reduce): the ranks
    then run the same number of training steps (each step's collectives,
    FSDP's all-gathers, must match; a rank that saw its save done a step
    before another waited in the next barrier while the other all-gathered:
    a hang of the 2-rank gpt2-small run)."""
    flag = torch.tensor([int(_done(h))], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _wait(h: Any) -> Any:
    if isinstance(h, reshard.SaveHandle):
        return h.wait()
    f = getattr(h, "upload_completion", h)
    return f.result()


def async_save(method: str, path: str) -> dict[str, Any]:
    """One asynchronous save: the foreground stall and the time to commit after it."""
    res: dict[str, Any] = {"rank": _rank()}
    if method == "memcpy":
        _memcpy_targets()
        with Usage() as u:
            _, own, total = _timed(_memcpy)
        res.update(stall_s=own, total_s=total, own_s=own, minflt=u.minflt, stall_cpu_s=u.cpu_s)
        return res
    dist.barrier()
    with Usage() as u:  # the staging copies: the caller's CPU, the page faults
        stall, h = start_async(method, path)
    t1 = time.perf_counter()
    with Usage() as ub:
        out = _wait(h)
    bg = time.perf_counter() - t1
    dist.barrier()
    res.update(stall_s=stall, background_s=bg, own_s=stall + bg, minflt=u.minflt,
               stall_cpu_s=u.cpu_s, background_cpu_s=ub.others_cpu_s)
    if isinstance(out, reshard.SaveResult):
        res.update(timings=out.timings, bytes=out.bytes_written)
    return res


# ---------------------------------------------------------------------------------- train
def train(methods: list[str], base: str, steps: int, settle: float, saves: int = 1,
          min_steps: int = 3, max_extra: int = 2) -> dict[str, Any]:
    """Step times with no save in flight, and while each method's background
    save is in flight (a real forward/backward/AdamW step of the workload);
    ``saves`` background saves per method (order rotated), then up to
    ``max_extra`` more of a method while fewer than ``min_steps`` of its
    steps were timed during a save on some rank (a save shorter than two
    steps gives one sample; the ranks agree on the count); ``save_s`` their
    median time from start to commit."""
    w = _w()
    out: dict[str, Any] = {"rank": _rank(), "no_save": [], "during": {m: [] for m in methods}, "save_s": {},
                           "no_save_cpu": [], "during_cpu": {m: [] for m in methods},
                           "save_cpu_s": {m: [] for m in methods}, "others_cpu_per_s": [],
                           "state_bytes": _nbytes(w.tensors())}
    took: dict[str, list[float]] = {m: [] for m in methods}
    w.step()

    def one(m: str, i: int) -> None:
        p = f"{base}-{m}-{i}"
        quiet(settle)
        with Usage() as quiet_u:
            for _ in range(steps):
                c0, t0 = time.thread_time(), time.perf_counter()
                w.step()
                out["no_save"].append(time.perf_counter() - t0)
                out["no_save_cpu"].append(time.thread_time() - c0)
        # the other threads' CPU with no save in flight (autograd, gloo), per second of steps
        out["others_cpu_per_s"].append(quiet_u.others_cpu_s / max(sum(out["no_save"][-steps:]), 1e-9))
        dist.barrier()
        xs: list[float] = []
        # the save's CPU seconds: the process's other threads (the background save,
        # its writers, the gloo threads of its collectives) while it is in flight
        with Usage() as u:
            _, h = start_async(m, p)
            t_start = time.perf_counter()
            while not _all_done(h):
                c0, t0 = time.thread_time(), time.perf_counter()
                w.step()
                xs.append(time.perf_counter() - t0)
                out["during_cpu"][m].append(time.thread_time() - c0)
            _wait(h)
        took[m].append(time.perf_counter() - t_start)
        window = time.perf_counter() - t_start
        out["save_cpu_s"][m].append(max(0.0, u.others_cpu_s - out["others_cpu_per_s"][-1] * window))
        out["during"][m].extend(xs)
        drop(p)

    order = [m for i in range(saves) for m in methods[i % len(methods):] + methods[:i % len(methods)]]
    for i, m in enumerate(order):
        one(m, i)
    for extra in range(max_extra):
        counts = torch.tensor([len(out["during"][m]) for m in methods])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        short = [m for m, n in zip(methods, counts.tolist(), strict=True) if n < min_steps]
        for m in short:
            one(m, len(order) + extra * len(methods) + methods.index(m))
    out["save_s"] = {m: sorted(v)[len(v) // 2] for m, v in took.items()}
    return out


def step_time() -> float:
    t0 = time.perf_counter()
    _w().step()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- loads
def cold_save(path: str, root: str) -> dict[str, Any]:
    """The first ``reshard.save`` of this (freshly started) process's state,
    with no warm-up call, then a ``CheckpointManager.save`` of it under
    ``root`` as ``reshard demo`` saves (``every_steps=1``, no retention)."""
    w = _w()
    _, own, total = _timed(lambda: reshard.save(w.reshard_state(), path, step=1))
    mgr = reshard.CheckpointManager(root, every_steps=1, keep_last=None, preempt_signals=())
    _, own2, total2 = _timed(lambda: mgr.save(1, w.reshard_state()))
    verify = None
    if _rank() == 0:  # the manager's check after each commit, on the coordinator: again, as a dry run
        t0 = time.perf_counter()
        mgr.verify_checkpoint(1, record=False)
        verify = time.perf_counter() - t0
    dist.barrier()
    return {"rank": _rank(), "own_s": [own], "total_s": [total], "manager_own_s": [own2],
            "manager_total_s": [total2], "manager_verify_s": verify}


def cold_restore(root: str, verify_fp: str) -> dict[str, Any]:
    """``CheckpointManager.restore`` of ``root`` into this (freshly started)
    process's state, the first load call here, as ``reshard demo`` restores;
    the state checked against ``verify_fp``."""
    w = _w()
    mgr = reshard.CheckpointManager(root, every_steps=1, keep_last=None, preempt_signals=())
    res, own, total = _timed(lambda: mgr.restore(w.reshard_state()))
    w.after_load()
    return {"rank": _rank(), "own_s": [own], "total_s": [total], "found": res is not None,
            "fingerprint_ok": fingerprint() == verify_fp}


def load(method: str, path: str, repeat: int, verify_fp: str | None = None, warm: bool = True) -> dict[str, Any]:
    """Warm load (one untimed call first; none with ``warm=False``), then
    ``repeat`` timed ones."""
    w = _w()
    rank = _rank()
    res: dict[str, Any] = {"rank": rank, "own_s": [], "total_s": [], "timings": [], "cpu_s": []}
    local = _nbytes(w.tensors())
    fn: Callable[[], Any]
    if method == "limit-read":
        read_buf = torch.empty(local, dtype=torch.uint8).fill_(0)  # preallocated, touched
        mv = memoryview(read_buf.numpy().data)
        if path.startswith("s3://"):
            from .objstore import get_limit

            fn = lambda: get_limit(path, mv)  # noqa: E731
        else:
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if not f.endswith(".json"))
            fn = lambda: _read_limit(files, mv)  # noqa: E731
    elif method in ("reshard", "reshard-nocheck", "reshard-verify-first"):
        opts = reshard.LoadOptions(checksums=method != "reshard-nocheck",
                                   verify_first=method == "reshard-verify-first")
        fn = lambda: _reshard_load(path, opts)  # noqa: E731
    elif method in ("dcp", "dcp-threads"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        def fn() -> None:
            sd = w.dcp_state()
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(w.model, w.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif method == "tc":
        fn = lambda: _tc_load(path)  # noqa: E731
    elif method in ("torch-load", "safetensors"):
        owned = _owned()
        f = os.path.join(path, f"r{rank:05d}." + ("pt" if method == "torch-load" else "safetensors"))

        def fn() -> None:
            if method == "torch-load":
                got = torch.load(f, weights_only=True)
            else:
                from safetensors.torch import load_file

                got = load_file(f)
            with torch.no_grad():
                for k, t in owned.items():
                    t.copy_(got[k])
    else:
        raise ValueError(f"unknown load method {method!r}")
    threads = torch.get_num_threads()
    if method == "dcp-threads":
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        if warm:
            fn()  # warm: page cache, first-call imports
        for _ in range(repeat):
            with Usage() as u:  # process CPU: the reader threads' too
                out, own, total = _timed(fn, f"load-{method}" if method.startswith("reshard") else None)
            res["cpu_s"].append(u.cpu_s)
            res["own_s"].append(own)
            res["total_s"].append(total)
            if isinstance(out, reshard.LoadResult):
                res["timings"].append(out.timings)
                res["bytes"] = out.bytes_read
    finally:
        torch.set_num_threads(threads)
    res.setdefault("bytes", local)
    gc.collect()
    _malloc_trim()  # torch.load / load_file / DCP buffers: freed, and given back
    if verify_fp is not None:
        got_fp = fingerprint()
        res["fingerprint_ok"] = got_fp == verify_fp
    return res


# ------------------------------------------------------------------------------------ RSS
def rss(method: str, path: str, saves: int = 2) -> dict[str, Any]:
    """Peak extra RSS of one call of ``method`` ("save", "async-save"
    (``saves`` consecutive ones, each committed), "load", "dcp-save", "dcp-load")."""
    w = _w()
    out: dict[str, Any] = {"rank": _rank(), "state_bytes": _nbytes(w.tensors())}
    if method == "async-save":
        extras = []
        for i in range(saves):
            p = f"{path}-{i}"
            dist.barrier()
            with PeakRSS() as m:
                _, h = start_async("reshard-async", p)
                _wait(h)
            extras.append(max(m.sampled_extra, m.hwm_extra or 0))
            drop(p)
        out["extra"] = extras
        return out
    import torch.distributed.checkpoint as dcp

    fns: dict[str, Callable[[], Any]] = {
        "save": lambda: reshard.save(w.reshard_state(), path, step=1),
        "load": lambda: _reshard_load(path),
        "dcp-save": lambda: dcp.save(w.dcp_state(), checkpoint_id=path),
        "dcp-load": lambda: dcp.load(w.dcp_state(), checkpoint_id=path),
    }
    if method.endswith("load"):
        fns[method]()  # warm
    dist.barrier()
    with PeakRSS() as m:
        fns[method]()
    dist.barrier()
    out["extra"] = [max(m.sampled_extra, m.hwm_extra or 0)]
    return out


def warm(base: str, methods: list[str]) -> None:
    """First-call costs (imports, DCP planner, staging pool) paid on a tiny
    state, outside every timed call."""
    import torch.distributed.checkpoint as dcp

    small = {"w": torch.ones(4, 4)}
    for m in methods:
        p = f"{base}-{m}"
        if m == "reshard":
            reshard.save(small, p, step=1)
            reshard.load({"w": torch.zeros(4, 4)}, p)
        elif m == "reshard-async":
            reshard.async_save(small, p, step=1).wait()
        elif m == "dcp":
            dcp.save(small, checkpoint_id=p)
            dcp.load({"w": torch.zeros(4, 4)}, checkpoint_id=p)
        elif m == "dcp-async":
            _wait(dcp.async_save(small, checkpoint_id=p, process_group=_W["bg_pg"]))
        elif m == "dcp-async-process":  # starts DCP's checkpoint process
            _wait(start_async(m, p, small)[1])
        elif m == "tc":
            _tc_load_small(p)
        elif m == "tc-async":  # starts its checkpoint process
            _wait(start_async(m, p, small)[1])
        drop(p)


