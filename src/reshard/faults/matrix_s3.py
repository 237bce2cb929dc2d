"""The S3 rows of the fault matrix: the same faults, on a real S3 endpoint.

One moto server (``reshard.testing.s3server``) runs per matrix run on
127.0.0.1, behind the fault-injecting HTTP proxy
(``reshard.testing.s3proxy``); every cell gets its own prefix in one bucket
and two real gloo ranks talking to the proxy. As in
:mod:`reshard.faults.matrix` each cell commits step 1 through a
:class:`~reshard.CheckpointManager`, then meets its fault saving (sync or
async) or loading:

* ``storage-error``: ``ENOSPC`` / ``EIO`` / a timeout from
  :class:`~reshard.faults.inject.FaultStorage` around the S3 store, at a
  data write, at the completion of a data object's upload, at the
  conditional put of the manifest; and a read error during a load;
* ``s3-http`` (from the proxy, so the client meets real HTTP answers): a
  persistent 500 on a part upload, 503 SlowDown on the manifest put, a
  connection reset on every data PUT, a LIST answering 500; the transient
  variants (a few 503s, two resets) must be retried into a commit, and a
  GET body cut off mid-stream during a load;
* ``truncated-body``: the proxy forwards only half of a request body (a data
  object, the manifest): the save must fail rather than publish it;
* ``sigkill-save`` at each phase (stage, plan, right after the lease,
  mid-data on either rank, with a multipart upload open, before the
  manifest's put, after it, before and in the middle of retention deletes),
  ``sigkill-load``, ``lost-rank`` (save and load);
* ``integrity``: committed objects truncated, bit-flipped, missing, extra,
  the manifest missing, truncated, corrupted or from another attempt, a data
  object from another attempt.

Run and judged by the one runner, :mod:`reshard.faults.matrix`
(every survivor of a killed or stalled rank names it as lost), with the S3
form of "no stray attempt": once the job has ended, the killed job's lease
has expired (``RESHARD_LEASE_TTL_S`` is a few seconds here) and ``gc`` ran,
no key of an attempt that no manifest names, no lease and no open
multipart upload is left; and before ``gc``, every such attempt is listed
as abandoned by :func:`reshard.commit.protocol.scan` (what ``reshard ls`` shows). A
committed checkpoint whose manifest was broken after its commit is no
attempt: it is listed as invalid and kept for a person, as locally.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Any

from .local import INTEGRITY
from .model import HTTP_MUST_FAIL, Cell

BUCKET = "reshard-faults"
ROWS = 48  # rows of ``w`` per rank: 12 KiB of float32, two 8 KiB parts
PART_BYTES = 8 << 10
LEASE_TTL_S = 3.0
DEADLINE_S = 2.0

_DATA = "att-*.data-*"
#: phase -> (FaultStorage op, match) on an S3 root
SPOTS = {"data": ("write", _DATA), "data-durable": ("fsync", _DATA),  # a multipart upload is open
         "manifest": ("put_if_absent", "manifest.json"),
         "publish-after": ("put_if_absent", "manifest.json"),
         "lease": ("write_bytes", "att-*.lease.json"),  # the attempt exists, no data yet
         "retention": ("delete", "manifest.json"),  # before the first delete of step 1
         # "step-????????": the checkpoint's prefix, not its verification record (deleted first)
         "retention-mid": ("delete", "step-????????"),
         "read": ("read", _DATA), "manifest-read": ("read", "manifest.json")}


def cells(*, quick: bool = False) -> list[Cell]:
    """Every S3 cell (``quick``: one per fault class: its first, or ``_QUICK``'s)."""
    b = "s3"
    out: list[Cell] = []
    for mode in ("sync", "async"):
        for action in ("enospc", "eio", "timeout"):
            for phase, rank in (("data", 1), ("data-durable", 1), ("manifest", 0)):
                out.append(Cell("storage-error", "save", mode, phase, action, rank, b))
        for action in HTTP_MUST_FAIL:
            phase = {"slowdown": "manifest", "list500": "plan", "lost-answer": "publish"}.get(action, "data")
            out.append(Cell("s3-http", "save", mode, phase, action, 0 if phase != "data" else 1, b))
        for phase, rank in (("data", 1), ("manifest", 0)):
            out.append(Cell("truncated-body", "save", mode, phase, "truncate_body", rank, b))
        for phase, rank in (("stage", 1), ("plan", 0), ("lease", 0), ("data", 1), ("data", 0),
                            ("data-durable", 1), ("manifest", 0), ("publish-after", 0),
                            ("retention", 0), ("retention-mid", 0)):
            out.append(Cell("sigkill-save", "save", mode, phase, "kill", rank, b))
        out.append(Cell("lost-rank", "save", mode, "data", "delay", 1, b))
    out.append(Cell("sigkill-load", "load", "-", "read", "kill", 1, b))
    out.append(Cell("lost-rank", "load", "-", "read", "delay", 1, b))
    out.append(Cell("storage-error", "load", "-", "read", "eio", 1, b))
    out.append(Cell("s3-http", "load", "-", "read", "reset_mid", 1, b))
    out.append(Cell("s3-http", "load", "-", "read", "reset_mid-transient", 1, b))
    for kind in INTEGRITY:
        out.append(Cell("integrity", "integrity", "-", kind, "-", 0, b))
    if quick:
        q: dict[str, Cell] = {}
        for c in out:
            if c.fault_class not in q or c.name == _QUICK.get(c.fault_class):
                q[c.fault_class] = c
        return list(q.values())
    return out


#: the quick matrix's cell of a class where it is not the class's first: a kill
#: with a multipart upload open (the one fault that leaves an upload to abort)
_QUICK = {"sigkill-save": "sigkill-save/save-sync/data-durable/kill/rank1"}


# --------------------------------------------------------------------------- rank side


def rank_storage() -> Any:
    from ..storage.s3 import S3Storage

    return S3Storage()


def other_path(st: Any, root: str) -> str:
    return str(st.join(root + "-other", "step-00000002"))


def faults_for(cell: Cell, rank: int, cdir: str, spec: dict[str, Any]) -> list[Any]:
    """FaultStorage faults of ``rank`` (proxy faults are armed by the parent)."""
    from .ranks import faults_for as generic

    return generic(cell, rank, cdir, spec, SPOTS, _half_delete)


def _half_delete(op: str, path: str) -> None:
    """Step 1's manifest deleted, then one of its data objects, then a kill."""
    inner = rank_storage()
    data = sorted(k for k in inner._keys(path.rstrip("/") + "/") if ".data-" in k)[:1]
    inner.delete_keys(data)
    os.kill(os.getpid(), signal.SIGKILL)

def corrupt(st: Any, kind: str, ckpt: str, other: str) -> None:
    """Corrupt the committed checkpoint ``ckpt`` (keys) the way ``kind`` says."""
    names = st.list_dir(ckpt)
    data = sorted(n for n in names if ".data-" in n)
    man = st.join(ckpt, "manifest.json")
    f0 = st.join(ckpt, data[0])
    if kind in ("truncated-shard", "flipped-shard", "truncated-manifest", "corrupted-manifest"):
        target = f0 if kind.endswith("shard") else man
        raw = bytearray(st.read_bytes(target))
        if kind == "truncated-shard":
            raw = raw[:-7]
        elif kind == "flipped-shard":
            raw[-5] ^= 0x10
        elif kind == "truncated-manifest":
            raw = raw[: len(raw) // 2]
        else:
            raw[10:19] = b"\x00garbage\xff"
        st.write_bytes(target, bytes(raw))
    elif kind == "missing-manifest":
        st.delete_keys([man])
    elif kind == "other-attempt-manifest":
        st.write_bytes(man, st.read_bytes(st.join(other, "manifest.json")))
    elif kind == "other-attempt-shard":
        od = sorted(n for n in st.list_dir(other) if ".data-" in n)
        st.write_bytes(f0, st.read_bytes(st.join(other, od[0])))
    elif kind == "missing-file":
        st.delete_keys([f0])
    elif kind == "extra-file":  # what a stray attempt's object looks like
        st.write_bytes(st.join(ckpt, "att-20990101T000000-0badc0de.data-r00099-0.safetensors"), b"junk")
    else:
        raise ValueError(kind)


# --------------------------------------------------------------------------- parent side


class Endpoint:
    """An S3 server on 127.0.0.1 behind the fault proxy, one bucket, one
    prefix per cell (shared by the cells of one matrix run): moto's, or
    s3rver's (``server="s3rver"``; it ignores conditional requests, so the
    cells, each one writer, run with ``RESHARD_S3_TRUST_CONDITIONAL=1``: the
    refusal itself is tested on its own)."""

    def __init__(self, server: str = "moto") -> None:
        from ..testing.s3proxy import FaultProxy
        from ..testing.s3server import S3rverServer, S3Server

        if server not in ("moto", "s3rver"):
            raise ValueError(f"unknown S3 server {server!r} (moto, s3rver)")
        self.name = server
        self.server: Any = S3Server(min_part_bytes=4 << 10) if server == "moto" else S3rverServer()
        self.proxy = FaultProxy(self.server.url)
        self.server.create_bucket(BUCKET)
        self.env = {**self.server.env(self.proxy.url), "RESHARD_S3_PART_BYTES": str(PART_BYTES),
                    "RESHARD_S3_RANGE_BYTES": str(PART_BYTES), "RESHARD_S3_DEADLINE_S": str(DEADLINE_S),
                    "RESHARD_LEASE_TTL_S": str(LEASE_TTL_S)}
        if server == "s3rver":
            self.env["RESHARD_S3_TRUST_CONDITIONAL"] = "1"
        self.n = 0

    def close(self) -> None:
        self.proxy.close()
        self.server.close()


def _proxy_faults(cell: Cell, root: str) -> list[Any]:
    """The proxy's rules of a cell (paths are ``/bucket/key``)."""
    from ..testing.s3proxy import Fault

    step2 = re.escape(f"/{root}/step-00000002/")
    data_r = rf"{step2}att-[^/]*\.data-r0000{cell.rank}-"
    step1_r = re.escape(f"/{root}/step-00000001/") + rf"att-[^/]*\.data-r0000{cell.rank}-"
    a = cell.action
    if cell.fault_class == "truncated-body":
        path = data_r if cell.phase == "data" else step2 + "manifest\\.json"
        return [Fault(method="PUT", path=path, action="truncate_body")]
    if cell.fault_class != "s3-http":
        return []
    if a == "http500":
        return [Fault(method="PUT", path=data_r, query="partNumber=2", status=500, code="InternalError")]
    if a == "slowdown":
        return [Fault(method="PUT", path=step2 + "manifest\\.json", status=503, code="SlowDown")]
    if a == "reset":
        return [Fault(method="PUT", path=data_r, action="reset")]
    if a == "list500":  # every LIST of the root while the save of step 2 chooses its name
        return [Fault(method="GET", path=re.escape(f"/{BUCKET}") + "/?$",
                      query="list-type=2.*" + re.escape(root.split("/", 1)[1].replace("/", "%2F")),
                      status=500, code="InternalError")]
    if a == "lost-answer":  # the manifest lands, the answer is lost, and it cannot be read back
        return [Fault(method="PUT", path=step2 + "manifest\\.json", action="reset_after"),
                Fault(method="GET", path=step2 + "manifest\\.json", status=500, code="InternalError")]
    if a == "slowdown-transient":
        return [Fault(method="PUT", path=step2, status=503, code="SlowDown", times=3)]
    if a == "reset-transient":
        return [Fault(method="PUT", path=data_r, action="reset", times=2)]
    if a == "reset_mid":  # every ranged GET of rank 1's object cut off mid-body
        return [Fault(method="GET", path=step1_r, query="^$", action="reset_mid")]
    if a == "reset_mid-transient":
        return [Fault(method="GET", path=step1_r, query="^$", action="reset_mid", times=2)]
    raise ValueError(f"no proxy fault for {cell.name}")


def _stray(st: Any, root: str) -> tuple[list[str], list[str], list[str]]:
    """``(attempts no manifest names, their keys, open uploads)`` below ``root``
    (``<checkpoint>/<attempt id>`` names; keys and uploads as ``<checkpoint>/<name>``)."""
    from ..commit.attempts import LEASE_SUFFIX, attempt_of
    from ..commit.protocol import read_manifest
    from ..errors import CheckpointError, CheckpointNotFoundError

    ids: list[str] = []
    keys: list[str] = []
    uploads: list[str] = []
    try:
        children = st.list_dir(root)
    except FileNotFoundError:
        return ids, keys, uploads
    for child in children:
        path = st.join(root, child)
        try:
            names = st.list_dir(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            m = read_manifest(st, path)
            used = {m.attempt_id} | {a for a in map(attempt_of, m.files) if a}
        except CheckpointNotFoundError:
            used = set()
        except CheckpointError:
            continue  # a committed checkpoint whose manifest broke: invalid, kept for a person
        for n in names:
            a = attempt_of(n)
            if a is not None and (a not in used or n.endswith(LEASE_SUFFIX)):
                keys.append(f"{child}/{n}")
                if a not in used and f"{child}/{a}" not in ids:
                    ids.append(f"{child}/{a}")
        uploads += [f"{child}/{st.basename(k)}" for k, _, _ in st.list_uploads(path + "/")]
    return ids, keys, uploads


def _wait_leases(st: Any, root: str) -> None:
    """Sleep until every lease below ``root`` has expired (a killed job's
    lease lapses after ``LEASE_TTL_S``; none is renewed once the job ended)."""
    from ..commit.attempts import LEASE_SUFFIX

    latest = 0.0
    for child in st.list_dir(root) if st.exists(root) else ():
        try:
            names = st.list_dir(st.join(root, child))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            if n.endswith(LEASE_SUFFIX):
                try:
                    latest = max(latest, float(json.loads(st.read_bytes(st.join(root, child, n)))["expires"]))
                except (FileNotFoundError, ValueError, KeyError):
                    pass
    wait = min(latest - time.time(), LEASE_TTL_S + 1.0)
    if wait > 0:
        time.sleep(wait + 0.1)




#: seconds added to the bound in which survivors must see a fault (the S3
#: store's retry deadline), :func:`reshard.faults.model.detect_bound_s`
DETECT_EXTRA_S = 4.0


def check_installed() -> None:
    """Raises RuntimeError when what this backend's matrix needs is missing."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"needs boto3 and moto[server] (the dev set): {e}") from None


def matrix_cells(*, quick: bool = False) -> list[Cell]:
    """This backend's cells of the matrix; the shared-root cells on S3 run in
    the full matrix (quick: their local side does)."""
    from .shared import cells as shared_cells

    return cells(quick=quick) + ([] if quick else shared_cells(S3Backend.name))


def open_backend(server: str = "moto") -> S3Backend:
    """The matrix's store for a run: one S3 server (``server``: "moto" or "s3rver")."""
    return S3Backend(server)


class S3Backend:
    """S3 as the matrix's store: one :class:`Endpoint` (moto's server, or
    s3rver's) for a matrix run, a fresh prefix per cell."""

    name = "s3"

    def __init__(self, server: str = "moto") -> None:
        self.ep = Endpoint(server)
        self.env = self.ep.env

    def rows(self, cell: Cell) -> int:
        return ROWS

    def root(self, cdir: str, cell: Cell) -> str:
        self.ep.n += 1
        return f"{BUCKET}/cells/{self.ep.n:03d}-{re.sub('[^A-Za-z0-9]+', '-', cell.name)}"

    def storage(self) -> Any:
        return rank_storage()

    def arm(self, cell: Cell, root: str) -> list[Any]:
        rules = _proxy_faults(cell, root)
        for f in rules:
            self.ep.proxy.add(f)
        return rules

    def disarm(self) -> None:
        self.ep.proxy.clear()
        self.ep.proxy.reset_stats()

    def stray(self, st: Any, root: str, res: Any) -> list[str]:
        """Attempts no manifest names and open uploads; every such attempt
        must be listed as abandoned by :func:`reshard.commit.protocol.scan` (``reshard ls``)."""
        from ..commit.protocol import scan

        ids, _, uploads = _stray(st, root)
        if res is not None:
            listed = {e.name for e in scan(st, root) if e.abandoned}
            unlisted = [a for a in ids if a not in listed]
            if unlisted:
                res.problems.append(f"attempts left behind but not listed as abandoned (reshard ls): {unlisted}")
        return ids + [f"upload {u}" for u in uploads]

    def after_gc(self, st: Any, root: str) -> list[str]:
        _, keys, uploads = _stray(st, root)
        return keys + [f"upload {u}" for u in uploads]

    def usage(self, st: Any, root: str) -> tuple[int, int]:
        """``(bytes of the objects under root, of those no manifest names)``
        (open multipart uploads are listed in ``stray``, not counted)."""
        c = self.ep.server.client()
        bucket, _, prefix = root.partition("/")
        total, sizes = 0, {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for o in page.get("Contents", ()):
                total += int(o["Size"])
                sizes[o["Key"][len(prefix) + 1:]] = int(o["Size"])
        _, keys, _ = _stray(st, root)
        return total, sum(sizes.get(k, 0) for k in keys)

    def before_gc(self, st: Any, root: str) -> None:
        _wait_leases(st, root)

    def close(self) -> None:
        self.ep.close()
