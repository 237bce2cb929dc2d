"""Hugging Face Trainer jobs run on the pool's gloo ranks
(tests/integrations/test_transformers.py): ``ReshardTrainer.train`` as a
``torchrun`` job runs it, recording per micro-batch and rank the loss, the
learning rate and the sample ids."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from _lightning_fns import Crash, _torchrun_env

N, D = 48, 6


def _classes() -> Any:
    from torch import nn
    from torch.utils.data import Dataset
    from transformers import TrainerCallback

    class Points(Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int = N) -> None:
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, D, generator=g), torch.randn(n, 1, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"ids": torch.tensor(i), "x": self.x[i], "labels": self.y[i]}

    class Net(nn.Module):
        def __init__(self, dropout: float) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
            self.step, self.lr = 0, 0.0
            self.records: list[dict[str, Any]] = []

        def forward(self, ids: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            loss = (self.net(x) - labels).pow(2).mean()
            if self.training:
                self.records.append({"step": self.step + 1, "rank": dist.get_rank(), "loss": loss.item(),
                                     "ids": ids.tolist(), "lr": self.lr})
            return {"loss": loss}

    class Track(TrainerCallback):  # type: ignore[misc]
        def __init__(self, net: Net, stop_at: int) -> None:
            self.net, self.stop_at = net, stop_at
            self.pre_steps = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.net.step = state.global_step
            self.net.lr = kw["optimizer"].param_groups[0]["lr"]

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == self.stop_at:
                raise Crash(f"stopped after step {self.stop_at}")

    return Points, Net, Track


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    """One ``ReshardTrainer.train`` on this rank; ``cfg``: out (output_dir),
    steps, every, dropout, batch, stop_at, reshard_async, limit
    (save_total_limit), naive_rng (restore RNG when the checkpoint is read),
    resume (``True``, a path or None: ``last_checkpoint``), best (evaluate
    every ``every`` steps, load_best_model_at_end), stock (the stock Trainer).
    Returns the records, the final parameters, the log history, what it
    resumed from and what was raised."""
    from transformers import Trainer, TrainingArguments, set_seed

    from reshard.integrations.transformers import ReshardTrainer

    _torchrun_env()
    Points, Net, Track = _classes()
    set_seed(0)
    net = Net(cfg.get("dropout", 0.0))
    best = cfg.get("best", False)
    args = TrainingArguments(
        output_dir=cfg["out"], use_cpu=True, max_steps=cfg["steps"],
        per_device_train_batch_size=cfg.get("batch", 4), learning_rate=1e-2, lr_scheduler_type="cosine",
        warmup_steps=2, save_strategy="steps", save_steps=cfg.get("every", 3), logging_steps=1,
        report_to=[], seed=0, disable_tqdm=True, save_total_limit=cfg.get("limit"),
        eval_strategy="steps" if best else "no", eval_steps=cfg.get("every", 3) if best else None,
        load_best_model_at_end=best, metric_for_best_model="loss" if best else None,
        greater_is_better=cfg.get("greater", False) if best else None, ddp_find_unused_parameters=False,
        save_only_model=cfg.get("save_only_model", False))

    class Naive(ReshardTrainer):
        def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            if self._rng is not None:
                self._rng.apply()  # where the checkpoint is read: before the loader's iterator exists

    track = Track(net, cfg.get("stop_at", 0))
    kwargs: dict[str, Any] = {"model": net, "args": args, "train_dataset": Points(),
                              "callbacks": [track]}
    if best:
        kwargs["eval_dataset"] = Points(8)
    if cfg.get("stock"):
        trainer: Any = Trainer(**kwargs)
    else:
        cls = Naive if cfg.get("naive_rng") else ReshardTrainer
        trainer = cls(**kwargs, reshard_async=cfg.get("reshard_async", False))
    resume = cfg.get("resume", "last")
    if resume == "last":
        resume = None if cfg.get("stock") else trainer.last_checkpoint
    raised = ""
    pre = []
    views = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("reshard-hf-resume-")}

    def count(*a: Any, **k: Any) -> None:
        pre.append(1)
        return orig(*a, **k)

    orig = getattr(trainer, "before_state_mutation", None)
    if orig is not None:
        trainer.before_state_mutation = count
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Crash as e:
        raised = str(e)
    params = [p.detach().flatten().tolist() for p in net.parameters()]
    return {"records": net.records, "params": params, "raised": raised,
            "log": [{k: v for k, v in r.items() if k in ("step", "loss", "learning_rate", "eval_loss")}
                    for r in trainer.state.log_history],
            "resumed_from": getattr(trainer, "resumed_from", None), "global_step": trainer.state.global_step,
            "best": trainer.state.best_model_checkpoint, "pre_mutation_calls": len(pre),
            "views_left": sorted({d for d in os.listdir(tempfile.gettempdir())
                                  if d.startswith("reshard-hf-resume-")} - views)}


def internals_missing(drop: str | None = None) -> list[str]:
    """``missing_trainer_internals`` of the Trainer, or of a subclass in which
    the method ``drop`` is gone (set to None)."""
    from transformers import Trainer

    from reshard.integrations.transformers import missing_trainer_internals

    cls = Trainer if drop is None else type("Changed", (Trainer,), {drop: None})
    return missing_trainer_internals(cls)


def construct_on(drop: str, out: str) -> str:
    """The error a ReshardTrainer over a Trainer whose method ``drop`` is gone raises."""
    from transformers import Trainer, TrainingArguments

    from reshard.integrations.transformers import ReshardTrainerMixin

    _torchrun_env()
    _, Net, _ = _classes()
    changed = type("Changed", (Trainer,), {drop: None})
    broken = type("Broken", (ReshardTrainerMixin, changed), {})
    try:
        broken(model=Net(0.0), args=TrainingArguments(output_dir=out, use_cpu=True, report_to=[]))
    except Exception as e:  # noqa: BLE001 - the test checks its type and message
        return f"{type(e).__name__}: {e}"
    return ""


def run_recipe(directory: str, code: str) -> bool:
    """Run a documented recipe on this rank (a torchrun job) in ``directory``."""
    _torchrun_env()
    here = os.getcwd()
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    try:
        exec(compile(code, "docs/integrations.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        os.chdir(here)
    return True


class Indexed(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """64 samples of (id, x, y), the accelerate loops' data."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def accelerate_loop(directory: str, max_steps: int, workers: int, plain: bool = False) -> dict[int, list[int]]:
    """A plain accelerate loop (the docs' recipe) whose batches come from
    DataLoader worker processes: through ``cursor_loader``, or (``plain``) a
    DataLoader with the cursor as its batch sampler. Resumes from
    ``directory/ckpt`` (saves every 2 steps); returns each step's sample ids."""
    import multiprocessing

    _torchrun_env()
    # the pool's ranks are daemonic processes, which may not start DataLoader workers; a torchrun
    # rank is not one: for this job, it is not either
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    try:
        return _accelerate_loop(directory, max_steps, workers, plain)
    finally:
        multiprocessing.current_process()._config["daemon"] = True  # type: ignore[attr-defined]


def _accelerate_loop(directory: str, max_steps: int, workers: int, plain: bool) -> dict[int, list[int]]:
    from accelerate import Accelerator

    import reshard
    from reshard.integrations.transformers import accelerate_state, cursor_loader

    os.makedirs(directory, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = Indexed()
    cursor = reshard.DataCursor(len(data), 8, seed=0, dp_rank=accelerator.process_index,
                                dp_size=accelerator.num_processes)
    if plain:
        batches = iter(torch.utils.data.DataLoader(data, batch_sampler=cursor, num_workers=workers))
    else:
        batches = iter(cursor_loader(data, cursor, num_workers=workers))
    state = accelerate_state(accelerator, model, optimizer, scheduler, data=cursor)
    mgr = reshard.CheckpointManager(os.path.join(directory, "ckpt"), every_steps=2, keep_last=2)
    res = mgr.restore(state)
    step = 0 if res is None else res.step
    ids: dict[int, list[int]] = {}
    while step < max_steps:
        i, x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        ids[step] = i.tolist()
        mgr.maybe_save(step, state)
    mgr.close()
    return ids
