"""Core benchmark of reshard against baselines measured in the same run.

Not a test. Usage::

    python benchmarks/bench_core.py [--gib 1.0] [--tensor-mib 64] [--repeat 3] [--dir DIR] [--json PATH]
                                    [--skip-dcp] [--verify-first]

A thin caller of the ``reshard bench io`` engine (:mod:`reshard.bench.io`)
on its ``synthetic`` workload: square ``Linear`` layers of ``--tensor-mib``
MiB with their two AdamW moments (``--gib`` GiB of state in all), FSDP2 over
2 real gloo ranks, local disk. Measured there (min and median of
``--repeat``; GB = 1e9 bytes of logical state): saves with fsync
(``os.write`` + ``fsync`` of the same bytes per rank, ``reshard.save`` with
and without checksums, DCP ``save``), warm loads (single-thread ``preadv``
from the page cache, ``reshard.load`` with and without checksums and, with
``--verify-first``, ``LoadOptions(verify_first=True)``; DCP ``load``), the
peak extra RSS of a save and a load (and DCP's), every figure with its ratio
to the limit and to DCP. Here only: ``decode_manifest`` (parse + validate)
of a synthetic 100k-chunk manifest.

``--json`` holds the engine's document (``summary``, one record per phase)
plus ``manifest`` and ``save`` (the 2-rank save summary: ``save.reshard.median_s``
is what ``reshard advise --bench`` reads).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

MiB = 1 << 20


def manifest_bench(n_chunks: int = 100_000, per_tensor: int = 100, repeat: int = 5) -> dict[str, Any]:
    """Encode and time decode_manifest of a synthetic manifest of ``n_chunks`` chunks."""
    from reshard.ondisk.manifest import (
        Chunk,
        FileEntry,
        Manifest,
        TensorEntry,
        decode_manifest,
        encode_sealed,
    )

    ranks = per_tensor
    files = [f"data-r{r:05d}-0.safetensors" for r in range(ranks)]
    pos = [64] * ranks
    rows, isz = 64, 4
    tensors = {}
    for t in range(n_chunks // per_tensor):
        chunks = []
        for k in range(per_tensor):
            length = rows * 64 * isz
            chunks.append(Chunk(global_offset=(k * rows, 0), local_shape=(rows, 64), file=files[k],
                                offset=pos[k], length=length, checksums=(f"{(t * 131 + k):016x}",)))
            pos[k] += length
        tensors[f"model.layers.{t // 10}.mlp.w{t % 10}.weight"] = TensorEntry(
            dtype="float32", global_shape=(per_tensor * rows, 64), chunks=tuple(chunks))
    m = Manifest(attempt_id="bench", created_at=time.time(), world_size=ranks,
                 checksum_block_bytes=MiB, step=1, tensors=tensors,
                 files={f: FileEntry(size=pos[i], checksum=f"{i:016x}") for i, f in enumerate(files)})
    t0 = time.perf_counter()
    raw = encode_sealed(m)  # as a save publishes it: the read checks its seal
    enc = time.perf_counter() - t0
    secs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        decode_manifest(raw)
        secs.append(time.perf_counter() - t0)
    return {"chunks": sum(len(te.chunks) for te in tensors.values()), "tensors": len(tensors),
            "json_bytes": len(raw), "encode_s": enc, "decode_validate_s": secs,
            "decode_validate_median_s": statistics.median(secs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of state (parameters + 2 AdamW moments)")
    ap.add_argument("--tensor-mib", type=int, default=64, help="MiB per parameter tensor")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per method (min and median)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait after os.sync() before each timed save")
    ap.add_argument("--skip-dcp", action="store_true", help="do not run torch.distributed.checkpoint")
    ap.add_argument("--verify-first", action="store_true",
                    help="also time LoadOptions(verify_first=True)")
    a = ap.parse_args(argv)
    if a.gib <= 0 or a.tensor_mib <= 0:
        ap.error("--gib and --tensor-mib must be positive")
    import os

    from reshard.bench import io, report

    width = max(16, int(math.isqrt(a.tensor_mib * MiB // 4)))
    skip = {"async", "train", "torch-save", "torch-load", "safetensors", "dcp-threads"}
    cfg: dict[str, Any] = {
        "model": "synthetic", "worlds": [2], "layout": "fsdp", "reshard_to": [], "backends": ["local"],
        "s3_endpoint": None, "repeat": a.repeat, "synthetic_mib": a.gib * 1024 / 3,
        "synthetic_width": width, "seq_len": 16, "steps": 1, "settle": a.settle,
        "skip": skip | ({"dcp"} if a.skip_dcp else set()), "timeout": 1800.0, "layout_of": {},
        "argv": sys.argv[1:], "cpus": os.cpu_count(), "profile": None, "verify_first": a.verify_first,
    }
    doc = io.run(cfg, progress=sys.stderr.isatty(), scratch_dir=a.dir)
    doc["manifest"] = mb = manifest_bench()
    s = doc["summary"]["local/w2"]
    doc["save"] = s["save"]
    print(report.table(doc))
    print(f"manifest: {mb['chunks']} chunks / {mb['tensors']} tensors, "
          f"{mb['json_bytes'] / 1e6:.1f} MB JSON; decode+validate {mb['decode_validate_median_s'] * 1e3:.0f} ms "
          f"(target < 1 s), encode {mb['encode_s'] * 1e3:.0f} ms")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"results written to {a.json_path}")
    ok = all(e["fingerprint_ok"] for e in s["load"].values()) and s["ratios"].get("load_rss_within_target", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
