"""reshard as TorchTitan's checkpoint component (reshard.integrations.torchtitan), on real
gloo ranks with TorchTitan's own components (tests/integrations/_torchtitan_fns.py: a Llama 3 model from
TorchTitan's model code sharded by its FSDP2 code, OptimizersContainer, LRSchedulersContainer,
HuggingFaceTextDataLoader, the Trainer's loop and hooks); and issue 27 point 7: export writes
model tensors only, import undoes export.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")  # torchtitan's model code imports it (no GPU needed)

import _torchtitan_fns as F  # noqa: E402
import reshard  # noqa: E402
from reshard.testing.pool import WorkerError  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS, INTERVAL = 6, 3


def _same_state(a: dict[str, Any], b: dict[str, Any], *, exact: bool = True) -> None:
    assert sorted(a["model"]) == sorted(b["model"]) and sorted(a["optim"]) == sorted(b["optim"])
    for part in ("model", "optim"):
        for k, v in a[part].items():
            w = b[part][k]
            if isinstance(v, torch.Tensor):
                if exact:
                    assert torch.equal(v, w), f"{part}.{k} differs"
                else:
                    torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=f"{part}.{k}")
            else:
                assert v == w, f"{part}.{k}: {v!r} != {w!r}"
    assert a["last_epoch"] == b["last_epoch"] and a["lr"] == b["lr"] and a["train"] == b["train"]


def _manifest_content(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.iterdir()):
        if (p / "manifest.json").exists():
            out[p.name] = reshard.inspect(str(p)).extra["torchtitan"]["content"]
    return out


# ----------------------------------------------------------------------------- the component


def test_config_is_a_torchtitan_component_and_every_field_is_treated() -> None:
    from torchtitan.components.checkpointer.base import BaseCheckpointManager
    from torchtitan.trainer import Trainer

    from reshard.integrations import torchtitan as tt

    cfg_cls = tt.ReshardCheckpointManager.Config
    assert "__slots__" in cfg_cls.__dict__ and all(f.kw_only for f in dataclasses.fields(cfg_cls))
    assert cfg_cls._owner is tt.ReshardCheckpointManager  # what Config.build() constructs
    names = {f.name for f in dataclasses.fields(BaseCheckpointManager.Config)}
    names |= {f.name for f in dataclasses.fields(cfg_cls)}
    assert names == set(tt.FIELDS), f"fields not treated: {names ^ set(tt.FIELDS)}"
    assert all(v.startswith(("honoured:", "refused:", "reshard's:")) for v in tt.FIELDS.values())
    for seam in tt.TORCHTITAN_SEAMS:  # every TorchTitan internal it relies on exists here
        import importlib

        mod, *attrs = seam.split(".")
        obj: Any = importlib.import_module(mod)
        for a in attrs:
            obj = getattr(obj, a) if hasattr(obj, a) else importlib.import_module(f"{obj.__name__}.{a}")
    for hook in ("_load", "_save", "_maybe_wait_for_staging", "_wait_for_saving", "_close"):
        assert hook in BaseCheckpointManager.__abstractmethods__
    # selected as TorchTitan selects components: a config-registry function, whose fields
    # TorchTitan's command line overrides as for its own checkpointer
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--module", "_torchtitan_registry", "--config",
                                      "llama3_debugmodel_reshard", "--checkpoint.interval", "7",
                                      "--checkpoint.trust-pickled-dataloader"])
    assert isinstance(cfg, Trainer.Config) and isinstance(cfg.checkpoint, cfg_cls)
    assert (cfg.checkpoint.interval, cfg.checkpoint.async_mode, cfg.checkpoint.keep_latest_k) == (7, "async", 3)
    assert cfg.checkpoint.trust_pickled_dataloader is True
    assert cfg.to_dict()["checkpoint"]["async_mode"] == "async"
    # refused with one line
    with pytest.raises(ValueError, match="initial_load_in_hf_quantized is refused") as e:
        cfg_cls(enable=True, initial_load_path="/x", initial_load_in_hf=True, initial_load_in_hf_quantized=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="async_mode"):
        cfg_cls(async_mode="sometimes")


def test_same_layout_resume_bitwise_async_and_dcp_switch(pool: Any, tmp_path: Path) -> None:
    d = str(tmp_path)
    full = pool.run(2, F.r_run, d, "uninterrupted", STEPS, INTERVAL, fresh=True, state=True, timeout=180)
    # stopped after step 4 (the last checkpoint is step 3, saved asynchronously), then resumed
    pool.run(2, F.r_run, d, "ckpt", STEPS, INTERVAL, stop_after=4, ckpt={"async_mode": "async"},
             fresh=True, timeout=120)
    res = pool.run(2, F.r_run, d, "ckpt", STEPS, INTERVAL, state=True, timeout=120)
    want = full[0]["curve"][INTERVAL:]
    assert res[0]["curve"] == want  # losses, lr and global batches (the dataloader resumed) bitwise
    for r in range(2):
        _same_state(res[r]["state"], full[r]["state"])
    # the last save (step 6) is model-only by TorchTitan's default: marked, never resumed as full
    assert _manifest_content(tmp_path / "ckpt") == {"step-00000003": "full", "step-00000006": "model_only"}
    m = reshard.inspect(str(tmp_path / "ckpt" / "step-00000003"))
    assert tuple(m.objects["dataloader.state"].global_shape) == (2,)  # one element per DP rank
    assert "train_state.step" in m.values and "model.tok_embeddings.weight" in m.tensors

    # a job that checkpointed with TorchTitan's own DCP CheckpointManager switches to reshard with
    # no flag: the DCP step-3 (its step read from train_state.step) is resumed
    pool.run(2, F.r_run, d, "dcp", STEPS, INTERVAL, stop_after=4, manager="dcp", fresh=True, timeout=120)
    assert (tmp_path / "dcp" / "step-3" / ".metadata").exists()
    res = pool.run(2, F.r_run, d, "dcp", STEPS, INTERVAL, state=True,
                   ckpt={"last_save_model_only": False}, timeout=120)
    assert res[0]["curve"] == want
    for r in range(2):
        _same_state(res[r]["state"], full[r]["state"])
    m6 = reshard.inspect(str(tmp_path / "dcp" / "step-00000006"))
    assert m6.extra["torchtitan"] == {"content": "full", "resumed_from_dcp": "step-3"}


def test_a_dcp_checkpoint_whose_step_is_a_tensor_is_resumed(pool: Any, tmp_path: Path) -> None:
    """A job whose train_state saves its step as an int32 tensor (older
    TorchTitan: torch.tensor(step), read back with .item()) checkpointed with
    TorchTitan's own DCP manager: the switch to reshard reads the DCP step from
    that tensor, resumes step 3 (the counters round-trip as tensors) and
    continues bitwise."""
    d = str(tmp_path)
    full = pool.run(2, F.r_run, d, "uninterrupted", STEPS, INTERVAL, fresh=True, timeout=180)
    want = full[0]["curve"][INTERVAL:]
    pool.run(2, F.r_run, d, "dcp", STEPS, INTERVAL, stop_after=4, manager="dcp", fresh=True,
             tensor_step=True, timeout=120)
    assert (tmp_path / "dcp" / "step-3" / ".metadata").exists()
    res = pool.run(2, F.r_run, d, "dcp", STEPS, INTERVAL, ckpt={"last_save_model_only": False},
                   tensor_step=True, timeout=120)
    assert res[0]["curve"] == want  # steps 4-6 bitwise, after the DCP step 3
    m6 = reshard.inspect(str(tmp_path / "dcp" / "step-00000006"))
    assert m6.extra["torchtitan"] == {"content": "full", "resumed_from_dcp": "step-3"}
    assert "train_state.step" in m6.tensors  # saved as the job holds it: a tensor


def test_layout_change_2_to_1_and_1_to_2(pool: Any, tmp_path: Path) -> None:
    d = str(tmp_path)
    ex = {"exclude_from_loading": ["dataloader"]}
    saved2 = pool.run(2, F.r_run, d, "two", 3, 3, fresh=True, state=True,
                      ckpt={"last_save_model_only": False}, timeout=180)
    got1 = pool.run(1, F.r_load_only, d, "two", 3, ckpt=ex, timeout=180)
    assert got1[0]["loaded"]
    _same_state(got1[0], saved2[0]["state"], exact=False)  # model, optimizer, schedulers 2 -> 1
    saved1 = pool.run(1, F.r_run, d, "one", 3, 3, fresh=True, state=True,
                      ckpt={"last_save_model_only": False}, timeout=120)
    got2 = pool.run(2, F.r_load_only, d, "one", 3, ckpt=ex, timeout=120)
    for r in range(2):
        _same_state(got2[r], saved1[0]["state"], exact=False)  # 1 -> 2
    # TorchTitan's dataloader state is per DP rank: another DP size is refused in one line
    with pytest.raises(WorkerError, match="saved by 2 DP ranks and this run has 1") as e:
        pool.run(1, F.r_load_only, d, "two", 3, timeout=120)
    msg = next(iter(e.value.failures.values()))[1]
    assert "exclude_from_loading" in msg and "DataCursor" in msg
    # next-step parity after 2 -> 1 (one fixed global batch per step, whatever the layout)
    ref = pool.run(2, F.r_run, d, "fixed", 4, 2, fresh=True, fixed_batch=True, timeout=120)
    pool.run(2, F.r_run, d, "fixed-k", 4, 2, fresh=True, fixed_batch=True, stop_after=2, timeout=120)
    res = pool.run(1, F.r_run, d, "fixed-k", 4, 2, fixed_batch=True, ckpt=ex, timeout=120)
    for a, b in zip(res[0]["curve"], ref[0]["curve"][2:], strict=True):
        assert a["step"] == b["step"] and a["lr"] == b["lr"] and a["batch"] == b["batch"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])


def test_datacursor_loader_resumes_on_another_dp_size(pool: Any, tmp_path: Path) -> None:
    d = str(tmp_path)
    ref = pool.run(2, F.r_run, d, "ref", STEPS, INTERVAL, fresh=True, cursor=True, timeout=180)
    pool.run(2, F.r_run, d, "cur", STEPS, INTERVAL, fresh=True, cursor=True, stop_after=4, timeout=120)
    res = pool.run(1, F.r_run, d, "cur", STEPS, INTERVAL, cursor=True, timeout=120)
    for a, b in zip(res[0]["curve"], ref[0]["curve"][INTERVAL:], strict=True):
        assert a["batch"] == b["batch"]  # the same global batch: every sample once
        assert a["lr"] == b["lr"] and abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])


def test_load_step_exclude_and_model_only_never_resumed(pool: Any, tmp_path: Path) -> None:
    d = str(tmp_path)
    # steps 1..4, interval 2, first-step checkpoint: full at 1, 2; model-only at 4 (bf16 export)
    pool.run(1, F.r_run, d, "c", 4, 2, fresh=True, timeout=180,
             ckpt={"enable_first_step_checkpoint": True, "export_dtype": "bfloat16", "keep_latest_k": 0})
    assert _manifest_content(tmp_path / "c") == {"step-00000001": "full", "step-00000002": "full",
                                                 "step-00000004": "model_only"}
    m4 = reshard.inspect(str(tmp_path / "c" / "step-00000004"))
    assert {te.dtype for te in m4.tensors.values()} == {"bfloat16"} and not m4.values
    # reshard.latest and a CheckpointManager agree: a model-only save is not a training state
    assert m4.extra["content"] == "model_only"
    assert reshard.latest(tmp_path / "c").endswith("step-00000002")
    assert reshard.latest(tmp_path / "c", include_model_only=True).endswith("step-00000004")
    reader = reshard.CheckpointManager(tmp_path / "c", writer=False, preempt_signals=())
    assert reader.latest_step() == 2
    reader.close()
    # a longer run resumes the newest *full* state (step 2), not the model-only step 4
    res = pool.run(1, F.r_run, d, "c", 5, 2, timeout=120)
    assert [r["step"] for r in res[0]["curve"]] == [3, 4, 5]
    # load_step: that step; a step nobody saved is an error
    res = pool.run(1, F.r_run, d, "c", 2, 2, load_step=1, timeout=120)
    assert [r["step"] for r in res[0]["curve"]] == [2]
    with pytest.raises(WorkerError, match="no checkpoint of step 9"):
        pool.run(1, F.r_run, d, "c", 10, 2, load_step=9, timeout=120)
    # load_only: loads, never saves, and leaves the root's HEAD alone
    before = sorted(p.name for p in (tmp_path / "c").iterdir())
    head = (tmp_path / "c" / "HEAD").read_bytes()
    pool.run(1, F.r_run, d, "c", 8, 2, ckpt={"load_only": True}, timeout=120)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == before
    assert (tmp_path / "c" / "HEAD").read_bytes() == head
    # create_seed_checkpoint: the seed save (step 0) is model-only and loads as initial weights
    got = pool.run(1, F.r_seed, d, timeout=120)[0]
    assert got["loaded"] and got["step"] == 0
    assert all(torch.equal(got["b"][k], v) for k, v in got["a"].items())
    assert _manifest_content(tmp_path / "seed") == {"step-00000000": "model_only"}


def test_last_save_in_hf_and_initial_load_in_hf(pool: Any, tmp_path: Path) -> None:
    from safetensors import safe_open

    d = str(tmp_path)
    saved = pool.run(2, F.r_run, d, "hfrun", 2, 5, fresh=True, state=True, hf=True, timeout=180,
                     ckpt={"last_save_in_hf": True})
    out = tmp_path / "hfrun" / "step-2"  # TorchTitan's path for it, beside the reshard checkpoints
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert "model.embed_tokens.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert _manifest_content(tmp_path / "hfrun") == {"step-00000002": "model_only"}
    assert not list(tmp_path.glob("hfrun.hf-staging*"))
    # another job starts from those weights (the sd_adapter's from_hf), on another number of ranks
    ck = {"initial_load_path": str(out), "initial_load_in_hf": True}
    got = pool.run(1, F.r_load_only, d, "fresh-folder", 2, ckpt=ck, hf=True, seed=5, timeout=120)[0]
    assert got["loaded"]
    for k, v in saved[0]["state"]["model"].items():
        assert torch.equal(got["model"][k], v), k
    # initial_load_path (model only, the default) from the reshard model-only checkpoint
    ck = {"initial_load_path": str(tmp_path / "hfrun" / "step-00000002")}
    got = pool.run(1, F.r_load_only, d, "fresh-2", 2, ckpt=ck, seed=6, timeout=120)[0]
    assert all(torch.equal(got["model"][k], v) for k, v in saved[0]["state"]["model"].items())


def test_dataloader_blob_is_unpickled_only_with_trust(tmp_path: Path) -> None:
    from reshard.errors import CheckpointError
    from reshard.integrations.torchtitan import (
        _decode_loader_state,
        _encode_loader_state,
        decode_loader_blob,
    )

    plain = {"_num_yielded": 3, "dataset_state": {"sample_idx": 6, "inputs_buffer": [1, 2]}, "s": None}
    assert decode_loader_blob(pickle.dumps(plain)) == plain
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    blob = pickle.dumps({"x": Evil()})
    with pytest.raises(CheckpointError, match="trust_pickled_dataloader=True") as e:
        decode_loader_blob(blob)
    assert "\n" not in str(e.value) and not marker.exists()  # refused before anything ran
    from collections import OrderedDict

    odd = pickle.dumps(OrderedDict(a=1))  # not plain data: a class
    enc = _encode_loader_state({"dp_rank_0": odd, "world_size": 1}, False)
    assert enc["pickled"] == {"dp_rank_0": odd} and enc["plain"] == {"world_size": 1}
    with pytest.raises(CheckpointError, match="trust_pickled_dataloader"):
        _decode_loader_state(enc, False, "dataloader.state")
    assert pickle.loads(_decode_loader_state(enc, True, "w")["dp_rank_0"]) == OrderedDict(a=1)
    enc = _encode_loader_state({"dp_rank_0": pickle.dumps(plain), "world_size": 1}, False)
    assert enc["blobs"] == {"dp_rank_0": plain} and not enc["pickled"]  # stored pickle-free


def test_staging_wait_waits_on_the_handles_staged_future(tmp_path: Path) -> None:
    from reshard.integrations.torchtitan import ReshardCheckpointManager

    ck = ReshardCheckpointManager.Config(enable=True, folder="c", async_mode="async").build(
        dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None, lr_schedulers=None,
        states={}, sd_adapter=None, base_folder=str(tmp_path))

    class Handle:
        staged: Future[None] = Future()
        committed: Future[None] = Future()

    ck._handle = Handle()
    done = threading.Event()
    t = threading.Thread(target=lambda: (ck.maybe_wait_for_staging(), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set()  # blocks until staged, not until committed
    Handle.staged.set_result(None)
    t.join(5)
    assert done.is_set() and not Handle.committed.done()
    ck._handle = None
    ck.close()


# ----------------------------------------------------------------------------- point 7


def test_export_writes_model_tensors_only_whatever_the_source(pool: Any, tmp_path: Path) -> None:
    from safetensors import safe_open

    from reshard.formats.hf_export import export_hf

    d = str(tmp_path)
    pool.run(2, F.r_run, d, "dcp", 3, 3, fresh=True, manager="dcp", ckpt={"last_save_model_only": False},
             timeout=180)
    pool.run(2, F.r_run, d, "rs", 3, 3, fresh=True, ckpt={"last_save_model_only": False}, timeout=120)

    def names(out: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    a = export_hf(tmp_path / "dcp" / "step-3", tmp_path / "out-dcp")  # TorchTitan's flattened keys
    b = export_hf(tmp_path / "rs" / "step-00000003", tmp_path / "out-rs")
    ta, tb = names(tmp_path / "out-dcp"), names(tmp_path / "out-rs")
    assert sorted(ta) == sorted(tb) and "tok_embeddings.weight" in ta and "layers.0.attention.qkv_linear.wq.weight" in ta
    assert not [k for k in ta if k.startswith(("train_state", "optimizer", "lr_scheduler", "dataloader"))]
    assert a.files == b.files == ("model.safetensors",)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k  # the same step of the same job, by either checkpointer
    # the command docs/integrations.md shows
    from click.testing import CliRunner

    from reshard.cli import main

    r = CliRunner().invoke(main, ["export", str(tmp_path / "rs" / "step-00000003"), str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert sorted(names(tmp_path / "cli")) == sorted(ta)


def test_export_never_writes_trainer_scalars(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from reshard.collectives import SingleProcess
    from reshard.formats.hf_export import export_hf

    def names(out: Path) -> list[str]:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    # a trainer scalar saved as a tensor (older TorchTitan: train_state.step = torch.tensor(step)),
    # a counter beside a model.state_dict() at the root: never exported
    w = {"tok_embeddings.weight": torch.randn(8, 4), "norm.weight": torch.ones(4),
         "bn.num_batches_tracked": torch.tensor(3)}  # an int buffer of the model's own: kept
    dcp.save({**w, "train_state": {"step": torch.tensor(5), "ntokens_seen": torch.tensor(640)},
              "lr_scheduler": {"last_epoch": torch.tensor(5)},
              "optimizer": {"state.norm.weight.exp_avg": torch.zeros(4)}},
             checkpoint_id=str(tmp_path / "old-dcp"), no_dist=True)
    export_hf(tmp_path / "old-dcp", tmp_path / "out-old")
    assert names(tmp_path / "out-old") == sorted(w)
    export_hf(tmp_path / "old-dcp", tmp_path / "out-all", subtree="")  # every tensor: no trainer state
    assert names(tmp_path / "out-all") == sorted(w)
    reshard.save({**w, "step": torch.tensor(7), "epoch": torch.tensor(1)}, tmp_path / "flat",
                 group=SingleProcess())
    export_hf(tmp_path / "flat", tmp_path / "out-flat")
    assert names(tmp_path / "out-flat") == sorted(w)


def test_import_hf_undoes_export_with_no_argument(tmp_path: Path) -> None:
    from reshard.collectives import SingleProcess
    from reshard.errors import ShardingError
    from reshard.formats.hf_export import export_hf
    from reshard.formats.hf_import import import_hf

    def net(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))

    m = net(0)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    reshard.save({"lm": reshard.ModelState(m), "optim": reshard.OptimizerState(m, opt), "step": 3},
                 tmp_path / "ck", group=SingleProcess())
    res = export_hf(tmp_path / "ck", tmp_path / "hf")  # the subtree "lm" found automatically
    assert sorted(res.weight_map) == sorted(m.state_dict())
    m2 = net(1)
    got = import_hf({"lm": reshard.ModelState(m2), "optim": reshard.OptimizerState(m2, torch.optim.AdamW(
        m2.parameters()))}, tmp_path / "hf", strict=False)
    assert not got.missing or all(k.startswith("optim.") for k in got.missing)
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    m3 = net(2)
    import_hf({"lm": reshard.ModelState(m3)}, tmp_path / "hf")  # strict, no argument
    assert all(torch.equal(m3.state_dict()[k], v) for k, v in m.state_dict().items())
    # two models hold those names: it cannot tell, and its error names subtree=
    with pytest.raises(ShardingError, match=r"pass subtree=") as e:
        import_hf({"a": reshard.ModelState(net(3)), "b": reshard.ModelState(net(4))}, tmp_path / "hf")
    assert "'a'" in str(e.value) and "'b'" in str(e.value)
    import_hf({"a": reshard.ModelState(net(3)), "b": reshard.ModelState(net(4))}, tmp_path / "hf",
              subtree="b", strict=True, allow_missing=["a.*"])
    json.dumps(res.weight_map)


# ----------------------------------------------------------------------------- benchmarks/gpu_integrations.py


def _script(*args: str, env: dict[str, str] | None = None) -> Any:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_integrations.py"), *args],
                          capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})


def test_gpu_script_cpu_self_check_and_clean_skip_lines(tmp_path: Path) -> None:
    p = _script("--cpu-self-check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT:")] == [
        ln for ln in p.stdout.splitlines() if ln.startswith("RESULT: SELF-CHECK OK")]
    # where torchtitan does not import (a torch it does not support), one clean line, exit 0
    fake = tmp_path / "site" / "torchtitan"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    p = _script(env={"PYTHONPATH": str(tmp_path / "site")})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT:")]
    assert p.returncode == 0 and lines == [
        "RESULT: SKIP torchtitan does not import here (torch " + torch.__version__
        + "): ImportError: built for another torch"], p.stdout + p.stderr
    if not torch.cuda.is_available():  # the GPU check itself says why it does not run
        p = _script()
        assert p.returncode == 0 and p.stdout.strip().splitlines()[-1].startswith("RESULT: SKIP no CUDA")
