"""LoadOptions.read_once="auto" (the default): replicas are read once where
storage is remote (an object store, a network or FUSE file system) and read
by every rank on a local disk or in memory; True and False are kept."""

from __future__ import annotations

from pathlib import Path

import pytest

import reshard
from reshard.loading import reading
from reshard.storage.local import LocalStorage
from reshard.storage.memory import MemoryStorage
from reshard.storage.s3 import S3Storage


def test_auto_reads_once_only_on_remote_storage(monkeypatch, tmp_path: Path) -> None:
    local, mem, s3 = LocalStorage(), MemoryStorage(), object.__new__(S3Storage)
    assert reshard.LoadOptions().read_once == "auto"
    assert reading.read_once_wanted("auto", s3, "bucket/ck") is True
    assert reading.read_once_wanted("auto", mem, "ck") is False
    for fs, want in (("ext4", False), ("xfs", False), ("tmpfs", False), ("nfs4", True), ("lustre", True),
                     ("fuse.s3fs", True), (None, False)):
        monkeypatch.setattr(reading, "_fs_type", lambda p, fs=fs: fs)
        assert reading.read_once_wanted("auto", local, str(tmp_path)) is want, fs
        assert reading.read_once_wanted(True, local, str(tmp_path)) is True
        assert reading.read_once_wanted(False, s3, "b/k") is False


def test_fs_type_is_the_longest_mount_point(monkeypatch, tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("rootfs / ext4 rw 0 0\nsrv:/x /mnt/shared nfs4 rw 0 0\nsrv:/y /mnt/shared\\040two fuse.sshfs rw 0 0\n")
    real_open = open

    def fake_open(path, *a, **k):  # type: ignore[no-untyped-def]
        return real_open(mounts if path == "/proc/self/mounts" else path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    assert reading._fs_type("/mnt/shared/ck") == "nfs4"
    assert reading._fs_type("/mnt/shared two/ck") == "fuse.sshfs"
    assert reading._fs_type("/mnt/sharedx/ck") == "ext4"


def test_read_once_option_is_checked() -> None:
    with pytest.raises(ValueError, match="read_once must be True, False or 'auto'"):
        reshard.LoadOptions(read_once="yes")
