"""``reshard demo``: the project's main job.

Fine-tunes the real all-MiniLM-L6-v2 weights with masked-LM on the standard
library's docstrings in layout A (default ``dp2,tp2``) on real gloo ranks,
checkpointing every K steps with :class:`reshard.manager.manager.CheckpointManager`;
kills one rank with SIGKILL in the middle of a save and shows that the
abandoned attempt is ignored; restarts in layout B (default ``tp1,pp2,dp2``)
from the newest committed checkpoint in fresh processes; checks next-step
parity against an uninterrupted run in layout A (loss, gradients, updated
weights and AdamW moments; DESIGN.md section 5); exports the final weights
to Hugging Face safetensors; prints a report and writes a PNG of the loss
curves. Exit status 0 only when every check passed.

Rank functions keep one :class:`Trainer` per worker process between calls
(the pool's workers persist), so the parent can drive a progress bar.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import reshard

from ..manager.manager import CheckpointManager
from ..storage import LocalStorage
from .model import model_config
from .parity import assemble, compare, grad_atol
from .trainer import Layout, TrainConfig, Trainer, make_corpus

_TRAINER: dict[str, Any] = {}


# ----------------------------------------------------------------------------- rank functions


def _corpus(path: str | None) -> Any:
    if path is None:
        return None
    from safetensors.torch import load_file

    from .data import TokenizedCorpus

    t = load_file(path)
    c = TokenizedCorpus.__new__(TokenizedCorpus)
    c.ids, c.attention_mask, c.seq_len = t["ids"], t["attention_mask"], int(t["ids"].shape[1])
    return c


def r_start(run: str, mc: Any, tc: TrainConfig, layout: str, corpus_file: str | None,
            hf_dir: str | None) -> dict[str, Any]:
    """Build this rank's trainer (and import the Hugging Face weights)."""
    torch.set_num_threads(1)
    tr = Trainer(mc, tc, layout, corpus=_corpus(corpus_file))
    if hf_dir is not None:
        tr.import_hf(hf_dir)
    _TRAINER[run] = tr
    return {"rank": torch.distributed.get_rank()}


def r_steps(run: str, n: int, record_last: bool = False) -> dict[str, Any]:
    """``n`` training steps; the losses (last-stage ranks) and, with
    ``record_last``, the pieces of the last step."""
    tr = _TRAINER[run]
    losses: list[tuple[int, float]] = []
    pieces: list[Any] = []
    for i in range(n):
        rec = record_last and i == n - 1
        res = tr.train_step(record=rec)
        if res.loss is not None:
            losses.append((tr.step, res.loss))
        if rec:
            pieces = res.pieces
    return {"losses": losses, "pieces": pieces, "step": tr.step}


def r_state(run: str) -> list[Any]:
    """This rank's pieces of the weights and moments as they are now."""
    return _TRAINER[run].state_pieces()


def _manager(root: str, every: int) -> CheckpointManager:
    return CheckpointManager(root, every_steps=every, keep_last=None, preempt_signals=())


class _KillMidSave(LocalStorage):
    """Storage of the victim rank: SIGKILLs its own process after writing
    part of its first data file (the other ranks have written theirs)."""

    def open_write(self, path: str, *, durable: bool = True) -> Any:
        stream = super().open_write(path, durable=durable)
        if path.endswith(".safetensors"):
            real_write = stream.write

            def write(data: Any) -> None:
                real_write(memoryview(data)[: max(1, len(memoryview(data)) // 2)])
                os.kill(os.getpid(), signal.SIGKILL)

            stream.write = write  # type: ignore[method-assign]
        return stream


def r_save(run: str, root: str, every: int, kill_rank: int | None = None) -> dict[str, Any]:
    """Save the training state at this step (through the manager); the rank
    ``kill_rank`` dies by SIGKILL in the middle of it."""
    tr = _TRAINER[run]
    mgr = _manager(root, every)
    L = tr.layout
    opts = reshard.SaveOptions(mesh={"pp": L.pp, "dp": L.dp, "tp": L.tp})
    mgr.options = opts
    rank = torch.distributed.get_rank()
    if kill_rank is not None and rank == kill_rank:
        mgr.storage = _KillMidSave()
    t0 = time.perf_counter()
    res = mgr.save(tr.step, tr.state())
    secs = time.perf_counter() - t0
    assert isinstance(res, reshard.SaveResult)
    return {"seconds": secs, "bytes": res.total_bytes, "files": res.num_files, "path": res.path,
            "written": res.bytes_written}


def r_resume(run: str, mc: Any, tc: TrainConfig, layout: str, corpus_file: str | None,
             root: str, every: int) -> dict[str, Any]:
    """Fresh processes in another layout: restore the newest committed checkpoint."""
    import warnings

    torch.set_num_threads(1)
    tr = Trainer(mc, tc, layout, seed=tc.seed + 1000, corpus=_corpus(corpus_file))
    _TRAINER[run] = tr
    mgr = _manager(root, every)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = mgr.restore(tr.state())
    secs = time.perf_counter() - t0
    assert res is not None
    tr.step = int(res.values["step"])
    tr.zero.finish_load()
    return {"step": tr.step, "seconds": secs, "bytes_read": res.bytes_read, "path": res.path,
            "warnings": sorted({str(w.message)[:160] for w in caught})}


# ----------------------------------------------------------------------------- driver


@dataclass
class DemoConfig:
    out: Path
    layout_a: str = "dp2,tp2"
    layout_b: str = "tp1,pp2,dp2"
    preset: str = "bert"
    size: str = "full"
    data: str = "stdlib"
    steps: int = 16
    every: int = 4
    kill_at: int = 12
    seq_len: int = 32
    global_batch: int = 8
    lr: float = 1e-4
    max_files: int | None = None
    progress: bool = True


@dataclass
class DemoReport:
    lines: list[str] = field(default_factory=list)
    ok: bool = True

    def add(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    def check(self, ok: bool, what: str) -> None:
        self.ok &= ok
        self.add(f"  [{'ok' if ok else 'FAIL'}] {what}")


def _losses(results: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in results:
        for step, loss in r["losses"]:
            out[step] = loss
    return out


def _steps(pool: Any, world: int, run: str, n: int, bar: Any, record_last: bool = False
           ) -> tuple[dict[int, float], list[Any]]:
    losses: dict[int, float] = {}
    pieces: list[Any] = []
    for i in range(n):
        rec = record_last and i == n - 1
        res = pool.run(world, r_steps, run, 1, rec, timeout=600)
        losses.update(_losses(res))
        if rec:
            pieces = [r["pieces"] for r in res]
        bar.update(1)
    return losses, pieces


def check_config(cfg: DemoConfig, mc: Any, la: Layout, lb: Layout) -> None:
    """Refuse settings the run cannot honour, before anything is touched.

    Raises:
        ValueError: naming the flag and what it needs.
    """
    if not (0 < cfg.every <= cfg.kill_at < cfg.steps and cfg.kill_at % cfg.every == 0
            and cfg.kill_at > cfg.every):
        raise ValueError("need 0 < every < kill_at < steps with kill_at a multiple of every")
    if cfg.seq_len > mc.max_positions:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the {cfg.preset} ({cfg.size}) model's "
                         f"{mc.max_positions} positions")
    for name, lay in (("--layout-a", la), ("--layout-b", lb)):
        bad = [f"{what} {n}" for what, n in (("heads", mc.heads), ("kv_heads", mc.kv_heads),
                                              ("ffn", mc.ffn)) if n % lay.tp]
        if bad:
            raise ValueError(f"{name} {lay}: tp {lay.tp} must divide the model's {', '.join(bad)}")
        if cfg.global_batch % lay.dp:
            raise ValueError(f"{name} {lay}: --global-batch {cfg.global_batch} must be a multiple "
                             f"of dp {lay.dp}")


def _clear_checkpoint_root(root: Path) -> None:
    """Start from an empty checkpoint root: remove what earlier demo runs left
    (``step-*`` checkpoints, attempts and sidecars) and refuse to touch
    anything else."""
    if not root.exists():
        return
    foreign = [p.name for p in root.iterdir() if not p.name.startswith("step-")]
    if foreign:
        raise ValueError(f"{root} holds files that are not demo checkpoints ({foreign[:3]}); "
                         "choose another --out")
    import shutil

    for p in root.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def run_demo(cfg: DemoConfig) -> int:
    """Run the demo; returns the exit status (0: every check passed)."""
    from tqdm import tqdm

    from ..testing.pool import WorkerPool

    la, lb = Layout.parse(cfg.layout_a), Layout.parse(cfg.layout_b)
    mc = model_config(cfg.preset, cfg.size)
    # AdamW eps 1e-6 as in BERT's pre-training (Devlin et al., 2019). Some
    # gradients are exactly zero in exact arithmetic (the attention key bias:
    # softmax is invariant to it) and are pure rounding noise, which differs
    # with the reduction order of each layout; eps 1e-8 would turn that noise
    # into lr-sized updates, 1e-6 keeps it below the fp32 parity tolerance.
    tc = TrainConfig(seq_len=cfg.seq_len, global_batch=cfg.global_batch, micro_batch=2, lr=cfg.lr,
                     eps=1e-6, data=cfg.data, max_files=cfg.max_files)
    check_config(cfg, mc, la, lb)
    rep = DemoReport()
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    root = out / "ckpt"
    _clear_checkpoint_root(root)
    resume_from = cfg.kill_at - cfg.every
    hf_dir = None
    corpus_file = None
    rep.add(f"reshard demo: {cfg.preset} ({cfg.size}), layout A ({la}) -> layout B ({lb}), "
            f"{cfg.steps} steps, checkpoint every {cfg.every}, SIGKILL during the save of step "
            f"{cfg.kill_at}")
    t_all = time.perf_counter()
    if cfg.preset == "bert" and cfg.size == "full":
        from .data import minilm_dir

        hf_dir = str(minilm_dir())
        rep.add(f"weights: {hf_dir}/model.safetensors (all-MiniLM-L6-v2)")
    if cfg.data == "stdlib":
        from safetensors.torch import save_file

        corpus = make_corpus(mc, tc)
        corpus_file = str(out / "corpus.safetensors")
        save_file({"ids": corpus.ids.contiguous(), "attention_mask": corpus.attention_mask.contiguous()},
                  corpus_file)
        rep.add(f"text: {len(corpus)} standard-library docstrings (train split), seq_len {cfg.seq_len}")
    pool = WorkerPool(pg_timeout=120.0, grace=3.0, dump_hung=False)
    phases: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    bar_kw = dict(disable=not cfg.progress, leave=False, unit="step")
    try:
        # 1. the uninterrupted run (layout A), recording the step after the resume point
        pool.run(la.world_size, r_start, "u", mc, tc, str(la), corpus_file, hf_dir, timeout=600)
        with tqdm(total=cfg.steps, desc="uninterrupted run (A)", **bar_kw) as bar:
            lu1, _ = _steps(pool, la.world_size, "u", resume_from, bar)
            ref_state = pool.run(la.world_size, r_state, "u", timeout=600)
            lu2, ref_pieces = _steps(pool, la.world_size, "u", 1, bar, record_last=True)
            lu3, _ = _steps(pool, la.world_size, "u", cfg.steps - resume_from - 1, bar)
        loss_u = {**lu1, **lu2, **lu3}
        phase("uninterrupted run")
        pool.restart(la.world_size)
        # 2. the run that checkpoints and loses a rank mid-save (layout A)
        pool.run(la.world_size, r_start, "a", mc, tc, str(la), corpus_file, hf_dir, timeout=600)
        loss_a: dict[int, float] = {}
        saves: list[dict[str, Any]] = []
        killed = False
        with tqdm(total=cfg.kill_at, desc="training (A) with checkpoints", **bar_kw) as bar:
            for s in range(cfg.every, cfg.kill_at + 1, cfg.every):
                la_, _ = _steps(pool, la.world_size, "a", cfg.every, bar)
                loss_a.update(la_)
                if s < cfg.kill_at:
                    saves.append(pool.run(la.world_size, r_save, "a", str(root), cfg.every,
                                          timeout=600)[0])
                else:
                    try:
                        pool.run(la.world_size, r_save, "a", str(root), cfg.every, 1, timeout=120)
                    except AssertionError as e:  # WorkerError: the victim died, the others failed
                        killed = "WorkerDied" in str(e) or "SIGKILL" in str(e) or "-9" in str(e)
        phase("run with checkpoints and the kill")
        rep.add("")
        rep.add(f"layout A ({la}): steps 1..{cfg.kill_at}, checkpoints at "
                f"{list(range(cfg.every, cfg.kill_at, cfg.every))}")
        for sv in saves:
            rep.add(f"  save: {sv['bytes'] / 2**20:.1f} MiB in {sv['files']} files, {sv['seconds']:.2f} s "
                    f"({sv['bytes'] / max(sv['seconds'], 1e-9) / 2**20:.0f} MiB/s)")
        rep.check(killed, f"rank 1 killed by SIGKILL in the middle of the save of step {cfg.kill_at}")
        st = LocalStorage()
        from ..commit.listing import scan

        entries = scan(st, str(root))
        abandoned = [e.name for e in entries if e.abandoned]
        committed_steps = sorted(e.step for e in entries if e.manifest is not None and e.step is not None)
        rep.add(f"  {root}: committed steps {committed_steps}, abandoned attempts {abandoned}")
        latest = reshard.latest(root)
        rep.check(latest is not None and latest.endswith(f"step-{resume_from:08d}"),
                  f"latest() ignores the abandoned attempt: {latest}")
        same = all(loss_a.get(k) == v for k, v in loss_u.items() if k <= cfg.kill_at)
        rep.check(same, "layout A losses before the kill equal the uninterrupted run's bit for bit")
        pool.restart(lb.world_size)
        # 3. restart in layout B from the newest committed checkpoint (fresh processes)
        res = pool.run(lb.world_size, r_resume, "b", mc, tc, str(lb), corpus_file, str(root),
                       cfg.every, timeout=600)
        r0 = res[0]
        rep.add("")
        rep.add(f"layout B ({lb}): restored step {r0['step']} from {r0['path']} in "
                f"{max(r['seconds'] for r in res):.2f} s, {sum(r['bytes_read'] for r in res) / 2**20:.1f} "
                f"MiB read by {lb.world_size} ranks")
        for w in r0["warnings"]:
            rep.add(f"  note: {w}")
        rep.check(r0["step"] == resume_from, f"resumed at step {resume_from}")
        # the resharding itself: the restored weights and moments are the uninterrupted
        # run's at that step, bit for bit (zero tolerance: a load copies, it computes nothing)
        _, restore_failures = compare(assemble(pool.run(lb.world_size, r_state, "b", timeout=600)),
                                      assemble(ref_state), exact=True)
        for f in restore_failures[:10]:
            rep.add(f"  FAIL {f}")
        rep.check(not restore_failures, f"restored weights and AdamW moments in layout B equal the "
                                        f"uninterrupted run's at step {resume_from} bit for bit")
        with tqdm(total=cfg.steps - resume_from, desc="resumed run (B)", **bar_kw) as bar:
            lb1, got_pieces = _steps(pool, lb.world_size, "b", 1, bar, record_last=True)
            lb2, _ = _steps(pool, lb.world_size, "b", cfg.steps - resume_from - 1, bar)
        loss_b = {**lb1, **lb2}
        phase("restart in layout B and resumed run")
        # 4. next-step parity (the step after the resume point)
        a, b = assemble(got_pieces), assemble(ref_pieces)
        # every gradient element sums the contributions of the global batch's tokens, in
        # another order in layout B: its atol grows like sqrt(tokens) (parity.grad_atol)
        terms = cfg.global_batch * cfg.seq_len
        stats, failures = compare(a, b, exact=la == lb, grad_terms=terms)
        rep.add("")
        rep.add(f"next-step parity at step {resume_from + 1} (resumed B vs uninterrupted A; "
                f"|a-b| <= atol + 1e-5|b| elementwise, atol 1e-6, for gradients 1e-6 * sqrt({terms} "
                f"tokens) = {grad_atol(1e-6, terms):.1e}):")
        for kind, ks in stats.items():
            rep.add(f"  {kind:<10} {ks.tensors:4d} tensors  max_abs {ks.max_abs:.3e}  tolerance used "
                    f"{100 * ks.budget:.1f}%  (worst: {ks.worst})")
        for f in failures[:10]:
            rep.add(f"  FAIL {f}")
        rep.check(not failures, "loss, gradients, updated weights and moments within tolerance")
        drift = max(abs(loss_b[k] - loss_u[k]) for k in loss_b)
        rep.add(f"  loss of the resumed run vs uninterrupted over steps {resume_from + 1}..{cfg.steps}: "
                f"max |diff| {drift:.3e}")
        # 5. final checkpoint and export to Hugging Face safetensors
        final = pool.run(lb.world_size, r_save, "b", str(root), cfg.every, timeout=600)[0]
        from ..formats.hf_export import export_hf

        hf_out = out / "hf"
        t0 = time.perf_counter()
        # the model's own names (the "model" subtree, its path left out), as Hugging Face
        # loaders expect: export_hf's default
        ex = export_hf(final["path"], hf_out, overwrite=True,
                       copy_files=[os.path.join(hf_dir, f) for f in ("config.json", "tokenizer.json",
                                                                     "vocab.txt")] if hf_dir else ())
        rep.add("")
        rep.add(f"export: {len(ex.weight_map)} tensors, {ex.total_size / 2**20:.1f} MiB to {hf_out} in "
                f"{time.perf_counter() - t0:.2f} s")
        phase("final save and export")
        v = reshard.verify(final["path"])
        rep.check(v.ok, f"final checkpoint {final['path']} verifies ({v.bytes_checked / 2**20:.1f} MiB "
                        "of checksums)")
    finally:
        pool.close()
    png = out / "loss.png"
    _plot(png, loss_u, loss_a, loss_b, resume_from, cfg)
    rep.add("")
    rep.add(f"loss (uninterrupted A): {', '.join(f'{k}:{loss_u[k]:.4f}' for k in sorted(loss_u))}")
    rep.add(f"loss (resumed B):       {', '.join(f'{k}:{loss_b[k]:.4f}' for k in sorted(loss_b))}")
    rep.add(f"plot: {png}")
    rep.add("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    if cfg.size == ("full" if cfg.preset == "bert" else "small"):  # a state `reshard bench io` builds
        bm = "bert-minilm" if cfg.preset == "bert" else "llama-tiny"
        rep.add(f"the same state's save and restore, measured warm and repeated: reshard bench io --model {bm} "
                f"--layout {cfg.layout_a} --reshard-to {cfg.layout_b} --demo-report {out / 'report.txt'}")
    rep.add(f"total {time.perf_counter() - t_all:.0f} s -- {'DEMO OK' if rep.ok else 'DEMO FAILED'}")
    (out / "report.txt").write_text("\n".join(rep.lines) + "\n")
    return 0 if rep.ok else 1


def _plot(path: Path, lu: dict[int, float], la: dict[int, float], lb: dict[int, float],
          resume: int, cfg: DemoConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(sorted(lu), [lu[k] for k in sorted(lu)], "-", color="0.6", lw=3,
            label=f"uninterrupted ({cfg.layout_a})")
    ax.plot(sorted(la), [la[k] for k in sorted(la)], "o", ms=3, color="tab:blue",
            label=f"run with checkpoints ({cfg.layout_a})")
    ax.plot(sorted(lb), [lb[k] for k in sorted(lb)], "x-", ms=5, color="tab:red",
            label=f"resumed from step {resume} ({cfg.layout_b})")
    ax.axvline(cfg.kill_at, color="k", ls=":", lw=1)
    ax.text(cfg.kill_at, ax.get_ylim()[1], " SIGKILL mid-save", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("masked-LM loss" if cfg.preset == "bert" else "LM loss")
    ax.set_title(f"reshard demo: {cfg.preset} resumed in another layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
