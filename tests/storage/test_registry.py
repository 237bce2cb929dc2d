"""The registry of storage schemes (reshard.storage.registry): what a URL
resolves to, a backend outside reshard found through its entry point, the
clear errors, and the test stores the backends register."""

from __future__ import annotations

import logging
import os
import textwrap

import pytest

from reshard.storage import (
    LocalStorage,
    MemoryStorage,
    Scheme,
    get_scheme,
    register_scheme,
    registry,
    resolve,
    scheme_of,
    schemes,
    start_test_store,
)


def test_each_builtin_backend_serves_its_scheme() -> None:
    assert [s.name for s in schemes()][:3] == ["file", "memory", "s3"]
    assert scheme_of("/a/b").backend == scheme_of("file:///a/b").backend == "local"
    st, key = resolve("memory://ns/run/")
    assert isinstance(st, MemoryStorage) and key == "ns/run" and st.url(key) == "memory://ns/run"
    st, key = resolve("file://localhost/tmp/x")
    assert isinstance(st, LocalStorage) and key == "/tmp/x" and st.url(key) == "file:///tmp/x"
    st, key = resolve("rel/dir")
    assert key == os.path.abspath("rel/dir") and st.url(key) == key  # a bare path stays bare
    assert get_scheme("local") is get_scheme("file") and not get_scheme("memory").shared


def test_unknown_scheme_and_clashes_are_named() -> None:
    with pytest.raises(ValueError, match=r"unsupported checkpoint URL scheme 'gs' in 'gs://b/k' "
                                         r"\(registered: file://, memory://, s3://"):
        resolve("gs://b/k")
    with pytest.raises(ValueError, match="an s3:// URL needs a bucket"):
        resolve("s3:///")
    with pytest.raises(ValueError, match="'memory' is already registered"):
        register_scheme(Scheme(name="memory", open=lambda rest: (MemoryStorage(), rest)))
    with pytest.raises(ValueError, match="backend name 'local' is already served by scheme 'file'"):
        register_scheme(Scheme(name="local2", backend="local", open=lambda rest: (LocalStorage(), rest)))
    with pytest.raises(ValueError, match="expected a URL scheme"):
        Scheme(name="Not A Scheme", open=lambda rest: (LocalStorage(), rest))
    with pytest.raises(ValueError, match="unknown storage scheme or backend 'nope'"):
        get_scheme("nope")


def _distribution(tmp_path, monkeypatch, name: str, module: str, body: str) -> None:  # type: ignore[no-untyped-def]
    """A real installed distribution on sys.path: ``module.py`` and a
    dist-info whose entry_points.txt names it in the ``reshard.storage`` group."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    info = tmp_path / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{name} = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry._loaded, "entry_points", False)  # this process looks again


def test_a_backend_outside_reshard_is_found_through_its_entry_point(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _distribution(tmp_path, monkeypatch, "eptoy", "reshard_eptoy_store", """
        from reshard.storage import MemoryStorage, Scheme, register_scheme

        class EpToyStorage(MemoryStorage):
            pass

        register_scheme(Scheme(name="eptoy", open=lambda rest: (EpToyStorage("eptoy"), rest.strip("/"))))
    """)
    try:
        st, key = resolve("eptoy://run/step-1")
        assert type(st).__name__ == "EpToyStorage" and key == "run/step-1"
        assert st.url(key) == "eptoy://run/step-1"
        st.write_bytes(st.join(key, "x"), b"x")
        assert resolve(st.url(key))[0].read_bytes(st.join(key, "x")) == b"x"
    finally:
        registry.unregister_scheme("eptoy")


def test_a_broken_entry_point_is_named_and_skipped(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    _distribution(tmp_path, monkeypatch, "broken", "reshard_broken_store", "raise ImportError('no sdk')\n")
    with caplog.at_level(logging.WARNING, logger="reshard.storage.registry"):
        assert "broken" not in [s.name for s in schemes()]
    assert "storage backend 'broken' (entry point reshard_broken_store in group reshard.storage) did not " \
           "load: no sdk" in caplog.text
    assert isinstance(resolve("memory://still/works")[0], MemoryStorage)


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_test_stores_start_empty_and_close_clean(backend: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ts = start_test_store(backend, scratch=str(tmp_path))
    try:
        st, key = resolve(ts.url("run"))
        assert not st.exists(key)
        st.makedirs(key)
        st.write_bytes(st.join(key, "a.bin"), b"abc")
        assert st.read_bytes(st.join(key, "a.bin")) == b"abc"
        assert ts.description and ts.env() == {}
    finally:
        ts.close()
    assert not st.exists(st.join(key, "a.bin"))
