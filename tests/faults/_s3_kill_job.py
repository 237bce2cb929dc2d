"""One rank of a 2-rank save job on S3 whose coordinator is SIGKILLed
(run as ``python _s3_kill_job.py RANK PORT KEY [WHEN]``; the AWS variables
come from the environment). WHEN "data" (default): rank 0 dies right after
its data object completed, so nothing discards the attempt; "publish": right
after its manifest put succeeded, before it released its lease. Rank 1 then
fails on the lost rank (or returns, if it already had its answer)."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import reshard
from reshard.faults.inject import Fault, FaultStorage
from reshard.storage.s3 import S3Storage


def main() -> int:
    rank, port, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=30))  # generous: a loaded CI machine
    when = sys.argv[4] if len(sys.argv) > 4 else "data"
    op, match = ("fsync", "att-*.data-*") if when == "data" else ("put_if_absent", "manifest.json")
    faults = [Fault(op=op, match=match, action="kill", after=True)] if rank == 0 else []
    w = torch.arange(64.0).reshape(8, 8)
    st = reshard.ShardedTensor("w", w[rank * 4:(rank + 1) * 4].clone(), global_shape=(8, 8),
                               global_offset=(rank * 4, 0))
    try:
        reshard.save({"w": st}, key, step=2, storage=FaultStorage(S3Storage(), faults))
    except Exception as e:  # noqa: BLE001 - the lost coordinator
        print(type(e).__name__, str(e)[:200])
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
