"""A small Hugging Face Trainer job checkpointed by reshard.integrations.transformers.ReshardTrainer,
run under torchrun the way users run it (benchmarks/bench_integrations.py kills and resumes it).

    torchrun --standalone --nproc-per-node 2 benchmarks/integrations/transformers_job.py --out-dir /tmp/h --records /tmp/h.jsonl

Every rank appends one JSON line per training micro-batch to ``--records``: step, rank, world, loss
(this rank's), lr, the sample ids of its batch. ``--kill-at K`` SIGKILLs the process when step
K ends (a crash between checkpoints; the benchmark kills from outside instead); ``--step-sleep S``
sleeps S seconds per step; ``--naive-rng`` restores the RNG streams where the checkpoint is read,
before the resumed epoch's iterator exists (the natural, wrong moment).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments, set_seed

from reshard.integrations.transformers import ReshardTrainer

N, D = 64, 8


class Points(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor(i), "x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self, dropout: float, log: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))
        self.log, self.step, self.lr, self.sleep = log, 0, 0.0, 0.0

    def forward(self, ids: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = (self.net(x) - labels).pow(2).mean()
        if self.training:
            time.sleep(self.sleep)
            rank = int(os.environ.get("RANK", 0))
            with open(f"{self.log}.{rank}", "a") as f:
                f.write(json.dumps({"step": self.step + 1, "rank": rank,
                                    "world": int(os.environ.get("WORLD_SIZE", 1)),
                                    "loss": loss.item(), "lr": self.lr, "ids": ids.tolist()}) + "\n")
        return {"loss": loss}


class NaiveRNG(ReshardTrainer):
    def _load_optimizer_and_scheduler(self, checkpoint):  # type: ignore[no-untyped-def]
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._rng is not None:
            self._rng.apply()


class Track(TrainerCallback):  # type: ignore[misc]
    def __init__(self, net: Net, kill_at: int) -> None:
        self.net, self.kill_at = net, kill_at

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.net.step = state.global_step
        self.net.lr = kwargs["optimizer"].param_groups[0]["lr"]

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--records", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="per-device batch as written")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--naive-rng", action="store_true")
    a = p.parse_args()
    args = TrainingArguments(output_dir=a.out_dir, use_cpu=True, max_steps=a.steps,
                             per_device_train_batch_size=a.batch, learning_rate=1e-2,
                             lr_scheduler_type="cosine", warmup_steps=2, save_strategy="steps",
                             save_steps=a.every, logging_steps=1, report_to=[], seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    set_seed(0)
    net = Net(a.dropout, a.records)
    net.sleep = a.step_sleep
    cls = NaiveRNG if a.naive_rng else ReshardTrainer
    trainer = cls(model=net, args=args, train_dataset=Points(),
                             callbacks=[Track(net, a.kill_at)])
    trainer.train(resume_from_checkpoint=trainer.last_checkpoint)


if __name__ == "__main__":
    main()
