"""Lightning jobs run on the pool's gloo ranks (tests/integrations/test_lightning.py).

Each rank runs ``lightning.Trainer.fit`` as a ``torchrun`` job would (the
torchrun environment variables set, the default group already made), with
:class:`reshard.integrations.lightning.ReshardCheckpoint`; the module records,
per training step and rank, the loss, the learning rate and the sample ids of
its batch.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

N, D = 48, 6


class Crash(RuntimeError):
    """Raised by the test to stop a run between checkpoints."""


def _torchrun_env() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update({"TORCHELASTIC_RUN_ID": "reshard-test", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "GROUP_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"})


def _classes() -> Any:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import Dataset

    class Points(Dataset):  # type: ignore[type-arg]
        def __init__(self, noise: float, n: int = N) -> None:
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, D, generator=g), torch.randn(n, 1, generator=g)
            self.noise, self.n = noise, n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
            x = self.x[i]
            if self.noise:  # augmentation from the global generator, in the main process
                x = x + self.noise * torch.randn(D)
            return i, x, self.y[i]

    class Net(pl.LightningModule):
        def __init__(self, dropout: float, fsdp: bool) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
            self.fsdp = fsdp
            self.records: list[dict[str, Any]] = []

        def configure_model(self) -> None:
            if self.fsdp:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for m in self.net:
                    if isinstance(m, nn.Linear):
                        fully_shard(m, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, x, y = batch
            loss = (self.net(x) - y).pow(2).mean()
            self.records.append({"step": self.trainer.global_step + 1, "batch": batch_idx,
                                 "epoch": self.current_epoch, "rank": self.global_rank,
                                 "loss": loss.item(), "ids": ids.tolist(),
                                 "lr": self.trainer.optimizers[0].param_groups[0]["lr"]})
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            ids, x, y = batch
            self.log("val_loss", (self.net(x) - y).pow(2).mean(), sync_dist=True)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Stop(pl.Callback):
        def __init__(self, at: int) -> None:
            self.at = at

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if trainer.global_step == self.at:
                raise Crash(f"stopped after step {self.at}")

    return Points, Net, Stop


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit(cfg: dict[str, Any]) -> dict[str, Any]:
    """One ``fit`` on this rank; ``cfg``: root, steps, every, strategy ("ddp" or
    "fsdp2"), dropout, noise, val_every, batch, stop_at, use_async, keep_last,
    naive_rng (restore RNG in on_fit_start, the natural and wrong moment),
    ckpt_path, save_lightning (a Lightning ModelCheckpoint beside), manage_data,
    n (dataset size), shuffle. Returns the records, the final parameters, the
    log lines, where it resumed from and what was raised."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader

    from reshard.integrations.lightning import ReshardCheckpoint

    _torchrun_env()
    Points, Net, Stop = _classes()
    world = dist.get_world_size()
    fsdp = cfg.get("strategy") == "fsdp2"
    pl.seed_everything(0, verbose=False)

    class Naive(ReshardCheckpoint):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_fit_start(trainer, pl_module)
            self._apply_rng()  # restored where the model first exists: before the iterator

    cls = Naive if cfg.get("naive_rng") else ReshardCheckpoint
    cb = cls(cfg["root"], every_n_train_steps=cfg.get("every", 3), use_async=cfg.get("use_async", False),
             keep_last=cfg.get("keep_last"), manage_data=cfg.get("manage_data", True),
             keep_best=cfg.get("keep_best", 0), monitor=cfg.get("monitor"), mode=cfg.get("mode", "min"))
    metrics: dict[int, float] = {}
    pre: list[int] = []
    orig = cb.before_state_mutation
    cb.before_state_mutation = lambda: (pre.append(1), orig())[1]  # type: ignore[method-assign]

    class Metrics(pl.Callback):  # what callback_metrics holds at each step's end (what a save carries)
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if "val_loss" in trainer.callback_metrics:
                metrics[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    cbs: list[Any] = [cb, Metrics()]
    if cfg.get("stop_at"):
        cbs.append(Stop(cfg["stop_at"]))
    if cfg.get("save_lightning"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        cbs.append(ModelCheckpoint(dirpath=cfg["save_lightning"], every_n_train_steps=cfg.get("every", 3),
                                   save_top_k=-1))
    strategy = (ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if fsdp
                else DDPStrategy(process_group_backend="gloo"))
    val_every = cfg.get("val_every", 0)
    val = ({"val_check_interval": val_every, "check_val_every_n_epoch": None, "limit_val_batches": 2,
            "num_sanity_val_steps": 0} if val_every else {"limit_val_batches": 0})
    plugins = []
    if cfg.get("fp16"):  # a GradScaler whose state changes every few steps
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=3)))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["steps"],
                         plugins=plugins,
                         callbacks=cbs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         accumulate_grad_batches=cfg.get("accumulate", 1),
                         reload_dataloaders_every_n_epochs=cfg.get("reload", 0), **val)
    n = cfg.get("n", N)
    data = Points(cfg.get("noise", 0.0), n)
    if cfg.get("weighted"):
        from torch.utils.data import WeightedRandomSampler

        loader = DataLoader(data, batch_size=cfg.get("batch", 4),
                            sampler=WeightedRandomSampler([1.0] * n, n))
    else:
        loader = DataLoader(data, batch_size=cfg.get("batch", 4), shuffle=cfg.get("shuffle", True))
    model = Net(cfg.get("dropout", 0.0), fsdp)
    if cfg.get("drop_internal") == "batch_progress":
        del trainer.fit_loop.epoch_loop.batch_progress
    lines = _Lines()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(lines)
    raised = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, loader, DataLoader(Points(0.0, 8), batch_size=4) if val_every else None,
                        ckpt_path=cfg.get("ckpt_path"))
        except Crash as e:
            raised = str(e)
        finally:
            logger.removeHandler(lines)
    params = []
    for p in model.parameters():
        t = p.detach()
        params.append((t.full_tensor() if hasattr(t, "full_tensor") else t).flatten().tolist())
    return {"records": model.records, "params": params, "lines": lines.lines, "raised": raised,
            "resumed_from": cb.resumed_from, "global_step": trainer.global_step,
            "precision": trainer.precision_plugin.state_dict(), "metrics": metrics,
            "pre_mutation_calls": len(pre),
            "warnings": [str(w.message) for w in caught]}


def internals_of_a_trainer(drop: str | None = None) -> list[str]:
    """``missing_lightning_internals`` of a fresh Trainer, with the attribute
    ``drop`` (``"data_source"`` or ``"batch_progress"``) removed first."""
    import lightning.pytorch as pl

    from reshard.integrations.lightning import missing_lightning_internals

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    if drop == "data_source":
        del trainer.fit_loop._data_source
    elif drop == "batch_progress":
        del trainer.fit_loop.epoch_loop.batch_progress
    return missing_lightning_internals(trainer)
