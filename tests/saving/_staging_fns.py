"""Rank functions for tests/saving/test_staging_budget.py (run inside WorkerPool
workers on real gloo ranks, imported by name): staging under a host-memory
budget, the overlap mode with its one documented wait, and the mutation
guard tripped by a loop that steps its optimizer too early."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.distributed as dist

import reshard
from _async_fns import GatedStorage
from reshard.testing.memory import PeakRSS


def budget_state(rank: int, world: int, mib: int) -> dict[str, Any]:
    """About ``mib`` MiB per rank: one sharded tensor of half of it (larger
    than any budget the tests use: staged in slices), many 256 KiB layers,
    a transposed (non-contiguous) bf16 tensor, a replicated plain float64
    tensor (every rank hashes it; one writes it) and a plain value."""
    g = torch.Generator().manual_seed(100 + rank)
    rows = (mib << 20) // 2 // 4096
    big = torch.randn(rows, 1024, generator=g)
    layers = {f"l{i}": torch.randn(256, 256, generator=g) for i in range(max(1, mib * 2))}
    bf = torch.randn(512, 384, generator=g).to(torch.bfloat16).t()
    return {
        "big": reshard.ShardedTensor("big", big, global_shape=(rows * world, 1024),
                                     global_offset=(rows * rank, 0)),
        "layers": {k: reshard.ShardedTensor(k, v, global_shape=(256 * world, 256),
                                            global_offset=(256 * rank, 0)) for k, v in layers.items()},
        "bf": reshard.ShardedTensor("bf", bf, global_shape=(384 * world, 512), global_offset=(384 * rank, 0)),
        "plain": torch.arange(100_000, dtype=torch.float64) * 0.5,
        "step": 7,
    }


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {"big": state["big"].data.clone(), "bf": state["bf"].data.clone(),
                                    "plain": state["plain"].clone()}
    out.update({k: v.data.clone() for k, v in state["layers"].items()})
    return out


def _targets(state: dict[str, Any]) -> dict[str, Any]:
    def like(st: reshard.ShardedTensor) -> reshard.ShardedTensor:
        return reshard.ShardedTensor(st.fqn, torch.zeros(st.data.shape, dtype=st.data.dtype),
                                     global_shape=st.global_shape, global_offset=st.global_offset)

    return {"big": like(state["big"]), "bf": like(state["bf"]),
            "layers": {k: like(v) for k, v in state["layers"].items()},
            "plain": torch.zeros_like(state["plain"]), "step": -1}


def _loaded(tgt: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {"big": tgt["big"].data, "bf": tgt["bf"].data, "plain": tgt["plain"]}
    out.update({k: v.data for k, v in tgt["layers"].items()})
    return out


def r_budget(path: str, budget: int, mib: int) -> dict[str, Any]:
    """One default-mode async_save of ``mib`` MiB per rank under ``budget``:
    whether ``staged`` was done on return, the save's own figures, the peak
    extra RSS of the call and its commit, and whether the checkpoint loads
    back bit for bit on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = budget_state(rank, world, mib)
    want = _tensors(state)
    opts = reshard.SaveOptions(staging_budget_bytes=budget, durable=False, staging_threads=2)
    reshard.prewarm_staging(options=opts)  # the pool's slabs exist before the measurement
    dist.barrier()
    with PeakRSS(interval_s=0.001) as m:
        h = reshard.async_save(state, path, step=1, options=opts)
        staged = h.staged.done()
        for st in [state["big"], state["bf"], *state["layers"].values()]:
            st.data.add_(1)  # the default mode: every byte is staged, the loop may mutate
        state["plain"].mul_(3)
        res = h.wait(timeout=120)
    tgt = _targets(state)
    loaded = reshard.load(tgt, path)
    got = _loaded(tgt)
    return {"staged": staged, "state_bytes": sum(t.numel() * t.element_size() for t in want.values()),
            "staging_peak": res.staging_peak_bytes, "staging_budget": res.staging_budget_bytes,
            "peak_rss": res.peak_rss_bytes, "extra_rss": max(m.sampled_extra, m.hwm_extra or 0),
            "pool_bytes": reshard.saving.staging._saver(None).pool.allocated_bytes,
            "equal": all(torch.equal(got[k], want[k]) for k in want), "step": loaded.values["step"]}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _train_step(model: _Model, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    for p in model.parameters():  # data parallel: gradients averaged over the ranks
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


def r_overlap_loop(root: str, budget: int, early: bool) -> dict[str, Any]:
    """A real data-parallel loop (forward, backward, gradient all-reduce,
    AdamW with foreach kernels) that checkpoints after the optimizer step of
    step 3 through a ``CheckpointManager`` in the overlap mode, as TorchTitan
    does: staging runs during step 4's forward and backward, and the loop
    calls the manager's ``wait_for_staging`` hook before step 4's
    ``optimizer.step()``. The writes are held back (a gated storage), so
    staging cannot finish before the loop reaches that step.
    ``early=False``: the gate opens from a timer while the hook waits;
    ``early=True``: the loop skips the hook at step 4 and steps first (too
    early), then opens the gate."""
    rank = dist.get_rank()
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    storage = GatedStorage()
    mgr = reshard.CheckpointManager(root, every_steps=3, use_async=True, storage=storage,
                                    options=reshard.SaveOptions(overlap_staging=True, staging_budget_bytes=budget,
                                                                durable=False, staging_threads=1),
                                    preempt_signals=())
    state = {"model": reshard.ModelState(model), "optim": reshard.OptimizerState(model, opt)}
    g = torch.Generator().manual_seed(1)
    want: dict[str, torch.Tensor] = {}
    staged_on_return = None
    waited = 0.0
    err: str | None = None
    for step in range(1, 6):
        x = torch.randn(32, 64, generator=g)
        _train_step(model, opt, x)
        if not (early and step == 4):
            waited += mgr.wait_for_staging(timeout=60)  # the hook, before optimizer.step()
        opt.step()  # mutates every parameter and moment in place
        opt.zero_grad()
        if step == 4 and early:
            storage.gate.set()
        if step == 3:
            want = {k: v.detach().clone() for k, v in model.state_dict().items()}
            want.update({f"exp_avg.{i}": opt.state[p]["exp_avg"].clone()
                         for i, p in enumerate(model.parameters())})
            h = mgr.maybe_save(step, state)
            assert isinstance(h, reshard.SaveHandle)
            staged_on_return = h.staged.done()
            if not early:
                threading.Timer(0.3, storage.gate.set).start()
    try:
        mgr.wait()
    except reshard.CheckpointError as e:
        err = str(e)
    out: dict[str, Any] = {"staged_on_return": staged_on_return, "waited": waited, "error": err,
                           "latest": reshard.latest(root), "rank": rank}
    if err is None:
        m2 = _Model()
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, foreach=True)
        mgr.restore({"model": reshard.ModelState(m2), "optim": reshard.OptimizerState(m2, o2)})
        got = {k: v.detach() for k, v in m2.state_dict().items()}
        got.update({f"exp_avg.{i}": o2.state[p]["exp_avg"] for i, p in enumerate(m2.parameters())})
        out["equal"] = all(torch.equal(got[k], want[k]) for k in want)
    mgr.close()
    return out


def r_guard_one_rank(path: str, budget: int, who: int) -> dict[str, Any]:
    """The overlap mode with only rank ``who`` writing to one of its own
    shards before staging finished (writes held back by a gated storage):
    the save must fail on every rank, naming that tensor; nothing is
    published."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = budget_state(rank, world, 4)
    storage = GatedStorage()
    opts = reshard.SaveOptions(overlap_staging=True, staging_budget_bytes=budget, durable=False,
                               staging_threads=1)
    h = reshard.async_save(state, path, step=5, options=opts, storage=storage)
    staged_on_return = h.staged.done()
    if rank == who:
        state["layers"]["l1"].data[3, 4] = -1.0  # too early: before wait_for_staging
    dist.barrier()
    storage.gate.set()
    reshard.wait_for_staging(timeout=60)
    err = None
    try:
        h.wait(timeout=60)
    except reshard.CheckpointError as e:
        err = f"{type(e).__name__}: {e}"
    return {"staged_on_return": staged_on_return, "error": err, "published": os.path.exists(path)}


# ----------------------------------------------------------------------------- a training backend that fails


#: collectives the training group was asked for (must stay empty)
TRAINING_CALLS: list[str] = []


def _failing_backend() -> None:
    """Register ``reshardfail``: a process-group backend whose every
    collective raises (and is recorded), standing in for NCCL, which the CPU
    wheel lacks: a checkpoint collective that reaches the training group
    fails the test."""

    class FailingGroup(dist.ProcessGroup):
        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "reshardfail"

        @property
        def group_name(self) -> str:  # a real backend's group has one (NCCL's "0")
            return "0"

    def fail(name: str) -> Any:
        def op(self: Any, *a: Any, **k: Any) -> Any:
            TRAINING_CALLS.append(name)
            raise RuntimeError(f"a checkpoint collective ran on the training group ({name})")
        return op

    for name in ("allreduce", "allgather", "_allgather_base", "broadcast", "barrier", "gather", "scatter",
                 "send", "recv", "recv_anysource", "reduce", "reduce_scatter", "alltoall", "alltoall_base",
                 "allreduce_coalesced", "_reduce_scatter_base", "allgather_into_tensor_coalesced",
                 "reduce_scatter_tensor_coalesced"):
        setattr(FailingGroup, name, fail(name))
    dist.Backend.register_backend("reshardfail", lambda store, rank, size, timeout: FailingGroup(rank, size),
                                  devices=["cpu"])


def r_training_backend_unused(rank: int, world: int, port: int, root: str, q: Any) -> None:
    """A spawned rank whose default group is the failing backend: every
    save, asynchronous save (both modes), load and manager save/restore,
    with the default timeouts and with ``timeout_s=None`` (the group's own),
    must run its collectives elsewhere (gloo)."""
    from datetime import timedelta

    try:
        _failing_backend()
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("reshardfail", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        assert dist.get_backend() == "reshardfail"
        state = budget_state(rank, world, 1)
        for i, to in enumerate((reshard.options.DEFAULT_TIMEOUT_S, None)):
            so = reshard.SaveOptions(timeout_s=to, durable=False)
            lo = reshard.LoadOptions(timeout_s=to)
            reshard.save(state, f"{root}/sync-{i}", step=1, options=so)
            h = reshard.async_save(state, f"{root}/async-{i}", step=2, options=so)
            h.wait(timeout=60)
            ov = reshard.SaveOptions(timeout_s=to, durable=False, overlap_staging=True,
                                     staging_budget_bytes=64 << 10)
            h = reshard.async_save(state, f"{root}/overlap-{i}", step=3, options=ov)
            reshard.wait_for_staging(timeout=60)
            h.wait(timeout=60)
            for name in ("sync", "async", "overlap"):
                tgt = _targets(state)
                reshard.load(tgt, f"{root}/{name}-{i}", options=lo)
                assert all(torch.equal(a, b) for a, b in zip(_loaded(tgt).values(), _tensors(state).values(),
                                                             strict=True)), name
            mgr = reshard.CheckpointManager(f"{root}/mgr-{i}", every_steps=1, use_async=True, options=ov,
                                            preempt_signals=())
            mgr.save(1, state)
            mgr.wait_for_staging(timeout=60)
            mgr.wait()
            tgt = _targets(state)
            mgr.restore(tgt)
            mgr.close()
        q.put((rank, list(TRAINING_CALLS), None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, list(TRAINING_CALLS), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
