"""``reshard bench incremental``: what incremental checkpoints save, measured
beside full saves and the peers, in one run (issue 30 point 5).

Two workloads on a Llama-style model of 134M parameters built from a config
(hidden 768, 12 layers, 12 heads, MLP 2048, vocabulary 32000, untied LM head;
float32; no weights downloaded), trained for real (AdamW, one batch of
``seq_len`` tokens a step) on one gloo rank:

* ``lora``: PEFT LoRA of rank 16 on all seven projections of every layer
  (q, k, v, o, gate, up, down), the base frozen. ``reshard incremental``
  (a :class:`~reshard.CheckpointManager`, incremental by default) saves
  after every step, ``lora_saves`` times, with ``keep_last``; ``reshard
  full`` (the manager with ``SaveOptions(incremental=False)``), PyTorch DCP
  (``torch.distributed.checkpoint.save``) and torch_checkpointing (its sync
  saver) save the same state every ``peer_every`` steps. After the run: the
  bytes the root stores (each file once) against the base's, ``verify`` of
  every kept checkpoint, a load of each into another layout (the two halves
  of a row split, as two ranks of a TP/FSDP layout would load them) compared
  bit for bit with the state saved, and ``reshard ls`` of the root.
* ``full-ft``: a full fine-tune with the token embedding frozen (every other
  parameter trained); every system saves after each of ``ft_saves`` steps.

Per save and system: the bytes written (new bytes on the store: files not
linked from an earlier checkpoint), the seconds of the save call (for the
managed saves also the save's own phases, without the verification record
and retention that follow it) and the data files. Every system saves the
same state (``get_state_dict`` of model and optimizer, the DCP form), fsynced.
The hashing cost is measured twice: the first save of ``full-ft`` writes
every byte in both modes (incremental adds the xxh3_128 of every chunk that
gets a file of its own), and the xxh3_128 of the whole state on one thread
and on every CPU.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: the issue's targets
TARGETS = {
    "lora_bytes_ratio": 1.1,  # a LoRA save writes <= 1.1x trainable + optimizer + non-tensor state
    "lora_time_ratio": 0.15,  # and takes <= 15% of a full save's time
    "ft_embedding_bytes": 0,  # a full fine-tune with frozen embeddings writes no embedding byte
    "hash_overhead": 0.10,  # hashing on a save where every byte changed: <= 10% of its time
}


@dataclass
class Row:
    workload: str
    system: str
    save: int
    step: int
    bytes_written: int
    seconds: float
    files: int
    logical_bytes: int
    save_seconds: float | None = None  # a managed save: its own phases (stage+plan+write+commit)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    load_avg: list[tuple[str, tuple[float, float, float]]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "load_avg": self.load_avg, "checks": self.checks,
                "rows": [asdict(r) for r in self.rows], "targets": TARGETS}


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False,
                       max_position_embeddings=512)


def _model(seed: int = 0) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def _init_dist() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _files(path: str) -> list[str]:
    out: list[str] = []
    for dirpath, _, names in os.walk(path):
        out.extend(os.path.join(dirpath, n) for n in names)
    return out


def _inodes(root: str) -> set[tuple[int, int]]:
    seen = set()
    for f in _files(root):
        s = os.lstat(f)
        seen.add((s.st_dev, s.st_ino))
    return seen


def _new_bytes(path: str, before: set[tuple[int, int]]) -> tuple[int, int, int]:
    """(bytes of files under ``path`` whose inode did not exist before, all
    bytes under ``path``, files under ``path``)."""
    new = total = n = 0
    for f in _files(path):
        s = os.lstat(f)
        total += s.st_size
        n += 1
        if (s.st_dev, s.st_ino) not in before:
            new += s.st_size
    return new, total, n


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


class _Peers:
    """DCP and torch_checkpointing saving into their own roots, keeping the newest ``keep``."""

    def __init__(self, root: str, keep: int) -> None:
        import torch_checkpointing as tc
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.root, self.keep = root, keep
        self.tc = tc.make_sync_checkpoint_saver(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
        self.done: dict[str, list[str]] = {"dcp": [], "torch_checkpointing": []}

    def save(self, system: str, step: int, state: dict[str, Any]) -> tuple[float, str]:
        path = os.path.join(self.root, system, f"step-{step:08d}")
        t0 = time.perf_counter()
        if system == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=path)
        else:
            import torch_checkpointing as tc

            class State(tc.CheckpointBase):
                def get_items(self) -> dict[str, Any]:
                    return {"state": tc.CheckpointItem(value=state)}

                def load_state_dict(self, state_dict: Any) -> None:
                    pass

            self.tc.save(path, State())
        secs = time.perf_counter() - t0
        self.done[system].append(path)
        while len(self.done[system]) > self.keep:
            shutil.rmtree(self.done[system].pop(0), ignore_errors=True)
        return secs, path

    def close(self) -> None:
        self.tc.close()


def _managed(root: str, keep: int, incremental: bool) -> Any:
    from ..manager.manager import CheckpointManager
    from ..options import SaveOptions

    return CheckpointManager(root, keep_last=keep, preempt_signals=(),
                             options=SaveOptions(incremental=incremental))


def _save_managed(mgr: Any, step: int, state: dict[str, Any], root: str) -> tuple[Row, Any]:
    before = _inodes(root)
    t0 = time.perf_counter()
    res = mgr.save(step, state)
    secs = time.perf_counter() - t0
    new, total, files = _new_bytes(res.path, before)
    own = sum(v for k, v in res.timings.items() if k in ("stage", "plan", "write", "commit"))
    return Row(workload="", system="", save=0, step=step, bytes_written=new, seconds=secs, files=files,
               logical_bytes=total, save_seconds=own), res


def _peer_row(peers: _Peers, system: str, step: int, state: dict[str, Any]) -> Row:
    before = _inodes(peers.root)
    secs, path = peers.save(system, step, state)
    new, total, files = _new_bytes(path, before)
    return Row(workload="", system=system, save=0, step=step, bytes_written=new, seconds=secs, files=files,
               logical_bytes=total)


def _train_step(model: Any, opt: Any, step: int, seq_len: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 32000, (1, seq_len), generator=g)
    opt.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()


def run(out_dir: str, *, lora_saves: int = 20, keep_last: int = 3, peer_every: int = 5, ft_saves: int = 4,
        seq_len: int = 32, lora_rank: int = 16, say: Callable[[str], None] = print) -> Report:
    """Run both workloads under ``out_dir`` (emptied first); returns the report."""
    import warnings

    from peft import LoraConfig, get_peft_model

    warnings.filterwarnings("ignore")
    _init_dist()
    rep = Report(config={"model": "llama 134M (hidden 768, 12 layers, MLP 2048, vocab 32000, untied)",
                         "dtype": "float32", "lora_rank": lora_rank, "lora_saves": lora_saves,
                         "keep_last": keep_last, "peer_every": peer_every, "ft_saves": ft_saves,
                         "seq_len": seq_len, "cpus": len(os.sched_getaffinity(0))})
    rep.load_avg.append(("start", os.getloadavg()))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)

    # ---------------------------------------------------------------- LoRA
    say("lora: building the model")
    model = get_peft_model(_model(), LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    lroot = os.path.join(out_dir, "lora")
    inc = _managed(os.path.join(lroot, "reshard-incremental"), keep_last, True)
    full = _managed(os.path.join(lroot, "reshard-full"), keep_last, False)
    peers = _Peers(os.path.join(lroot, "peers"), keep_last)
    kept: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for step in range(1, lora_saves + 1):
            _train_step(model, opt, step, seq_len)
            state = _state(model, opt)
            row, res = _save_managed(inc, step, state, os.path.join(lroot, "reshard-incremental"))
            row.workload, row.system, row.save = "lora", "reshard incremental", step
            rep.rows.append(row)
            if step > lora_saves - keep_last:
                kept[step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            if step == 1 or step % peer_every == 0:
                r2, _ = _save_managed(full, step, state, os.path.join(lroot, "reshard-full"))
                r2.workload, r2.system, r2.save = "lora", "reshard full", step
                rep.rows.append(r2)
                for system in ("dcp", "torch_checkpointing"):
                    r3 = _peer_row(peers, system, step, state)
                    r3.workload, r3.save = "lora", step
                    rep.rows.append(r3)
            say(f"lora: step {step}: incremental wrote {row.bytes_written / 2**20:.1f} MiB in "
                f"{row.seconds:.2f} s")
        inc.wait()
        full.wait()
        # optimizer state and non-tensor state per save: the trainable bytes, two moments, the steps
        osd = _state(model, opt)["optim"]
        moments = sum(v.numel() * v.element_size() for st in osd["state"].values() for v in st.values()
                      if isinstance(v, torch.Tensor))
        rep.checks["lora"] = _lora_checks(rep, os.path.join(lroot, "reshard-incremental"), kept, model,
                                          trainable, moments, base_bytes, say)
    finally:
        peers.close()
        inc.close()
        full.close()
    del model, opt, kept
    gc.collect()
    rep.load_avg.append(("after lora", os.getloadavg()))

    # ---------------------------------------------------------------- full fine-tune, frozen embedding
    say("full-ft: building the model")
    model = _model()
    model.model.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    froot = os.path.join(out_dir, "full-ft")
    inc = _managed(os.path.join(froot, "reshard-incremental"), keep_last, True)
    full = _managed(os.path.join(froot, "reshard-full"), keep_last, False)
    peers = _Peers(os.path.join(froot, "peers"), keep_last)
    try:
        for step in range(1, ft_saves + 1):
            _train_step(model, opt, step, seq_len)
            state = _state(model, opt)
            # alternate which goes first: the page cache and writeback favour neither
            order = ["inc", "full", "dcp", "torch_checkpointing"]
            if step % 2 == 0:
                order = order[::-1]
            for what in order:
                if what in ("inc", "full"):
                    mgr = inc if what == "inc" else full
                    sub = "reshard-incremental" if what == "inc" else "reshard-full"
                    row, _ = _save_managed(mgr, step, state, os.path.join(froot, sub))
                    row.system = "reshard incremental" if what == "inc" else "reshard full"
                else:
                    row = _peer_row(peers, what, step, state)
                row.workload, row.save = "full-ft", step
                rep.rows.append(row)
            say(f"full-ft: step {step} saved by every system")
        inc.wait()
        full.wait()
        rep.checks["full-ft"] = _ft_checks(rep, os.path.join(froot, "reshard-incremental"))
        rep.checks["hash"] = _hash_checks(rep, state)
    finally:
        peers.close()
        inc.close()
        full.close()
    rep.load_avg.append(("end", os.getloadavg()))
    return rep


def _lora_checks(rep: Report, root: str, kept: dict[int, dict[str, torch.Tensor]], model: Any,
                 trainable: int, moments: int, base_bytes: int, say: Callable[[str], None]) -> dict[str, Any]:
    """The targets of the LoRA workload and the 20-saves criterion."""
    import subprocess
    import sys

    import reshard

    from ..state.sharding import ShardedTensor, torch_dtype

    inc = [r for r in rep.rows if r.workload == "lora" and r.system == "reshard incremental"]
    full = {r.step: r for r in rep.rows if r.workload == "lora" and r.system == "reshard full"}
    newest = max(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "manifest.json")))
    import msgspec

    values = len(msgspec.json.encode(reshard.inspect(os.path.join(root, newest)).values))
    target_bytes = trainable + moments + values  # + the non-tensor state: hyperparameters, as encoded
    later = [r for r in inc if r.step > 1]
    worst_bytes = max(r.bytes_written for r in later)
    time_ratios = [r.save_seconds / fs for r in later if r.step in full and r.save_seconds
                   and (fs := full[r.step].save_seconds)]
    wall_ratios = [r.seconds / full[r.step].seconds for r in later if r.step in full]

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2

    # the typical incremental save against the typical full save: medians of every
    # save of each (a shared machine's bursts hit single saves, not the medians)
    inc_median = median([r.save_seconds or r.seconds for r in later])
    full_median = median([r.save_seconds or r.seconds for r in full.values()])
    names = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "manifest.json")))
    stored = sum({(s.st_dev, s.st_ino): s.st_size for n in names for f in _files(os.path.join(root, n))
                  if (s := os.lstat(f))}.values())
    logical = sum(reshard.inspect(os.path.join(root, n)).total_bytes for n in names)
    loads = {}
    params = dict(model.named_parameters())
    for n in names:
        path = os.path.join(root, n)
        ok = reshard.verify(path).ok
        m = reshard.inspect(path)
        step = int(m.step or 0)
        halves: list[dict[str, Any]] = []
        for r in range(2):  # rank r of a 2-rank row split (another TP/FSDP layout), loaded in turn
            tgt: dict[str, Any] = {}
            for fqn, te in m.tensors.items():
                g = tuple(te.global_shape)
                if fqn.startswith("model.") and len(g) >= 1 and g[0] >= 2 and not g[0] % 2:
                    half = g[0] // 2
                    tgt[fqn] = ShardedTensor(fqn, torch.empty((half, *g[1:]), dtype=torch_dtype(te.dtype)),
                                             global_shape=g, global_offset=(r * half,) + (0,) * (len(g) - 1))
            reshard.load(tgt, path, strict=False)
            halves.append(tgt)
        exact, compared = True, 0
        for fqn in halves[0]:
            whole = torch.cat([h[fqn].data for h in halves])
            name = fqn[len("model."):]
            want = kept.get(step, {}).get(name)
            if want is None and name in params and not params[name].requires_grad:
                want = params[name].detach()
            if want is not None:
                exact &= torch.equal(whole, want)
                compared += 1
        loads[n] = {"verify": ok, "bit_exact_in_row_split": exact, "tensors_compared": compared}
        say(f"lora: {n}: verify {'ok' if ok else 'FAILED'}, row-split load bit-exact {exact} "
            f"({compared} tensors)")
    ls = subprocess.run([sys.executable, "-m", "reshard.cli", "ls", root], capture_output=True, text=True).stdout
    return {"trainable_bytes": trainable, "optimizer_bytes": moments, "non_tensor_bytes": values,
            "target_bytes": target_bytes,
            "worst_bytes_after_first": worst_bytes,
            "bytes_ratio": worst_bytes / target_bytes,
            "state_bytes": base_bytes + trainable + moments,
            "incremental_median_s": inc_median, "full_median_s": full_median,
            "time_ratio": inc_median / full_median,
            "paired_time_ratios": time_ratios, "paired_wall_ratios": wall_ratios,
            "kept": names, "stored_bytes": stored, "base_bytes": base_bytes, "logical_bytes": logical,
            "base_stored_once": base_bytes <= stored < base_bytes + len(names) * (target_bytes + (4 << 20)),
            "loads": loads, "ls": ls}


def _ft_checks(rep: Report, root: str) -> dict[str, Any]:
    """Embedding bytes written by the incremental saves after the first."""
    import reshard

    names = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "manifest.json")))
    emb_written = []
    for n in names:
        m = reshard.inspect(os.path.join(root, n))
        files = {c.file for fqn, te in m.tensors.items() if "embed_tokens" in fqn for c in te.chunks}
        emb_written.append((n, sum(m.files[f].size for f in files if not m.files[f].origin)))
    return {"embedding_bytes_written": emb_written[1:], "first": emb_written[:1],
            "after_first_max": max((b for _, b in emb_written[1:]), default=0)}


def _hash_checks(rep: Report, state: dict[str, Any]) -> dict[str, Any]:
    """Hashing cost on a save where every byte is new (the first full-ft save,
    incremental against full) and the xxh3_128 of the whole state on one
    thread and on every CPU."""
    from concurrent.futures import ThreadPoolExecutor

    from ..ondisk.shardfile import content_digest, tensor_bytes

    first = {r.system: r for r in rep.rows if r.workload == "full-ft" and r.step == 1}
    views = []
    for part in state.values():
        stack = [part]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, torch.Tensor) and x.numel() * x.element_size() >= 1 << 20:
                views.append(tensor_bytes(x))
    total = sum(len(v) for v in views)
    t0 = time.perf_counter()
    for v in views:
        content_digest(v)
    one = time.perf_counter() - t0
    cpus = min(4, len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cpus) as ex:
        list(ex.map(content_digest, sorted(views, key=len, reverse=True)))
    many = time.perf_counter() - t0
    inc, full = first.get("reshard incremental"), first.get("reshard full")
    out: dict[str, Any] = {"hashed_bytes": total, "one_thread_s": one, "all_cpus_s": many, "cpus": cpus}
    if inc and full and inc.save_seconds and full.save_seconds:
        out["first_save_incremental_s"] = inc.save_seconds
        out["first_save_full_s"] = full.save_seconds
        out["overhead"] = inc.save_seconds / full.save_seconds - 1
        out["hash_share_of_save"] = many / inc.save_seconds
    return out


def table(rep: Report) -> str:
    """The per-save table (markdown)."""
    lines = ["| workload | system | save at step | bytes written | seconds (call) | seconds (save phases) "
             "| files |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rep.rows:
        lines.append(f"| {r.workload} | {r.system} | {r.step} | {r.bytes_written / 2**20:.1f} MiB | "
                     f"{r.seconds:.2f} | {'-' if r.save_seconds is None else f'{r.save_seconds:.2f}'} | {r.files} |")
    return "\n".join(lines)
