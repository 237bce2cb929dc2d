"""Fuzzing of the untrusted inputs: manifest, shard files, DCP ``.metadata``,
safetensors headers. The only acceptable outcomes are a valid load or a
CheckpointError, in bounded time and memory; plus one regression test per
distinct failure the fuzzer found."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard.cli import main
from reshard.errors import ManifestError
from reshard.fuzz import runner as F
from reshard.fuzz.cases import _deep_metadata_pickle


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return F.Corpus(str(tmp_path_factory.mktemp("fuzz")))


def _run(case: F.Case, corpus: F.Corpus) -> str:
    with F.memory_ceiling(1 << 30):
        return F.run_case(case, corpus)


def test_seed_inputs_load(corpus):
    for kind, files in (("reshard", corpus.reshard), ("dcp", corpus.dcp), ("hf", corpus.hf)):
        assert F.run_case(F.Case(kind, "seed", dict(files), data_only=True), corpus) == "ok"


def test_a_thousand_inputs(tmp_path):
    rep = F.fuzz(1000, seed=13, workdir=str(tmp_path))
    assert rep.inputs == 1000
    assert rep.ok, rep.crashes[:5]
    kinds = {k.split(":")[0] for k in rep.outcomes}
    assert kinds == {"reshard", "dcp", "hf"}
    # the inputs are hostile: most are refused, and by more than one class
    refused = sum(v for k, v in rep.outcomes.items() if not k.endswith(":ok"))
    assert refused > 700 and len({k.split(":")[1] for k in rep.outcomes}) >= 4


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_generated_inputs_shrink_under_hypothesis(corpus, rng):
    case = F.generate(rng, corpus)
    _run(case, corpus)  # raises (and shrinks) on anything but ok / CheckpointError


_json = st.recursive(st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                     | st.floats(allow_nan=False) | st.text(max_size=30),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=_json)
def test_any_manifest_field_any_json_value(corpus, data, value):
    m = json.loads(corpus.reshard[F.MANIFEST])
    paths = list(F._paths(m))[1:]
    p = data.draw(st.sampled_from(paths))
    F._set(m, p, value)
    files = dict(corpus.reshard)
    files[F.MANIFEST] = json.dumps(m).encode()
    _run(F.Case("reshard", f"{list(p)} = {value!r}", files), corpus)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), value=_json)
def test_any_safetensors_header_field(corpus, data, value):
    h = json.loads(json.dumps(corpus.hf_header))
    p = data.draw(st.sampled_from(list(F._paths(h))[1:]))
    F._set(h, p, value)
    _run(F.Case("hf", f"{list(p)} = {value!r}", {F.HF_FILE: F._hf_file(h, corpus.hf_data)}), corpus)


def test_huge_declarations_fail_before_allocating(corpus):
    """2^60 elements declared consistently in each format: refused under a
    1 GiB address-space ceiling, without a MemoryError behind the refusal."""
    m = json.loads(corpus.reshard[F.MANIFEST])
    ch = m["tensors"]["w"]["chunks"][0]
    m["tensors"]["w"] = {"dtype": "float32", "global_shape": [2**30, 2**30],
                         "chunks": [{**ch, "global_offset": [0, 0], "local_shape": [2**30, 2**30],
                                     "length": 2**62, "checksums": []}]}
    m["files"][ch["file"]]["size"] = 2**62
    files = {**corpus.reshard, F.MANIFEST: json.dumps(m).encode()}
    assert _run(F.Case("reshard", "2^60", files), corpus) in ("ManifestError", "IntegrityError")
    h = json.loads(json.dumps(corpus.hf_header))
    h["w"]["shape"], h["w"]["data_offsets"] = [2**30, 2**30], [0, 2**62]
    assert _run(F.Case("hf", "2^60", {F.HF_FILE: F._hf_file(h, corpus.hf_data)}), corpus) != "ok"


# --------------------------------------------------------------------------- regressions


def test_regression_dcp_memo_index_does_not_allocate(corpus, tmp_path):
    """Found by the fuzzer (a bit flip in ``.metadata`` turned a BINPUT into
    ``LONG_BINPUT 1298491233``): the C unpickler grew its memo array to 1.3e9
    entries (10 GiB) before failing. The restricted unpickler keeps the memo in
    a dict now; the refusal must not be a MemoryError in disguise."""
    from reshard.ondisk.dcp import read_dcp_metadata

    d = tmp_path / "dcp"
    d.mkdir()
    # PROTO 2, EMPTY_DICT, LONG_BINPUT 2^31-1, STOP
    (d / ".metadata").write_bytes(b"\x80\x02}r\xff\xff\xff\x7f.")
    with F.memory_ceiling(256 << 20), pytest.raises(ManifestError) as ei:
        read_dcp_metadata(str(d))
    assert "MemoryError" not in str(ei.value)
    # the record the same bytes were flipped from still loads
    raw = corpus.dcp[F.DCP_META]
    assert pickle.loads(raw) is not None
    for n, b in corpus.dcp.items():
        (d / n).write_bytes(b)
    assert type(read_dcp_metadata(str(d))).__name__ == "Metadata"


def test_regression_dcp_marks_nested_past_the_limit(tmp_path):
    """Found by profiling the fuzzer: a crafted ``.metadata`` of 100k MARKs,
    or of 100k empty lists nested by APPENDs, was walked to its end (the
    slowest DCP inputs); they are refused at MAX_MARK_DEPTH / MAX_FRAME_ITEMS
    with a ManifestError naming the file."""
    from reshard.ondisk.dcp import read_dcp_metadata
    from reshard.ondisk.dcp_metadata import MAX_FRAME_ITEMS, MAX_MARK_DEPTH

    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(b"(" * 100_000 + b".")
    with pytest.raises(ManifestError, match=f"more than {MAX_MARK_DEPTH} MARKs") as ei:
        read_dcp_metadata(str(d))
    assert ".metadata" in str(ei.value)
    # below the limit, the nesting itself is not refused (the stray MARKs are)
    (d / ".metadata").write_bytes(b"(" * (MAX_MARK_DEPTH - 1) + b".")
    with pytest.raises(ManifestError) as ei:
        read_dcp_metadata(str(d))
    assert "MARKs" not in str(ei.value)
    # 100k empty lists piled up to be nested: refused at MAX_FRAME_ITEMS
    for field in ("state_dict_metadata", "planner_data"):
        (d / ".metadata").write_bytes(_deep_metadata_pickle(100_000, field))
        with pytest.raises(ManifestError, match=f"more than {MAX_FRAME_ITEMS} items"):
            read_dcp_metadata(str(d))
    # a Metadata whose field nests 5000 lists deep is read (refused later, by its use)
    (d / ".metadata").write_bytes(_deep_metadata_pickle(5000))
    assert type(read_dcp_metadata(str(d))).__name__ == "Metadata"


def test_regression_no_hidden_memory_error(corpus):
    """The harness itself: a CheckpointError caused by a MemoryError is a crash."""
    err = ManifestError("x")
    err.__cause__ = MemoryError()
    with pytest.raises(AssertionError, match="memory ceiling"):
        F._no_memory_error(err)


# --------------------------------------------------------------------------- CLI


def test_cli_fuzz(tmp_path):
    r = CliRunner().invoke(main, ["fuzz", "--count", "60", "--seed", "5", "--workdir", str(tmp_path),
                                  "--json", str(tmp_path / "f.json")])
    assert r.exit_code == 0, r.output
    assert "crashes: 0" in r.output
    rep = json.loads((tmp_path / "f.json").read_text())
    assert rep["inputs"] == 60 and sum(rep["outcomes"].values()) == 60
    assert CliRunner().invoke(main, ["fuzz", "--count", "0"]).exit_code == 2
    assert CliRunner().invoke(main, ["fuzz", "--count", "x"]).exit_code == 2


def test_cli_fuzz_exits_1_on_a_crash(tmp_path, monkeypatch):
    """A target raising anything but a CheckpointError is counted as a crash
    and fails the run (the seed input, loaded first, passes through)."""
    real = F._load_reshard
    calls = []

    def flaky(d, root, data_only):
        calls.append(d)
        if len(calls) == 1:
            return real(d, root, data_only)
        raise KeyError("not a CheckpointError")

    monkeypatch.setattr(F, "_load_reshard", flaky)
    r = CliRunner().invoke(main, ["fuzz", "--count", "30", "--seed", "2", "--workdir", str(tmp_path),
                                  "--jobs", "1"])  # in this process, where the patch is
    assert r.exit_code == 1, r.output
    assert "KeyError" in r.output and "crashes: 0" not in r.output


def test_workers_run_the_same_inputs_and_report_their_crashes(tmp_path):
    """Input i is derived from (seed, i) alone: two worker processes reach
    the outcomes one process does, input for input; a worker's crash (here
    every input past a 1 microsecond timer) comes back to the report, and
    the report names the slowest input and the time of each family."""
    one = F.fuzz(120, seed=21, workdir=str(tmp_path / "one"))
    two = F.fuzz(120, seed=21, workdir=str(tmp_path / "two"), jobs=2)
    assert two.jobs == 2 and two.inputs == one.inputs == 120
    assert two.outcomes == one.outcomes and two.ok and one.ok
    assert sum(f.inputs for f in two.families.values()) == 120
    assert {k.split(":")[0] for k in two.families} == {"reshard", "dcp", "hf"}
    assert two.slowest.startswith("#") and two.slowest_s == max(f.max_s for f in two.families.values())
    assert F.case_rng(21, 7).random() == F.case_rng(21, 7).random() != F.case_rng(21, 8).random()
    hung = F.fuzz(6, seed=3, workdir=str(tmp_path / "hung"), jobs=2, timeout_s=1e-6)
    assert not hung.ok and len(hung.crashes) == 6, hung.crashes
    assert {c[1] for c in hung.crashes} == {"_Hang"}
    assert [int(c[0].split()[0][1:]) for c in hung.crashes] == list(range(6))


def test_regression_deep_json_in_a_safetensors_header(corpus):
    """Found by the fuzzer: a header nesting 5000 lists raised RecursionError
    out of ``json.loads``; it is a ManifestError now (header and index)."""
    h = json.loads(json.dumps(corpus.hf_header))
    h["b"]["shape"] = "__DEEP_5000__"
    case = F.Case("hf", "deep", {F.HF_FILE: F._hf_file(h, corpus.hf_data)})
    assert F.run_case(case, corpus) == "ManifestError"
    idx = b'{"weight_map": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    case = F.Case("hf", "deep index", {"model.safetensors.index.json": idx, **corpus.hf})
    assert F.run_case(case, corpus) == "ManifestError"


def test_regression_deep_json_in_a_manifest(corpus):
    """Found by the fuzzer: an unknown field (or a value) nesting 5000 lists
    raised RecursionError out of the msgspec decoder; a ManifestError now."""
    m = json.loads(corpus.reshard[F.MANIFEST])
    for where in (m, m["tensors"]["z"]["chunks"][0]):
        where["unknown_1"] = "__DEEP_5000__"
        files = {**corpus.reshard, F.MANIFEST: F._dumps(m)}
        assert F.run_case(F.Case("reshard", "deep", files), corpus) == "ManifestError"
        del where["unknown_1"]


def test_regression_dcp_bytearray8_does_not_allocate(tmp_path):
    """Found by the fuzzer (a MEMOIZE byte 0x94 flipped to 0x96): BYTEARRAY8
    allocates its declared length (here 2^40 bytes) before reading; the
    restricted unpickler refuses it."""
    from reshard.ondisk.dcp import read_dcp_metadata

    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"xx.")
    with F.memory_ceiling(256 << 20), pytest.raises(ManifestError, match="BYTEARRAY8") as ei:
        read_dcp_metadata(str(d))
    assert "MemoryError" not in str(ei.value)


def test_regression_values_nested_past_the_recursion_limit(corpus):
    """Found by the fuzzer: a common value nested 900 lists deep (within
    msgspec's limit) made the codec's decoder raise RecursionError."""
    from reshard.ondisk import codec

    m = json.loads(corpus.reshard[F.MANIFEST])
    m["values"] = {"meta": {"$tuple": [1, "__DEEP_900__"]}}
    files = {**corpus.reshard, F.MANIFEST: F._dumps(m)}
    # any CheckpointError (run_case raises on anything else)
    assert F.run_case(F.Case("reshard", "deep value", files), corpus) != "ok"
    with pytest.raises(ManifestError, match="nested too deeply"):
        codec.decode(b"[" * 900 + b"]" * 900)


def test_regression_seeds_are_the_same_bytes_in_every_workdir(tmp_path):
    """CI saw input i classified ManifestError in one process and
    IntegrityError in another: the seed manifest held the save's clock and
    random attempt id (a created_at one digit shorter moves every later byte
    offset) and the DCP seed its path and a random save id. The seeds are
    pinned now: byte-equal whatever the workdir, and still valid."""
    a = F.Corpus(str(tmp_path / "a"))
    b = F.Corpus(str(tmp_path / "a-longer-path"))
    assert a.reshard == b.reshard and a.dcp == b.dcp and a.hf == b.hf
    assert reshard.verify(str(tmp_path / "a" / "seed" / "reshard")).ok
    assert F.run_case(F.Case("reshard", "seed", dict(a.reshard)), a) == "ok"
    assert F.run_case(F.Case("dcp", "seed", dict(a.dcp)), a) == "ok"
