"""Evaluate the newest committed checkpoint on one process, without the
training job's process group (no torchrun, no ``init_process_group``).

    python examples/evaluate.py --root /tmp/ckpts

Only the model's tensors are read (the optimizer state, RNG streams and data
cursor stay on disk): ``strict=False`` accepts the saved keys this state does
not ask for, and the result lists them as ``unexpected``. Prints one JSON line
``{"path", "step", "eval_loss"}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import reshard

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from train import build_model, eval_loss  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    args = p.parse_args()
    model = build_model()
    try:  # the newest checkpoint, leased before it is read (the trainer's retention keeps it)
        res = reshard.load_latest({"model": reshard.ModelState(model)}, args.root, strict=False)
    except reshard.CheckpointNotFoundError as e:
        sys.exit(f"evaluate: {e}")
    print(json.dumps({"path": res.path, "step": res.step, "eval_loss": eval_loss(model)}))


if __name__ == "__main__":
    main()
