"""SaveOptions by concern (issue 31 point 7): every flat field sits in exactly
one group; a SaveOptions built from its groups equals the flat one, and old
code (flat keywords, ``dataclasses.replace``, ``asdict``, ``==``) keeps working."""

from __future__ import annotations

import dataclasses

import pytest

from reshard.options import (
    SAVE_OPTION_GROUPS,
    BackgroundOptions,
    IntegrityOptions,
    LineageOptions,
    SaveOptions,
    TimeoutOptions,
)


def test_every_field_is_in_exactly_one_group() -> None:
    fields = [f.name for f in dataclasses.fields(SaveOptions)]
    grouped = [f for names in SAVE_OPTION_GROUPS.values() for f in names]
    assert sorted(grouped) == sorted(fields)  # a field added later must be given a group
    assert len(grouped) == len(set(grouped))


def test_groups_build_the_flat_options_and_read_them_back() -> None:
    key = b"k" * 32
    o = SaveOptions.of(integrity=IntegrityOptions(checksums=False, hmac_key=key),
                       background=BackgroundOptions(overlap_staging=True, staging_budget_bytes=1 << 20),
                       lineage_options=LineageOptions(parent="p", incremental=True),
                       timeouts=TimeoutOptions(timeout_s=30.0), durable=False)
    flat = SaveOptions(checksums=False, hmac_key=key, overlap_staging=True, staging_budget_bytes=1 << 20,
                       parent="p", incremental=True, timeout_s=30.0, durable=False)
    assert o == flat
    assert o.integrity == IntegrityOptions(checksums=False, hmac_key=key)
    assert o.background.overlap_staging and o.lineage_options.parent == "p"
    assert o.files.durable is False and o.timeouts.timeout_s == 30.0
    # old code: replace, asdict and == on the flat names
    r = dataclasses.replace(o, checksums=True)
    assert r.integrity.checksums and not o.integrity.checksums
    assert dataclasses.asdict(o)["overlap_staging"] is True
    # defaults of a group are SaveOptions' defaults
    assert SaveOptions.of() == SaveOptions()
    for name, names in SAVE_OPTION_GROUPS.items():
        view = getattr(SaveOptions(), "lineage_options" if name == "lineage" else name)
        assert dataclasses.asdict(view) == {f: getattr(SaveOptions(), f) for f in names}


def test_bad_groups_are_named() -> None:
    with pytest.raises(TypeError, match="given both flat and in its group"):
        SaveOptions.of(integrity=IntegrityOptions(), checksums=False)
    with pytest.raises(TypeError, match="takes a BackgroundOptions"):
        SaveOptions.of(background=IntegrityOptions())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staging_budget_bytes"):
        SaveOptions.of(background=BackgroundOptions(staging_budget_bytes=1))
