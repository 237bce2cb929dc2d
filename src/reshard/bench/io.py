"""``reshard bench io``: checkpoint I/O of a real model state, with its peers
and the machine's limits measured in the same run on the same state.

Per world size and backend, on real gloo ranks (:class:`reshard.testing.pool.WorkerPool`):

1. setup: the workload (:mod:`reshard.bench.models`) in its layout, one
   training step (the AdamW moments exist); first-call costs of every
   method paid on a tiny state;
2. training-step slowdown: step times with no save in flight, then while a
   reshard / DCP async save is in flight;
3. saves (fsync'd, the disk quiet before each, order rotated per repeat):
   ``limit-write`` (each rank ``os.write`` + ``fsync`` of the bytes reshard
   makes it write, one writer per rank), ``reshard.save`` with and without
   checksums, DCP ``save``, ``torch.save`` and safetensors ``save_file`` of
   each rank's share (each + ``fsync``);
4. async saves: ``memcpy`` of the state into preallocated memory (the stall's
   limit), ``reshard.async_save``, DCP ``async_save`` (thread) and DCP's
   process mode with its ``DefaultStager``: the foreground stall and the time
   from return to commit;
5. peak extra RSS per rank of a save, two consecutive async saves, a load
   (and DCP's save and load); the resident bytes after each of
   ``--rss-saves`` consecutive async saves of a small state in the same
   layout (:func:`reshard.bench.usage.rss_growth`);
6. warm loads (page cache warm; one untimed call first): ``limit-read``
   (single-thread sequential ``preadv`` of the checkpoint's own files into
   preallocated memory; ``memcpy`` is the figure of step 4), ``reshard.load`` with and without
   checksums, DCP ``load`` (+ ``set_state_dict``) at 1 torch thread and at
   the machine's core count, ``torch.load(weights_only=True)`` and
   safetensors ``load_file`` (each + copy into the state); then the first
   training step after the load;
7. ``--reshard-to``: the checkpoint of this world loaded into another layout
   / world size (reshard and DCP), the state's fingerprint checked, and the
   first step there.

Every load is checked against the saved state with a bit-exact,
layout-independent digest of its tensors (:mod:`reshard.bench.digest`).

Backends: ``local`` (a scratch directory), ``s3`` (moto's server on
127.0.0.1 started for the run, or ``--s3-endpoint``: reshard and the limits
of the endpoint, raw boto3 PUT / ranged GET of the same bytes; see
:mod:`reshard.bench.objstore`), ``memory`` (objects live in one process: the
other ranks, separate processes, cannot see them, so it runs at world 1
only). Layouts: ``fsdp``, ``dpN`` (nn.Module state dicts, with the peers)
and the demo's TP/PP syntax (the demo trainer's state, reshard and the
limits only). Outputs: a table (ratios beside figures), ``--json`` (one
record per phase measurement, every rank's timings, the load average),
``--plot``. The command itself is :mod:`reshard.cli.bench`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

from ..planning.plan_store import PLAN_FILE
from ..storage.registry import get_scheme, scheme_of, start_test_store
from .models import parse_layout

GB = 1e9
#: the most ranks (processes on this machine) a run, a --layout or a --reshard-to takes
MAX_WORLD = 8


def check_layouts(model: str, layout: str, reshard_to: list[str], worlds: list[int] | None) -> list[int]:
    """Validate the layouts against each other and the model; the world sizes
    to run (a grid layout's own when ``worlds`` is None; else 1 and 2).

    Raises:
        ValueError: a bad layout, a grid layout of a model without one, a
            world size a grid layout cannot take, a layout of more than
            :data:`MAX_WORLD` ranks, a reshard between the
            trainer's grid state and an nn.Module state dict (their keys differ).
    """
    from .models import GRID_MODELS

    spec = parse_layout(layout)
    targets = [parse_layout(t) for t in reshard_to]
    for sp, what in [(spec, "--layout"), *((t, "--reshard-to") for t in targets)]:
        if sp.world is not None and sp.world > MAX_WORLD:  # each rank is a process on this machine
            raise ValueError(f"{what} {sp}: {sp.world} ranks; the runs take 1 to {MAX_WORLD} ranks "
                             "(each a process on this machine)")
        if sp.kind == "grid" and model not in GRID_MODELS:
            raise ValueError(f"{what} {sp}: tensor/pipeline layouts run the demo's trainer, which has "
                             f"the models {', '.join(GRID_MODELS)} (not {model!r})")
        if (sp.kind == "grid") != (spec.kind == "grid"):
            raise ValueError(f"--reshard-to {sp} from --layout {spec}: the demo trainer's state (TP/PP "
                             "layouts) and an nn.Module state dict (fsdp, dpN) have different keys; "
                             "reshard between two layouts of the same kind")
    if spec.kind == "grid":
        if worlds is not None and worlds != [spec.world]:
            raise ValueError(f"--world {','.join(map(str, worlds))}: layout {spec} runs on "
                             f"{spec.world} ranks")
        return [int(spec.world or 1)]
    return worlds or [1, 2]


#: logical state bytes (parameters + AdamW moments) of the fixed workloads (measured: the setup's figure)
STATE_BYTES = {"gpt2-small": 1.49e9, "bert-minilm": 0.32e9, "llama-tiny": 0.01e9}
#: resident bytes of a rank with torch imported and nothing built (about 350 MiB measured), rounded up
RANK_BASE_BYTES = 0.4e9


def memory_needed(model: str, layout: str, worlds: list[int], reshard_to: list[str],
                  synthetic_mib: float) -> float:
    """Bytes of memory the largest world of the run needs, about: each rank
    holds its share of the state (all of it when replicated) and, with the
    peers' copies, up to about 5.5x that (the README's measurement), plus
    :data:`RANK_BASE_BYTES`. An estimate to refuse a run that cannot fit
    (a rank of `--synthetic-mib 100000` was killed by the kernel's OOM killer,
    which may pick any process of the machine)."""
    state = 3 * synthetic_mib * (1 << 20) if model == "synthetic" else STATE_BYTES[model]
    spec = parse_layout(layout)
    need = 0.0
    for w in [*worlds, *(parse_layout(t).world or max(worlds) for t in reshard_to)]:
        copies = w if spec.kind == "dp" else 1  # replicated: every rank holds the whole state
        need = max(need, 5.5 * state * copies + RANK_BASE_BYTES * w)
    return need


class BenchError(RuntimeError):
    """A phase failed on the ranks (a rank raised, died, or did not answer
    within ``--timeout``). ``phase`` names it; ``partial_json`` is the
    ``--json`` path holding the records of the worlds completed before it
    (None when none was written)."""

    def __init__(self, message: str, phase: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.partial_json: str | None = None


class Runner:
    """Runs the phases on the pool and collects one record per measurement."""

    def __init__(self, cfg: dict[str, Any], progress: bool):
        from ..testing.pool import WorkerPool

        self.cfg = cfg
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.tc_io: dict[int, dict[str, Any]] = {}
        self.pool = WorkerPool(pg_timeout=900.0, grace=60.0, max_groups=1)
        self.progress = progress
        self.bar: Any = None
        self.info: dict[int, list[dict[str, Any]]] = {}
        self.stores: dict[str, Any] = {}  # backend -> its test store (reshard.storage.start_test_store)
        #: world -> (CheckpointManager root of the --cold save, the state's digest then)
        self.cold_root: dict[int, tuple[str, str]] = {}

    # -- helpers
    def run(self, world: int, fn: Any, *args: Any) -> list[Any]:
        from ..testing.pool import WorkerError

        if self.bar is not None:  # the phase under way, shown while it runs
            self.bar.set_postfix_str(f"{self.ctx} ({fn.__name__})", refresh=True)
        try:
            return self.pool.run(world, fn, *args, timeout=self.cfg["timeout"])
        except WorkerError as e:
            phase = f"{self.ctx} ({fn.__name__}, {world} ranks)"
            why = [f"rank {r} raised {name}: {' '.join(str(msg).split())[:300]}"
                   for r, (name, msg, _tb) in sorted(e.failures.items())]
            if e.hung:
                why.append(f"ranks {e.hung} did not answer "
                           + ("after the first failure" if e.failures else
                              f"within --timeout {self.cfg['timeout']:g} s")
                           + " (killed; their stacks are on stderr)")
            raise BenchError(f"{phase} failed: {'; '.join(why)}", phase) from e

    ctx = ""

    def setup(self, world: int, layout: str) -> list[dict[str, Any]]:
        from . import ranks

        c = self.cfg
        return self.run(world, ranks.setup, c["model"], layout, c["synthetic_mib"], c["seq_len"], c["profile"],
                        c.get("synthetic_width"))

    def tick(self, what: str) -> None:
        self.ctx = what
        if self.bar is not None:
            self.bar.update(1)

    def record(self, phase: str, method: str, world: int, backend: str, per_rank: list[dict[str, Any]],
               **extra: Any) -> dict[str, Any]:
        rec = {"phase": phase, "method": method, "world": world, "backend": backend,
               "model": self.cfg["model"], "layout": self.cfg["layout_of"][world],
               "loadavg": list(os.getloadavg()), "time": time.time(), "per_rank": per_rank,
               "rss_after": self.worker_rss(extra.get("target_world", world)), **extra}
        self.records.append(rec)
        return rec

    def worker_rss(self, world: int) -> list[int | None]:
        """Resident bytes of each rank's process now (after the phase)."""
        import psutil

        group = self.pool._groups.get(world)
        out: list[int | None] = []
        for p in group.procs if group is not None else []:
            try:
                out.append(psutil.Process(p.pid).memory_info().rss)
            except (psutil.Error, TypeError):
                out.append(None)
        return out

    def url(self, backend: str, scratch: str, name: str) -> str:
        return str(self.stores[backend].url(name))

    def stored(self, p: str) -> dict[str, Any]:
        """Stored bytes, file count, manifest and cached-plan bytes of a saved checkpoint."""
        if p.startswith("s3://"):
            from .objstore import objects

            objs = {k.rsplit("/", 1)[-1]: n for k, n in objects(p)}
        elif os.path.isdir(p):
            objs = {f: os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(p) for f in fs}
        else:
            return {}
        out: dict[str, Any] = {"stored_bytes": sum(objs.values()),
                               "files": len([f for f in objs if not f.startswith(".")])}
        if "manifest.json" in objs:
            out["manifest_bytes"] = objs["manifest.json"]
            out["plan_bytes"] = objs.get(PLAN_FILE, 0)  # the cached save plan (reshard.planning.plan_store)
        return out

    # -- one world size on one backend
    def world_run(self, world: int, backend: str, scratch: str) -> None:
        from . import ranks

        cfg = self.cfg
        rep, settle = cfg["repeat"], cfg["settle"]
        self.ctx = f"w{world} {backend}: setup"
        cold = cfg.get("cold") and get_scheme(backend).shared  # memory://: a restart would lose the objects
        self.cold_root.pop(world, None)
        if cold and world in self.pool._groups:
            self.pool.restart(world)  # freshly started processes for the first save
        info = self.setup(world, cfg["layout"])
        self.info[world] = info
        cfg["layout_of"][world] = info[0]["layout"]
        self.record("setup", "build", world, backend, info, logical_bytes=info[0]["logical_bytes"])
        self.tick(f"w{world} {backend}: warm-up")
        if info[0]["replicas_differ"]:
            self.notes.append(f"w{world}: replicas differ before any save: {info[0]['replicas_differ']}")
        if cold:  # fresh processes (this setup's): the first save, as the demo saves
            pc, root = self.url(backend, scratch, f"w{world}-cold"), self.url(backend, scratch, f"w{world}-mgr")
            out = self.run(world, ranks.cold_save, pc, root)
            self.record("cold", "first-save", world, backend, out)
            self.record("cold", "manager-save", world, backend,
                        [{"rank": o["rank"], "own_s": o["manager_own_s"], "total_s": o["manager_total_s"]}
                         for o in out])
            v = out[0]["manager_verify_s"]
            self.record("cold", "manager-verify", world, backend, [{"rank": 0, "own_s": [v], "total_s": [v]}])
            self.run(world, ranks.drop, pc)
            self.cold_root[world] = (root, info[0]["fingerprint"])  # restored by --reshard-to (cold)
        peers = backend == "local" and info[0]["peers"]  # DCP, torch.save, safetensors
        limits = backend in ("local", "s3")  # limit-write / limit-read on this storage
        base = self.url(backend, scratch, f"w{world}")
        tc = peers and self.tc_ready(world, base)  # torch_checkpointing, when installed
        warm = ["reshard", "reshard-async"] + (["dcp", "dcp-async"] if peers else [])
        warm += [m for m in ("tc", "tc-async") if tc]
        warm = [m for m in warm if m not in cfg["skip"]]
        self.run(world, ranks.warm, base + "-warm", warm)  # DCP's process: only around the async phase
        growth = int(cfg.get("rss_growth", 0))  # RSS over many async saves of a small state
        if growth and "rss" not in cfg["skip"] and "rss-growth" not in cfg["skip"]:
            from .usage import rss_growth

            self.ctx = f"w{world} {backend}: rss over {growth} async saves"
            self.record("rss", "async-growth", world, backend,
                        self.run(world, rss_growth, cfg["layout"], growth,
                                 self.url(backend, scratch, f"w{world}-rss-growth")))
        # peak RSS of the first save and of the first two async saves (the staging pool's growth)
        for m in [m for m in ("save", "async-save") if m not in cfg["skip"] and "rss" not in cfg["skip"]]:
            self.ctx = f"w{world} {backend}: rss {m}"
            p = self.url(backend, scratch, f"w{world}-rss-{m}")
            self.record("rss", m, world, backend, self.run(world, ranks.rss, m, p, cfg.get("rss_saves", 2)))
            if m == "save":
                self.run(world, ranks.drop, p)
        # training-step slowdown while a background save is in flight
        self.tick(f"w{world} {backend}: training during a background save")
        tm = ["reshard-async"] + (["dcp-async"] if peers and "dcp-async" not in cfg["skip"] else [])
        if "train" not in cfg["skip"]:
            out = self.run(world, ranks.train, tm, base + "-train", cfg["steps"], settle,
                           cfg.get("bg_saves", 1))
            self.record("train", "step", world, backend, out)
        if "overlap" not in cfg["skip"]:
            self.overlap(world, backend, base, peers, tc)
        fp = self.run(world, ranks.fingerprint)[0]
        # saves
        methods = [m for m in ranks.SAVE_METHODS if (peers or m.startswith("reshard")
                                                      or (limits and m == "limit-write"))
                   and m not in cfg["skip"] and (tc or m not in ranks.TC_METHODS)]
        keep: dict[str, str] = {}
        if world in self.cold_root:
            keep["cold-manager"] = self.cold_root[world][0]  # removed with the others at the end
        limit_bytes: list[int] = [0] * world
        methods = ["reshard"] + [m for m in methods if m != "reshard"]  # bytes per rank first
        if "save" in cfg["skip"] and "load" in cfg["skip"]:
            methods = []  # nothing to load: no save either
        for r in range(rep if methods else 0):
            order = methods if r == 0 else methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                self.tick(f"w{world} {backend}: save {m}")
                p = self.url(backend, scratch, f"w{world}-save-{m}-{r}")
                self.run(world, ranks.quiet, settle)
                out = self.run(world, ranks.save, m, p, limit_bytes)
                if m == "reshard":  # the limit writes the bytes reshard wrote, per rank
                    limit_bytes = [o["bytes"] for o in out]
                self.record("save", m, world, backend, out, repeat_index=r, **self.stored(p))
                if m in keep:
                    self.run(world, ranks.drop, keep[m])
                keep[m] = p
        # async saves
        amethods = [m for m in ranks.ASYNC_METHODS if (peers or m in ("memcpy", "reshard-async"))
                    and m not in cfg["skip"] and "async" not in cfg["skip"]
                    and (tc or m not in ranks.TC_METHODS)]
        if "dcp-async-process" in amethods:  # its process (started untimed) lives for this phase only
            self.run(world, ranks.warm, base + "-warm-process", ["dcp-async-process"])
        for r in range(rep if amethods else 0):
            order = amethods[r % len(amethods):] + amethods[:r % len(amethods)]
            for m in order:
                self.tick(f"w{world} {backend}: async {m}")
                p = self.url(backend, scratch, f"w{world}-async-{m}-{r}")
                self.run(world, ranks.quiet, settle)
                try:
                    out = self.run(world, ranks.async_save, m, p)
                except Exception as e:  # noqa: BLE001 - a peer's mode this torch lacks: reported
                    if m == "dcp-async-process":
                        why = [ln for ln in str(e).splitlines() if "raised" in ln][:1] or [str(e)[:200]]
                        self.notes.append(f"{m} not measured (world {world}): {why[0].strip()[:300]}")
                        amethods.remove(m)
                        self.pool.restart(world)
                        self.setup(world, cfg["layout"])
                        continue
                    raise
                self.record("async", m, world, backend, out, repeat_index=r)
                if m != "memcpy":
                    self.run(world, ranks.drop, p)
        self.run(world, ranks.end_dcp_process)
        self.run(world, ranks.trim)  # the async phases' buffers, before the loads allocate theirs
        if "load" in cfg["skip"]:
            self.run(world, ranks.release)
            self._remove(keep, world)
            return
        # peak RSS
        self.tick(f"w{world} {backend}: rss of a load")
        ckpt = keep["reshard"]
        rm = ["load"] + (["dcp-save", "dcp-load"] if peers and "dcp" in keep else [])
        rm = [] if "rss" in cfg["skip"] else rm
        for m in rm:
            p = ckpt if m == "load" else keep.get("dcp", "") if m == "dcp-load" else \
                self.url(backend, scratch, f"w{world}-rss-{m}")
            out = self.run(world, ranks.rss, m, p)
            self.record("rss", m, world, backend, out)
            if m == "dcp-save":
                self.run(world, ranks.drop, p)
        # warm loads
        src = {"limit-read": keep.get("reshard"), "reshard": keep["reshard"],
               "reshard-nocheck": keep["reshard"], "dcp": keep.get("dcp"),
               "dcp-threads": keep.get("dcp"), "torch-load": keep.get("torch-save"),
               "safetensors": keep.get("safetensors"), "tc": keep.get("tc") or keep.get("tc+sync")}
        src["reshard-verify-first"] = keep["reshard"] if cfg.get("verify_first") else None
        lm = [m for m in ranks.LOAD_METHODS if src.get(m) is not None and m not in cfg["skip"]
              and (peers or m.startswith("reshard") or (limits and m == "limit-read"))]
        for m in lm:
            self.tick(f"w{world} {backend}: load {m}")
            out = self.run(world, ranks.load, m, src[m], rep,
                           fp if m.startswith(("reshard", "dcp", "tc")) else None)
            self.record("load", m, world, backend, out)
        self.run(world, ranks.load, "reshard", keep["reshard"], 1, None)
        out = self.run(world, ranks.step_time)
        self.record("load", "first-step", world, backend, [{"rank": i, "own_s": [s], "total_s": [s]}
                                                          for i, s in enumerate(out)])
        self.run(world, ranks.release)
        # reshard to other layouts / world sizes (the source world's state released first)
        for target in cfg["reshard_to"]:
            tw = parse_layout(target).world or world
            if not get_scheme(backend).shared and tw != world:
                self.notes.append(f"memory://: --reshard-to {target} not measured ({tw} ranks are other "
                                  "processes, which do not see this one's memory)")
                continue
            self.reshard_to(world, backend, target, keep, fp)
        self._remove(keep, world)

    def overlap(self, world: int, backend: str, base: str, peers: bool, tc: bool) -> None:
        """The overlap phase (:mod:`reshard.bench.ranks_overlap`): K probed (or
        ``--overlap-k``), then the training loop checkpointing every K steps
        with each method, and the peak RSS of a save of the state with a
        budget of a quarter of it."""
        from . import ranks, ranks_overlap

        cfg = self.cfg
        self.tick(f"w{world} {backend}: overlap: the cadence K")
        k = cfg.get("overlap_k") or max(p["k"] for p in self.run(world, ranks_overlap.probe_k,
                                                                  base + "-probe"))
        methods = ["none"] + [m for m in ranks_overlap.OVERLAP_METHODS if m not in cfg["skip"] and (
            m.startswith("reshard") or (peers and not m.startswith("tc")) or (tc and m == "tc-async"))]
        if "dcp-async-process" in methods:
            try:
                self.run(world, ranks.warm, base + "-warm-process", ["dcp-async-process"])
            except BenchError as e:
                self.notes.append(f"overlap: dcp-async-process not measured (world {world}): {str(e)[:300]}")
                methods.remove("dcp-async-process")
                self.pool.restart(world)
                self.setup(world, cfg["layout"])
        for m in methods:
            self.tick(f"w{world} {backend}: overlap loop {m}")
            out = self.run(world, ranks_overlap.loop, m, base + "-ov", k, cfg.get("overlap_cycles", 3))
            if out[0].get("skipped"):
                self.notes.append(f"overlap (w{world}): {m} not measured: {out[0]['skipped']}")
                continue
            self.record("overlap", m, world, backend, out, k=k)
        self.run(world, ranks.end_dcp_process)
        self.tick(f"w{world} {backend}: overlap: a state four times the budget")
        self.record("overlap", "budget-rss", world, backend, self.run(world, ranks_overlap.budget_rss, base))
        self.run(world, ranks.trim)

    def tc_ready(self, world: int, base: str) -> bool:
        """Whether torch_checkpointing is measured in this world (installed and
        not skipped); its default O_DIRECT writer is tried first on every rank
        and, where it fails, its buffered writer is used (said in a note and in
        ``meta["torch_checkpointing"]``)."""
        from . import ranks

        if all(m in self.cfg["skip"] for m in ranks.TC_METHODS):
            return False
        if not ranks.tc_available():
            note = ("torch_checkpointing not installed: its columns are empty "
                    "(pip install torch-checkpointing)")
            if note not in self.notes:
                self.notes.append(note)
            return False
        out = self.run(world, ranks.tc_probe, base)
        direct = all(o["direct_io"] for o in out)
        self.tc_io[world] = {"direct_io": direct, "error": next((o["error"] for o in out if o["error"]), None)}
        if not direct:
            self.notes.append(f"torch_checkpointing (w{world}): its default O_DIRECT writer failed here "
                              f"({self.tc_io[world]['error']}); measured with its buffered writer")
        else:
            self.notes.append(f"torch_checkpointing (w{world}): measured with its default O_DIRECT writer")
        return True

    def _remove(self, keep: dict[str, str], world: int = 1) -> None:
        """Delete the kept checkpoints (memory://: in the workers of ``world``,
        the same group: a memory run never reshards to another world)."""
        from . import ranks

        for p in keep.values():
            if not scheme_of(p).shared:
                self.run(world, ranks.drop, p)
            elif not scheme_of(p).bare_paths:
                from ..storage import resolve

                st, key = resolve(p)
                st.delete_tree(key)
            else:
                shutil.rmtree(p, ignore_errors=True)

    def reshard_to(self, world: int, backend: str, target: str, keep: dict[str, str], fp: str) -> None:
        from . import ranks

        cfg = self.cfg
        spec = parse_layout(target)
        tw = spec.world or world
        self.ctx = f"w{world}->{target}: setup"
        if world in self.cold_root and tw in self.pool._groups:
            self.pool.restart(tw)  # the first load of freshly started processes, as the demo restores
        info = self.setup(tw, target)
        tag = f"{info[0]['layout']}<-{cfg['layout_of'][world]}"
        if world in self.cold_root:  # the demo's restore: CheckpointManager.restore, first call
            root, cfp = self.cold_root[world]
            out = self.run(tw, ranks.cold_restore, root, cfp)
            self.record("cold", "manager-restore", world, backend, out, target=tag, target_world=tw)
        for m, p in (("reshard", keep["reshard"]), ("reshard-nocheck", keep["reshard"]),
                     ("dcp", keep.get("dcp"))):
            if p is None or m in cfg["skip"]:
                continue
            self.tick(f"w{world}->{tag}: {m}")
            out = self.run(tw, ranks.load, m, p, cfg["repeat"], fp)
            self.record("reshard", m, world, backend, out, target=tag, target_world=tw)
        out = self.run(tw, ranks.step_time)
        self.record("reshard", "first-step", world, backend,
                    [{"rank": i, "own_s": [s], "total_s": [s]} for i, s in enumerate(out)],
                    target=tag, target_world=tw)
        self.run(tw, ranks.release)

    def close(self) -> None:
        self.pool.close()


def _phase_count(cfg: dict[str, Any]) -> int:
    per = 4 + 6 * cfg["repeat"] + 4 * cfg["repeat"] + 8 + 4 * len(cfg["reshard_to"])
    return per * len(cfg["worlds"]) * len(cfg["backends"])


def _notes(cfg: dict[str, Any]) -> list[str]:
    out = []
    if parse_layout(cfg["layout"]).kind == "grid":
        out.append(f"layout {cfg['layout']}: the demo trainer's state (manual TP views, GPipe stages, ZeRO-1 "
                   "moments, RNG, data cursor); DCP, torch.save and safetensors have no equivalent of it, "
                   "so only reshard and the limits are measured")
    if any(not get_scheme(b).shared for b in cfg["backends"]):
        out.append("memory://: the store keeps every checkpoint in the rank's own memory, so its peak extra "
                   "RSS counts the stored bytes (async_rss_over_state, async_rss_flat measure the store there, "
                   "not the staging buffers), and nothing is fsync'd")
    if "s3" in cfg["backends"]:
        out.append(f"s3 ({cfg['s3_endpoint'] or 'moto server on 127.0.0.1, started for this run'}): DCP, "
                   "torch.save and safetensors have no S3 writer; the limits are raw boto3 uploads and ranged "
                   "GETs of the same bytes on the same endpoint, with the backend's client, part and range "
                   "sizes. moto is a Python server on the ranks' cores: it, not the network, sets the pace")
    return out


def _exit_on_termination() -> dict[int, Any]:
    """SIGTERM and SIGHUP (a job scheduler's kill, a closed terminal) end the
    run the way Ctrl-C does: ``SystemExit(128 + signal)`` in the main thread,
    so the ranks, the S3 endpoint and the scratch checkpoints are removed
    (the default action ended this process at once and left them: 1.4 GB of
    scratch checkpoints for a 64 MiB synthetic model). During that cleanup
    (see :func:`run`) these and SIGINT are ignored. Returns the handlers to
    restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    ending = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if not ending.is_set():
            ending.set()
            raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def run(cfg: dict[str, Any], *, progress: bool, json_path: str | None = None,
        scratch_dir: str | None = None) -> dict[str, Any]:
    """Run every (backend, world) of ``cfg`` and return the document
    (``config``, ``meta``, ``notes``, ``summary``, ``records``); with
    ``json_path``, what is measured so far is written there after each world."""
    import psutil
    import torch

    import reshard

    from ..progress import bar
    from . import report

    meta = {"torch": torch.__version__, "reshard": reshard.__version__, "cpus": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
            "cuda": torch.cuda.is_available(), "loadavg_start": list(os.getloadavg())}
    scratch = tempfile.mkdtemp(prefix="reshard-bench-io-", dir=scratch_dir)
    if "save" in cfg["skip"]:
        cfg["skip"].add("load")  # the loads read the reshard save's checkpoint
    runner = Runner(cfg, progress)
    runner.notes.extend(_notes(cfg))
    t0 = time.perf_counter()
    wrote = False
    handlers = _exit_on_termination()
    try:
        for b in cfg["backends"]:  # before any rank starts: they inherit the variables (AWS_*)
            try:
                runner.stores[b] = start_test_store(b, scratch=scratch, endpoint=cfg["s3_endpoint"])
            except RuntimeError as e:
                raise BenchError(str(e), f"{b} endpoint") from e
        if progress:
            runner.bar = bar(_phase_count(cfg), "bench io", enabled=True, unit="phase")
        for b in cfg["backends"]:
            for w in cfg["worlds"]:
                if not get_scheme(b).shared and w > 1:  # reshard refuses storage the ranks do not share
                    runner.notes.append(f"memory://, world {w}: not measured (memory:// lives in one "
                                        "process; the ranks are separate processes, and every rank must "
                                        "see the same checkpoint; use local or s3)")
                    continue
                runner.world_run(w, b, scratch)
                if json_path:  # what is measured so far survives a later failure
                    with open(json_path, "w") as f:
                        json.dump({"config": {**cfg, "skip": sorted(cfg["skip"])}, "meta": meta,
                                   "notes": runner.notes, "partial": True, "records": runner.records},
                                  f, indent=1, default=str)
                    wrote = True
    except BenchError as e:
        e.partial_json = json_path if wrote else None
        raise
    finally:
        if handlers:  # the cleanup is not cut short by a second Ctrl-C (it left the scratch folder)
            handlers.setdefault(signal.SIGINT, signal.signal(signal.SIGINT, signal.SIG_IGN))
            for sig in handlers:
                signal.signal(sig, signal.SIG_IGN)
        try:
            if runner.bar is not None:
                runner.bar.close()
            runner.close()
            for ts in runner.stores.values():
                ts.close()
            shutil.rmtree(scratch, ignore_errors=True)
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
    meta["loadavg_end"] = list(os.getloadavg())
    meta["wall_s"] = time.perf_counter() - t0
    cfg["skip"] = sorted(cfg["skip"])
    summary = report.summarise(runner.records, cfg)
    if runner.tc_io:
        import importlib.metadata

        meta["torch_checkpointing"] = {"version": importlib.metadata.version("torch-checkpointing"),
                                       "io_by_world": {str(k): v for k, v in runner.tc_io.items()},
                                       "durable": "its save never fsyncs: tc+sync is its save then os.sync()"}
    return {"config": cfg, "meta": meta, "notes": runner.notes, "summary": summary,
            "records": runner.records}

