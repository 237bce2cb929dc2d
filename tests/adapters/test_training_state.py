"""Training-state adapters on real files, single process: ModelState,
OptimizerState, schedulers, GradScaler, RNGState, DataCursor, strictness and
schema versions (cases 1, 2, 3, 4, 10, 11, 12, 13, 17, 18 of
shared/cases/README.md)."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import reshard
from reshard import (
    CheckpointError,
    DataCursor,
    LoadOptions,
    ModelState,
    OptimizerState,
    RNGState,
    SaveOptions,
    ShardingError,
)
from reshard.adapters.rng import counter_uniform
from reshard.transforms import Cast, Rename

# ----------------------------------------------------------------------------- helpers


class P12(nn.Module):
    """p1 [2,3] declared before p2 [3,4]."""

    def __init__(self) -> None:
        super().__init__()
        self.p1 = nn.Parameter(torch.randn(2, 3))
        self.p2 = nn.Parameter(torch.randn(3, 4))


class P21(nn.Module):
    """The same parameters, p2 declared first."""

    def __init__(self) -> None:
        super().__init__()
        self.p2 = nn.Parameter(torch.zeros(3, 4))
        self.p1 = nn.Parameter(torch.zeros(2, 3))


def _adamw_step(model: nn.Module, opt: torch.optim.Optimizer, scale: dict[str, float]) -> None:
    """One real step with per-parameter loss weights (so moments differ)."""
    loss = sum(w * (getattr(model, n) ** 2).sum() for n, w in scale.items())
    loss.backward()
    opt.step()
    opt.zero_grad()


def _opt_state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    return {n: dict(opt.state.get(p, {})) for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- case 1


def test_case1_optimizer_state_follows_names_not_positions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = P12()
    opt = torch.optim.AdamW(src.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.03)
    _adamw_step(src, opt, {"p1": 1.0, "p2": 5.0})
    _adamw_step(src, opt, {"p1": 2.0, "p2": -3.0})
    saved = {n: {k: v.clone() for k, v in st.items()} for n, st in _opt_state_by_name(src, opt).items()}
    ckpt = tmp_path / "c1"
    reshard.save({"model": ModelState(src), "optim": OptimizerState(src, opt)}, ckpt, step=2)

    dst = P21()
    fresh = torch.optim.AdamW(dst.parameters(), lr=123.0)  # another lr, never stepped
    assert not fresh.state
    res = reshard.load({"model": ModelState(dst), "optim": OptimizerState(dst, fresh)}, ckpt)
    assert res.missing == () and res.unexpected == ()
    assert "optim.params_without_state" not in res.notes

    torch.testing.assert_close(dst.p1, src.p1, rtol=0, atol=0)
    torch.testing.assert_close(dst.p2, src.p2, rtol=0, atol=0)
    got = _opt_state_by_name(dst, fresh)
    for name in ("p1", "p2"):
        assert set(got[name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[name][key].shape == saved[name][key].shape
            assert torch.equal(got[name][key], saved[name][key]), (name, key)
        step = got[name]["step"]
        assert step.dim() == 0 and step.dtype == saved[name]["step"].dtype
        assert step.item() == 2.0
    # the moments differ between the parameters (so a positional mix-up would show)
    assert not torch.equal(saved["p1"]["exp_avg"].flatten()[:6], saved["p2"]["exp_avg"].flatten()[:6])
    # hyperparameters restored by name, despite the other lr at construction
    for g in fresh.param_groups:
        assert g["lr"] == 0.01
        assert g["betas"] == (0.8, 0.95) and type(g["betas"]) is tuple
        assert g["weight_decay"] == 0.03

    # next-step parity: one more identical step on both gives identical weights
    _adamw_step(src, opt, {"p1": 1.0, "p2": 1.0})
    _adamw_step(dst, fresh, {"p1": 1.0, "p2": 1.0})
    assert torch.equal(dst.p1, src.p1) and torch.equal(dst.p2, src.p2)


# ----------------------------------------------------------------------------- case 2


class AB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.full((3,), 2.0))
        self.B = nn.Parameter(torch.full((2,), -1.0))


def test_case2_frozen_and_unstepped_parameters(tmp_path: Path) -> None:
    src = AB()
    opt = torch.optim.AdamW(src.parameters(), lr=0.1)
    (src.A ** 3).sum().backward()  # B gets no gradient: AdamW creates no state for it
    opt.step()
    opt.zero_grad()
    src.A.requires_grad_(False)  # frozen, but still in the optimizer with its state
    assert src.B not in opt.state or not opt.state[src.B]
    exp_avg = opt.state[src.A]["exp_avg"].clone()
    ckpt = tmp_path / "c2"
    reshard.save({"model": ModelState(src), "optim": OptimizerState(src, opt)}, ckpt)
    m = reshard.inspect(ckpt)
    assert "optim.state.A.exp_avg" in m.tensors
    assert not any(k.startswith("optim.state.B.") for k in m.tensors)

    dst = AB()
    dst.A.requires_grad_(False)
    fresh = torch.optim.AdamW(dst.parameters(), lr=0.1)
    ost = OptimizerState(dst, fresh)
    res = reshard.load({"model": ModelState(dst), "optim": ost}, ckpt)
    assert res.notes["optim.params_without_state"] == ["B"]
    assert ost.params_without_state == ("B",)
    assert torch.equal(fresh.state[dst.A]["exp_avg"], exp_avg)
    assert fresh.state[dst.A]["step"].item() == 1.0
    assert not fresh.state.get(dst.B)
    # B then initialises by Adam's own rule on its first step
    (dst.B ** 2).sum().backward()
    fresh.step()
    assert fresh.state[dst.B]["step"].item() == 1.0


# ----------------------------------------------------------------------------- case 3


class Tied(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_case3_tied_weights_stored_once_and_retied(tmp_path: Path) -> None:
    torch.manual_seed(1)
    src = Tied()
    ref = src.emb.weight.detach().clone()
    ckpt = tmp_path / "c3"
    reshard.save({"model": ModelState(src)}, ckpt)
    m = reshard.inspect(ckpt)
    assert set(m.tensors) == {"model.emb.weight"}
    assert m.aliases == {"model.head.weight": "model.emb.weight"}

    dst = Tied()
    with torch.no_grad():
        dst.emb.weight.zero_()
    res = reshard.load({"model": ModelState(dst)}, ckpt)
    assert res.missing == () and res.unexpected == ()
    assert dst.head.weight is dst.emb.weight
    assert torch.equal(dst.emb.weight, ref)


def test_case3_claimed_tying_with_distinct_tensors(tmp_path: Path) -> None:
    torch.manual_seed(2)
    src = Tied(tie=False)
    with torch.no_grad():
        src.head.weight.copy_(torch.arange(15.0).reshape(5, 3))
    emb, head = src.emb.weight.detach().clone(), src.head.weight.detach().clone()
    ckpt = tmp_path / "c3b"
    reshard.save({"model": ModelState(src)}, ckpt)
    m = reshard.inspect(ckpt)
    assert set(m.tensors) == {"model.emb.weight", "model.head.weight"}
    assert m.aliases == {}

    dst = Tied(tie=False)
    reshard.load({"model": ModelState(dst)}, ckpt)
    assert dst.head.weight is not dst.emb.weight
    assert torch.equal(dst.emb.weight, emb) and torch.equal(dst.head.weight, head)
    assert not torch.equal(dst.emb.weight, dst.head.weight)


# ----------------------------------------------------------------------------- case 4


class W(nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(shape, dtype=dtype))


def test_case4_no_silent_cast_or_reshape(tmp_path: Path) -> None:
    torch.manual_seed(3)
    src = W((4, 3))
    with torch.no_grad():
        src.w.copy_(torch.randn(4, 3) * 100)
    ckpt = tmp_path / "c4"
    reshard.save({"model": ModelState(src)}, ckpt)

    bf = W((4, 3), torch.bfloat16)
    with pytest.raises(ShardingError) as ei:
        reshard.load({"model": ModelState(bf)}, ckpt)
    msg = str(ei.value)
    assert "w" in msg and "float32" in msg and "bfloat16" in msg
    assert torch.count_nonzero(bf.w) == 0  # nothing written

    narrow = W((4, 2))
    with pytest.raises(ShardingError) as ei:
        reshard.load({"model": ModelState(narrow)}, ckpt)
    msg = str(ei.value)
    assert "w" in msg and "[4, 3]" in msg and "[4, 2]" in msg
    assert torch.count_nonzero(narrow.w) == 0

    reshard.load({"model": ModelState(bf)}, ckpt, transforms=[Cast("model.w")])
    assert bf.w.dtype == torch.bfloat16
    assert torch.equal(bf.w, src.w.detach().bfloat16())


# ----------------------------------------------------------------------------- case 10 (schedulers)


def _sched_sd(s: object) -> dict:
    sd = dict(s.state_dict())  # type: ignore[attr-defined]
    sd.pop("lr_lambdas", None)  # callables are not state
    return sd


def _one_param_opt(lr: float = 0.5) -> tuple[nn.Module, torch.optim.Optimizer]:
    mod = nn.Linear(2, 1)
    return mod, torch.optim.SGD(mod.parameters(), lr=lr, momentum=0.9)


def _train(mod: nn.Module, opt: torch.optim.Optimizer) -> None:
    mod(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_case10_multisteplr_counter_round_trips(tmp_path: Path) -> None:
    mod, opt = _one_param_opt()
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    for _ in range(3):
        _train(mod, opt)
        sched.step()
    ref = sched.state_dict()
    assert isinstance(ref["milestones"], collections.Counter)
    ckpt = tmp_path / "c10"
    # MultiStepLR is chainable: the next lr derives from the optimizer's current lr
    reshard.save({"sched": sched, "optim": OptimizerState(mod, opt)}, ckpt)

    mod2, opt2 = _one_param_opt()
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[7], gamma=0.1)
    reshard.load({"sched": sched2, "optim": OptimizerState(mod2, opt2)}, ckpt)
    got = sched2.state_dict()
    assert got == ref
    assert type(got["milestones"]) is collections.Counter
    assert got["milestones"] == collections.Counter({2: 1, 4: 2})
    assert type(got["base_lrs"]) is list and type(got["last_epoch"]) is int
    assert type(got["gamma"]) is float
    # the next steps give the same lr (milestone 4 counted twice: gamma**2)
    for _ in range(2):
        _train(mod, opt)
        sched.step()
        _train(mod2, opt2)
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()
    assert sched.get_last_lr() == [0.5 * 0.5 ** 3]


@pytest.mark.parametrize("kind", ["lambda", "onecycle"])
def test_case10_schedulers_round_trip_and_next_lr(tmp_path: Path, kind: str) -> None:
    def make() -> tuple[nn.Module, torch.optim.Optimizer, object]:
        mod, opt = _one_param_opt()
        if kind == "lambda":
            s = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
        else:
            s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20)
        return mod, opt, s

    mod, opt, sched = make()
    for _ in range(7):
        _train(mod, opt)
        sched.step()  # type: ignore[attr-defined]
    ckpt = tmp_path / f"c10-{kind}"
    reshard.save({"sched": sched, "optim": OptimizerState(mod, opt)}, ckpt)

    mod2, opt2, sched2 = make()
    reshard.load({"sched": sched2, "optim": OptimizerState(mod2, opt2)}, ckpt)
    assert _sched_sd(sched2) == _sched_sd(sched)
    assert sched2.last_epoch == 7  # type: ignore[attr-defined]
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _train(mod, opt)
    sched.step()  # type: ignore[attr-defined]
    _train(mod2, opt2)
    sched2.step()  # type: ignore[attr-defined]
    assert sched2.get_last_lr() == sched.get_last_lr()  # type: ignore[attr-defined]
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    if kind == "onecycle":
        assert opt2.param_groups[0]["momentum"] == opt.param_groups[0]["momentum"]


# ----------------------------------------------------------------------------- case 12


def test_case12_scaler_and_scheduler_restore_without_side_effects(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = P12()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256)
    sd = scaler.state_dict()
    sd["_growth_tracker"] = 7
    scaler.load_state_dict(sd)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    _adamw_step(model, opt, {"p1": -1.0, "p2": 0.5})
    for _ in range(11):
        sched.step()
    assert sched.last_epoch == 11
    ref_scaler, ref_sched = scaler.state_dict(), sched.state_dict()
    assert ref_scaler["scale"] == 256 and ref_scaler["_growth_tracker"] == 7
    ckpt = tmp_path / "c12"
    reshard.save({"scaler": scaler, "sched": sched}, ckpt)

    # a fresh scaler and scheduler on the live (stepped) optimizer
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1024)
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ostate = {n: {k: v.clone() for k, v in st.items()} for n, st in _opt_state_by_name(model, opt).items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    reshard.load({"scaler": scaler2, "sched": sched2}, ckpt)

    assert scaler2.state_dict() == ref_scaler
    assert scaler2.get_scale() == 256.0 and scaler2._get_growth_tracker() == 7
    assert sched2.state_dict() == ref_sched and sched2.last_epoch == 11
    # nothing else moved: no dummy step, no RNG draw
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
    for n, st in _opt_state_by_name(model, opt).items():
        assert set(st) == set(ostate[n])
        for k, v in st.items():
            assert torch.equal(v, ostate[n][k]) and v.dtype == ostate[n][k].dtype
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    np_now = np.random.get_state()
    assert np_now[0] == rng[2][0] and np.array_equal(np_now[1], rng[2][1]) and np_now[2:] == rng[2][2:]


# ----------------------------------------------------------------------------- case 13


def test_case13_prefixed_keys_non_strict_load_matching_nothing(tmp_path: Path) -> None:
    torch.manual_seed(5)
    src = P12()
    ckpt = tmp_path / "c13"
    reshard.save({"model": {"model": ModelState(src)}}, ckpt)
    assert set(reshard.inspect(ckpt).tensors) == {"model.model.p1", "model.model.p2"}

    dst = P12()
    before = dst.p1.detach().clone()
    with pytest.raises(ShardingError, match="no requested key matches"):
        reshard.load({"model": ModelState(dst)}, ckpt, strict=False)
    assert torch.equal(dst.p1, before)

    res = reshard.load({"model": ModelState(dst)}, ckpt, transforms=[Rename(r"^model\.", "")])
    assert res.missing == () and res.unexpected == ()
    assert torch.equal(dst.p1, src.p1) and torch.equal(dst.p2, src.p2)


def test_case13_plain_tree_with_extra_prefix(tmp_path: Path) -> None:
    w = torch.arange(6.0).reshape(2, 3)
    ckpt = tmp_path / "c13b"
    reshard.save({"model": {"w": w, "b": torch.ones(3)}}, ckpt)
    target = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    with pytest.raises(ShardingError, match="no requested key matches"):
        reshard.load(target, ckpt, strict=False)
    reshard.load(target, ckpt, transforms=[Rename(r"^model\.", "")])
    assert torch.equal(target["w"], w) and torch.equal(target["b"], torch.ones(3))


# ----------------------------------------------------------------------------- case 17


class Opaque(nn.Module):
    def __init__(self, blob: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.blob = blob

    def get_extra_state(self) -> torch.Tensor:
        return self.blob

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.blob = state


class Holder(nn.Module):
    def __init__(self, blob: torch.Tensor) -> None:
        super().__init__()
        self.te = Opaque(blob)


class NoExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.te = nn.Module()
        self.te.lin = nn.Linear(2, 2)


def test_case17_opaque_extra_state_sized_from_checkpoint(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    blob = torch.randint(0, 256, (2322,), dtype=torch.uint8, generator=g)
    src = Holder(blob.clone())
    ckpt = tmp_path / "c17"
    reshard.save({"model": ModelState(src)}, ckpt)
    assert "model.te._extra_state" in reshard.inspect(ckpt).objects

    dst = Holder(torch.zeros(4, dtype=torch.uint8))
    reshard.load({"model": ModelState(dst)}, ckpt)
    got = dst.te.blob
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.shape == (2322,)
    assert torch.equal(got, blob)
    assert torch.equal(dst.te.lin.weight, src.te.lin.weight)

    # a checkpoint without the extra state: strict load names the missing key
    ckpt2 = tmp_path / "c17b"
    reshard.save({"model": ModelState(NoExtra())}, ckpt2)
    dst2 = Holder(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ShardingError, match=r"te\._extra_state"):
        reshard.load({"model": ModelState(dst2)}, ckpt2)
    assert dst2.te.blob.shape == (4,)


# ----------------------------------------------------------------------------- case 18


class WithScratch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("running", torch.arange(2.0))
        self.register_buffer("scratch", torch.full((4,), 3.0), persistent=False)


def test_case18_non_persistent_buffers_not_saved_nor_touched(tmp_path: Path) -> None:
    torch.manual_seed(7)
    src = WithScratch()
    with torch.no_grad():
        src.running.add_(10)
        src.scratch.fill_(-1.0)
    ckpt = tmp_path / "c18"
    reshard.save({"model": ModelState(src)}, ckpt)
    m = reshard.inspect(ckpt)
    saved = set(m.tensors) | set(m.aliases) | set(m.objects) | set(m.values or {})
    assert saved == {f"model.{k}" for k in src.state_dict()}
    assert set(src.state_dict()) == {"lin.weight", "lin.bias", "running"}

    dst = WithScratch()
    with torch.no_grad():
        dst.scratch.copy_(torch.tensor([9.0, 8.0, 7.0, 6.0]))
    res = reshard.load({"model": ModelState(dst)}, ckpt)
    assert res.missing == () and res.unexpected == ()
    assert torch.equal(dst.scratch, torch.tensor([9.0, 8.0, 7.0, 6.0]))
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert set(dst.state_dict()) == set(src.state_dict())


# ----------------------------------------------------------------------------- step boundary


def test_save_inside_gradient_accumulation_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(8)
    model = P12()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _adamw_step(model, opt, {"p1": 1.0, "p2": 1.0})
    (model.p1.sum() * 3).backward()  # accumulating: p1 holds a non-zero grad
    with pytest.raises(CheckpointError, match="accumulation"):
        reshard.save({"model": ModelState(model), "optim": OptimizerState(model, opt)}, tmp_path / "a")
    assert not (tmp_path / "a" / "manifest.json").exists()

    grad = model.p1.grad.clone()
    ckpt = tmp_path / "b"
    reshard.save({"model": ModelState(model), "optim": OptimizerState(model, opt, save_grads=True)},
                 ckpt)
    m = reshard.inspect(ckpt)
    assert "optim.grad.p1" in m.tensors
    assert "optim.grad.p2" not in m.tensors  # p2's grad is None

    dst = P21()
    fresh = torch.optim.AdamW(dst.parameters(), lr=0.1)
    reshard.load({"model": ModelState(dst), "optim": OptimizerState(dst, fresh, save_grads=True)},
                 ckpt)
    assert dst.p1.grad is not None and torch.equal(dst.p1.grad, grad)
    assert dst.p2.grad is None
    assert torch.equal(fresh.state[dst.p1]["exp_avg"], opt.state[model.p1]["exp_avg"])


def test_failed_load_does_not_disable_the_step_boundary_check(tmp_path: Path) -> None:
    model = P12()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _adamw_step(model, opt, {"p1": 1.0, "p2": 1.0})
    ckpt = tmp_path / "ok"
    reshard.save({"optim": OptimizerState(model, opt)}, ckpt)
    ost = OptimizerState(model, opt)
    with pytest.raises(ShardingError, match="extra"):  # strict: "extra" is not in the checkpoint
        reshard.load({"optim": ost, "extra": torch.zeros(1)}, ckpt)
    model.p2.sum().backward()
    with pytest.raises(CheckpointError, match="accumulation"):
        reshard.save({"optim": ost}, tmp_path / "after")


# ----------------------------------------------------------------------------- RNG


def test_rng_same_layout_restores_every_stream(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    rng = RNGState(rank=0, world_size=1, streams={"tp": gen})
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    torch.rand(3)  # move off the seeded position
    ckpt = tmp_path / "rng"
    reshard.save({"rng": rng}, ckpt)

    def draw() -> tuple:
        mask = torch.nn.functional.dropout(torch.ones(64), p=0.5, training=True)
        return (mask, random.random(), random.randint(0, 10**9), np.random.rand(4),
                torch.rand(5, generator=gen))

    first = draw()
    second_uninterrupted = draw()
    assert not torch.equal(first[0], second_uninterrupted[0])  # the streams do move
    res = reshard.load({"rng": RNGState(rank=0, world_size=1, streams={"tp": gen})}, ckpt)
    assert not res.notes
    again = draw()
    assert torch.equal(again[0], first[0])
    assert again[1] == first[1] and again[2] == first[2]
    assert np.array_equal(again[3], first[3])
    assert torch.equal(again[4], first[4])


def test_counter_uniform_is_layout_independent() -> None:
    full = counter_uniform(7, 3, (6, 4))
    assert full.shape == (6, 4) and full.dtype == torch.float32
    box = counter_uniform(7, 3, (6, 4), (2, 1), (3, 2))
    assert torch.equal(box, full[2:5, 1:3])
    assert float(full.min()) >= 0.0 and float(full.max()) < 1.0
    assert len(set(full.flatten().tolist())) == 24
    assert not torch.equal(counter_uniform(7, 4, (6, 4)), full)
    assert not torch.equal(counter_uniform(8, 3, (6, 4)), full)
    assert torch.equal(counter_uniform(7, 3, (6, 4)), full)  # deterministic
    before = torch.get_rng_state()
    counter_uniform(7, 3, (6, 4))
    assert torch.equal(torch.get_rng_state(), before)


# ----------------------------------------------------------------------------- case 11 (data)


def _uninterrupted(epochs: int) -> list[list[int]]:
    c = DataCursor(10, 2, seed=3)
    return [c.next_global_batch() for _ in range(epochs * 5)]


@pytest.mark.parametrize("batches_done", [7, 5])  # epoch 1 after 2 batches; end of epoch 0
@pytest.mark.parametrize("resume_dp", [2, 1])
def test_case11_data_cursor_resume(tmp_path: Path, batches_done: int, resume_dp: int) -> None:
    ref = _uninterrupted(3)
    # train at DP=2: each rank draws its half of every global batch
    ranks = [DataCursor(10, 2, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    seen = []
    for _ in range(batches_done):
        seen.append([s for c in ranks for s in c.next_batch()])
    assert seen == ref[:batches_done]
    ckpt = tmp_path / f"d{batches_done}-{resume_dp}"
    common = [{k: v for k, v in c.state_dict().items() if k != "pending"} for c in ranks]
    assert common[0] == common[1]  # global position, equal on all ranks
    # one process stands for the DP=2 save (a real DP=2 save: test_training_state_dist.py)
    saver = DataCursor(10, 2, seed=3)
    for _ in range(batches_done):
        saver.next_global_batch()
    assert {k: v for k, v in saver.state_dict().items() if k != "pending"} == common[0]
    reshard.save({"data": saver}, ckpt)

    new = [DataCursor(10, 2, seed=0, dp_rank=r, dp_size=resume_dp) for r in range(resume_dp)]
    for c in new:
        reshard.load({"data": c}, ckpt)
    assert new[0].epoch == (1 if batches_done >= 5 else 0)
    rest = [[s for c in new for s in c.next_batch()] for _ in range(15 - batches_done)]
    assert rest == ref[batches_done:]
    if batches_done == 5:  # the boundary: epoch 1 starts with all 5 of its batches
        assert new[0].consumed == 0
        epoch1 = rest[:5]
        assert sorted(s for b in epoch1 for s in b) == list(range(10))
        assert [s for b in epoch1 for s in b] == DataCursor(10, 2, seed=3).epoch_order(1).tolist()


def test_data_cursor_refuses_another_batch_geometry(tmp_path: Path) -> None:
    c = DataCursor(10, 2, seed=3)
    c.next_global_batch()
    reshard.save({"data": c}, tmp_path / "d")
    with pytest.raises(ShardingError, match="global_batch_size"):
        reshard.load({"data": DataCursor(10, 4, seed=3)}, tmp_path / "d")


# ----------------------------------------------------------------------------- strictness


def test_allow_missing_zero_fills_and_reports(tmp_path: Path) -> None:
    w = torch.arange(4.0)
    ckpt = tmp_path / "s"
    reshard.save({"w": w, "gone": torch.ones(2)}, ckpt)
    target = {"w": torch.zeros(4), "opt": {"m": torch.full((3,), 5.0), "v": torch.full((2,), 5.0)}}
    with pytest.raises(ShardingError, match="opt.m"):
        reshard.load(target, ckpt, allow_missing=["gone"])
    assert torch.equal(target["opt"]["m"], torch.full((3,), 5.0))

    res = reshard.load(target, ckpt, allow_missing=[("opt.*", "zeros")], strict=False)
    assert torch.equal(target["w"], w)
    assert torch.equal(target["opt"]["m"], torch.zeros(3))
    assert torch.equal(target["opt"]["v"], torch.zeros(2))
    assert sorted(res.initialized) == ["opt.m", "opt.v"]
    assert set(res.missing) == {"opt.m", "opt.v"}
    assert res.unexpected == ("gone",)

    # strict: the unexpected saved key is an error even though missing keys are allowed
    with pytest.raises(ShardingError, match="gone"):
        reshard.load(target, ckpt, allow_missing=[("opt.*", "zeros")])


def test_non_strict_load_lists_missing_and_unexpected(tmp_path: Path) -> None:
    ckpt = tmp_path / "ns"
    reshard.save({"a": torch.ones(2), "b": torch.ones(3)}, ckpt)
    keep = torch.full((4,), 7.0)
    target = {"a": torch.zeros(2), "c": keep}
    res = reshard.load(target, ckpt, strict=False)
    assert res.missing == ("c",) and res.unexpected == ("b",) and res.initialized == ()
    assert torch.equal(target["a"], torch.ones(2))
    assert torch.equal(keep, torch.full((4,), 7.0))  # missing, "keep": untouched
    with pytest.raises(ShardingError) as ei:
        reshard.load(target, ckpt)
    assert "c" in str(ei.value) and "b" in str(ei.value)


# ----------------------------------------------------------------------------- schema versions


def test_schema_version_mismatch_names_both(tmp_path: Path) -> None:
    ckpt = tmp_path / "sv"
    reshard.save({"w": torch.ones(2)}, ckpt, options=SaveOptions(schema_version="2"))
    assert reshard.inspect(ckpt).schema_version == "2"
    target = {"w": torch.zeros(2)}
    with pytest.raises(ShardingError) as ei:
        reshard.load(target, ckpt, options=LoadOptions(schema_version="3"))
    assert "'2'" in str(ei.value) and "'3'" in str(ei.value)
    assert torch.equal(target["w"], torch.zeros(2))
    reshard.load(target, ckpt, options=LoadOptions(schema_version="2"))
    assert torch.equal(target["w"], torch.ones(2))
