"""S3 benchmark against a loopback endpoint (moto's server), baselines in the same run.

Not a test. Usage::

    python benchmarks/bench_s3.py [--mib 128] [--repeat 3] [--json PATH]

Starts moto's S3 server on 127.0.0.1 (and the fault proxy, to count bytes),
then measures, for ``--mib`` MiB of float32 state (MB = 1e6 bytes):

* clients (the choice of the backend's client): a multipart upload of the
  bytes (8 MiB parts, 8 in parallel) and parallel ranged GETs of the same
  bytes (8 MiB ranges, 8 in parallel) with boto3 (s3transfer upload_fileobj /
  threads of get_object), s3fs (``pipe`` / ``cat_ranges``) and obstore
  (``put`` with ``max_concurrency`` / ``get_ranges``): MB/s and CPU seconds
  per GB of this process (the server's CPU is not counted);
* ``reshard.save`` (checksums on) of the state as a ratio to the plain
  boto3 multipart upload of the same bytes, and ``reshard.load`` (checksums
  on) as a ratio to the plain parallel ranged download (goal >= 0.8x);
* a load of a quarter of one tensor: bytes fetched, counted at the proxy.

The server is Python: on loopback it, not the network, is the bottleneck,
so absolute figures are low; the ratios compare clients and code paths on
the same endpoint in the same run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import reshard
from reshard.testing.s3proxy import FaultProxy
from reshard.testing.s3server import S3Server

MiB = 1 << 20
PART = 8 * MiB
BUCKET = "bench"


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_clients(srv: S3Server, data: bytes, repeat: int) -> dict[str, dict[str, float]]:
    import boto3
    import obstore
    import s3fs
    from boto3.s3.transfer import TransferConfig
    from obstore.store import S3Store

    n = len(data)
    starts = list(range(0, n, PART))
    ends = [min(s + PART, n) for s in starts]
    c = boto3.client("s3", endpoint_url=srv.url, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1")
    tc = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=srv.url,
                           client_kwargs={"region_name": "us-east-1"})
    ob = S3Store(BUCKET, endpoint=srv.url, access_key_id="testing", secret_access_key="testing",
                 region="us-east-1", client_options={"allow_http": True})

    def boto_get() -> None:
        buf = bytearray(n)

        def one(i: int) -> None:
            r = c.get_object(Bucket=BUCKET, Key="clients/boto3", Range=f"bytes={starts[i]}-{ends[i] - 1}")
            buf[starts[i]:ends[i]] = r["Body"].read()

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, range(len(starts))))

    cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "boto3": (lambda: c.upload_fileobj(io.BytesIO(data), BUCKET, "clients/boto3", Config=tc),
                  boto_get),
        "s3fs": (lambda: fs.pipe(f"{BUCKET}/clients/s3fs", data, chunksize=PART),
                 lambda: fs.cat_ranges([f"{BUCKET}/clients/s3fs"] * len(starts), starts, ends)),
        "obstore": (lambda: obstore.put(ob, "clients/obstore", data, chunk_size=PART,
                                        max_concurrency=8),
                    lambda: obstore.get_ranges(ob, "clients/obstore", starts=starts, ends=ends)),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (put, get) in cases.items():
        up = _median([_timed(put) for _ in range(repeat)])
        down = _median([_timed(get) for _ in range(repeat)])
        out[name] = {"upload_MB_s": n / 1e6 / up[0], "upload_cpu_s_per_GB": up[1] / (n / 1e9),
                     "ranged_get_MB_s": n / 1e6 / down[0], "ranged_get_cpu_s_per_GB": down[1] / (n / 1e9)}
    return out


def bench_reshard(srv: S3Server, mib: int, repeat: int) -> dict[str, float]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    os.environ.update(srv.env())
    os.environ.pop("RESHARD_S3_PART_BYTES", None)
    tensors = {f"t{i}": torch.randn(mib * MiB // 4 // 8 // 1024, 1024) for i in range(8)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    raw = b"".join(t.numpy().tobytes() for t in tensors.values())
    c = boto3.client("s3", endpoint_url=srv.url, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1")
    tc = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=16)
    saves, plain_up, loads, plain_down = [], [], [], []
    for r in range(repeat):
        url = f"s3://{BUCKET}/ckpt/step-{r:08d}"
        saves.append(_timed(lambda url=url, r=r: reshard.save(tensors, url, step=r)))
        plain_up.append(_timed(lambda r=r: c.upload_fileobj(io.BytesIO(raw), BUCKET, f"plain/{r}",
                                                              Config=tc)))
        targets = {k: torch.empty_like(v) for k, v in tensors.items()}
        loads.append(_timed(lambda url=url, targets=targets: reshard.load(
            targets, url, options=reshard.LoadOptions(threads=16))))
        assert all(torch.equal(targets[k], tensors[k]) for k in tensors)
        buf = bytearray(nbytes)

        def plain_get(key: str = f"plain/{r}", buf: bytearray = buf) -> None:
            def one(a: int) -> None:
                b = min(a + PART, nbytes)
                buf[a:b] = c.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read()

            with ThreadPoolExecutor(16) as ex:
                list(ex.map(one, range(0, nbytes, PART)))

        plain_down.append(_timed(plain_get))
    s, u, ld, d = _median(saves), _median(plain_up), _median(loads), _median(plain_down)
    return {"bytes": nbytes, "save_s": s[0], "plain_upload_s": u[0], "save_ratio": u[0] / s[0],
            "load_s": ld[0], "plain_download_s": d[0], "load_ratio": d[0] / ld[0],
            "save_cpu_s_per_GB": s[1] / (nbytes / 1e9), "load_cpu_s_per_GB": ld[1] / (nbytes / 1e9)}


def bench_quarter(srv: S3Server) -> dict[str, float]:
    proxy = FaultProxy(srv.url)
    try:
        os.environ.update(srv.env(proxy.url))
        w = torch.randn(2048, 1024)
        url = f"s3://{BUCKET}/quarter/step-00000001"
        reshard.save({"w": w}, url, step=1)
        proxy.reset_stats()
        q = torch.empty(512, 1024)
        reshard.load({"w": reshard.ShardedTensor("w", q, global_shape=(2048, 1024),
                                                 global_offset=(0, 0))}, url)
        assert torch.equal(q, w[:512])
        return {"tensor_bytes": w.numel() * 4, "fetched_bytes": proxy.stats.get_bytes,
                "fraction": proxy.stats.get_bytes / (w.numel() * 4)}
    finally:
        proxy.close()
        os.environ.update(srv.env())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with S3Server(min_part_bytes=5 * MiB) as srv:
        srv.create_bucket(BUCKET)
        res: dict[str, Any] = {"mib": a.mib, "repeat": a.repeat}
        res["clients"] = bench_clients(srv, os.urandom(a.mib * MiB), a.repeat)
        for name, r in res["clients"].items():
            print(f"{name:8s} upload {r['upload_MB_s']:7.1f} MB/s ({r['upload_cpu_s_per_GB']:5.2f} CPU s/GB)"
                  f"  ranged GET {r['ranged_get_MB_s']:7.1f} MB/s ({r['ranged_get_cpu_s_per_GB']:5.2f} CPU s/GB)")
        res["reshard"] = r = bench_reshard(srv, a.mib, a.repeat)
        print(f"reshard.save {r['save_s']:.2f} s vs plain multipart upload {r['plain_upload_s']:.2f} s: "
              f"{r['save_ratio']:.2f}x")
        print(f"reshard.load {r['load_s']:.2f} s vs plain ranged download {r['plain_download_s']:.2f} s: "
              f"{r['load_ratio']:.2f}x")
        res["quarter"] = q = bench_quarter(srv)
        print(f"quarter of a {q['tensor_bytes'] / MiB:.0f} MiB tensor: fetched {q['fetched_bytes'] / MiB:.2f} MiB "
              f"({q['fraction']:.3f} of its bytes, manifest included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
