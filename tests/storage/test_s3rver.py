"""A second S3 implementation: s3rver (npm) on 127.0.0.1, beside moto. It
answers 200 to ``If-None-Match: *`` and ``If-Match`` and ignores them, and
501 NotImplemented to ListMultipartUploads. Store capabilities are proven,
not declared: the probe finds the ignored headers and publishing is refused
up front (two writers or two resuming jobs never both succeed); 501 is never
retried; gc degrades without ListMultipartUploads. The conformance suite
runs against s3rver too. Skipped where node or s3rver is not installed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reshard
from reshard.cli import main
from reshard.errors import StorageError, StoreCapabilityError
from reshard.ondisk.manifest import MANIFEST_NAME
from reshard.storage import Storage, resolve
from reshard.storage.s3 import TRUST_ENV, S3Storage
from reshard.testing.s3proxy import Fault
from reshard.testing.storage_conformance import StorageConformance


class TestS3rverConformance(StorageConformance):
    large_bytes = 1 << 20

    @pytest.fixture(autouse=True)
    def _root(self, s3r: Any) -> None:
        self.url = s3r.url("conformance")

    def make(self) -> tuple[Storage, str]:
        return resolve(self.url)


def _keys(ep: Any, url: str) -> list[str]:
    prefix = url.split("/", 3)[3] + "/"
    r = ep.server.client().list_objects_v2(Bucket=ep.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in r.get("Contents", ()))


def test_probe_finds_what_each_server_honours(s3e: Any, s3r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3r.url("probe")
    got = S3Storage().probe(url[len("s3://"):] + "/ck")
    assert not got.conditional_put and not got.conditional_replace
    assert "If-None-Match: * of one key was accepted" in got.why and "If-Match" in got.why
    assert _keys(s3r, url) == []  # the scratch key is gone
    for k, v in s3e.env.items():  # moto honours both
        monkeypatch.setenv(k, v)
    assert S3Storage().probe(s3e.url("probe")[len("s3://"):] + "/ck").ok


def _race(target: Any) -> dict[int, Any]:
    results: dict[int, Any] = {}
    go = threading.Barrier(2)

    def run(i: int) -> None:
        go.wait()
        try:
            results[i] = target(i)
        except Exception as e:  # noqa: BLE001
            results[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


@pytest.mark.timeout(120)
def test_two_writers_of_one_step_never_both_succeed(s3r: Any) -> None:
    """Both would have "succeeded" (the second silently replacing the
    first's commit): the store is refused before any data is written."""
    url = s3r.url("ckpt") + "/step-00000005"
    results = _race(lambda i: reshard.save({"w": torch.full((64, 64), float(i))}, url, step=5))
    assert all(isinstance(r, StoreCapabilityError) for r in results.values()), results
    msg = str(results[1])
    assert "refusing to publish" in msg and TRUST_ENV in msg and "If-None-Match" in msg
    assert len(msg.splitlines()) == 1
    assert _keys(s3r, url) == []  # nothing written, nothing published


@pytest.mark.timeout(120)
def test_two_resuming_jobs_never_both_take_head(s3r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root = s3r.url("root")
    monkeypatch.setenv(TRUST_ENV, "1")  # one job alone writes: the documented escape
    mgr = reshard.CheckpointManager(root, every_steps=1, preempt_signals=())
    mgr.save(3, {"x": torch.full((8,), 3.0)}, sync=True)
    mgr.close()
    monkeypatch.delenv(TRUST_ENV)

    def resume(i: int) -> Any:
        return reshard.CheckpointManager(root, preempt_signals=()).restore({"x": torch.zeros(8)})

    results = _race(resume)
    assert all(isinstance(r, StoreCapabilityError) for r in results.values()), results
    assert "HEAD" not in _keys(s3r, root)
    # an evaluation that records no HEAD still reads it
    x = torch.zeros(8)
    res = reshard.CheckpointManager(root, writer=False, preempt_signals=()).restore({"x": x},
                                                                                    record_head=False)
    assert res is not None and res.step == 3 and torch.equal(x, torch.full((8,), 3.0))


@pytest.mark.timeout(120)
def test_gc_on_s3rver_removes_an_abandoned_attempt_without_listing_uploads(
        s3r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """ListMultipartUploads answers 501: never retried (a managed save used to
    stall ~60 s on it), gc deletes what listing found and says what it could not do."""
    monkeypatch.setenv(TRUST_ENV, "1")
    monkeypatch.setenv("RESHARD_S3_DEADLINE_S", "60")  # a retried 501 would take this long
    root = s3r.url("gc")
    mgr = reshard.CheckpointManager(root, every_steps=1, keep_last=2, preempt_signals=())
    mgr.save(1, {"x": torch.ones(8)}, sync=True)  # its housekeeping runs gc_abandoned
    assert isinstance(mgr.storage, S3Storage) and mgr.storage.retries == 0
    assert any("does not list multipart uploads" in n for n in mgr.storage.notes)
    mgr.close()
    # an abandoned attempt of step 2: a data object with no manifest and no lease
    prefix = root.split("/", 3)[3]
    s3r.server.client().put_object(Bucket=s3r.bucket, Key=f"{prefix}/step-00000002/att-dead01.data-r00000-0.safetensors",
                                   Body=b"x" * 100)
    r = CliRunner().invoke(main, ["gc", root, "--grace", "0"])
    assert r.exit_code == 0, r.output
    assert "abandoned attempt step-00000002/dead01" in r.output
    assert "does not list multipart uploads" in r.output
    assert _keys(s3r, root + "/step-00000002") == []
    assert MANIFEST_NAME in _keys(s3r, root + "/step-00000001")


def test_501_fails_fast_on_moto_too(s3e: Any) -> None:
    """A permanent answer is never retried (a 503 is)."""
    url = s3e.url("nimpl")
    st, key = resolve(url)
    s3e.proxy.add(Fault(method="PUT", path="nimpl", status=501, code="NotImplemented"))
    with pytest.raises(StorageError, match="NotImplemented"):
        st.write_bytes(st.join(key, "a.bin"), b"abc")
    assert st.retries == 0 and st.requests == 1
    s3e.proxy.clear()
    s3e.proxy.add(Fault(method="GET", query="uploads", status=501, code="NotImplemented"))
    assert st.list_uploads(key + "/") == [] and st.retries == 0
    assert any("does not list multipart uploads" in n for n in st.notes)


def test_gc_failing_on_the_store_exits_2_not_1(s3e: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """1 is a failed check (README); a store that fails is an environment error."""
    root = s3e.url("gcfail")
    reshard.save({"x": torch.ones(4)}, root + "/step-00000001", step=1)
    monkeypatch.setenv("RESHARD_S3_DEADLINE_S", "0.5")
    s3e.proxy.add(Fault(method="GET", query="list-type=2", status=500, code="InternalError"))
    r = CliRunner().invoke(main, ["gc", root, "--grace", "0"])
    assert r.exit_code == 2 and "StorageError" in r.output, r.output


@pytest.mark.timeout(300)
def test_s3_fault_cells_on_s3rver(s3rver_session: Any, tmp_path: Any) -> None:
    """The S3 rows of the fault matrix on the second server (a killed save;
    the whole quick row of seven cells passes too, in about two minutes):
    safe, and gc removes what the kill left although s3rver
    cannot list multipart uploads. The cells are single writers, so they run
    with the documented RESHARD_S3_TRUST_CONDITIONAL=1."""
    from reshard.faults.matrix import cells, run_matrix

    chosen = [c for c in cells(quick=True, backend="s3") if c.fault_class in ("sigkill-save",)]
    assert len(chosen) == 1
    results = run_matrix(chosen, workdir=str(tmp_path / "m"), s3_server="s3rver")
    unsafe = [r for r in results if not r.safe]
    assert not unsafe, "\n".join(f"{r.cell.name}: {r.problems}" for r in unsafe)
    killed = next(r for r in results if r.cell.fault_class == "sigkill-save")
    assert killed.after_gc == []
