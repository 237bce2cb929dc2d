"""Checkpoints on a real S3 endpoint: moto's server on 127.0.0.1 (started by the
session fixture ``s3``) behind the fault-injecting proxy; gloo ranks for the
multi-rank cases. No client call is mocked."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import reshard
from _s3_fns import COLS, ROWS, full_weight, load_state, save_expect_failure, save_state
from reshard.commit import attempts
from reshard.ondisk.manifest import MANIFEST_NAME
from reshard.storage import resolve
from reshard.testing.s3proxy import Fault


def _keys(s3, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    r = s3.server.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in r.get("Contents", ()))


def _uploads(s3, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    r = s3.server.client().list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix)
    return [u["Key"] for u in r.get("Uploads", ())]


def test_save_on_2_load_on_3_bit_exact_replicas_once(pool, s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000007"
    res = pool.run(2, save_state, s3e.env, url, 7)
    m = reshard.inspect(url)
    assert m.step == 7 and len(m.tensors["bias"].chunks) == 1  # the replica is written once
    assert len(m.tensors["weight"].chunks) == 2
    assert all(name.startswith(f"att-{m.attempt_id}.") for name in m.files)
    # each weight shard spans several parts: the multipart path ran, and nothing is left open
    assert all(m.files[c.file].size > (256 << 10) for c in m.tensors["weight"].chunks)
    assert _uploads(s3e, url) == []
    assert sum(r["bytes_written"] for r in res) == res[0]["total"] == m.total_bytes
    assert set(_keys(s3e, url)) == {MANIFEST_NAME, *m.files}  # the lease is gone
    assert pool.run(3, load_state, s3e.env, url) == [True, True, True]
    assert reshard.verify(url).ok


def test_failed_part_on_one_rank_fails_every_rank(pool, s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000001"
    # every try of part 2 of rank 1's file fails: retried until the deadline (4 s), then fails
    s3e.proxy.add(Fault(method="PUT", path=r"data-r00001-", query=r"partNumber=2", status=500,
                        code="InternalError"))
    out = pool.run(2, save_expect_failure, s3e.env, url, 1)
    assert [o[0] for o in out] == ["StorageError", "StorageError"], out
    assert all(o[1] < 10.0 for o in out), out
    assert "rank 1" in out[0][2] and "upload part 2" in out[0][2]
    assert _keys(s3e, url) == []  # no manifest, no data object, no lease
    assert _uploads(s3e, url) == []
    with pytest.raises(reshard.CheckpointNotFoundError):
        reshard.inspect(url)


def test_throttling_and_resets_are_retried(pool, s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000002"
    slow = s3e.proxy.add(Fault(method="PUT", status=503, code="SlowDown", probability=0.3))
    pool.run(2, save_state, s3e.env, url, 2)
    assert slow.fired > 0
    s3e.proxy.clear()
    reset = s3e.proxy.add(Fault(method="GET", query=r"^$", path=r"data-r0000", action="reset_mid",
                                times=2))
    throttled = s3e.proxy.add(Fault(method="GET", status=503, code="SlowDown", times=2))
    assert pool.run(3, load_state, s3e.env, url) == [True, True, True]
    assert reset.fired == 2 and throttled.fired == 2


def test_failing_list_is_storage_error_never_none(s3e, monkeypatch) -> None:
    monkeypatch.setenv("RESHARD_S3_DEADLINE_S", "1")
    root = s3e.url("root")
    reshard.save({"x": torch.ones(4)}, root + "/step-00000001", step=1)
    assert reshard.latest(root) == root + "/step-00000001"
    s3e.proxy.add(Fault(method="GET", query=r"list-type=2", status=500, code="InternalError"))
    with pytest.raises(reshard.StorageError, match="list"):
        reshard.latest(root)
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    with pytest.raises(reshard.StorageError):
        mgr.restore({"x": torch.zeros(4)})


def test_probe_failing_for_another_reason_is_never_a_capability_error(s3e) -> None:
    """A request the store refuses whatever its headers (no such bucket, access
    denied) is raised as what it is, naming the bucket, and never as a store
    that ignores conditional requests (with advice to trust it)."""
    from reshard.errors import StoreCapabilityError
    from reshard.storage.s3 import TRUST_ENV

    state = {"x": torch.ones(4)}
    with pytest.raises(reshard.StorageError) as ei:
        reshard.save(state, "s3://reshard-no-such-bucket/run/step-00000001", step=1)
    assert not isinstance(ei.value, StoreCapabilityError)
    assert "bucket 'reshard-no-such-bucket' does not exist" in str(ei.value)
    assert "NoSuchBucket" in str(ei.value) and TRUST_ENV not in str(ei.value)
    s3e.server.create_bucket("reshard-denied")  # a bucket of its own: the probe is cached per bucket
    s3e.proxy.add(Fault(method="PUT", path=r"^/reshard-denied/", status=403, code="AccessDenied"))
    with pytest.raises(reshard.StorageError) as ei:
        reshard.save(state, "s3://reshard-denied/run/step-00000001", step=1)
    assert not isinstance(ei.value, StoreCapabilityError)
    assert "AccessDenied" in str(ei.value) and TRUST_ENV not in str(ei.value)
    assert "not about conditional requests" in str(ei.value)
    s3e.proxy.clear()  # the same bucket, now writable: probed again (a failure is not cached), published
    reshard.save(state, "s3://reshard-denied/run/step-00000001", step=1)
    got = {"x": torch.zeros(4)}
    reshard.load(got, "s3://reshard-denied/run/step-00000001")
    assert torch.equal(got["x"], torch.ones(4))


def test_two_concurrent_writers_exactly_one_publishes(s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000005"
    # hold both manifest PUTs so that both writers are past their checks when they publish
    s3e.proxy.add(Fault(method="PUT", path=MANIFEST_NAME, action="delay", delay_s=0.5, times=2))
    results: dict[int, object] = {}
    go = threading.Barrier(2)

    def writer(i: int) -> None:
        go.wait()
        try:
            results[i] = reshard.save({"w": torch.full((64, 64), float(i))}, url, step=5)
        except Exception as e:  # noqa: BLE001
            results[i] = e

    ts = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    won = [i for i, r in results.items() if isinstance(r, reshard.SaveResult)]
    lost = [r for r in results.values() if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "another writer published" in str(lost[0])
    m = reshard.inspect(url)
    assert m.attempt_id == results[won[0]].attempt_id  # type: ignore[attr-defined]
    w = torch.zeros(64, 64)
    reshard.load({"w": w}, url)
    assert torch.equal(w, torch.full((64, 64), float(won[0])))
    # the loser's objects are gone; only the winner's (and its manifest) remain
    assert set(_keys(s3e, url)) == {MANIFEST_NAME, *m.files}


def test_prefix_without_manifest_is_never_a_checkpoint(s3e) -> None:
    root = s3e.url("root")
    for step in (1, 2):
        reshard.save({"x": torch.full((8,), float(step))}, f"{root}/step-{step:08d}", step=step)
    # step 2 loses its manifest: data objects remain, nothing proves a commit
    s3e.server.client().delete_object(Bucket=s3e.bucket,
                                      Key=f"{root.split('/', 3)[3]}/step-00000002/{MANIFEST_NAME}")
    assert any(k.startswith("att-") for k in _keys(s3e, root + "/step-00000002"))
    assert reshard.latest(root) == root + "/step-00000001"
    with pytest.raises(reshard.CheckpointNotFoundError):
        reshard.load({"x": torch.zeros(8)}, root + "/step-00000002")
    x = torch.zeros(8)
    res = reshard.CheckpointManager(root, preempt_signals=()).restore({"x": x})
    assert res is not None and res.step == 1 and torch.equal(x, torch.ones(8))


def test_gc_removes_abandoned_attempts_only(s3e) -> None:
    root = s3e.url("root")
    st, key = resolve(root)
    reshard.save({"x": torch.arange(16.0)}, f"{root}/step-00000001", step=1)
    committed = set(_keys(s3e, root + "/step-00000001"))

    def fake_attempt(step: int, attempt_id: str, expires_in: float) -> None:
        path = st.join(key, f"step-{step:08d}")
        st.write_bytes(st.join(path, attempts.data_name(attempt_id, "data-r00000-0.safetensors")),
                       b"x" * 100)
        st.write_bytes(attempts.lease_key(st, path, attempt_id),
                       f'{{"attempt": "{attempt_id}", "expires": {time.time() + expires_in}}}'.encode())
        b, k = st.join(path, attempts.data_name(attempt_id, "data-r00001-0.safetensors")).split("/", 1)
        s3e.server.client().create_multipart_upload(Bucket=b, Key=k)

    fake_attempt(2, "20260101T000000-deadbeef", -10.0)  # crashed: lease expired
    fake_attempt(3, "20260101T000000-cafecafe", 600.0)  # still running: lease held
    fake_attempt(1, "20260101T000000-0badf00d", -10.0)  # a loser's leftovers beside a commit
    got = attempts.gc_root(st, key, grace_s=0.0)
    assert sorted(got.attempts) == ["step-00000001/20260101T000000-0badf00d",
                                    "step-00000002/20260101T000000-deadbeef"]
    assert len(got.uploads) == 2
    assert set(_keys(s3e, root + "/step-00000001")) == committed
    assert _keys(s3e, root + "/step-00000002") == []
    assert _uploads(s3e, root + "/step-00000002") == []
    assert len(_keys(s3e, root + "/step-00000003")) == 2
    assert len(_uploads(s3e, root + "/step-00000003")) == 1
    assert reshard.verify(f"{root}/step-00000001").ok


def test_quarter_of_a_tensor_reads_a_quarter_of_its_bytes(s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000001"
    w = full_weight()
    reshard.save({"weight": w}, url, step=1,
                 options=reshard.SaveOptions(checksum_block_bytes=16 << 10))
    manifest_bytes = len(s3e.server.client().get_object(
        Bucket=s3e.bucket, Key=url.split("/", 3)[3] + "/" + MANIFEST_NAME)["Body"].read())
    s3e.proxy.reset_stats()
    q = torch.zeros(ROWS // 4, COLS)
    reshard.load({"weight": reshard.ShardedTensor("weight", q, global_shape=(ROWS, COLS),
                                                  global_offset=(0, 0))}, url)
    assert torch.equal(q, w[: ROWS // 4])
    data = s3e.proxy.stats.get_bytes - manifest_bytes
    quarter = w.numel() * 4 // 4
    assert quarter <= data <= quarter + (16 << 10), (data, quarter)


def test_cli_on_s3_urls(s3e) -> None:
    from click.testing import CliRunner

    from reshard.cli import main

    root = s3e.url("cli")
    mgr = reshard.CheckpointManager(root, preempt_signals=())
    for step in (1, 2):
        mgr.save(step, {"w": torch.arange(32.0) * step, "step": step})
    st, key = resolve(root)
    dead = "20260101T000000-deadbeef"
    path = st.join(key, "step-00000003")
    st.write_bytes(st.join(path, attempts.data_name(dead, "data-r00000-0.safetensors")), b"x" * 10)
    run = CliRunner().invoke
    out = run(main, ["ls", root])
    assert out.exit_code == 0, out.output
    assert "step-00000001" in out.output and "step-00000002" in out.output
    out = run(main, ["inspect", root + "/step-00000002"])
    assert out.exit_code == 0 and "w" in out.output, out.output
    out = run(main, ["verify", root + "/step-00000002"])
    assert out.exit_code == 0, out.output
    out = run(main, ["gc", root, "--grace", "0"])
    assert out.exit_code == 0, out.output
    assert f"step-00000003/{dead}" in out.output
    assert not st.exists(path)
    assert reshard.latest(root) == root + "/step-00000002" and reshard.verify(reshard.latest(root)).ok
    out = run(main, ["inspect", root + "/step-00000003"])
    assert out.exit_code == 2, out.output


def test_export_hf_to_s3(s3e, tmp_path) -> None:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from reshard.cli import main

    url = s3e.url("ckpt") + "/step-00000001"
    model = {"emb": torch.randn(64, 1024), "head": torch.randn(128, 1024),
             "norm": torch.ones(1024, dtype=torch.bfloat16)}
    reshard.save({"model": model, "optim": {"m": torch.zeros(8)}}, url, step=1)
    out = s3e.url("hf")
    res = CliRunner().invoke(main, ["export", url, out, "--max-shard-size", "300KiB"])
    assert res.exit_code == 0, res.output
    keys = _keys(s3e, out)
    assert "model.safetensors.index.json" in keys and len(keys) == 4, keys  # 3 shards + index
    c = s3e.server.client()
    prefix = out.split("/", 3)[3]
    index = json.loads(c.get_object(Bucket=s3e.bucket, Key=f"{prefix}/model.safetensors.index.json")
                       ["Body"].read())
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        local = tmp_path / name
        c.download_file(s3e.bucket, f"{prefix}/{name}", str(local))
        got.update(load_file(str(local)))
    assert set(got) == {"emb", "head", "norm"}  # the container path (model.) is stripped
    assert all(torch.equal(got[k], v) for k, v in model.items())
    assert _uploads(s3e, out) == []
    # exporting again without --overwrite is refused; nothing changes
    res = CliRunner().invoke(main, ["export", url, out])
    assert res.exit_code == 2 and "already holds model files" in res.output  # a refused overwrite


def test_delete_removes_the_manifest_first(s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000001"
    reshard.save({"w": torch.arange(8.0), "v": torch.ones(3)}, url, step=1)
    st, key = resolve(url)
    s3e.proxy.reset_stats()
    st.delete_tree(key)
    deletes = [body for m, _, q, body in s3e.proxy.stats.log if m == "POST" and "delete" in q]
    assert len(deletes) == 2, s3e.proxy.stats.log
    assert deletes[0].count(b"<Key>") == 1 and MANIFEST_NAME.encode() in deletes[0]
    assert MANIFEST_NAME.encode() not in deletes[1]
    assert _keys(s3e, url) == []


def test_lease_is_renewed_and_async_save(s3e) -> None:
    url = s3e.url("ckpt") + "/step-00000001"
    st, key = resolve(url)
    lease = attempts.AttemptLease(st, key, "20260101T000000-1ea5e001", ttl_s=0.6).start()
    first = json.loads(st.read_bytes(lease.key))["expires"]
    time.sleep(0.9)
    assert lease.renewals >= 2 and json.loads(st.read_bytes(lease.key))["expires"] > first + 0.3
    lease.stop()
    assert not st.exists(lease.key)
    # an async save commits through the same protocol
    h = reshard.async_save({"w": torch.arange(16.0)}, url, step=1)
    res = h.wait(timeout=60)
    w = torch.zeros(16)
    reshard.load({"w": w}, url)
    assert torch.equal(w, torch.arange(16.0)) and reshard.inspect(url).attempt_id == res.attempt_id
