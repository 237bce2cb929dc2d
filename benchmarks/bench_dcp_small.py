"""Reading many small tensors from a PyTorch DCP checkpoint: ``reshard.load``
(through reshard.ondisk.dcp) against ``torch.distributed.checkpoint.load``.

One process; a DCP checkpoint of N float32 tensors of E elements each (the
shape of a model with many small parameters: norms, biases) written with
``dcp.save``; both loaders fill preallocated targets of the same shapes. The
two are timed alternately (warm page cache), medians of ``--repeat`` runs.

    python benchmarks/bench_dcp_small.py --tensors 20000 --elements 16 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--elements", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one reshard load")
    ap.add_argument("--threads", type=int, default=None, help="LoadOptions(threads=...) for reshard")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch.distributed.checkpoint as dcp

    import reshard

    warnings.simplefilter("ignore")
    src = {f"layers.{i}.w": torch.full((a.elements,), float(i)) for i in range(a.tensors)}
    d = tempfile.mkdtemp(prefix="bench-dcp-small-")
    dcp.save({"model": src}, checkpoint_id=d, no_dist=True)

    def dst() -> dict[str, torch.Tensor]:
        return {k: torch.empty(a.elements) for k in src}

    def run_dcp() -> float:
        sd = {"model": dst()}
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=d, no_dist=True)
        t = time.perf_counter() - t0
        assert torch.equal(sd["model"]["layers.7.w"], src["layers.7.w"])
        return t

    def run_reshard() -> float:
        sd = {"model": dst()}
        t0 = time.perf_counter()
        reshard.load(sd, d, options=None if a.threads is None else reshard.LoadOptions(threads=a.threads))
        t = time.perf_counter() - t0
        assert torch.equal(sd["model"]["layers.7.w"], src["layers.7.w"])
        return t

    run_dcp(), run_reshard()  # warm the page cache and imports
    if a.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        run_reshard()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    td, tr = [], []
    for _ in range(a.repeat):
        td.append(run_dcp())
        tr.append(run_reshard())
    md, mr = statistics.median(td), statistics.median(tr)
    out = {"tensors": a.tensors, "elements": a.elements, "dcp_load_s": md, "reshard_load_s": mr,
           "reshard_over_dcp": mr / md}
    print(f"{a.tensors} tensors x {a.elements} float32: dcp.load {md:.3f} s, reshard.load {mr:.3f} s "
          f"(median of {a.repeat}); reshard/dcp time = {mr / md:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
