"""TorchTitan's real Trainer on one GPU with reshard as its checkpoint backend:
run, kill, resume, compare losses. Under 5 minutes on one GPU.

    python benchmarks/gpu_integrations.py                  # the GPU check (needs CUDA)
    python benchmarks/gpu_integrations.py --cpu-self-check # everything that runs without CUDA

Three processes, each a single-rank TorchTitan job (``Trainer(config).train()``,
as ``torchtitan.train`` runs it) of the Llama 3 debugmodel (flex attention,
seq_len 256), its tokenizer and a JSON dataset built here (no hub), checkpoints
by ``ReshardCheckpointManager`` (async saves every ``--interval`` steps,
``debug.deterministic``):

1. uninterrupted: ``--steps`` steps;
2. killed: the same job SIGKILLs itself right after step ``--kill-after``
   (an async save may be in flight: the resume takes the newest committed one);
3. resumed: the same command again, until ``--steps``.

It prints the losses of both runs for the resumed steps and one line
``RESULT: PASS|FAIL|SKIP ...``: PASS when the resumed run's losses equal the
uninterrupted run's (bitwise, or within 1e-5 relative: printed which). Where
torchtitan or reshard does not import, or there is no CUDA device, the one
line says so (``RESULT: SKIP ...``) and the exit code is 0.

``--cpu-self-check`` builds what the GPU run builds (the config through the
config-registry function, TorchTitan's command line over it, the tokenizer and
dataset, a batch from TorchTitan's dataloader) and runs the checkpoint
component as the Trainer builds it (single-rank gloo, a CPU model, save, load
into a fresh job, equal state), then prints ``RESULT: SELF-CHECK OK``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
if os.path.isdir(SRC) and SRC not in sys.path:
    sys.path.insert(0, SRC)  # reshard from this checkout


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())[:400]


def _imports() -> str | None:
    """None, or the one-line reason why the stack does not import here."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch does not import here: {type(e).__name__}: {_one_line(e)}"
    try:
        import torchtitan.trainer  # noqa: F401
    except Exception as e:  # noqa: BLE001
        import torch

        return (f"torchtitan does not import here (torch {torch.__version__}): "
                f"{type(e).__name__}: {_one_line(e)}")
    try:
        import reshard.integrations.torchtitan  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"reshard does not import here: {type(e).__name__}: {_one_line(e)}"
    return None


def make_assets(d: str) -> tuple[str, str]:
    """A WordLevel tokenizer (tokenizer.json, tokenizer_config.json) and a JSON
    dataset under ``d``: (hf_assets_path, dataset_path)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf, data = os.path.join(d, "hf_assets"), os.path.join(d, "data")
    os.makedirs(hf, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    words = [f"w{i}" for i in range(500)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    tk.save(os.path.join(hf, "tokenizer.json"))
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    rng = random.Random(0)
    with open(os.path.join(data, "train.json"), "w") as f:
        for _ in range(2000):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))}) + "\n")
    return hf, data


def _offline(work: str) -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HF_DATASETS_CACHE"] = os.path.join(work, "hf_cache")


def reshard_debugmodel(work: str, steps: int = 8, interval: int = 2, seq_len: int = 256) -> Any:
    """The config-registry function: TorchTitan's llama3 debugmodel with reshard as
    its checkpoint component, local assets, a short run."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from reshard.integrations.torchtitan import ReshardCheckpointManager

    config = llama3_debugmodel()
    config.hf_assets_path = os.path.join(work, "hf_assets")
    config.dump_folder = os.path.join(work, "outputs")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                         dataset_path=os.path.join(work, "data"))
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = 4
    config.training.disable_cuda_graphs = True
    config.validator.enable = False
    config.debug.seed = 0
    config.debug.deterministic = True
    config.lr_scheduler.warmup_steps = 2
    config.checkpoint = ReshardCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=interval, async_mode="async",
        last_save_model_only=False, keep_latest_k=3)
    return config


# ----------------------------------------------------------------------------- one job (a child)


def run_phase(work: str, out: str, steps: int, interval: int, kill_after: int | None) -> None:
    """One single-rank TorchTitan job, as ``torchtitan.train.main`` runs it;
    per-step losses appended to ``out`` (JSON lines) as they are logged."""
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    _offline(work)
    config = reshard_debugmodel(work, steps, interval)
    trainer = config.build()
    log = trainer.metrics_processor.log

    def logged(step: int, loss: float, *a: Any, **k: Any) -> Any:
        with open(out, "a") as f:
            f.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
        return log(step, loss, *a, **k)

    trainer.metrics_processor.log = logged  # type: ignore[method-assign]
    load, save = trainer.checkpointer.load, trainer.checkpointer.save

    def loaded(step: int = -1) -> bool:
        done = load(step)
        with open(out, "a") as f:
            f.write(json.dumps({"resumed_at": trainer.step if done else None}) + "\n")
        return done

    def saved(curr_step: int, last_step: bool = False) -> bool:
        done = save(curr_step, last_step)
        if kill_after is not None and curr_step >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # killed: no close, saves in flight cut
        return done

    trainer.checkpointer.load = loaded  # type: ignore[method-assign]
    trainer.checkpointer.save = saved  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(work: str, out: str, args: argparse.Namespace, kill_after: int | None,
           timeout: float) -> tuple[int, float]:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", "--work", work, "--out", out,
           "--steps", str(args.steps), "--interval", str(args.interval)]
    if kill_after is not None:
        cmd += ["--kill-after", str(kill_after)]
    t0 = time.perf_counter()
    with open(out + ".log", "w") as logf:
        p = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
    return p.returncode, time.perf_counter() - t0


def _read(out: str) -> tuple[dict[int, float], int | None]:
    losses: dict[int, float] = {}
    resumed = None
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                rec = json.loads(line)
                if "resumed_at" in rec:
                    resumed = rec["resumed_at"]
                else:
                    losses[rec["step"]] = rec["loss"]
    return losses, resumed


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def gpu_check(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"RESULT: SKIP no CUDA device here (torch {torch.__version__})")
        return 0
    t0 = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="reshard-gpu-titan-")
    make_assets(work)
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; work dir {work}")
    budget = max(60.0, args.budget_s / 3)
    if args.kill_after is None:
        args.kill_after = 5
    phases: dict[str, Any] = {}
    for name, kill in (("uninterrupted", None), ("killed", args.kill_after), ("resumed", None)):
        w = os.path.join(work, "a" if name == "uninterrupted" else "b")
        if name != "resumed":
            os.makedirs(w, exist_ok=True)
            for sub in ("hf_assets", "data"):
                link = os.path.join(w, sub)
                if not os.path.exists(link):
                    os.symlink(os.path.join(work, sub), link)
        out = os.path.join(work, f"{name}.jsonl")
        try:
            rc, secs = _child(w, out, args, kill, budget)
        except subprocess.TimeoutExpired:
            print(_tail(out + ".log"))
            print(f"RESULT: FAIL the {name} run did not end within {budget:.0f} s")
            return 1
        phases[name] = (rc, secs, *_read(out))
        print(f"{name}: exit {rc} in {secs:.1f} s, {len(phases[name][2])} steps logged"
              + (f", resumed at step {phases[name][3]}" if phases[name][3] else ""))
        expect_kill = kill is not None
        if (rc != -signal.SIGKILL) if expect_kill else (rc != 0):
            print(_tail(out + ".log"))
            print(f"RESULT: FAIL the {name} run exited with {rc}")
            return 1
    full, resumed = phases["uninterrupted"][2], phases["resumed"][2]
    at = phases["resumed"][3]
    if not at:
        print(_tail(os.path.join(work, "resumed.jsonl.log")))
        print("RESULT: FAIL the resumed run did not resume from a checkpoint")
        return 1
    steps = sorted(resumed)
    print(f"{'step':>5} {'uninterrupted':>16} {'resumed':>16} {'|d|':>10}")
    worst, bitwise = 0.0, True
    for s in steps:
        a, b = full.get(s), resumed[s]
        if a is None:
            print(f"RESULT: FAIL step {s} has no uninterrupted loss")
            return 1
        d = abs(a - b)
        worst = max(worst, d / max(abs(a), 1e-12))
        bitwise &= a == b
        print(f"{s:>5} {a:>16.10f} {b:>16.10f} {d:>10.2e}")
    total = time.perf_counter() - t0
    ok = bitwise or worst <= 1e-5
    how = "bitwise equal" if bitwise else f"max relative |d| {worst:.2e}"
    print(f"RESULT: {'PASS' if ok else 'FAIL'} killed after step {args.kill_after}, resumed at step {at}; "
          f"steps {steps[0]}..{steps[-1]} losses {how} vs the uninterrupted run; {total:.0f} s in all")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- no CUDA


def cpu_self_check() -> int:
    """Everything the GPU run builds that builds without CUDA (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ConfigManager

    from reshard.integrations.torchtitan import ReshardCheckpointManager

    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="reshard-gpu-selfcheck-")
    hf, data = make_assets(work)
    _offline(work)
    config = reshard_debugmodel(work, steps=8, interval=2)
    assert isinstance(config.checkpoint, ReshardCheckpointManager.Config)
    config.to_dict()
    # TorchTitan's command line over the registry function, as `torchtitan.train` parses it
    mod = os.path.join(work, "gpu_registry.py")
    with open(mod, "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {HERE!r})\nfrom gpu_integrations import reshard_debugmodel\n"
                f"def titan_reshard():\n    return reshard_debugmodel({work!r})\n")
    sys.path.insert(0, work)
    parsed = ConfigManager().parse_args(["--module", "gpu_registry", "--config", "titan_reshard",
                                         "--checkpoint.interval", "3"])
    assert parsed.checkpoint.interval == 3 and parsed.checkpoint.async_mode == "async"
    tok = HuggingFaceTokenizer(tokenizer_path=hf)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=32,
                                     local_batch_size=2)
    x, y = next(iter(loader))
    assert x["input"].shape == (2, 32) and y.shape == (2, 32)
    # the checkpoint component as the Trainer builds it, on one gloo rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        def job(seed: int) -> dict[str, Any]:
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Embedding(600, 16), torch.nn.Linear(16, 600))
            opt = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
                pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
                implementation="foreach").build(model_parts=[model])
            lrs = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opt, training_steps=4)
            dl = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=32,
                                         local_batch_size=2)
            ck = config.checkpoint.build(dataloader=dl, model_parts=[model], optimizers=opt,
                                         lr_schedulers=lrs, states={}, sd_adapter=None,
                                         base_folder=os.path.join(work, "selfcheck"))
            return {"model": model, "opt": opt, "lr": lrs, "dl": dl, "ck": ck}

        a = job(0)
        it = iter(a["dl"])
        for step in (1, 2):
            xb, yb = next(it)
            loss = torch.nn.functional.cross_entropy(a["model"](xb["input"]).flatten(0, 1), yb.flatten())
            loss.backward()
            a["ck"].maybe_wait_for_staging()
            a["opt"].step()
            a["lr"].step()
            a["opt"].zero_grad()
            a["ck"].save(step)
        a["ck"].close()
        b = job(1)
        assert b["ck"].load()
        for k, v in a["model"].state_dict().items():
            assert torch.equal(v, b["model"].state_dict()[k]), k
        assert b["lr"].schedulers[0].last_epoch == a["lr"].schedulers[0].last_epoch == 2
        assert b["dl"].state_dict() == a["dl"].state_dict()
        b["ck"].close()
    finally:
        dist.destroy_process_group()
    print(f"RESULT: SELF-CHECK OK (imports, the registry config and TorchTitan's command line over "
          f"it, tokenizer and dataset, the checkpoint component saved and resumed on one gloo rank) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-self-check", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--kill-after", type=int, default=None, help="the killed run stops after this step "
                    "(default 5)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="seconds for the three runs")
    ap.add_argument("--work", default=None)
    ap.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        run_phase(args.work, args.out, args.steps, args.interval, args.kill_after)
        return 0
    why = _imports()
    if why is not None:
        print(f"RESULT: SKIP {why}")
        return 0
    if args.cpu_self_check:
        return cpu_self_check()
    return gpu_check(args)


if __name__ == "__main__":
    sys.exit(main())
