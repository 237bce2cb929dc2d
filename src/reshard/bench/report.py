"""Summary, terminal table and plot of ``reshard bench io`` records.

Conventions: a time of one measurement is the slowest rank's (barrier to
barrier); repeats give min and median; GB = 1e9 bytes of the logical state.
Ratios of saves and loads are *speed* ratios (``t_reference / t``: above 1 is
faster than the reference); ratios of stalls and training steps are *time*
ratios (``t / t_reference``: below 1 is shorter).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any

from . import targets

MiB = 1 << 20
GB = 1e9

NAMES = {
    "limit-write": "limit: os.write+fsync, 1 writer/rank", "reshard": "reshard.save",
    "reshard-nocheck": "reshard.save, no checksums", "dcp": "DCP save", "torch-save": "torch.save+fsync",
    "safetensors": "safetensors save_file+fsync", "memcpy": "limit: memcpy, preallocated",
    "reshard-async": "reshard.async_save", "dcp-async": "DCP async_save (thread)",
    "dcp-async-process": "DCP async_save (process, DefaultStager)",
    "tc": "torch_checkpointing save (no fsync)", "tc+sync": "torch_checkpointing save+os.sync()",
    "tc-async": "torch_checkpointing async save (process)",
}
LOAD_NAMES = {
    "limit-read": "limit: preadv page cache, 1 thread", "memcpy": "limit: memcpy, preallocated",
    "reshard": "reshard.load (checksums)", "reshard-nocheck": "reshard.load, no checksums",
    "reshard-verify-first": "reshard.load, verify_first",
    "dcp": "DCP load, 1 thread", "dcp-threads": "DCP load, all cores", "tc": "torch_checkpointing load",
    "torch-load": "torch.load(weights_only)+copy", "safetensors": "safetensors load_file+copy",
    "first-step": "first training step after load",
}
_COLD = {"first-save": "reshard.save", "manager-save": "then CheckpointManager.save",
         "manager-verify": "of which its post-commit smoke check (rank 0, again)",
         "manager-restore": "CheckpointManager.restore"}
#: the limits on S3 (raw boto3 calls on the same endpoint; see reshard.bench.objstore)
S3_NAMES = {"limit-write": "limit: boto3 PUT/multipart, 1 object/rank",
            "limit-read": "limit: boto3 ranged GETs into preallocated memory"}
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"seconds": xs, "min_s": min(xs) if xs else float("nan"), "median_s": _med(xs)}


def summarise(records: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per backend and world size: every method's min/median, bytes, per-rank
    figures, ratios to the limit and the peer, and the targets."""
    out: dict[str, Any] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["backend"], r["world"])].append(r)
    for (backend, world), recs in groups.items():
        s: dict[str, Any] = {"save": {}, "async": {}, "load": {}, "reshard": {}, "rss": {}, "cold": {},
                             "overlap": {}}
        setup = next(r for r in recs if r["phase"] == "setup")
        logical = setup["logical_bytes"]
        s["logical_bytes"] = logical
        s["local_bytes_per_rank"] = [p["local_bytes"] for p in setup["per_rank"]]
        s["tensors_per_rank"] = [p["tensors"] for p in setup["per_rank"]]
        s["params"] = setup["per_rank"][0]["params"]
        s["layout"] = setup["layout"]
        s["loadavg"] = [r["loadavg"][0] for r in recs]
        by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for r in recs:
            by[(r["phase"], r["method"] + ("@" + r["target"] if "target" in r else ""))].append(r)
        for (phase, m), rs in by.items():
            if phase == "save":
                xs = [max(p["total_s"] for p in r["per_rank"]) for r in rs]
                e = _stats(xs)
                e["gb_per_s"] = logical / GB / e["median_s"]
                last = rs[-1]
                e["per_rank"] = [{"rank": p["rank"], "bytes": p.get("bytes"), "own_s": p["own_s"],
                                  "timings": p.get("timings")} for p in last["per_rank"]]
                e["slowest_writer"] = max(last["per_rank"], key=lambda p: p["own_s"])["rank"]
                e["stored_bytes"] = last.get("stored_bytes")
                e["files"] = last.get("files") or sum(p.get("files", 0) for p in last["per_rank"])
                if last["per_rank"][0].get("timings"):
                    e["phases_s"] = {k: _med([max(p["timings"].get(k, 0.0) for p in r["per_rank"])
                                              for r in rs]) for k in ("stage", "plan", "write", "commit")}
                s["save"][m] = e
            elif phase == "async":
                st = [max(p["stall_s"] for p in r["per_rank"]) for r in rs]
                e = {"stall": _stats(st)}
                if "stall_cpu_s" in rs[0]["per_rank"][0]:  # the caller's CPU and page faults in the stall
                    e["cpu_s"] = min(max(p["stall_cpu_s"] for p in r["per_rank"]) for r in rs)
                    e["minflt_per_repeat"] = [max(p["minflt"] for p in r["per_rank"]) for r in rs]
                    e["minflt"] = min(e["minflt_per_repeat"])
                if "background_cpu_s" in rs[0]["per_rank"][0]:
                    e["background_cpu_s"] = _med([max(p["background_cpu_s"] for p in r["per_rank"]) for r in rs])
                if "background_s" in rs[0]["per_rank"][0]:
                    e["background"] = _stats([max(p["background_s"] for p in r["per_rank"]) for r in rs])
                    if rs[-1]["per_rank"][0].get("timings"):
                        e["phases_s"] = {k: max(p["timings"].get(k, 0.0) for p in rs[-1]["per_rank"])
                                         for k in ("stage", "checksum", "plan", "write", "commit")}
                s["async"][m] = e
            elif phase in ("load", "reshard"):
                r = rs[-1]
                n = len(r["per_rank"][0]["total_s"])
                xs = [max(p["total_s"][i] for p in r["per_rank"]) for i in range(n)]
                e = _stats(xs)
                if m.split("@")[0] != "first-step":
                    e["gb_per_s"] = logical / GB / e["median_s"]
                e["per_rank_own_s"] = [_med(p["own_s"]) for p in r["per_rank"]]
                if r["per_rank"][0].get("cpu_s"):  # process CPU seconds per rank (reader threads too)
                    e["cpu_s"] = max(min(p["cpu_s"]) for p in r["per_rank"])
                e["fingerprint_ok"] = all(p.get("fingerprint_ok", True) for p in r["per_rank"])
                tl = [p["timings"] for p in r["per_rank"] if p.get("timings")]
                if tl:
                    e["phases_s"] = {k: max(_med([t.get(k, 0.0) for t in p["timings"]])
                                            for p in r["per_rank"] if p.get("timings"))
                                     for k in ("manifest", "plan", "read", "place")}
                if "target" in r:
                    e["target"], e["target_world"] = r["target"], r["target_world"]
                s[phase][m] = e
            elif phase == "cold":  # one call each: the slowest rank's time
                s["cold"][m] = {"s": max(p["total_s"][0] for p in rs[-1]["per_rank"]),
                                "fingerprint_ok": all(p.get("fingerprint_ok", True) for p in rs[-1]["per_rank"])}
            elif phase == "rss" and m == "async-growth":
                r = rs[-1]
                g = max(r["per_rank"], key=lambda p: (p["rss_after"][-1] - p["rss_after"][0]) / p["rss_after"][0])
                first, last = g["rss_after"][0], g["rss_after"][-1]
                s["rss"][m] = {"saves": len(g["rss_after"]), "rss_first": first, "rss_last": last,
                               "growth_bytes": last - first, "growth": (last - first) / first,
                               "seconds": max(p["seconds"] for p in r["per_rank"]),
                               "rss_after_per_rank": [p["rss_after"] for p in r["per_rank"]]}
            elif phase == "rss":
                r = rs[-1]
                s["rss"][m] = {"extra_per_rank": [p["extra"] for p in r["per_rank"]],
                               "state_bytes_per_rank": [p["state_bytes"] for p in r["per_rank"]]}
            elif phase == "overlap" and m == "budget-rss":
                per = rs[-1]["per_rank"]
                worst = max(per, key=lambda p: max(p[k]["extra"] for k in ("default", "overlap")) - p["budget"])
                s["overlap"]["budget_rss"] = {
                    "budget": worst["budget"], "state_bytes": worst["state_bytes"], "rank": worst["rank"],
                    "extra": max(worst[k]["extra"] for k in ("default", "overlap")),
                    **{k: worst[k] for k in ("default", "overlap")},
                    "per_rank": [{k: p[k] for k in ("rank", "budget", "state_bytes", "default", "overlap")}
                                 for p in per]}
            elif phase == "overlap":
                per = rs[-1]["per_rank"]
                means = [statistics.fmean(p["steps_s"]) for p in per]
                stalls = [statistics.fmean(p["stalls_s"]) if p["stalls_s"] else 0.0 for p in per]
                s["overlap"].setdefault("methods", {})[m] = {
                    "k": rs[-1].get("k"), "steps": len(per[0]["steps_s"]), "saves": len(per[0]["stalls_s"]),
                    "step_mean_s": max(means), "step_median_s": max(_med(p["steps_s"]) for p in per),
                    "stall_mean_s": max(stalls), "stall_max_s": max(max(p["stalls_s"], default=0.0) for p in per),
                    "cpu_s": max(p["cpu_s"] for p in per), "loop_s": max(p["loop_s"] for p in per),
                    "peak_extra_rss": max(p["peak_extra_rss"] for p in per),
                    "per_rank": [{k: p[k] for k in ("rank", "steps_s", "stalls_s", "cpu_s", "loop_s",
                                                    "peak_extra_rss")} for p in per]}
            elif phase == "train":
                r = rs[-1]
                trows: list[dict[str, Any]] = []
                for p in r["per_rank"]:
                    base = _med(p["no_save"])
                    trows.append({"no_save_s": base, **{k: {"median_s": _med(v), "ratio": _med(v) / base,
                                                           "steps": len(v), "save_s": p["save_s"][k]}
                                                       for k, v in p["during"].items()}})
                s["train"] = {"per_rank": trows, **{f"{k}_ratio": max(x[k]["ratio"] for x in trows)
                                                   for k in r["per_rank"][0]["during"]}}
                if "save_cpu_s" in r["per_rank"][0]:  # the save's CPU beside the steps' extra time
                    for k in r["per_rank"][0]["during"]:
                        # per save: the steps' time beyond as many steps with no save (their median)
                        def extra(p: dict[str, Any], k: str = k) -> float:
                            return (sum(p["during"][k]) - len(p["during"][k]) * _med(p["no_save"])) / max(
                                1, len(p["save_cpu_s"][k]))
                        worst = max(r["per_rank"], key=extra)
                        cpu = sum(worst["save_cpu_s"][k]) / max(1, len(worst["save_cpu_s"][k]))
                        s["train"][f"{k}_cpu"] = {
                            "save_cpu_s": cpu, "extra_s": extra(worst),
                            "step_cpu_s": _med(worst["no_save_cpu"]),
                            "step_cpu_during_s": _med(worst["during_cpu"][k]), "rank": worst["rank"],
                            "save_cpu_s_per_gb": cpu / (worst["state_bytes"] / GB)}
        rss_after = [r["rss_after"] for r in recs if r.get("rss_after") and "target" not in r]
        if rss_after:
            s["rss_after_max_per_rank"] = [max((x[i] or 0) for x in rss_after if len(x) > i)
                                           for i in range(max(len(x) for x in rss_after))]
        om = s["overlap"].get("methods", {})
        if "none" in om:  # each method against the loop without checkpoints
            base = om["none"]
            for e in om.values():
                e["ratio"] = e["step_mean_s"] / base["step_mean_s"]
                e["save_cpu_per_ckpt_s"] = max(0.0, e["cpu_s"] - base["cpu_s"]) / max(1, e["saves"])
        s["world"], s["cpus"] = world, cfg.get("cpus")
        s["ratios"] = _ratios(s)
        s["targets"] = targets.evaluate(s, world)
        out[f"{backend}/w{world}"] = s
    return out


def _t(s: dict[str, Any], phase: str, m: str) -> float | None:
    e = s[phase].get(m)
    return None if e is None else e["median_s"]


def _ratios(s: dict[str, Any]) -> dict[str, Any]:
    r: dict[str, Any] = {}
    sv, lim, dcp = _t(s, "save", "reshard"), _t(s, "save", "limit-write"), _t(s, "save", "dcp")
    if sv and lim:
        r["save_vs_limit"] = lim / sv
    if sv and dcp:
        r["save_vs_dcp"] = dcp / sv
    tcs = _t(s, "save", "tc+sync")  # durable, as reshard's save is
    if sv and tcs:
        r["save_vs_tc"] = tcs / sv
    a = s["async"]
    if "reshard-async" in a and "tc-async" in a:
        r["stall_vs_tc"] = a["reshard-async"]["stall"]["median_s"] / a["tc-async"]["stall"]["median_s"]
    if "reshard-async" in a and "memcpy" in a:
        r["stall_vs_memcpy"] = a["reshard-async"]["stall"]["median_s"] / a["memcpy"]["stall"]["median_s"]
    if "reshard-async" in a and "dcp-async" in a:
        r["stall_vs_dcp"] = a["reshard-async"]["stall"]["median_s"] / a["dcp-async"]["stall"]["median_s"]
    if "train" in s and "reshard-async_ratio" in s["train"]:
        r["step_slowdown"] = s["train"]["reshard-async_ratio"]
    ld, lr = _t(s, "load", "reshard"), _t(s, "load", "limit-read")
    dl = [x for x in (_t(s, "load", "dcp"), _t(s, "load", "dcp-threads")) if x]
    if ld and lr:
        r["load_vs_limit"] = lr / ld
    nc = _t(s, "load", "reshard-nocheck")
    if nc and lr:
        r["load_nocheck_vs_limit"] = lr / nc
    if ld and dl:
        r["load_vs_dcp"] = min(dl) / ld
    tl = _t(s, "load", "tc")
    if ld and tl:
        r["load_vs_tc"] = tl / ld
    if sv and _t(s, "save", "reshard-nocheck"):
        r["checksum_cost_save"] = sv / _t(s, "save", "reshard-nocheck")  # type: ignore[operator]
    if ld and nc:
        r["checksum_cost_load"] = ld / nc
    rss = s["rss"]
    if "load" in rss:
        worst = max((e[0] - (0.10 * b + 64 * MiB)) for e, b in
                    zip(rss["load"]["extra_per_rank"], s["local_bytes_per_rank"], strict=False))
        r["load_rss_within_target"] = worst <= 0
    if "async-save" in rss:
        ex = rss["async-save"]["extra_per_rank"]
        r["async_rss_over_state"] = max(e[0] / b for e, b in zip(ex, s["local_bytes_per_rank"], strict=False))
        r["async_rss_flat"] = all(x <= 32 * MiB for e in ex for x in e[1:])  # no growth after the first
    return r


def _fmt_s(x: float | None) -> str:
    return "" if x is None or x != x else f"{x:.3f}"


def table(doc: dict[str, Any]) -> str:
    """The terminal report."""
    cfg, meta = doc["config"], doc["meta"]
    lines = [f"reshard bench io: {cfg['model']}, layout {cfg['layout']}, worlds {cfg['worlds']}, "
             f"backends {cfg['backends']}, repeat {cfg['repeat']} (min / median); {meta['cpus']} CPUs, "
             f"torch {meta['torch']}, CUDA {'yes' if meta['cuda'] else 'no (no device->host figure)'}; "
             f"load average {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}; "
             f"{meta['wall_s']:.0f} s; GB = 1e9 B"]
    for key, s in doc["summary"].items():
        lb = s["logical_bytes"]
        s3 = key.startswith("s3/")
        names = {**NAMES, **S3_NAMES} if s3 else NAMES
        lnames = {**LOAD_NAMES, **S3_NAMES} if s3 else LOAD_NAMES
        lines.append("")
        lines.append(f"== {key} ({s['layout']}): {s['params'] / 1e6:.1f}M params, logical state "
                     f"{lb / GB:.3f} GB, {s['tensors_per_rank'][0]} tensors on rank 0, per rank "
                     f"{', '.join(f'{b / MiB:.0f}' for b in s['local_bytes_per_rank'])} MiB; load average "
                     f"{min(s['loadavg']):.1f}-{max(s['loadavg']):.1f}")
        rows: list[tuple[str, ...]] = []
        sv = s["save"]
        lim, dcp, tcs = _t(s, "save", "limit-write"), _t(s, "save", "dcp"), _t(s, "save", "tc+sync")
        if sv:
            rows.append(("save (durable)" if s3 else "save (in memory)" if key.startswith("memory/") else
                         "save (fsync)", "min s", "med s", "GB/s", "x limit",
                         "x DCP", "x TC", ""))
        for m, e in sv.items():
            extra = []
            if e.get("stored_bytes"):
                extra.append(f"stored {e['stored_bytes'] / MiB:.0f} MiB in {e['files']} files")
            if e.get("phases_s"):
                extra.append("stage/plan/write/commit " + "/".join(f"{v:.2f}" for v in e["phases_s"].values()))
            extra.append(f"slowest writer r{e['slowest_writer']}")
            rows.append((f"  {names.get(m, m)}", _fmt_s(e["min_s"]), _fmt_s(e["median_s"]),
                         f"{e['gb_per_s']:.2f}", _ratio(lim, e["median_s"]), _ratio(dcp, e["median_s"]),
                         _ratio(tcs, e["median_s"]), "; ".join(extra)))
        a = s["async"]
        if a:
            mc = a.get("memcpy", {}).get("stall", {}).get("median_s")
            dc = a.get("dcp-async", {}).get("stall", {}).get("median_s")
            tca = a.get("tc-async", {}).get("stall", {}).get("median_s")
            rows.append(("async: stall", "min s", "med s", "bg s", "x memcpy", "x DCP", "x TC", "(time ratios)"))
            for m, e in a.items():
                bg = e.get("background", {}).get("median_s")
                ph = e.get("phases_s")
                rows.append((f"  {NAMES.get(m, m)}", _fmt_s(e["stall"]["min_s"]), _fmt_s(e["stall"]["median_s"]),
                             _fmt_s(bg), _ratio(e["stall"]["median_s"], mc, inv=True),
                             _ratio(e["stall"]["median_s"], dc, inv=True),
                             _ratio(e["stall"]["median_s"], tca, inv=True),
                             "" if not ph else "background checksum/plan/write/commit " +
                             "/".join(f"{ph[k]:.2f}" for k in ("checksum", "plan", "write", "commit"))))
        ld = s["load"]
        if ld:
            lr = _t(s, "load", "limit-read")
            dl = min([x for x in (_t(s, "load", "dcp"), _t(s, "load", "dcp-threads")) if x] or [float("nan")])
            tl = _t(s, "load", "tc")
            rows.append(("load" if s3 else "warm load", "min s", "med s", "GB/s", "x limit", "x DCP", "x TC", ""))
            if "memcpy" in a:  # the limit of a load from memory: the memcpy of the async phase
                e = a["memcpy"]["stall"]
                rows.append((f"  {lnames['memcpy']}", _fmt_s(e["min_s"]), _fmt_s(e["median_s"]),
                             f"{s['logical_bytes'] / GB / e['median_s']:.2f}", _ratio(lr, e["median_s"]), "", "",
                             "(the async phase's copy)"))
            for m, e in ld.items():
                ph = e.get("phases_s")
                note = "" if not ph else "manifest/plan/read/place " + "/".join(f"{v:.3f}" for v in ph.values())
                if not e["fingerprint_ok"]:
                    note += " STATE DIFFERS"
                rows.append((f"  {lnames.get(m, m)}", _fmt_s(e["min_s"]), _fmt_s(e["median_s"]),
                             f"{e['gb_per_s']:.2f}" if "gb_per_s" in e else "",
                             "" if m == "first-step" else _ratio(lr, e["median_s"]),
                             "" if m == "first-step" else _ratio(dl, e["median_s"]),
                             "" if m == "first-step" else _ratio(tl, e["median_s"]), note))
        for m, e in s["reshard"].items():
            name, _, tgt = m.partition("@")
            rows.append((f"  reshard {tgt}: {lnames.get(name, name)}", _fmt_s(e["min_s"]),
                         _fmt_s(e["median_s"]), f"{e['gb_per_s']:.2f}" if "gb_per_s" in e else "", "", "", "",
                         ("state equal" if e["fingerprint_ok"] else "STATE DIFFERS") if name != "first-step" else ""))
        lines.extend(_grid(rows))
        if s.get("cold"):
            lines.append("first calls in freshly started processes (no warm-up): " + "; ".join(
                f"{_COLD.get(m.split('@')[0], m)}{' into ' + m.split('@')[1].split('<-')[0] if '@' in m else ''} "
                f"{e['s']:.2f} s{'' if e['fingerprint_ok'] else ' STATE DIFFERS'}" for m, e in s["cold"].items()))
        if "train" in s:
            tr = s["train"]
            r0 = tr["per_rank"][0]
            parts = [f"no save {r0['no_save_s'] * 1e3:.0f} ms"]
            for k in ("reshard-async", "dcp-async"):
                if k in r0:
                    parts.append(f"during {NAMES[k]} {r0[k]['median_s'] * 1e3:.0f} ms (x{tr[k + '_ratio']:.2f} "
                                 f"worst rank, {r0[k]['steps']} steps, save {r0[k]['save_s']:.2f} s)")
            lines.append("training step (rank 0): " + "; ".join(parts))
        lines.extend(overlap_lines(s))
        rss = {m: v for m, v in s["rss"].items() if "extra_per_rank" in v}
        if rss:
            lines.append("peak extra RSS per rank (MiB): " + "; ".join(
                f"{m} [" + ", ".join("/".join(f"{x / MiB:.0f}" for x in e) for e in v["extra_per_rank"]) + "]"
                for m, v in rss.items()))
        a = s["async"].get("reshard-async", {})
        if "minflt_per_repeat" in a:
            lines.append("page faults of the process during each async stall (after the staging pool "
                         "is filled: reused buffers fault none): "
                         + ", ".join(map(str, a["minflt_per_repeat"]))
                         + f"; memcpy {s['async'].get('memcpy', {}).get('minflt', '')}")
        hi = s.get("rss_after_max_per_rank")
        if hi:
            lines.append("resident memory per rank, highest after any phase (MiB): "
                         + ", ".join(f"{x / MiB:.0f}" for x in hi))
        lines.extend(target_lines(s, cfg["repeat"]))
    if doc.get("demo"):
        lines.extend(demo_lines(doc["demo"]))
    for n in doc["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


#: the overlap phase's methods, as the table names them
OVERLAP_NAMES = {"none": "no checkpoint", "reshard-async": "reshard.async_save (default mode)",
                 "reshard-overlap": "reshard.async_save (overlap mode)",
                 "reshard-overlap-split": "reshard overlap, step and save on their own cores",
                 "dcp-async": "DCP async_save (thread)", "dcp-async-process": "DCP async_save (process, DefaultStager)",
                 "tc-async": "torch_checkpointing async save (process)"}


def overlap_lines(s: dict[str, Any]) -> list[str]:
    """The overlap phase's block: per method the loop's mean step time and its
    ratio to the loop without checkpoints, the visible stall per checkpoint,
    the save's CPU per checkpoint, the loop's peak extra RSS; then the save
    of a state four times its budget."""
    ov = s.get("overlap") or {}
    om = ov.get("methods")
    out: list[str] = []
    if om:
        k = next(iter(om.values()))["k"]
        rows: list[tuple[str, ...]] = [(f"training loop, checkpoint every K={k} steps", "step ms", "x none",
                                        "stall ms", "max ms", "save CPU s", "RSS MiB",
                                        "(mean step; visible stall per checkpoint; peak extra RSS)")]
        for m, e in om.items():
            rows.append((f"  {OVERLAP_NAMES.get(m, m)}", f"{e['step_mean_s'] * 1e3:.0f}",
                         f"{e.get('ratio', float('nan')):.2f}",
                         "" if m == "none" else f"{e['stall_mean_s'] * 1e3:.0f}",
                         "" if m == "none" else f"{e['stall_max_s'] * 1e3:.0f}",
                         "" if m == "none" else f"{e.get('save_cpu_per_ckpt_s', 0.0):.2f}",
                         f"{e['peak_extra_rss'] / MiB:.0f}",
                         f"{e['steps']} steps, {e['saves']} checkpoints; loop CPU {e['cpu_s']:.1f} s"))
        out.extend(_grid(rows))
    b = ov.get("budget_rss")
    if b:
        out.append(f"a state four times the staging budget (rank {b['rank']}: {b['state_bytes'] / MiB:.0f} MiB, budget "
                   f"{b['budget'] / MiB:.0f} MiB): peak extra RSS of a save {b['default']['extra'] / MiB:.0f} MiB "
                   f"(default mode, stall {b['default']['stall_s']:.2f} s), {b['overlap']['extra'] / MiB:.0f} MiB "
                   f"(overlap mode, visible stall {b['overlap']['stall_s']:.2f} s); staging slabs at most "
                   f"{max(b['default']['staging_peak'], b['overlap']['staging_peak']) / MiB:.0f} MiB")
    return out


def state_mismatches(doc: dict[str, Any]) -> list[str]:
    """Every load of the run whose state differed from the saved one
    (``"<backend>/w<N> <phase> <method>[@<target>]"``): the bench checks each
    load bit for bit, and ``reshard bench io`` exits 1 when this is not empty."""
    return [f"{key} {phase} {m}" for key, s in doc["summary"].items()
            for phase in ("load", "reshard", "cold") for m, e in s.get(phase, {}).items()
            if not e.get("fingerprint_ok", True)]


def target_lines(s: dict[str, Any], repeat: int) -> list[str]:
    """The targets block of one world's table: each target's measured ratio
    (minima of the repeats), goal and verdict, and beside a missed (or
    reported) one the measured figures that bound it."""
    la = s.get("loadavg") or [float("nan")]
    out = [f"targets (ratios of the minimum of {repeat} repeat(s); load average {min(la):.1f}-{max(la):.1f}):"]
    rows = [(e["target"], targets.fmt(e), e["what"], e["detail"] if e["verdict"] != "met" else "")
            for e in s.get("targets", [])]
    w0 = max((len(r[0]) for r in rows), default=0)
    w1 = max((len(r[1]) for r in rows), default=0)
    for k, v, what, bound in rows:
        out.append(f"  {k:{w0}}  {v:{w1}}  {what}" + (f"; bound: {bound}" if bound else ""))
    return out


def _ratio(ref: float | None, t: float | None, inv: bool = False) -> str:
    if not ref or not t or ref != ref or t != t:
        return ""
    return f"{(ref / t):.2f}"


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    if not rows:
        return []
    w = [max(len(r[i]) for r in rows) for i in range(7)]
    out = []
    for r in rows:
        out.append(f"{r[0]:{w[0]}}  " + "  ".join(f"{c:>{w[i]}}" for i, c in enumerate(r[1:7], 1))
                   + (f"  {r[7]}" if r[7] else ""))
    return out


def plot(doc: dict[str, Any], path: str) -> None:
    """PNG: per-rank timelines of the last reshard save (stage, plan, write,
    commit) and load (manifest, plan, read, place) of each world size, and of
    the load into the first ``--reshard-to`` layout where there is one; GB/s
    over world sizes per backend and the async stalls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = doc["summary"]
    keys = list(summ)
    cols = 3 if any(s["reshard"] for s in summ.values()) else 2
    fig, axes = plt.subplots(len(keys) + 1, cols, figsize=(6.5 * cols, 2.6 * (len(keys) + 1)), squeeze=False)
    if cols == 3:
        axes[-1][2].axis("off")
    colors = {"stage": "#8c564b", "plan": "#1f77b4", "write": "#d62728", "commit": "#2ca02c",
              "manifest": "#9467bd", "read": "#ff7f0e", "place": "#17becf", "checksum": "#7f7f7f"}
    for row, key in enumerate(keys):
        s = summ[key]
        tgt = next((m for m in s["reshard"] if m.startswith("reshard@")), None)
        cells = [("save", "reshard", ("stage", "plan", "write", "commit")),
                 ("load", "reshard", ("manifest", "plan", "read", "place"))]
        if cols == 3:
            cells.append(("reshard", tgt or "", ("manifest", "plan", "read", "place")))
        for col, (phase, m, parts) in enumerate(cells):
            ax = axes[row][col]
            e = s[phase].get(m)
            ax.set_title(f"{key}: reshard {phase} per rank" if phase != "reshard" else
                         f"{key}: load into {m.split('@')[-1].split('<-')[0]} per rank", fontsize=9)
            if e is None:
                ax.text(0.5, 0.5, "not measured", ha="center")
                continue
            timings = ([p["timings"] for p in e["per_rank"]] if phase == "save" else
                       _load_timings(doc, key, phase, e.get("target")))
            for r, t in enumerate(timings):
                x = 0.0
                for k in parts:
                    v = (t or {}).get(k, 0.0)
                    ax.barh(r, v, left=x, color=colors[k],
                            label=(k if k != "commit" else "commit (finalize)") if r == 0 else None)
                    x += v
            ax.set_yticks(range(len(timings)), [f"rank {i}" for i in range(len(timings))])
            ax.set_xlabel("seconds")
            ax.legend(fontsize=7, loc="lower right")
    ax = axes[-1][0]
    for backend in sorted({k.split("/")[0] for k in keys}):
        ws = sorted(int(k.split("/w")[1]) for k in keys if k.startswith(backend + "/"))
        for phase, m, style in (("save", "reshard", "-o"), ("save", "limit-write", "--^"), ("save", "dcp", ":x"),
                                ("load", "reshard", "-s"), ("load", "limit-read", "--v"), ("load", "dcp", ":+")):
            ys = [summ[f"{backend}/w{w}"][phase].get(m, {}).get("gb_per_s", float("nan")) for w in ws]
            if any(y == y for y in ys):
                ax.plot(ws, ys, style, label=f"{backend} {phase} {m}")
    ax.set_xticks(sorted({int(k.split("/w")[1]) for k in keys}))
    ax.set_xlabel("world size")
    ax.set_ylabel("GB/s of logical state")
    ax.set_title("scaling over world sizes and backends", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    ax = axes[-1][1]
    for key in keys:
        a = summ[key]["async"]
        names = [m for m in a]
        ax.bar([f"{key}\n{m}" for m in names], [a[m]["stall"]["median_s"] for m in names])
    ax.set_ylabel("foreground stall, s")
    ax.tick_params(axis="x", labelsize=5, rotation=60)
    ax.set_title("async save stall", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_timings(doc: dict[str, Any], key: str, phase: str = "load",
                  target: str | None = None) -> list[dict[str, float]]:
    """Each rank's phase timings of the last reshard load of run ``key``
    (``"local/w2"``); for ``phase="reshard"``, of the load into ``target``
    (``"fsdp1<-fsdp2"``; the record's own target, not the last one's)."""
    backend, w = key.split("/w")
    for r in reversed(doc["records"]):
        if (r["phase"], r["method"], r["backend"], str(r["world"]), r.get("target")) == (
                phase, "reshard", backend, w, target):
            return [p["timings"][-1] if p.get("timings") else {} for p in r["per_rank"]]
    return []


# ------------------------------------------------------------------ the demo's figures beside the bench's
_DEMO_HEAD = re.compile(r"layout A \((?P<a>[^)]*)\) -> layout B \((?P<b>[^)]*)\)")
_DEMO_SAVE = re.compile(r"^\s*save: (?P<mib>[\d.]+) MiB in (?P<files>\d+) files, (?P<s>[\d.]+) s")
_DEMO_RESTORE = re.compile(r"restored step \d+ from .* in (?P<s>[\d.]+) s, (?P<mib>[\d.]+) MiB read by "
                           r"(?P<n>\d+) ranks")

#: what differs between the demo's timings and the bench's (the report names them beside a ratio)
DEMO_DIFFERENCES = (
    "the demo times one save per checkpoint through CheckpointManager, whose rank 0 runs a post-commit "
    "smoke check (a trial load with checksums), retention and gc inside save (--cold measures "
    "CheckpointManager.save beside reshard.save in the same fresh processes); each demo save is the first "
    "of its step, with no warm-up call; its restore is the first load of freshly started processes, timed "
    "once; the bench's figures are medians of repeated calls after an untimed one, on a quiet disk "
    "(os.sync before each save)")


def parse_demo_report(text: str) -> dict[str, Any]:
    """The figures of a ``reshard demo`` report.txt: ``layout_a``, ``layout_b``
    (the trainer's ``pp,dp,tp`` spelling), ``saves`` (``[{"mib", "files",
    "s"}]``, layout A) and ``restore`` (``{"s", "mib", "ranks"}``).

    Raises:
        ValueError: the text is not a demo report (no layout line, or no save).
    """
    head = _DEMO_HEAD.search(text)
    saves = [{"mib": float(m["mib"]), "files": int(m["files"]), "s": float(m["s"])}
             for m in (_DEMO_SAVE.match(ln) for ln in text.splitlines()) if m]
    if head is None or not saves:
        raise ValueError("not a `reshard demo` report (no 'layout A (...) -> layout B (...)' line or "
                         "no 'save: ... MiB in ... files, ... s' line)")
    r = _DEMO_RESTORE.search(text)
    return {"layout_a": head["a"], "layout_b": head["b"], "saves": saves,
            "restore": None if r is None else {"s": float(r["s"]), "mib": float(r["mib"]),
                                               "ranks": int(r["n"])}}


def demo_compare(doc: dict[str, Any], demo: dict[str, Any]) -> dict[str, Any]:
    """Ratios of the demo's save and restore times to the bench's for the
    same state and layouts: ``save_ratio`` (median demo save / median
    ``reshard.save``), ``restore_ratio`` (demo restore / the bench's
    ``--reshard-to`` load into layout B, checksums on), ``within_2x`` and the
    differences that explain a ratio above 2."""
    key = next((k for k, s in doc["summary"].items()
                if k.startswith("local/") and s["layout"] == demo["layout_a"]), None)
    out: dict[str, Any] = {"demo": demo, "bench": key}
    if key is None:
        out["why"] = (f"no local run of layout {demo['layout_a']} in this bench (run it with "
                      f"--layout {demo['layout_a']} --reshard-to {demo['layout_b']})")
        return out
    s = doc["summary"][key]
    ds = _med([x["s"] for x in demo["saves"]])
    bs = s["save"].get("reshard", {}).get("median_s")
    if bs:
        out["save_ratio"] = ds / bs
        out["save_demo_s"], out["save_bench_s"] = ds, bs
        out["stored_mib_demo"] = _med([x["mib"] for x in demo["saves"]])
        out["stored_mib_bench"] = (s["save"]["reshard"].get("stored_bytes") or 0) / MiB
        # another model or size (the demo's --preset/--size vs --model): the ratios compare two states
        out["same_state"] = abs(out["stored_mib_demo"] - out["stored_mib_bench"]) <= 0.1 * max(
            out["stored_mib_demo"], out["stored_mib_bench"])
    rb = s["reshard"].get(f"reshard@{demo['layout_b']}<-{demo['layout_a']}", {}).get("median_s")
    if demo["restore"] and rb:
        out["restore_ratio"] = demo["restore"]["s"] / rb
        out["restore_demo_s"], out["restore_bench_s"] = demo["restore"]["s"], rb
    cold = s.get("cold", {})
    if "first-save" in cold:
        out["cold_save_s"] = cold["first-save"]["s"]
        out["cold_manager_save_s"] = cold["manager-save"]["s"]
        out["cold_manager_verify_s"] = cold.get("manager-verify", {}).get("s")
        out["save_ratio_cold"] = ds / max(cold["first-save"]["s"], 1e-9)
    cl = cold.get(f"manager-restore@{demo['layout_b']}<-{demo['layout_a']}")
    if cl and demo["restore"]:
        out["cold_restore_s"] = cl["s"]
        out["restore_ratio_cold"] = demo["restore"]["s"] / max(cl["s"], 1e-9)
    ratios = [out[k] for k in ("save_ratio", "restore_ratio") if k in out]
    out["within_2x"] = bool(ratios) and all(0.5 <= x <= 2.0 for x in ratios)
    if out.get("same_state") is False:
        out["why"] = (f"not the same state: the demo saved {out['stored_mib_demo']:.1f} MiB, this bench "
                      f"{out['stored_mib_bench']:.1f} MiB (run the bench with the demo's model: --model "
                      "bert-minilm for --preset bert --size full)")
    elif not out["within_2x"]:
        out["why"] = DEMO_DIFFERENCES
    return out


def demo_lines(cmp: dict[str, Any]) -> list[str]:
    """The terminal lines of :func:`demo_compare`."""
    d = cmp["demo"]
    lines = [f"demo report ({d['layout_a']} -> {d['layout_b']}) beside this bench ({cmp['bench']}):"]
    if "save_ratio" in cmp:
        lines.append(f"  save: demo {cmp['save_demo_s']:.2f} s ({cmp['stored_mib_demo']:.1f} MiB), bench "
                     f"reshard.save {cmp['save_bench_s']:.2f} s ({cmp['stored_mib_bench']:.1f} MiB): "
                     f"demo/bench x{cmp['save_ratio']:.2f}")
    if "restore_ratio" in cmp:
        lines.append(f"  restore into {d['layout_b']}: demo {cmp['restore_demo_s']:.2f} s, bench "
                     f"{cmp['restore_bench_s']:.2f} s: demo/bench x{cmp['restore_ratio']:.2f}")
    if "save_ratio_cold" in cmp:
        lines.append(f"  first calls in fresh processes (--cold): save {cmp['cold_save_s']:.2f} s (demo/cold "
                     f"x{cmp['save_ratio_cold']:.2f}), then CheckpointManager.save {cmp['cold_manager_save_s']:.2f} s"
                     + ("" if cmp.get("cold_manager_verify_s") is None else
                        f" (its post-commit smoke check on rank 0 alone: {cmp['cold_manager_verify_s']:.2f} s)"))
    if "restore_ratio_cold" in cmp:
        lines.append(f"  CheckpointManager.restore into {d['layout_b']}, the first call of fresh processes: "
                     f"{cmp['cold_restore_s']:.2f} s "
                     f"(demo/cold x{cmp['restore_ratio_cold']:.2f})")
    if "within_2x" in cmp:
        lines.append(f"  within 2x: {'yes' if cmp['within_2x'] else 'NO'}"
                     + (" (of different states)" if cmp.get("same_state") is False else ""))
    if cmp.get("why"):
        lines.append(f"  why: {cmp['why']}")
    return lines
