"""A small Lightning job checkpointed by reshard.integrations.lightning.ReshardCheckpoint,
run under torchrun the way users run it (benchmarks/bench_integrations.py kills and resumes it).

    torchrun --standalone --nproc-per-node 2 benchmarks/integrations/lightning_job.py --root /tmp/l --out /tmp/l.jsonl

Every rank appends one JSON line per training step to ``--out``: step, rank, world, loss
(this rank's), lr, the sample ids of its batch. ``--kill-at K`` SIGKILLs the process after
step K's batch (a crash between checkpoints; the benchmark kills from outside instead);
``--step-sleep S`` sleeps S seconds per step (so an outside kill lands mid-run);
``--naive-rng`` restores the RNG streams in ``on_fit_start``, where the model first exists and
before Lightning creates the DataLoader iterator (the natural, wrong moment);
``--lightning-default`` checkpoints with Lightning's own ``ModelCheckpoint(save_last=True)`` and
resumes with ``fit(ckpt_path="last")`` instead (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from reshard.integrations.lightning import ReshardCheckpoint

N, D = 64, 8


class Points(Dataset):  # type: ignore[type-arg]
    def __init__(self, noise: float) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)
        self.noise = noise

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise:  # augmentation from the global generator, in the main process
            x = x + self.noise * torch.randn(D)
        return i, x, self.y[i]


class Net(pl.LightningModule):
    def __init__(self, dropout: float, fsdp: bool, out: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))
        self.fsdp, self.out = fsdp, out

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    sleep = 0.0

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        time.sleep(self.sleep)
        ids, x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        rec = {"step": self.trainer.global_step + 1, "rank": self.global_rank,
               "world": self.trainer.world_size, "loss": loss.item(),
               "lr": self.trainer.optimizers[0].param_groups[0]["lr"], "ids": ids.tolist()}
        with open(f"{self.out}.{self.global_rank}", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        ids, x, y = batch
        self.log("val_loss", (self.net(x) - y).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class NaiveRNG(ReshardCheckpoint):
    def on_fit_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        super().on_fit_start(trainer, pl_module)
        self._apply_rng()


class SayResumed(pl.Callback):
    """The baseline's "resuming from PATH (step N)" line (ReshardCheckpoint prints its own)."""

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        if trainer.ckpt_path and trainer.is_global_zero:
            print(f"resuming from {trainer.ckpt_path} (step {trainer.global_step})", flush=True)


class Kill(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="per-device batch at this world size")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--val-every", type=int, default=0, help="validate every K batches (0: never)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--naive-rng", action="store_true")
    p.add_argument("--lightning-default", action="store_true")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    pl.seed_everything(0, verbose=False)
    strategy = (ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
                if a.strategy == "fsdp2" else DDPStrategy(process_group_backend="gloo"))
    cls = NaiveRNG if a.naive_rng else ReshardCheckpoint
    cbs: list[pl.Callback] = [cls(a.root, every_n_train_steps=a.every)]
    ckpt_path = None
    if a.lightning_default:
        from lightning.pytorch.callbacks import ModelCheckpoint

        cbs = [ModelCheckpoint(dirpath=a.root, every_n_train_steps=a.every, save_last=True, save_top_k=-1),
               SayResumed()]
        ckpt_path = "last"
    if a.kill_at:
        cbs.append(Kill(a.kill_at))
    val = {"val_check_interval": a.val_every, "check_val_every_n_epoch": None, "limit_val_batches": 2,
           "num_sanity_val_steps": 0} if a.val_every else {"limit_val_batches": 0}
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=a.steps,
                         callbacks=cbs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, **val)
    loader = DataLoader(Points(a.noise), batch_size=a.batch, shuffle=True)
    val_loader = DataLoader(Points(0.0), batch_size=a.batch, shuffle=True)
    net = Net(a.dropout, a.strategy == "fsdp2", a.out)
    net.sleep = a.step_sleep
    trainer.fit(net, loader, val_loader if a.val_every else None, ckpt_path=ckpt_path)


if __name__ == "__main__":
    main()
