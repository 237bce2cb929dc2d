"""The cross-layout next-step tolerance (``parity.grad_atol``: gradients'
atol grows like sqrt(tokens summed)) passes a real resume in another layout
and still catches real restore errors injected into it."""

from __future__ import annotations

import pytest
import torch

import _parity_fns as fns
from reshard.demo.model import model_config
from reshard.demo.parity import assemble, compare, grad_atol, rank_continuous, rank_save
from reshard.demo.trainer import Layout, TrainConfig
from reshard.testing.pool import WorkerPool


def test_grad_atol_grows_like_sqrt_of_terms() -> None:
    assert grad_atol(1e-6, 1) == 1e-6 and grad_atol(1e-6, 0) == 1e-6
    assert grad_atol(1e-6, 256) == pytest.approx(16e-6)
    assert grad_atol(2e-6, 100) == pytest.approx(2e-5)


def test_reassociated_sum_with_cancellation_fits_and_a_wrong_sum_does_not() -> None:
    """Sums of 256 cancelling fp32 contributions as two layouts form them: in
    another order (sequential vs. 2 DP ranks x 2 micro-batches) and each
    contribution off by its own rounding (here up to 1e-7, a tenth of atol).
    The sums' difference exceeds ``1e-6 + 1e-5|b|`` where they cancel to near
    zero (the demo's token_type_embeddings failure), fits grad_atol(1e-6,
    256); a sum missing one contribution fails either way."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 4096, generator=g) * 1e-2).float()
    delta = ((torch.rand(256, 4096, generator=g) * 2 - 1) * 1e-7).float()
    seq = torch.zeros(4096)
    for t in range(256):
        seq += x[t]
    y = x + delta
    parts = [y[i * 64:(i + 1) * 64].sum(0) for i in range(4)]
    tree = (parts[0] + parts[1]) + (parts[2] + parts[3])
    a, b = {"grad/w": tree}, {"grad/w": seq}
    assert compare(a, b, exact=False, grad_terms=1)[1]  # the plain elementwise tolerance fails
    stats, fails = compare(a, b, exact=False, grad_terms=256)
    assert not fails and stats["grad"].budget < 1.0
    wrong = {"grad/w": tree - x[17]}  # one token's contribution lost
    assert compare(wrong, b, exact=False, grad_terms=256)[1]


_MC, _TC = model_config("bert", "tiny"), TrainConfig()


@pytest.fixture(scope="module")
def saved(pool: WorkerPool, tmp_path_factory) -> tuple[dict[str, torch.Tensor], str]:
    """The uninterrupted step 3 in dp2,tp2 and a checkpoint of step 2 (run once)."""
    sl = Layout.parse("dp2,tp2")
    path = str(tmp_path_factory.mktemp("tol") / "ck")
    ref = pool.run(4, rank_continuous, _MC, _TC, sl, 3, timeout=120)
    pool.run(4, rank_save, _MC, _TC, sl, 2, path, timeout=120)
    return assemble(ref), path


@pytest.mark.parametrize("fault", [None, "exp_avg", "rng_step"])
def test_injected_restore_errors_are_caught(pool: WorkerPool, saved, fault: str | None) -> None:
    ref, path = saved
    pool.restart(4)  # fresh processes in the other layout
    got = pool.run(4, fns.resume_with_fault, _MC, _TC, "tp1,pp2,dp2", path, fault, timeout=120)
    stats, fails = compare(assemble(got), ref, exact=False, grad_terms=_TC.global_batch * _TC.seq_len)
    if fault is None:
        assert not fails, fails
        assert stats["grad"].max_abs > 0  # another layout: not bit-exact, the tolerance matters
    elif fault == "exp_avg":
        assert any(f.startswith("exp_avg/") for f in fails), stats
        assert not any(f.startswith("grad/") for f in fails)  # the gradient itself was right
    else:
        assert any(f.startswith("grad/") for f in fails) and any(f.startswith("loss/") for f in fails)
