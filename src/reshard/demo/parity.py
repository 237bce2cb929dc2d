"""Next-step parity harness (DESIGN.md section 5) over the reference trainer.

:func:`parity` runs, on real gloo ranks, an uninterrupted run in the save
layout and a run that saves at step N, then resumes in fresh processes in
the load layout, and compares step N+1's loss, reduced gradients, updated
weights and AdamW moments, gathered to logical tensors: bit-exact for the same
layout, ``|a - b| <= atol + rtol * |b|`` elementwise otherwise.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..state.sharding import numel
from .model import ModelConfig, model_config

# ----------------------------------------------------------------------------- layout and groups
from .trainer import Layout, Piece, TrainConfig, Trainer

# ----------------------------------------------------------------------------- rank functions


def rank_continuous(mc: ModelConfig, tc: TrainConfig, layout: Layout, steps: int) -> list[Piece]:
    """``steps`` steps without stopping; the pieces of the last one."""
    tr = Trainer(mc, tc, layout)
    for _ in range(steps - 1):
        tr.train_step()
    return tr.train_step(record=True).pieces


def rank_save(mc: ModelConfig, tc: TrainConfig, layout: Layout, steps: int, path: str) -> dict[str, Any]:
    """``steps`` steps, then save the training state at ``path``."""
    tr = Trainer(mc, tc, layout)
    for _ in range(steps):
        tr.train_step()
    t0 = time.perf_counter()
    res = tr.save(path)
    return {"seconds": time.perf_counter() - t0, "total_bytes": res.total_bytes}


def rank_resume(mc: ModelConfig, tc: TrainConfig, layout: Layout, path: str) -> dict[str, Any]:
    """A trainer initialised from another seed loads ``path`` and takes one step."""
    tr = Trainer(mc, tc, layout, seed=tc.seed + 1000)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = tr.load(path)
    secs = time.perf_counter() - t0
    return {"pieces": tr.train_step(record=True).pieces, "seconds": secs, "step": res.step,
            "warnings": [str(w.message) for w in caught], "notes": dict(res.notes)}


# ----------------------------------------------------------------------------- harness


def assemble(ranks: Sequence[Sequence[Piece]]) -> dict[str, torch.Tensor]:
    """Logical tensors ``"{kind}/{fqn}"`` from every rank's pieces. Replicas
    must agree bit for bit and the pieces must cover each tensor."""
    full: dict[str, torch.Tensor] = {}
    cover: dict[str, torch.Tensor] = {}
    for pieces in ranks:
        for kind, fqn, gs, go, ls, fr, data in pieces:
            key = f"{kind}/{fqn}"
            if key not in full:
                full[key] = torch.zeros(gs, dtype=data.dtype)
                cover[key] = torch.zeros(gs, dtype=torch.bool)
            box = tuple(slice(o, o + s) for o, s in zip(go, ls, strict=True))
            idx = torch.arange(numel(gs)).reshape(gs)[box].reshape(-1)
            if fr is not None:
                idx = idx[fr[0]:fr[1]]
            f, c, src = full[key].view(-1), cover[key].view(-1), data.reshape(-1)
            seen = c[idx]
            if seen.any() and not torch.equal(f[idx][seen], src[seen]):
                raise AssertionError(f"{key}: replicas differ")
            f[idx] = src
            c[idx] = True
    holes = [k for k, c in cover.items() if not bool(c.all())]
    if holes:
        raise AssertionError(f"pieces do not cover {holes[:5]}")
    return full


@dataclass(frozen=True)
class KindStats:
    """Largest differences of one kind (loss, grad, param, exp_avg, exp_avg_sq).

    ``max_rel`` is over elements where the reference is non-zero (large for
    near-zero elements); ``budget`` is the largest ``|a - b| / (atol + rtol *
    |b|)`` (<= 1 passes); ``worst`` is the tensor with the largest budget."""

    tensors: int
    max_abs: float
    max_rel: float
    budget: float
    worst: str


@dataclass
class ParityReport:
    """Outcome of :func:`parity` (``a`` = resumed, ``b`` = uninterrupted)."""

    save_layout: Layout
    load_layout: Layout
    preset: str
    steps_before: int
    exact: bool  # bit-exact required (same layout)
    loss_continuous: float
    loss_resumed: float
    stats: dict[str, KindStats]
    failures: list[str]
    seconds: dict[str, float]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        mode = "bit-exact" if self.exact else "|a-b| <= 1e-6 + 1e-5|b|"
        lines = [f"{self.preset} ({self.save_layout}) -> ({self.load_layout}), step "
                 f"{self.steps_before + 1}, {mode}: {'OK' if self.ok else 'FAIL'}  loss "
                 f"{self.loss_continuous:.9g} vs {self.loss_resumed:.9g}"]
        for kind, s in self.stats.items():
            lines.append(f"  {kind:<10} {s.tensors:3d} tensors  max_abs {s.max_abs:.3e}  max_rel "
                         f"{s.max_rel:.3e}  tolerance used {100 * s.budget:.1f}%  ({s.worst})")
        lines += [f"  FAIL {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def grad_atol(atol: float, terms: int) -> float:
    """The absolute tolerance of a gradient element that is a sum of ``terms``
    per-token contributions (``terms`` = tokens of the global batch).

    Another layout adds the same contributions in another order (TP partial
    sums, pipeline stages, micro-batches, the DP all-reduce), and each
    contribution differs by its own rounding. With independent rounding
    errors the difference of the sums grows like ``sqrt(terms)`` times that
    of one term (the probabilistic bound ``lambda * sqrt(n) * u`` in place
    of the worst case ``n * u``: Higham and Mary, "A New Approach to
    Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5),
    2019, Theorem 3.1). The cancellation in such a sum (a gradient much
    smaller than its contributions: ``embeddings.token_type_embeddings``,
    a sum over every token) is why ``rtol * |b|`` alone cannot cover it.
    Returns ``atol * sqrt(terms)`` (``atol`` for ``terms <= 1``)."""
    return atol * math.sqrt(max(1, terms))


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, exact: bool,
            atol: float = 1e-6, rtol: float = 1e-5, grad_terms: int = 1
            ) -> tuple[dict[str, KindStats], list[str]]:
    """Elementwise comparison of resumed ``a`` with reference ``b``:
    ``|a - b| <= atol + rtol * |b|``, with ``atol`` of the ``"grad/"`` keys
    :func:`grad_atol` ``(atol, grad_terms)`` (``grad_terms``: tokens of the
    global batch summed into each gradient element); bit-exact with ``exact``.

    Returns per-kind :class:`KindStats` and the failures (one line per key)."""
    failures = [f"{k}: only in the {'resumed' if k in a else 'uninterrupted'} run"
                for k in sorted(set(a) ^ set(b))]
    acc: dict[str, list[Any]] = {}
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        kind = key.split("/", 1)[0]
        if x.shape != y.shape or x.dtype != y.dtype:
            failures.append(f"{key}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
            continue
        same = torch.equal(x, y)
        xd, yd = x.double(), y.double()
        d = (xd - yd).abs()
        mabs = float(d.max()) if d.numel() else 0.0
        nz = yd != 0
        mrel = float((d[nz] / yd[nz].abs()).max()) if bool(nz.any()) else 0.0
        at = grad_atol(atol, grad_terms) if kind == "grad" else atol
        budget = float((d / (at + rtol * yd.abs())).max()) if d.numel() else 0.0
        if exact and not same:
            failures.append(f"{key}: not bit-exact (max_abs {mabs:.3e})")
        elif not exact and budget > 1.0:
            failures.append(f"{key}: max_abs {mabs:.3e} max_rel {mrel:.3e} exceeds the tolerance")
        st = acc.setdefault(kind, [0, 0.0, 0.0, 0.0, ""])
        st[0] += 1
        if budget >= st[3]:
            st[4] = key.split("/", 1)[1]
        st[1], st[2], st[3] = max(st[1], mabs), max(st[2], mrel), max(st[3], budget)
    return {k: KindStats(*v) for k, v in acc.items()}, failures


def parity(save_layout: Layout | str, load_layout: Layout | str, *, preset: str = "llama",
           steps_before: int = 2, model: ModelConfig | None = None, train: TrainConfig | None = None,
           pool: Any = None, resume_pool: Any = None, workdir: str | None = None,
           fresh_processes: bool = True, atol: float = 1e-6, rtol: float = 1e-5,
           timeout: float = 120.0) -> ParityReport:
    """Next-step parity of a save in ``save_layout`` at step ``steps_before``
    resumed in ``load_layout``.

    1. An uninterrupted run in ``save_layout`` takes ``steps_before + 1``
       steps and records step ``steps_before + 1``: loss, reduced gradients,
       updated weights, AdamW moments (gathered to logical tensors).
    2. A separate run in ``save_layout`` takes ``steps_before`` steps and saves.
    3. Processes in ``load_layout`` that did not run step 2 build a trainer
       from another init seed, load, take the next step on the same global
       batch and record the same. They are ``resume_pool``'s workers when
       given (a pool kept apart from ``pool``), else ``pool``'s, restarted
       first when the world size is the same and ``fresh_processes``.

    Same layout: every tensor must be bit-exact; otherwise
    ``|a - b| <= atol + rtol * |b|`` elementwise.

    Args:
        model: default ``model_config(preset, "tiny")``; train: default
            ``TrainConfig()`` (lr 1e-4, AdamW, dropout 0.1 from the model config).
        pool: a :class:`~reshard.testing.pool.WorkerPool` for steps 1 and 2
            (default: a private one, closed at the end).
        resume_pool: another WorkerPool for step 3 (default: ``pool``).
        workdir: where the checkpoint goes (default: a temporary directory, removed).
    """
    from ..testing.pool import WorkerPool

    sl, ll = Layout.parse(save_layout), Layout.parse(load_layout)
    mc = model or model_config(preset, "tiny")
    tc = train or TrainConfig()
    own = pool is None
    pl = WorkerPool() if own else pool
    tmp = None if workdir is not None else tempfile.mkdtemp(prefix="reshard-parity-")
    path = f"{workdir or tmp}/ckpt-{sl}-to-{ll}".replace(",", "_")
    secs: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        ref = pl.run(sl.world_size, rank_continuous, mc, tc, sl, steps_before + 1, timeout=timeout)
        t1 = time.perf_counter()
        saved = pl.run(sl.world_size, rank_save, mc, tc, sl, steps_before, path, timeout=timeout)
        t2 = time.perf_counter()
        rp = resume_pool if resume_pool is not None else pl
        if fresh_processes and rp is pl and ll.world_size == sl.world_size:
            pl.restart(ll.world_size)
        t3 = time.perf_counter()
        got = rp.run(ll.world_size, rank_resume, mc, tc, ll, path, timeout=timeout)
        t4 = time.perf_counter()
        secs = {"continuous": t1 - t0, "save_run": t2 - t1, "restart": t3 - t2, "resume_run": t4 - t3,
                "save": max(s["seconds"] for s in saved), "load": max(r["seconds"] for r in got)}
        b = assemble(ref)
        a = assemble([r["pieces"] for r in got])
    finally:
        if own:
            pl.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    exact = sl == ll
    stats, failures = compare(a, b, exact=exact, atol=atol, rtol=rtol)
    notes = {"warnings": sorted({w for r in got for w in r["warnings"]}),
             "checkpoint_bytes": saved[0]["total_bytes"], "loaded_step": got[0]["step"],
             "checkpoint": path if tmp is None else None}
    return ParityReport(sl, ll, mc.preset, steps_before, exact, float(b["loss/loss"]),
                        float(a["loss/loss"]), stats, failures, secs, notes)


__all__ = ["KindStats", "ParityReport", "assemble", "compare", "parity", "rank_continuous",
           "rank_resume", "rank_save"]
