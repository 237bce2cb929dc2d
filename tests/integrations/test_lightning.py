"""reshard.integrations.lightning.ReshardCheckpoint with the real Lightning on
real gloo ranks: an uninterrupted run against the same run stopped after a
step and resumed in a fresh process group (same code, same callback), under
DDP and under ModelParallelStrategy (FSDP2), on 2 ranks (bitwise: losses,
learning rates, the samples of every step, the final weights) and on 1 rank
(losses within 1e-5 relative, every sample of the epoch once).

Tested with lightning 2.6.6 (the dev requirements' pin)."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from _lightning_fns import N, fit, internals_of_a_trainer
from _pool_fns import new_default_group
from reshard.testing.pool import WorkerPool

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(240)

G = 8  # global batch: 4 per rank on 2 ranks


def _by_step(results: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for res in results:
        for r in res["records"]:
            out[(r["step"], r["rank"])] = r
    return out


def _run(pool: WorkerPool, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    pool.run(world, new_default_group)  # a restarted job: a new process group (new store, new port)
    return pool.run(world, fit, cfg, timeout=180.0)


def _stitched(part1: list[dict[str, Any]], part2: list[dict[str, Any]],
              resumed_at: int) -> dict[tuple[int, int], dict[str, Any]]:
    """What the stopped run trained up to its checkpoint, then the resumed run."""
    a = {k: v for k, v in _by_step(part1).items() if k[0] <= resumed_at}
    b = _by_step(part2)
    assert min(s for s, _ in b) == resumed_at + 1, sorted(b)
    return {**a, **b}


def test_ddp_resume_same_layout_is_bitwise(pool: WorkerPool, tmp_path: Path) -> None:
    """Dropout, a dataset drawing noise in __getitem__, validation at the save
    step, an LR scheduler, async saves and keep_last: stopped after step 7,
    resumed from step 4 in a fresh group: every step bitwise equal. The same
    resume with the streams restored in on_fit_start (before Lightning creates
    the DataLoader iterator) trains the same samples at the same LR with
    different losses: the timing the integration gets right."""
    cfg = {"steps": 10, "every": 4, "dropout": 0.2, "noise": 0.05, "val_every": 4, "use_async": True,
           "keep_last": 2}
    full = _run(pool, 2, {**cfg, "root": str(tmp_path / "full")})
    part1 = _run(pool, 2, {**cfg, "root": str(tmp_path / "run"), "stop_at": 7})
    assert [r["raised"] for r in part1] == ["stopped after step 7"] * 2
    shutil.copytree(tmp_path / "run", tmp_path / "naive")
    part2 = _run(pool, 2, {**cfg, "root": str(tmp_path / "run")})

    assert part2[0]["resumed_from"].endswith("step-00000004")
    assert f"resuming from {part2[0]['resumed_from']} (step 4)" in part2[0]["lines"], part2[0]["lines"]
    want, got = _by_step(full), _stitched(part1, part2, 4)
    assert sorted(got) == sorted(want) and len(want) == 20
    for k in sorted(want):
        assert (got[k]["loss"], got[k]["lr"], got[k]["ids"]) == (want[k]["loss"], want[k]["lr"],
                                                                  want[k]["ids"]), k
    assert [r["params"] for r in part2] == [r["params"] for r in full]
    assert part2[0]["global_step"] == 10
    assert part2[0]["pre_mutation_calls"] == 6  # before each of the 6 optimizer steps of the resumed run
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")
                   and "." not in p.name)
    # keep_last=2 leaves 2: step 4, the resume source, was kept while the run lived only
    assert names == ["step-00000008", "step-00000010"], names

    naive = _by_step(_run(pool, 2, {**cfg, "root": str(tmp_path / "naive"), "naive_rng": True}))
    assert naive[(5, 0)]["ids"] == want[(5, 0)]["ids"] and naive[(5, 0)]["lr"] == want[(5, 0)]["lr"]
    assert naive[(5, 0)]["loss"] != want[(5, 0)]["loss"]


def _two_to_one(pool: WorkerPool, tmp_path: Path, strategy: str) -> None:
    """2 ranks stopped after step 9 (checkpoint 8, two steps into epoch 1),
    resumed on 1 rank with the same code (per-device batch 4 as written: the
    callback keeps the global batch of 8); the loader is made again at every
    epoch (reload_dataloaders_every_n_epochs=1) and continues the cursor."""
    cfg = {"steps": 12, "every": 4, "strategy": strategy, "reload": 1}
    full = _run(pool, 2, {**cfg, "root": str(tmp_path / "full")})
    part1 = _run(pool, 2, {**cfg, "root": str(tmp_path / "run"), "stop_at": 9})
    one = _run(pool, 1, {**cfg, "root": str(tmp_path / "run")})
    assert one[0]["resumed_from"].endswith("step-00000008")
    assert any(ln.startswith("global batch 8 kept: per-device batch 4 -> 8") for ln in one[0]["lines"])
    want = _by_step(full)
    e0, e1 = ([i for s in steps for rk in (0, 1) for i in want[(s, rk)]["ids"]]
              for steps in (range(1, 7), range(7, 13)))
    assert sorted(e0) == sorted(e1) == list(range(N)) and e0 != e1  # each epoch its own permutation
    got = _by_step(one)
    assert sorted(s for s, _ in got) == list(range(9, 13))
    for step in range(9, 13):
        a, b = want[(step, 0)], want[(step, 1)]
        mean = (a["loss"] + b["loss"]) / 2  # the global loss of the 2-rank step
        r = got[(step, 0)]
        assert abs(r["loss"] - mean) <= 1e-5 * abs(mean), (step, r["loss"], mean)
        assert r["lr"] == a["lr"]
        assert r["ids"] == a["ids"] + b["ids"]  # the same global batch, in data-parallel order
    # epoch 1 (steps 7-12): 2 steps on 2 ranks before the stop, 4 on 1 rank after the resume
    before = _by_step(part1)
    epoch1 = [i for s in (7, 8) for rk in (0, 1) for i in before[(s, rk)]["ids"]]
    epoch1 += [i for s in range(9, 13) for i in got[(s, 0)]["ids"]]
    assert sorted(epoch1) == list(range(N))


def test_ddp_resume_two_ranks_to_one(pool: WorkerPool, tmp_path: Path) -> None:
    _two_to_one(pool, tmp_path, "ddp")


def test_fsdp2_resume_same_layout_and_two_to_one(pool: WorkerPool, tmp_path: Path) -> None:
    """ModelParallelStrategy (FSDP2 over the data-parallel mesh): the 2-rank
    resume bitwise, and the 2 -> 1 resume within tolerance."""
    cfg = {"steps": 8, "every": 3, "strategy": "fsdp2", "dropout": 0.2}
    full = _run(pool, 2, {**cfg, "root": str(tmp_path / "full")})
    part1 = _run(pool, 2, {**cfg, "root": str(tmp_path / "run"), "stop_at": 5})
    part2 = _run(pool, 2, {**cfg, "root": str(tmp_path / "run")})
    assert part2[0]["resumed_from"].endswith("step-00000003")
    want, got = _by_step(full), _stitched(part1, part2, 3)
    assert {k: (v["loss"], v["lr"], v["ids"]) for k, v in got.items()} == \
        {k: (v["loss"], v["lr"], v["ids"]) for k, v in want.items()}
    assert [r["params"] for r in part2] == [r["params"] for r in full]
    _two_to_one(pool, tmp_path / "one", "fsdp2")


def test_gradient_accumulation_saves_and_resumes_at_optimizer_steps(pool: WorkerPool,
                                                                     tmp_path: Path) -> None:
    """accumulate_grad_batches=2 and 16-mixed precision with a GradScaler: a
    checkpoint is taken at the micro-batch that completes a step (never inside
    one), and the resume continues bitwise, the scaler's scale and growth
    tracker (the precision plugin's state) included."""
    cfg = {"steps": 5, "every": 2, "accumulate": 2, "dropout": 0.2, "fp16": True}
    whole = _run(pool, 1, {**cfg, "root": str(tmp_path / "full")})[0]
    full = whole["records"]
    part1 = _run(pool, 1, {**cfg, "root": str(tmp_path / "run"), "stop_at": 3})[0]
    part2 = _run(pool, 1, {**cfg, "root": str(tmp_path / "run")})[0]
    assert part2["resumed_from"].endswith("step-00000002")
    got = [r for r in part1["records"] if r["step"] <= 2] + part2["records"]
    assert [(r["epoch"], r["batch"], r["loss"], r["ids"]) for r in got] == \
        [(r["epoch"], r["batch"], r["loss"], r["ids"]) for r in full]
    assert len(full) == 10
    assert part1["precision"]["scale"] != 2.0**10  # it grew before the save
    assert part2["precision"] == whole["precision"]


def test_an_explicit_ckpt_path_wins_over_dirpath(pool: WorkerPool, tmp_path: Path) -> None:
    """fit(ckpt_path=<Lightning checkpoint>) with committed reshard checkpoints
    in dirpath: Lightning restores its file, the callback says so and does not
    resume, and the data position comes from the callback's state that
    Lightning saved in its file (the samples continue, none repeated)."""
    cfg = {"steps": 6, "every": 2}
    full = _by_step(_run(pool, 1, {**cfg, "root": str(tmp_path / "full")}))
    first = _run(pool, 1, {**cfg, "steps": 4, "root": str(tmp_path / "run"),
                           "save_lightning": str(tmp_path / "pl")})
    assert first[0]["resumed_from"] is None
    ckpt = sorted((tmp_path / "pl").glob("*step=2.ckpt"))
    assert len(ckpt) == 1, sorted((tmp_path / "pl").iterdir())
    res = _run(pool, 1, {**cfg, "root": str(tmp_path / "run"), "ckpt_path": str(ckpt[0])})[0]
    assert res["resumed_from"] is None
    assert any(ln.startswith("fit(ckpt_path=") and "not resuming from" in ln for ln in res["lines"])
    got = _by_step([res])
    assert sorted(s for s, _ in got) == [3, 4, 5, 6]  # Lightning's step 2, not reshard's step 4
    for k in got:
        assert (got[k]["ids"], got[k]["lr"]) == (full[k]["ids"], full[k]["lr"]), k
        assert got[k]["loss"] == full[k]["loss"], k  # weights, moments, RNG: Lightning's own


def test_a_fit_ended_mid_epoch_resumes_with_the_epochs_next_batch(pool: WorkerPool,
                                                                     tmp_path: Path) -> None:
    """fit(max_steps=4) ends in the middle of epoch 0 (6 batches of 8): its
    end-of-fit save (step 4) records the epoch's position, not the next
    epoch's, and the loop counters of that batch. fit(max_steps=10) on the same
    dirpath continues with exactly the batches of the uninterrupted run: the
    last 2 of epoch 0, then epoch 1 (samples, losses, LR, epoch and batch index)."""
    cfg = {"every": 3, "dropout": 0.2}
    whole = _run(pool, 2, {**cfg, "steps": 10, "root": str(tmp_path / "full")})
    full = _by_step(whole)
    first = _run(pool, 2, {**cfg, "steps": 4, "root": str(tmp_path / "run")})
    assert first[0]["raised"] == "" and (tmp_path / "run" / "step-00000004").is_dir()
    second = _run(pool, 2, {**cfg, "steps": 10, "root": str(tmp_path / "run")})
    assert second[0]["resumed_from"].endswith("step-00000004")
    got = _stitched(first, second, 4)
    assert sorted(got) == sorted(full) and len(full) == 20
    for k in sorted(full):
        assert [got[k][f] for f in ("ids", "epoch", "batch", "lr", "loss")] == \
            [full[k][f] for f in ("ids", "epoch", "batch", "lr", "loss")], k
    assert [r["params"] for r in second] == [r["params"] for r in whole]


def test_fit_ckpt_path_naming_a_reshard_checkpoint_says_how_to_resume(pool: WorkerPool,
                                                                      tmp_path: Path) -> None:
    """fit(ckpt_path=<a reshard checkpoint, or its root>) is refused before the
    fit starts, in one line naming the path and what to do (call fit without
    it: the callback resumes by itself), instead of Lightning failing to open
    a folder as its .ckpt file; the same fit without ckpt_path then resumes."""
    root = tmp_path / "run"
    _run(pool, 1, {"steps": 3, "every": 3, "root": str(root)})
    for given, what in ((root / "step-00000003", "a reshard checkpoint"),
                        (root, "a root of reshard checkpoints")):
        with pytest.raises(Exception, match=rf"fit\(ckpt_path='{given}'\) names {what}, which Lightning's "
                           r"own restore cannot read .*call fit without ckpt_path: ReshardCheckpoint "
                           r"resumes by itself .*step-00000003"):
            _run(pool, 1, {"steps": 6, "every": 3, "root": str(root), "ckpt_path": str(given)})
    other = tmp_path / "other"
    with pytest.raises(Exception, match=rf"make it the dirpath: ReshardCheckpoint\('{root}', \.\.\.\)"):
        _run(pool, 1, {"steps": 6, "every": 3, "root": str(other), "ckpt_path": str(root / "step-00000003")})
    res = _run(pool, 1, {"steps": 6, "every": 3, "root": str(root)})[0]
    assert res["resumed_from"] == str(root / "step-00000003") and res["global_step"] == 6


def test_loaders_the_cursor_drops_from_refuses_or_leaves_alone(pool: WorkerPool, tmp_path: Path) -> None:
    """30 samples in global batches of 4: one epoch is 7 batches of one
    permutation, the 2 left named by a warning; a custom sampler is refused
    naming manage_data=False; with manage_data=False Lightning's loader is used
    (its DistributedSampler, which shuffles even a shuffle=False loader)."""
    from torch.utils.data.distributed import DistributedSampler

    res = _run(pool, 1, {"steps": 7, "every": 3, "n": 30, "root": str(tmp_path / "drop")})[0]
    epoch = [i for r in res["records"] for i in r["ids"]]
    assert len(epoch) == 28 and len(set(epoch)) == 28
    assert any("the last 2 samples of each epoch's order are not trained" in w for w in res["warnings"])
    with pytest.raises(Exception, match=r"custom sampler \(WeightedRandomSampler\).*manage_data=False"):
        _run(pool, 1, {"steps": 2, "every": 1, "weighted": True, "root": str(tmp_path / "w")})
    res = _run(pool, 1, {"steps": 2, "every": 1, "manage_data": False, "shuffle": False,
                         "root": str(tmp_path / "plain")})[0]
    lightnings = list(DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=0))
    assert [r["ids"] for r in res["records"]] == [lightnings[:4], lightnings[4:8]]


def test_keep_best_keeps_the_best_checkpoint_by_the_monitored_metric(pool: WorkerPool,
                                                                     tmp_path: Path) -> None:
    """keep_last=1, keep_best=1, monitor="val_loss", mode="max": the newest
    checkpoint and the one whose metric (callback_metrics at its save: the
    last validation's; none yet at step 2) is the highest are kept."""
    import reshard

    res = _run(pool, 1, {"steps": 8, "every": 2, "val_every": 2, "keep_last": 1, "keep_best": 1,
                         "monitor": "val_loss", "mode": "max", "root": str(tmp_path / "b")})[0]
    saved = {s: v for s, v in res["metrics"].items() if s % 2 == 0}
    assert sorted(saved) == [4, 6, 8], res["metrics"]
    best = max(saved, key=lambda s: saved[s])
    assert best != 8, saved
    kept = sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith("step-")
                  and "." not in p.name)
    assert kept == sorted({f"step-{best:08d}", "step-00000008"}), (kept, saved)
    assert reshard.inspect(tmp_path / "b" / f"step-{best:08d}").extra["metric"] == saved[best]


def test_the_lightning_internals_are_there_and_a_missing_one_is_named(pool: WorkerPool,
                                                                      tmp_path: Path) -> None:
    """missing_lightning_internals names what a Trainer lacks, and a fit with
    such a Trainer fails in setup with that name and Lightning's version."""
    assert pool.run(1, internals_of_a_trainer) == [[]]
    with pytest.raises(Exception, match=r"the installed Lightning \(2\.[\d.]+\) lacks .*"
                                        r"batch_progress\.current\.processed"):
        _run(pool, 1, {"steps": 2, "drop_internal": "batch_progress", "root": str(tmp_path / "x")})
    missing = pool.run(1, internals_of_a_trainer, "data_source")[0]
    assert len(missing) == 1 and missing[0].startswith("Trainer.fit_loop._data_source.dataloader()")
    missing = pool.run(1, internals_of_a_trainer, "batch_progress")[0]
    assert len(missing) == 1 and "batch_progress.current.processed" in missing[0]


def test_before_state_mutation_waits_for_staging_only() -> None:
    """The pre-mutation hook blocks while the save in flight is not staged,
    returns once it is, and never raises the save's failure."""
    from reshard.integrations.lightning import ReshardCheckpoint
    from reshard.saving.staging import SaveHandle

    cb = ReshardCheckpoint("unused")
    cb.before_state_mutation()  # nothing in flight
    h = SaveHandle("p", 1)
    cb._inflight = h
    t = threading.Thread(target=cb.before_state_mutation)
    t.start()
    t.join(0.3)
    assert t.is_alive()
    h.staged.set_result(None)
    t.join(5)
    assert not t.is_alive()
    h2 = SaveHandle("p", 2)
    h2.staged = Future()
    h2.staged.set_exception(RuntimeError("staging failed"))
    cb._inflight = h2
    cb.before_state_mutation()  # reported by the manager, not raised here
