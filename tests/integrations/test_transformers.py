"""reshard.integrations.transformers.ReshardTrainer with the real Hugging Face
Trainer (and accelerate underneath) on real gloo ranks: an uninterrupted run
against the same run stopped after a step and resumed in a fresh process
group, on 2 ranks (bitwise: losses, learning rates, the samples of every
step, the weights, the Trainer's log history) and on 1 rank (losses within
1e-5 relative, every sample of the epoch once).

Tested with transformers 5.23.0 and accelerate 1.15.0 (the dev requirements' pins)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from _pool_fns import new_default_group
from _transformers_fns import N, construct_on, internals_missing, run_recipe, train
from reshard.testing.pool import WorkerPool

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(240)


def _by_step(results: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["step"], r["rank"]): r for res in results for r in res["records"]}


def _run(pool: WorkerPool, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    pool.run(world, new_default_group)  # a restarted job: a new process group (new store, new port)
    return pool.run(world, train, cfg, timeout=180.0)


def test_same_layout_resume_is_bitwise(pool: WorkerPool, tmp_path: Path) -> None:
    """Dropout, a cosine schedule with warmup, async saves, save_total_limit=2:
    stopped after step 5, resumed from step 4, in the middle of the epoch (the
    Trainer's batch skipping, its trainer state, the scheduler and RNG from
    reshard's checkpoint): every step bitwise equal, the log history too.
    Restoring the streams where the checkpoint is read (before the skipping
    loader's iterator, made by the first fetch, draws its seed) trains the same
    samples at the same LR with other losses."""
    cfg = {"steps": 10, "every": 4, "dropout": 0.2, "reshard_async": True, "limit": 2}
    full = _run(pool, 2, {**cfg, "out": str(tmp_path / "full")})
    part1 = _run(pool, 2, {**cfg, "out": str(tmp_path / "run"), "stop_at": 5})
    assert [r["raised"] for r in part1] == ["stopped after step 5"] * 2
    shutil.copytree(tmp_path / "run", tmp_path / "naive")
    part2 = _run(pool, 2, {**cfg, "out": str(tmp_path / "run")})
    assert part2[0]["resumed_from"] == str(tmp_path / "run" / "checkpoints" / "step-00000004")
    want = _by_step(full)
    got = {**{k: v for k, v in _by_step(part1).items() if k[0] <= 4}, **_by_step(part2)}
    assert sorted(got) == sorted(want) and len(want) == 20
    for k in sorted(want):
        assert (got[k]["loss"], got[k]["lr"], got[k]["ids"]) == (want[k]["loss"], want[k]["lr"],
                                                                  want[k]["ids"]), k
    assert [r["params"] for r in part2] == [r["params"] for r in full]
    assert part2[0]["log"][:-1] == full[0]["log"][:-1]  # every step's logged loss and LR (the last: runtimes)
    assert part2[0]["global_step"] == 10 and part2[0]["views_left"] == []
    assert part2[0]["pre_mutation_calls"] == 6  # once per optimizer step, before it
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()
                   if p.name.startswith("step-") and "." not in p.name)
    # keep_last=2 leaves 2: step 4, the resume source, was kept while the run lived only
    assert names == ["step-00000008", "step-00000010"], names
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "run").iterdir())

    naive = _by_step(_run(pool, 2, {**cfg, "out": str(tmp_path / "naive"), "naive_rng": True}))
    assert naive[(5, 0)]["ids"] == want[(5, 0)]["ids"] and naive[(5, 0)]["lr"] == want[(5, 0)]["lr"]
    assert naive[(5, 0)]["loss"] != want[(5, 0)]["loss"]


def test_resume_at_an_epoch_boundary_is_bitwise(pool: WorkerPool, tmp_path: Path) -> None:
    """Saved after the last step of epoch 0 (6 steps of 8 samples): the
    streams are applied before epoch 1's iterator exists, as the
    uninterrupted run made it after the save."""
    cfg = {"steps": 8, "every": 6, "dropout": 0.2, "batch": 8}
    full = _by_step(_run(pool, 1, {**cfg, "out": str(tmp_path / "full")}))
    part1 = _run(pool, 1, {**cfg, "out": str(tmp_path / "run"), "stop_at": 7})
    part2 = _run(pool, 1, {**cfg, "out": str(tmp_path / "run")})
    assert part2[0]["resumed_from"].endswith("step-00000006")
    got = {**{k: v for k, v in _by_step(part1).items() if k[0] <= 6}, **_by_step(part2)}
    assert {k: (v["loss"], v["ids"]) for k, v in got.items()} == \
        {k: (v["loss"], v["ids"]) for k, v in full.items()}


def test_two_ranks_resumed_on_one(pool: WorkerPool, tmp_path: Path) -> None:
    """2 ranks stopped after step 9 (checkpoint 8, two steps into epoch 1),
    resumed on 1 rank with the same arguments (per-device batch 4 as written:
    the global batch of 8 is kept)."""
    cfg = {"steps": 12, "every": 4}
    full = _by_step(_run(pool, 2, {**cfg, "out": str(tmp_path / "full")}))
    part1 = _by_step(_run(pool, 2, {**cfg, "out": str(tmp_path / "run"), "stop_at": 9}))
    one = _run(pool, 1, {**cfg, "out": str(tmp_path / "run")})[0]
    assert one["resumed_from"].endswith("step-00000008")
    got = _by_step([one])
    assert sorted(s for s, _ in got) == list(range(9, 13))
    for step in range(9, 13):
        a, b = full[(step, 0)], full[(step, 1)]
        mean = (a["loss"] + b["loss"]) / 2
        r = got[(step, 0)]
        assert abs(r["loss"] - mean) <= 1e-5 * abs(mean), (step, r["loss"], mean)
        assert r["lr"] == a["lr"] and r["ids"] == a["ids"] + b["ids"]
    epoch1 = [i for s in (7, 8) for rk in (0, 1) for i in part1[(s, rk)]["ids"]]
    epoch1 += [i for s in range(9, 13) for i in got[(s, 0)]["ids"]]
    assert sorted(epoch1) == list(range(N))


def test_best_model_retention_and_a_stock_checkpoint(pool: WorkerPool, tmp_path: Path) -> None:
    """load_best_model_at_end: retention keeps the best checkpoint beside the
    newest and its weights are loaded at the end (greater_is_better=True on the
    loss, so the best is an early one). A stock checkpoint-N folder resumes
    through the stock code, then reshard checkpoints follow."""
    res = _run(pool, 1, {"steps": 8, "every": 2, "best": True, "greater": True, "limit": 1,
                         "out": str(tmp_path / "b")})[0]
    evals = {r["step"]: r["eval_loss"] for r in res["log"] if "eval_loss" in r}
    best_step = max(evals, key=lambda s: evals[s])
    assert res["best"].endswith(f"step-{best_step:08d}")
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()
                  if p.name.startswith("step-") and "." not in p.name)
    assert kept == sorted({f"step-{best_step:08d}", "step-00000008"}), (kept, evals)
    import torch

    import reshard
    from reshard.collectives import SingleProcess

    def weight(path: str) -> list[float]:
        w = torch.zeros(16, 6)
        reshard.load({"model": {"model": {"net.0.weight": w}}}, path, strict=False, group=SingleProcess())
        return w.flatten().tolist()

    assert res["params"][0] == weight(res["best"])  # the weights the Trainer ends with: the best's
    assert best_step != 8 and weight(str(tmp_path / "b" / "checkpoints" / "step-00000008")) != \
        res["params"][0], evals
    stock = _run(pool, 1, {"steps": 4, "every": 2, "out": str(tmp_path / "s"), "stock": True})[0]
    assert (tmp_path / "s" / "checkpoint-2" / "trainer_state.json").is_file()
    cont = _run(pool, 1, {"steps": 6, "every": 2, "out": str(tmp_path / "s"),
                          "resume": str(tmp_path / "s" / "checkpoint-4")})[0]
    assert cont["resumed_from"] is None and [r["step"] for r in cont["records"]] == [5, 6]
    assert (tmp_path / "s" / "checkpoints" / "step-00000006").is_dir()
    del stock


def test_the_stock_resume_idioms(pool: WorkerPool, tmp_path: Path) -> None:
    """train(resume_from_checkpoint=True) with no reshard checkpoint yet resumes
    the stock Trainer's newest checkpoint-N of output_dir (a run switching its
    backend), then reshard's newest; a root of reshard checkpoints resumes its
    newest; a path that is no checkpoint is refused naming what is expected."""
    out = tmp_path / "s"
    _run(pool, 1, {"steps": 4, "every": 2, "out": str(out), "stock": True})
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    cont = _run(pool, 1, {"steps": 6, "every": 2, "out": str(out), "resume": True})[0]
    assert cont["resumed_from"] is None and [r["step"] for r in cont["records"]] == [5, 6]
    assert (out / "checkpoints" / "step-00000006").is_dir()
    again = _run(pool, 1, {"steps": 8, "every": 2, "out": str(out), "resume": True})[0]
    assert again["resumed_from"] == str(out / "checkpoints" / "step-00000006")
    assert [r["step"] for r in again["records"]] == [7, 8]
    root = _run(pool, 1, {"steps": 10, "every": 2, "out": str(out), "resume": str(out / "checkpoints")})[0]
    assert root["resumed_from"] == str(out / "checkpoints" / "step-00000008")
    assert [r["step"] for r in root["records"]] == [9, 10]
    with pytest.raises(Exception, match=rf"resume_from_checkpoint='{tmp_path}' is not a checkpoint: "
                       r"expected a reshard checkpoint \(a folder with manifest.json"):
        _run(pool, 1, {"steps": 2, "out": str(tmp_path / "x"), "resume": str(tmp_path)})


def test_refusals_and_the_internals(pool: WorkerPool, tmp_path: Path) -> None:
    assert pool.run(1, internals_missing) == [[]]
    missing = pool.run(1, internals_missing, "_load_rng_state")[0]
    assert len(missing) == 1 and missing[0].startswith("Trainer._load_rng_state(checkpoint)")
    err = pool.run(1, construct_on, "_load_optimizer_and_scheduler", str(tmp_path / "x"))[0]
    assert err.startswith("CheckpointError: ReshardTrainer: the installed transformers (5.") and \
        "Trainer._load_optimizer_and_scheduler(checkpoint)" in err, err
    with pytest.raises(Exception, match="No valid checkpoint found in .*reshard.latest"):
        _run(pool, 1, {"steps": 2, "out": str(tmp_path / "empty"), "resume": True})
    with pytest.raises(Exception, match="save_only_model=True makes checkpoints a run cannot resume"):
        _run(pool, 1, {"steps": 2, "out": str(tmp_path / "m"), "save_only_model": True})


def test_the_accelerate_recipe_on_two_ranks(pool: WorkerPool, tmp_path: Path) -> None:
    """docs/integrations.md's accelerate recipe under DDP on 2 gloo ranks: run
    to step 5 then resumed to 8, against the same code run to 8 at once: the
    checkpoints of step 8 are identical (weights, moments, scheduler, RNG
    streams of both ranks, data position)."""
    from reshard.catalog.diff import diff
    from test_readme import ROOT, blocks

    code = next(b.code for b in blocks(ROOT / "docs" / "integrations.md")
                if "accelerate_state(accelerator" in b.code)
    assert code.rstrip().endswith("assert main(max_steps=8) == 8   # resumes from step 4")
    once = code[:code.index("main(max_steps=5)")] + "assert main(max_steps=8) == 8\n"
    pool.run(2, new_default_group)
    assert pool.run(2, run_recipe, str(tmp_path / "twice"), code, timeout=120.0) == [True, True]
    pool.run(2, new_default_group)
    assert pool.run(2, run_recipe, str(tmp_path / "once"), once, timeout=120.0) == [True, True]
    a = tmp_path / "twice" / "accelerate-ckpt" / "step-00000008"
    b = tmp_path / "once" / "accelerate-ckpt" / "step-00000008"
    d = diff(a, b)
    assert d.identical, d


def test_the_accelerate_recipe_two_ranks_resumed_on_one_keeps_the_lr(pool: WorkerPool,
                                                                     tmp_path: Path) -> None:
    """accelerate's prepared scheduler steps num_processes times per optimizer
    step. The recipe stopped at step 5 on 2 ranks (checkpoint 4) and resumed on
    1 rank to step 8 (the cursor keeps the global batch of 8): the scheduler
    keeps the 2-rank pace (2 scheduler steps per optimizer step), so its state
    at step 8 is the uninterrupted 2-rank run's, as is the data position; the
    weights and moments agree within the fp32 tolerance (the recipe without its
    dropout)."""
    import torch

    import reshard
    from test_readme import ROOT, blocks

    code = next(b.code for b in blocks(ROOT / "docs" / "integrations.md")
                if "accelerate_state(accelerator" in b.code)
    # without dropout (its masks are re-derived streams on another world size), the weights compare
    head = code[:code.index("main(max_steps=5)")].replace("torch.nn.Dropout(0.1)", "torch.nn.Identity()")
    assert "Identity" in head
    pool.run(2, new_default_group)
    assert pool.run(2, run_recipe, str(tmp_path / "once"), head + "assert main(max_steps=8) == 8\n",
                    timeout=120.0) == [True, True]
    pool.run(2, new_default_group)
    assert pool.run(2, run_recipe, str(tmp_path / "run"), head + "main(max_steps=5)\n",
                    timeout=120.0) == [True, True]
    pool.run(1, new_default_group)
    assert pool.run(1, run_recipe, str(tmp_path / "run"), head + "assert main(max_steps=8) == 8\n",
                    timeout=120.0) == [True]
    want = reshard.read_state(str(tmp_path / "once" / "accelerate-ckpt" / "step-00000008"))
    got = reshard.read_state(str(tmp_path / "run" / "accelerate-ckpt" / "step-00000008"))
    assert got["scheduler"] == want["scheduler"] and want["scheduler"]["last_epoch"] == 16
    assert got["scheduler_pace"] == want["scheduler_pace"] == {"steps_per_optimizer_step": 2}
    assert {k: got["data"][k] for k in ("epoch", "consumed")} == \
        {k: want["data"][k] for k in ("epoch", "consumed")}

    def tensors(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out.update(tensors(v, f"{prefix}{k}."))
            elif isinstance(v, torch.Tensor):
                out[prefix + k] = v
        return out

    a, b = tensors(want["model"]), tensors(got["model"])  # weights and AdamW moments
    assert sorted(a) == sorted(b) and any(k.endswith("weight") for k in a), sorted(a)
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_importing_the_integration_prints_no_torchao_noise() -> None:
    """`from transformers import Trainer` imports torchao (transformers'
    quantizers) where it is installed, and torchao logs lines about its own
    compiled extensions (built for another Python, torch or GPU) and torch
    warns about its Enum constants: importing the integration prints none of
    them, and a torchao line logged after the import is not hidden."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = ("import logging, sys\n"
            "import reshard.integrations.transformers\n"
            "print('torchao imported:', 'torchao' in sys.modules)\n"
            "logging.getLogger('torchao').warning('Failed to load after-the-import')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "torchao imported: True"  # the import that used to be noisy happened
    assert out.stderr.strip() == "Failed to load after-the-import", out.stderr[-3000:]


def test_accelerate_with_dataloader_workers_resumes_exactly_or_is_refused(pool: WorkerPool,
                                                                          tmp_path: Path) -> None:
    """An accelerate loop whose batches come from 2 DataLoader workers per rank
    (which fetch ahead of training), 2 gloo ranks: with cursor_loader, stopped
    after step 5 and resumed (checkpoint 4) to step 10, across the epoch end
    (8 steps), every step takes the samples of the uninterrupted run and the
    step-10 checkpoints are identical (weights, moments, scheduler, RNG, data
    position). The cursor as the batch sampler of a loader with workers is
    refused at the first batch, naming cursor_loader."""
    from _transformers_fns import accelerate_loop
    from reshard.catalog.diff import diff

    def run(d: str, steps: int, **kw: Any) -> list[dict[int, list[int]]]:
        pool.run(2, new_default_group)
        return pool.run(2, accelerate_loop, str(tmp_path / d), steps, 2, timeout=180.0, **kw)

    full = run("full", 10)
    first = run("run", 5)
    second = run("run", 10)
    assert sorted(second[0]) == list(range(5, 11))  # resumed from step 4: step 5 again, then on
    for r in range(2):
        assert {**first[r], **second[r]} == full[r]
        assert sorted(i for s in range(1, 9) for rk in range(2) for i in full[rk][s]) == list(range(64))
    d = diff(tmp_path / "full" / "ckpt" / "step-00000010", tmp_path / "run" / "ckpt" / "step-00000010")
    assert d.identical, d
    with pytest.raises(Exception, match=r"DataCursor is the batch sampler of a DataLoader with "
                       r"num_workers=2: .*a resume would skip those batches.*cursor_loader"):
        run("plain", 2, plain=True)
