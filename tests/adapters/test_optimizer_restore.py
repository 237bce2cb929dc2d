"""Honest optimizer restores (issue 9 items 7-8, issue 10 item 4):
hyperparameters by parameter for every layout and a stated rule when the
group partition changed; model-only checkpoints leave the optimizer as
constructed; state looked up by saved names after a re-layout; the step
boundary without false alarms; state not shaped like its parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import _optim_fns as fns
import reshard
from reshard import CheckpointError, ModelState, OptimizerState, ShardingError
from reshard.adapters.torch_native import TorchState


class P12(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.p1 = nn.Parameter(torch.randn(2, 3, generator=g))
        self.p2 = nn.Parameter(torch.randn(3, 4, generator=g))


def _step(m: nn.Module, opt: torch.optim.Optimizer, k: int = 0) -> None:
    opt.zero_grad()
    sum(((p * (k + 1 + i)).sin().sum() for i, p in enumerate(m.parameters())), torch.zeros(())).backward()
    opt.step()


def _groups(opt: torch.optim.Optimizer, m: nn.Module) -> list[tuple[list[str], float, float]]:
    names = {id(p): n for n, p in m.named_parameters()}
    return [([names[id(p)] for p in g["params"]], g["lr"], g["weight_decay"]) for g in opt.param_groups]


# ----------------------------------------------------------------------------- hyperparameters


def test_zero_flat_buffers_restore_hyperparameters(pool, tmp_path: Path) -> None:
    """Flat ZeRO buffers (a layout names the state: no parameter fqn) record
    the hyperparameters of every canonical tensor they hold; 2 -> 3 ranks."""
    path = str(tmp_path / "z")
    pool.run(2, fns.r_zero1_save, path)
    m = reshard.inspect(path)
    assert {"optim.param_group.p1", "optim.param_group.p2"} <= set(m.objects)
    for r in pool.run(3, fns.r_zero1_load, path):
        assert (r["lr"], r["weight_decay"], r["betas"], r["groups"]) == (0.05, 0.01, (0.8, 0.95), 1)


def _two_group_checkpoint(tmp_path: Path, adapter: str) -> tuple[Path, P12]:
    src = P12()
    opt = torch.optim.AdamW([{"params": [src.p1], "lr": 0.1, "weight_decay": 0.01},
                             {"params": [src.p2], "lr": 0.2, "weight_decay": 0.02}])
    _step(src, opt)
    opt.zero_grad()
    ckpt = tmp_path / adapter
    state = ({"train": TorchState(src, opt)} if adapter == "torch" else
             {"model": ModelState(src), "optim": OptimizerState(src, opt)})
    reshard.save(state, ckpt)
    return ckpt, src


def _target(adapter: str, m: P12, opt: torch.optim.Optimizer, rule: str | None) -> dict[str, Any]:
    kw = {} if rule is None else {"hyperparams": rule}
    if adapter == "torch":
        return {"train": TorchState(m, opt, **kw)}
    return {"model": ModelState(m), "optim": OptimizerState(m, opt, **kw)}


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_changed_group_partition_errors_or_follows_the_chosen_rule(tmp_path: Path, adapter: str) -> None:
    """Saved with p1 and p2 in groups of their own; loaded into one group: an
    error naming both and their values (default), each parameter's exact
    values by splitting the group ("saved"), or the constructed ones
    ("current"). OptimizerState and TorchState behave the same."""
    ckpt, src = _two_group_checkpoint(tmp_path, adapter)
    dst = P12(1)
    before = dst.p1.detach().clone()
    opt = torch.optim.AdamW(dst.parameters(), lr=0.5, weight_decay=0.5)
    with pytest.raises(ShardingError) as ei:
        reshard.load(_target(adapter, dst, opt, None), ckpt)
    msg = str(ei.value)
    assert "p1: lr=0.1, weight_decay=0.01" in msg and "p2: lr=0.2, weight_decay=0.02" in msg
    assert "hyperparams='saved'" in msg
    # refused before any target was written
    assert "every target is unchanged" in msg and torch.equal(dst.p1, before) and dict(opt.state) == {}
    assert _groups(opt, dst) == [(["p1", "p2"], 0.5, 0.5)]
    for rule, want in (("saved", [(["p1"], 0.1, 0.01), (["p2"], 0.2, 0.02)]),
                       ("current", [(["p1", "p2"], 0.5, 0.5)])):
        dst = P12(1)
        opt = torch.optim.AdamW(dst.parameters(), lr=0.5, weight_decay=0.5)
        reshard.load(_target(adapter, dst, opt, rule), ckpt)
        assert _groups(opt, dst) == want, rule
        assert torch.equal(opt.state[dst.p2]["exp_avg"], _adam_state(src, tmp_path, adapter)), rule
    # groups merged at save, split at load: no conflict, each group gets the saved values
    dst = P12(1)
    opt = torch.optim.AdamW([{"params": [dst.p2], "lr": 0.7}, {"params": [dst.p1], "lr": 0.8}])
    reshard.load(_target(adapter, dst, opt, None), ckpt)
    assert _groups(opt, dst) == [(["p2"], 0.2, 0.02), (["p1"], 0.1, 0.01)]


def _adam_state(src: P12, tmp_path: Path, adapter: str) -> torch.Tensor:
    """exp_avg of p2 as saved (read back through a fresh matching optimizer)."""
    m = P12(2)
    opt = torch.optim.AdamW([{"params": [m.p1]}, {"params": [m.p2]}])
    reshard.load(_target(adapter, m, opt, None), tmp_path / adapter)
    return opt.state[m.p2]["exp_avg"]


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_model_only_checkpoint_leaves_the_optimizer_as_constructed(tmp_path: Path, adapter: str) -> None:
    src = P12()
    ckpt = tmp_path / "m"
    if adapter == "torch":
        reshard.save({"train": TorchState(src)}, ckpt)
    else:
        reshard.save({"model": ModelState(src)}, ckpt)
    dst = P12(1)
    opt = torch.optim.Adam(dst.parameters(), lr=0.3)
    reshard.load(_target(adapter, dst, opt, None), ckpt, strict=False)
    assert torch.equal(dst.p1, src.p1)
    assert dict(opt.state) == {} and opt.param_groups[0]["lr"] == 0.3  # no step=1, no zero moments
    # and the first step after it is the first step of a fresh optimizer
    ref = P12()
    ropt = torch.optim.Adam(ref.parameters(), lr=0.3)
    _step(dst, opt)
    _step(ref, ropt)
    assert torch.equal(dst.p1, ref.p1) and float(opt.state[dst.p1]["step"]) == 1.0


def test_torch_state_saves_no_state_for_an_optimizer_that_never_stepped(tmp_path: Path) -> None:
    m = P12()
    opt = torch.optim.Adam(m.parameters(), lr=0.3)
    reshard.save({"train": TorchState(m, opt)}, tmp_path / "c")
    assert dict(opt.state) == {}  # get_state_dict's initialisation step was undone
    assert not any(".state." in k for k in reshard.inspect(tmp_path / "c").tensors)


def test_expert_relayout_looks_state_up_by_saved_names(pool, tmp_path: Path) -> None:
    """EP 1 -> 2: rank 1's local experts.0.w is global expert 2, which never
    had optimizer state; its local name is global expert 0's, which had.
    The strict load succeeds and expert 2 stays without state."""
    path = str(tmp_path / "ep")
    pool.run(1, fns.r_ep_save, path)
    r0, r1 = pool.run(2, fns.r_ep_load, path)
    assert r0["has_state"] == [True, True] and r1["has_state"] == [False, True]
    assert r0["w"][0] < 0 and r1["w"][1] == pytest.approx(3 - 0.1)  # Adam moved them by lr
    assert r1["w"][0] == 2.0  # never stepped
    assert r1["without"] == ["experts.2.w"] and r0["without"] == []


# ----------------------------------------------------------------------------- step boundary


def _batch(k: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(k))


def _loss(m: nn.Module, k: int) -> torch.Tensor:
    return m(_batch(k)).pow(2).mean()


def test_the_tutorial_loop_saves_and_reloads_exactly(tmp_path: Path) -> None:
    """``zero_grad(); backward(); step(); save()``: the gradients left after
    step() were consumed; the save succeeds (adapters built at save time, as
    a trainer does) and the resumed next step is bit-exact."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    for k in range(3):
        opt.zero_grad()
        _loss(m, k).backward()
        opt.step()
        reshard.save({"model": ModelState(m), "optim": OptimizerState(m, opt), "step": k},
                     tmp_path / f"s{k}")
    assert all(p.grad is not None for p in m.parameters())  # the leftovers did not block
    opt.zero_grad()
    _loss(m, 3).backward()
    opt.step()
    torch.manual_seed(1)
    r = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    ropt = torch.optim.AdamW(r.parameters(), lr=0.5)
    reshard.load({"model": ModelState(r), "optim": OptimizerState(r, ropt), "step": 0}, tmp_path / "s2")
    ropt.zero_grad()
    _loss(r, 3).backward()
    ropt.step()
    for (n, a), b in zip(m.named_parameters(), r.parameters(), strict=True):
        assert torch.equal(a, b), n
        assert torch.equal(opt.state[a]["exp_avg_sq"], ropt.state[b]["exp_avg_sq"]), n


def test_mid_accumulation_save_is_refused_unless_grads_are_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _loss(m, 0).backward()
    opt.step()
    state = {"model": ModelState(m), "optim": OptimizerState(m, opt)}
    _loss(m, 1).backward()  # accumulating into the consumed gradients (version bumped)
    with pytest.raises(CheckpointError, match="accumulated since the optimizer's last step"):
        reshard.save(state, tmp_path / "a")
    opt.zero_grad()  # set_to_none: then a first micro-batch of the next step
    _loss(m, 2).backward()
    with pytest.raises(CheckpointError, match="save_grads=True"):
        reshard.save(state, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    opt.zero_grad(set_to_none=False)  # zeros: nothing accumulated
    reshard.save(state, tmp_path / "c")
    _loss(m, 2).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    reshard.save({"model": ModelState(m), "optim": OptimizerState(m, opt, save_grads=True)}, tmp_path / "d")
    r = nn.Linear(3, 2)
    ropt = torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9)
    reshard.load({"model": ModelState(r), "optim": OptimizerState(r, ropt, save_grads=True)}, tmp_path / "d")
    assert all(torch.equal(p.grad, g) for p, g in zip(r.parameters(), grads, strict=True))


# ----------------------------------------------------------------------------- state of other shapes


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.randn(4))
        self.conv = nn.Parameter(torch.randn(2, 3, 5))


def _run(m: Net, opt: torch.optim.Optimizer, ks: range) -> None:
    for k in ks:
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 + k)
        x = torch.randn(3, generator=g)
        ((m.w @ x).sin().sum() + (m.b * k).cos().sum() + (m.conv * x.view(1, 3, 1)).pow(2).sum()).backward()
        opt.step()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    lambda ps: torch.optim.Adafactor(ps, lr=0.02, weight_decay=0.1, beta2_decay=-0.5),
], ids=["adafactor", "adafactor-wd"])
def test_adafactor_factored_state_resumes_bit_exact(tmp_path: Path, make: Any) -> None:
    """Adafactor's row_var [.., R, 1] / col_var [.., 1, C] (and 1-D
    variance) are saved whole as replicas; the next step after a reload into
    a fresh optimizer is bit-exact (CPU, same layout)."""
    torch.manual_seed(0)
    m = Net()
    opt = make(m.parameters())
    _run(m, opt, range(3))
    reshard.save({"model": ModelState(m), "optim": OptimizerState(m, opt)}, tmp_path / "ck")
    shapes = {k: tuple(e.global_shape) for k, e in reshard.inspect(tmp_path / "ck").tensors.items()}
    assert shapes["optim.state.w.row_var"] == (4, 1) and shapes["optim.state.w.col_var"] == (1, 3)
    assert shapes["optim.state.conv.row_var"] == (2, 3, 1) and shapes["optim.state.b.variance"] == (4,)
    _run(m, opt, range(3, 4))
    torch.manual_seed(5)
    r = Net()
    ropt = make(r.parameters())
    res = reshard.load({"model": ModelState(r), "optim": OptimizerState(r, ropt)}, tmp_path / "ck")
    assert res.missing == () and res.unexpected == ()
    _run(r, ropt, range(3, 4))
    for n, p in m.named_parameters():
        q = dict(r.named_parameters())[n]
        assert torch.equal(p, q), n
        for key, v in opt.state[p].items():
            assert torch.equal(ropt.state[q][key], v), (n, key)


def test_muon_momentum_resumes_bit_exact(tmp_path: Path) -> None:
    """Muon (2-D parameters; its momentum buffer is shaped like them)."""
    torch.manual_seed(0)
    m = nn.Linear(6, 4, bias=False)
    opt = torch.optim.Muon(m.parameters(), lr=0.02)
    for k in range(2):
        opt.zero_grad()
        _loss6(m, k).backward()
        opt.step()
    reshard.save({"model": ModelState(m), "optim": OptimizerState(m, opt)}, tmp_path / "ck")
    r = nn.Linear(6, 4, bias=False)
    ropt = torch.optim.Muon(r.parameters(), lr=0.02)
    reshard.load({"model": ModelState(r), "optim": OptimizerState(r, ropt)}, tmp_path / "ck")
    for mm, oo in ((m, opt), (r, ropt)):
        oo.zero_grad()
        _loss6(mm, 2).backward()
        oo.step()
    assert torch.equal(m.weight, r.weight)


def _loss6(m: nn.Module, k: int) -> torch.Tensor:
    return m(torch.randn(3, 6, generator=torch.Generator().manual_seed(k))).pow(2).mean()


def test_other_shaped_state_of_a_sharded_parameter_needs_a_layout(tmp_path: Path) -> None:
    """Rows 2..3 of a [4, 3] parameter (tensor parallel, declared by a model
    layout): its factored state cannot be sharded by guess."""
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(2, 3))

    def layout(fqn: str, t: torch.Tensor) -> reshard.ShardedTensor:
        return reshard.ShardedTensor(fqn, t, global_shape=(4, 3), global_offset=(2, 0))

    opt = torch.optim.Adafactor(m.parameters(), lr=0.01)
    m.w.sum().backward()
    opt.step()
    ms = ModelState(m, layout=layout)
    with pytest.raises(ShardingError) as ei:
        reshard.save({"model": ms, "optim": OptimizerState(ms, opt)}, tmp_path / "ck")
    msg = str(ei.value)
    assert "state.w.row_var" in msg and "(2, 1)" in msg and "(2, 3)" in msg and "(4, 3)" in msg
    assert "layout" in msg


def test_adafactor_state_of_a_sharded_parameter_via_a_declared_layout(pool, tmp_path: Path) -> None:
    """TP=2: the optimizer layout declares row_var as row shards of a [4, 1]
    statistic and col_var as per-rank elements; the resumed step is bit-exact."""
    path = str(tmp_path / "tp")
    before = pool.run(2, fns.r_tp_adafactor_save, path)
    m = reshard.inspect(path)
    assert tuple(m.tensors["optim.state.w.row_var"].global_shape) == (4, 1)
    assert len(m.tensors["optim.state.w.row_var"].chunks) == 2
    assert tuple(m.tensors["optim.state.w.col_var"].global_shape) == (2, 1, 3)
    after = pool.run(2, fns.r_tp_adafactor_load, path)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a["w"], b["w"]) and torch.equal(a["row_var"], b["row_var"])


@pytest.mark.parametrize("adapter", ["optim", "torch"])
def test_a_refused_load_leaves_a_fresh_optimizer_fresh(tmp_path: Path, adapter: str) -> None:
    """The state a load creates for a never-stepped optimizer is installed
    only once the load succeeded: a load refused before writing (a shape
    mismatch) leaves no state, no gradients and the constructed values."""
    ckpt, _ = _two_group_checkpoint(tmp_path, adapter)
    dst = P12(1)
    dst.p2 = nn.Parameter(torch.zeros(3, 5))  # not the saved [3, 4]
    opt = torch.optim.AdamW(dst.parameters(), lr=0.5)
    with pytest.raises(ShardingError, match=r"\[3, 4\]"):
        reshard.load(_target(adapter, dst, opt, "saved"), ckpt)
    assert dict(opt.state) == {} and all(p.grad is None for p in dst.parameters())
    assert [g["lr"] for g in opt.param_groups] == [0.5]
