"""The failure budget (DESIGN section 1): a fault costs at most the save it
hit. Real processes (gloo ranks), a real tmpfs for ENOSPC (skipped where
``mount`` is not allowed)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from _fault_cost_fns import r_async_enospc_then_next_save, r_full_disk, r_gated_saves
from reshard.testing.pool import WorkerPool


@pytest.fixture
def tmpfs(mount_tmpfs: Callable[[str], Path]) -> Path:
    """A 4 MiB tmpfs (needs root and mount permission; skipped elsewhere)."""
    return mount_tmpfs("4m")


@pytest.mark.timeout(120)
def test_failed_async_save_never_costs_the_next(pool: WorkerPool, tmpfs: Path) -> None:
    """A background save on a full disk (a real tmpfs) is reported at once (one line on
    the coordinator naming step, path and cause; the hook on every rank; the
    handle), and the next maybe_save saves its own step once there is room."""
    root = str(tmpfs / "ckpts")
    outs = pool.run(2, r_async_enospc_then_next_save, root, timeout=100)
    for rank, o in enumerate(outs):
        assert o["err"] == "StorageError"
        assert o["hooked"] == [(2, f"{root}/step-00000002", "StorageError")]
        assert o["step3"] == 3
        assert o["latest"] == f"{root}/step-00000003"
        assert o["warned"] == []  # the hook reported it: no second report
        assert o["attempts_left"] == []  # the failed attempt was removed at once
        if rank == 0:
            assert len(o["lines"]) == 1 and "not enough space" in o["lines"][0], o["lines"]
            assert f"{root}/step-00000002" in o["lines"][0]
        else:
            assert o["lines"] == []


def _attempts(root: Path) -> list[Path]:
    return [p for p in root.glob("*.incomplete-*") if p.is_dir()]


def _when(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(150)
def test_gc_never_deletes_a_leased_attempt(pool: WorkerPool, tmp_path: Path) -> None:
    """`reshard gc --grace 0` beside a running save (2 gloo ranks) keeps its
    attempt and says it is in progress; an attempt removed anyway (rm -rf)
    fails its save with a CheckpointError saying so, never a raw OSError."""
    root = tmp_path / "ckpts"
    gates = [str(tmp_path / "gate1"), str(tmp_path / "gate2")]
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(pool.run(2, r_gated_saves, str(root), gates,
                                                             timeout=120)))
    th.start()
    try:
        _when(lambda: len(_attempts(root)) == 1, "the first attempt")
        attempt = _attempts(root)[0]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        r = subprocess.run([sys.executable, "-m", "reshard.cli", "gc", str(root), "--grace", "0"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert re.search(rf"kept attempt {attempt.name}: in progress \(lease renewed \d+ s ago\)",
                         r.stdout), r.stdout
        assert attempt.is_dir()
        r = subprocess.run([sys.executable, "-m", "reshard.cli", "ls", str(root)],
                           capture_output=True, text=True, env=env, timeout=60)
        assert f"{attempt.name}  in progress (lease renewed" in r.stdout, r.stdout
        Path(gates[0]).touch()
        _when(lambda: (root / "step-00000001").is_dir() and len(_attempts(root)) == 1,
              "the second attempt")
        second = _attempts(root)[0]
        shutil.rmtree(second)  # removed anyway, under the running save
        Path(gates[1]).touch()
    finally:
        for g in gates:
            Path(g).touch()
        th.join(timeout=130)
    outs = got[0]
    for o in outs:
        assert o[0] == f"committed {root}/step-00000001"
        assert o[1].startswith("CheckpointError: ") and "was removed while the save ran" in o[1], o[1]
        assert second.name in o[1]
    assert not list(root.glob("*.lease.json"))  # leases end with their saves


def test_verify_records_a_failure_that_ls_then_shows(tmp_path: Path) -> None:
    """`reshard verify` of a bit-flipped checkpoint (its passing record
    still bound to the same manifest and sizes) records the failure:
    `reshard ls` says failed, retention counts it unverified."""
    import torch

    import reshard
    from reshard import CheckpointManager

    root = tmp_path / "ckpts"
    mgr = CheckpointManager(str(root), preempt_signals=(), options=reshard.SaveOptions(durable=False))
    mgr.save(1, {"w": torch.arange(4096, dtype=torch.float32)})
    assert mgr.is_verified("step-00000001")
    data = next((root / "step-00000001").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0x40  # inside the tensor bytes, same size
    data.write_bytes(bytes(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "verify", str(root / "step-00000001")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and r.stdout.startswith("FAILED"), r.stdout + r.stderr
    assert not mgr.is_verified("step-00000001")
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "ls", str(root)],
                       capture_output=True, text=True, env=env, timeout=60)
    row = next(ln for ln in r.stdout.splitlines() if ln.rstrip().endswith("step-00000001"))
    assert " failed " in row and " verified " not in row, r.stdout
    assert (root / "step-00000001").is_dir()  # nothing renamed


@pytest.mark.timeout(150)
def test_full_disk_frees_itself(pool: WorkerPool, tmpfs: Path) -> None:
    """A restart with keep_last=1 on a disk full of older checkpoints saves
    (retention frees what it no longer keeps first); async saves with
    keep_last=1 hold at most 1 committed + 1 being written; a checkpoint that
    cannot fit fails before writing, naming needed and free bytes."""
    (tmpfs / "ballast").write_bytes(b"\0" * (512 << 10))  # 3.5 MiB left: three 1 MiB checkpoints
    root = str(tmpfs / "ckpts")
    assert pool.run(2, r_full_disk, root, "fill", timeout=100)[0]["latest"] == f"{root}/step-00000003"
    outs = pool.run(2, r_full_disk, root, "restart", timeout=100)
    o = outs[0]
    assert o["sync"] == 4, o["sync"]
    assert o["after_sync"] == (1, 0)
    assert all(done <= 1 and done + att <= 2 for done, att in o["async_seen"]), o["async_seen"]
    assert o["latest"] == f"{root}/step-00000008"
    assert re.search(r"not enough space for the checkpoint of step 9: it needs about \d+ bytes "
                     r"\([\d.]+ MiB\), \d+ bytes \([\d.]+ MiB\) are free; nothing was written", o["big"]), o["big"]
    assert outs[1]["big"] == o["big"]
    assert not [n for n in o["after_big"] if "too-big" in n], o["after_big"]


SIGTERM_JOB = r"""
import sys, time
import torch
sys.path.insert(0, sys.argv[3])
from _async_fns import GatedStorage  # data files wait up to 30 s for a gate never opened
from reshard import CheckpointManager

mgr = CheckpointManager(sys.argv[1], every_steps=1, use_async=True, storage=GatedStorage())
mgr.maybe_save(1, {"w": torch.zeros(64)})
if sys.argv[2] == "unwinding":
    try:
        raise RuntimeError("the training step failed")
    finally:
        print("ready", flush=True)
        time.sleep(30)  # cleanup that takes a while, as an exception propagates
print("ready", flush=True)  # exiting: the exit waits for the save in flight
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("when", ["unwinding", "exiting"])
def test_sigterm_while_unwinding_or_exiting_ends_the_process(tmp_path: Path, when: str) -> None:
    """torchrun's SIGTERM to a process that is raising or exiting (a save in
    flight, a peer lost) ends it as without reshard, not as a deferred save."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_JOB, str(tmp_path / "ck"), when,
                          str(Path(__file__).parent)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    time.sleep(1.0)  # inside the finally block / the exit wait
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == -signal.SIGTERM, (p.returncode, err)
    assert took < 5.0, took
    assert "will be saved at the next step boundary" not in err, err
    assert f"while {'unwinding an exception' if when == 'unwinding' else 'exiting'}" in err, err
    if when == "exiting":
        assert "reshard: exit waits for the asynchronous save of step 1" in err, err


HUNG_PEER_JOB = r"""
import os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import reshard
from reshard.storage import LocalStorage

rank, port, root, what = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                        timeout=timedelta(seconds=300))  # the training group's: long

class Stopping(LocalStorage):  # rank 1 is SIGSTOPped as it opens its shard file
    def open_write(self, path, *, durable=True):
        if rank == 1 and path.endswith(".safetensors"):
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().open_write(path, durable=durable)

n = 1 << 10
w = torch.arange(2 * n, dtype=torch.float32)[rank * n:(rank + 1) * n].clone()
state = {"w": reshard.ShardedTensor("w", w, global_shape=(2 * n,), global_offset=(rank * n,))}
opts = reshard.SaveOptions(durable=False, timeout_s=3)
if what == "load":
    reshard.save(state, root + "/ok", step=1, options=opts)
t0 = time.monotonic()
try:
    if what == "save":
        reshard.save(state, root + "/ck", step=2, options=opts, storage=Stopping())
    else:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        reshard.load(state, root + "/ok", options=reshard.LoadOptions(timeout_s=3))
    print("no error", flush=True)
except reshard.CheckpointError as e:
    print(f"{time.monotonic() - t0:.1f} {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["save", "load"])
def test_hung_peer_is_named_within_the_checkpoint_timeout(tmp_path: Path, what: str) -> None:
    """One rank SIGSTOPped inside a save (load) with timeout_s=3 while the
    training group waits 300 s: the other rank fails within the bound,
    naming the stopped rank and the phase; while it waits, the coordinator's
    progress line names the rank that has not arrived."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1",
           "RESHARD_WAIT_REPORT_S": "1"}  # the coordinator's progress line (30 s by default)
    procs = [subprocess.Popen([sys.executable, "-c", HUNG_PEER_JOB, str(r), str(port), str(tmp_path),
                               what], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 0, err
    took, msg = out.strip().split(" ", 1)
    assert float(took) < 20, out
    assert msg.startswith("CheckpointError: "), out
    if what == "save":
        assert "rank 1 was lost" in msg, msg
        assert "(save of step 2, phase write)" in msg, msg
        assert re.search(r"save of step 2: waiting \d+ s for ranks \[1\] in phase write", err), err
    else:  # stopped before it called load: it never arrived (the check-in is bounded by timeout_s)
        assert "rank 1 of the 2 ranks of the group did not arrive within 3 s" in msg, msg
        assert "phase arrival" in msg, msg
        assert re.search(r"load of .*ok: waiting \d+ s for ranks \[1\] in phase arrival", err), err
    for bad in ("0", "-1", "x", "nan"):
        with pytest.raises(ValueError, match="SaveOptions.timeout_s must be a number of seconds > 0"):
            import reshard

            reshard.SaveOptions(timeout_s=float(bad) if bad not in ("x",) else bad)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_failed_verification_record_never_blocks_the_next_saves(tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The verification record of step 2 fails to write (ENOSPC) on a disk
    with room for two checkpoints: step 2 stays unverified, so retention
    keeps step 1 and the disk is full. The next save's space check
    smoke-tests step 2 again (as ``reshard gc`` does), which frees step 1, so
    step 3 and every later save commit (before, every later save failed
    with "not enough space" for good, restarts included)."""
    import torch

    import reshard
    from reshard.faults.inject import Fault, FaultStorage
    from reshard.storage import LocalStorage

    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(m.parameters())
    ms = reshard.ModelState(m)
    state = {"model": ms, "optim": reshard.OptimizerState(ms, opt)}
    store = FaultStorage(LocalStorage(), [Fault(op="write_bytes", action="enospc",
                                                 match="step-00000002.verified.json*")])
    root = tmpfs / "ckpts"
    mgr = reshard.CheckpointManager(str(root), every_steps=1, keep_last=1, storage=store)

    def step(i: int) -> None:
        m(torch.randn(4, 256)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(i, state)

    step(1)
    size = sum(p.stat().st_size for p in (root / "step-00000001").iterdir())
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    (tmpfs / "ballast").write_bytes(b"\0" * (free - int(1.6 * size)))  # room for step 2, not 3
    step(2)
    assert "step-00000002 committed, but its verification record failed" in caplog.text
    assert not (root / "step-00000002.verified.json").exists() and (root / "step-00000001").exists()
    for i in (3, 4, 5):
        step(i)
    mgr.close()
    assert reshard.latest(str(root)) == str(root / "step-00000005")
    assert "applying retention first" in caplog.text
    assert not (root / "step-00000001").exists() and (root / "step-00000005.verified.json").exists()
