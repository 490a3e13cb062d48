"""Reproducer fixtures: bit-exact round trip, and every damaged / foreign / half-written file refused."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from mla_verify.core.bits import same_bits
from mla_verify.core.errors import FixtureError, UsageError
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.records import fixtures
from mla_verify.records.fixtures import fixture_paths, load_fixture, save_fixture

SPECS = {
    "bf16": ProblemSpec(seq_lens=(5, 17), q_len=2, num_heads=3, page_size=16, extra_pages=2, table_pad=1, seed=3),
    "fp8": ProblemSpec(seq_lens=(9,), num_heads=2, page_size=4, kv_lora_rank=256, dtype="fp8", q_scale=0.5,
                       k_scale=2.0, seed=4),
}
LAYOUT = LayoutSpec(cache_dims=4, page_stride_pad=3, table_width="pad128", pass_out=False)


def _save(tmp_path, kind="bf16", name="case"):
    spec = SPECS[kind]
    problem = build_problem(spec)
    g = torch.Generator().manual_seed(0)
    extra = {"kernel_out": torch.randn(spec.batch, spec.q_len, spec.num_heads, spec.kv_lora_rank,
                                       generator=g).to(torch.bfloat16),
             "kernel_lse": torch.randn(spec.batch * spec.q_len, spec.num_heads, generator=g)}
    meta = {"spec": spec.to_json(), "layout": LAYOUT.to_json(), "backend": "peer", "verdict": "fail",
            "failures": ["max |out - ref| too large"], "diagnosis": []}
    path = save_fixture(tmp_path, name, problem, meta, extra)
    return path, problem, extra


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_round_trip_is_bit_exact(tmp_path, kind):
    path, problem, extra = _save(tmp_path, kind)
    fx = load_fixture(path)
    for name in fixtures.PROBLEM_TENSORS:
        got, want = getattr(fx.problem, name), getattr(problem, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert same_bits(got, want), name
    for name, want in extra.items():
        assert same_bits(fx.tensors[name], want)
    assert fx.spec == SPECS[kind] and fx.layout == LAYOUT
    assert (fx.problem.dims, fx.problem.bmm1_scale, fx.problem.bmm2_scale, fx.problem.max_seq_len) == (
        problem.dims, problem.bmm1_scale, problem.bmm2_scale, problem.max_seq_len)
    assert fx.meta["verdict"] == "fail" and fx.meta["backend"] == "peer"
    if kind == "fp8":
        assert fx.problem.query.dtype == torch.float8_e4m3fn  # stored as its own dtype, not a uint8 view


def test_record_holds_versions_and_hashes(tmp_path):
    path, _, _ = _save(tmp_path)
    meta = json.loads(path.read_text())
    assert {"python", "torch", "flashinfer", "mla_verify"} <= set(meta["versions"])
    assert set(meta["tensors"]) == {"query", "kv_cache", "block_table", "seq_lens", "kernel_out", "kernel_lse"}
    assert all(len(t["sha256"]) == 64 for t in meta["tensors"].values())
    assert len(meta["tensors_sha256"]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.json", "case.safetensors"]  # no temp files left


@pytest.mark.parametrize("name", ["case", "case.json", "case.safetensors"])
def test_any_of_the_pair_names_the_fixture(tmp_path, name):
    _save(tmp_path)
    assert load_fixture(tmp_path / name).meta["backend"] == "peer"


def _refused(path, match: str) -> str:
    with pytest.raises(FixtureError, match=match) as info:
        load_fixture(path)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing(tmp_path):
    _refused(tmp_path / "nothing.json", "no such fixture")


def test_json_without_tensors(tmp_path):
    path, _, _ = _save(tmp_path)
    fixture_paths(path)[0].unlink()
    _refused(path, "missing .*half-written")


def test_tensors_without_json(tmp_path):
    path, _, _ = _save(tmp_path)
    path.unlink()
    _refused(path, "missing while .* exists .*half-written")


def test_crash_before_json_leaves_a_detectable_half_pair(tmp_path, monkeypatch):
    real = fixtures.atomic_write

    def crash_on_json(p, data):
        if p.suffix == ".json":
            raise OSError("disk full")
        real(p, data)

    monkeypatch.setattr(fixtures, "atomic_write", crash_on_json)
    with pytest.raises(OSError):
        _save(tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.safetensors"]
    _refused(tmp_path / "case", "half-written")


def test_a_case_record_written_over_in_place_holds_the_last_case_alone(tmp_path):
    # the case in flight is rewritten for every case, in place: a shorter record must not keep the tail of
    # the longer one before it
    long_meta = {"backend": "peer", "layout": LAYOUT.to_json(), "reason": "x" * 500}
    fixtures.write_case_record(tmp_path, "in-flight", SPECS["fp8"], torch.device("cpu"), long_meta, durable=False)
    path = fixtures.write_case_record(tmp_path, "in-flight", SPECS["bf16"], torch.device("cpu"),
                                      {"backend": "peer", "layout": LAYOUT.to_json()}, durable=False)
    fx = load_fixture(path)
    assert fx.spec == SPECS["bf16"] and "reason" not in fx.meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-flight.json"]  # no temporary file left


def test_truncated_tensors(tmp_path):
    path, _, _ = _save(tmp_path)
    tensors = fixture_paths(path)[0]
    tensors.write_bytes(tensors.read_bytes()[:-100])
    _refused(path, "sha256 does not match")


def _flip_last_tensor_byte(path) -> bytes:
    tensors = fixture_paths(path)[0]
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    return bytes(data)


def test_tampered_tensor_byte(tmp_path):
    path, _, _ = _save(tmp_path)
    _flip_last_tensor_byte(path)
    _refused(path, "sha256 does not match")


def test_tampered_tensor_with_file_hash_forged(tmp_path):
    """Whoever edits the tensors and the file hash still trips the per-tensor hashes."""
    import hashlib

    path, _, _ = _save(tmp_path)
    data = _flip_last_tensor_byte(path)
    meta = json.loads(path.read_text())
    meta["tensors_sha256"] = hashlib.sha256(data).hexdigest()
    path.write_text(json.dumps(meta))
    _refused(path, "does not match its recorded dtype/shape/sha256")


class _Trap:
    """Unpickling this creates a marker file: proof that something unpickled."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_pickled_tensors_are_refused_unopened(tmp_path, writer):
    path, _, _ = _save(tmp_path)
    marker = tmp_path / "unpickled"
    trap = _Trap()
    trap.marker = str(marker)
    tensors = fixture_paths(path)[0]
    if writer == "pickle":
        tensors.write_bytes(pickle.dumps({"query": trap}))
    else:
        torch.save({"query": trap}, tensors)
    _refused(path, "pickle or zip")
    assert not marker.exists()


def test_pickled_json_is_refused(tmp_path):
    path, _, _ = _save(tmp_path)
    path.write_bytes(pickle.dumps({"format": fixtures.FORMAT}))
    _refused(path, "pickle or zip archive, not JSON")


@pytest.mark.parametrize("blob", [b"", b"garbage!", b"\x10\x00\x00\x00\x00\x00\x00\x00not-json-header-",
                                  b"\xff" * 64])
def test_garbage_tensors(tmp_path, blob):
    path, _, _ = _save(tmp_path)
    fixture_paths(path)[0].write_bytes(blob)
    _refused(path, "truncated|not a safetensors")


@pytest.mark.parametrize("text,match", [("{not json", "not valid JSON"), ("[1, 2]", "not an mla-verify fixture"),
                                        ('{"format": "other"}', "not an mla-verify fixture")])
def test_garbage_json(tmp_path, text, match):
    path, _, _ = _save(tmp_path)
    path.write_text(text)
    _refused(path, match)


def test_other_format_version(tmp_path):
    path, _, _ = _save(tmp_path)
    meta = json.loads(path.read_text())
    meta["format_version"] = 99
    path.write_text(json.dumps(meta))
    _refused(path, "format version 99")


def test_malformed_record(tmp_path):
    path, _, _ = _save(tmp_path)
    meta = json.loads(path.read_text())
    meta["layout"] = {"cache_dims": 3, "bogus": 1}
    path.write_text(json.dumps(meta))
    _refused(path, "malformed record")


def test_version_1_fixtures_still_load():
    """The committed golden fixtures predate version 2: each holds its problem's tensors."""
    golden = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "golden").glob("*.json"))
    assert golden
    for path in golden:
        fx = load_fixture(path)
        assert fx.meta["format_version"] == 1 and fx.problem is not None and fx.spec is not None


def _spec_only(tmp_path):
    spec = SPECS["bf16"]
    return save_fixture(tmp_path, "case", build_problem(spec), {"spec": spec.to_json()}, store_problem=False)


def test_a_spec_only_fixture_has_no_tensor_file_and_rebuilds_its_problem(tmp_path):
    path = _spec_only(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.json"]
    problem, exact = load_fixture(path).problem_on("cpu")
    assert exact is True and same_bits(problem.kv_cache, build_problem(SPECS["bf16"]).kv_cache)


@pytest.mark.parametrize("damage,match", [("problem_tensors", "no spec with its problem's records"),
                                          ("spec", "no spec with its problem's records"),
                                          ("tensors", "no file holding them")])
def test_a_spec_only_fixture_missing_its_records_is_refused(tmp_path, damage, match):
    path = _spec_only(tmp_path)
    meta = json.loads(path.read_text())
    if damage == "tensors":
        meta["tensors"] = {"kernel_out": {"dtype": "bfloat16", "shape": [1], "sha256": "0" * 64}}
    else:
        del meta[damage]
    path.write_text(json.dumps(meta))
    _refused(path, re.escape(match))


def test_check_writable_dir(tmp_path):
    fixtures.check_writable_dir(tmp_path / "not" / "yet", "--fixtures-dir")  # created later, parent writable
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="--fixtures-dir: .*file is not a directory"):
        fixtures.check_writable_dir(tmp_path / "file" / "sub", "--fixtures-dir")


@pytest.mark.parametrize("field,value,match", [
    ("spec.seq_lens", "ab", "'seq_lens' = 'ab' is not a non-empty list of integers"),
    ("spec.seq_lens", [], "'seq_lens' = [] is not a non-empty list"),
    ("spec.seq_lens", [5.5, 17], "'seq_lens' = [5.5, 17] is not a non-empty list of integers"),
    ("spec.num_heads", "2", "'num_heads' = '2' is not an integer"),
    ("spec.dtype", "int4", "'dtype' = 'int4' is not one of"),
    ("spec", [1, 2], "spec: expected an object of fields, got list"),
    ("metamorphic", "bogus", "metamorphic 'bogus' is not one of"),
    ("backend", 5, "backend 5 is not a name"),
    ("torch_threads", 0, "torch_threads 0 is not a thread count"),
    ("torch_threads", "2", "torch_threads '2' is not a thread count"),
    ("kernel_output", {"out": {"dtype": "bfloat16"}}, "kernel_output is not a record"),
])
def test_a_hand_edited_field_is_refused_in_one_line(tmp_path, field, value, match):
    # replay reads these: a wrong type used to surface later as a TypeError or KeyError "internal error"
    path = _spec_only(tmp_path)
    meta = json.loads(path.read_text())
    *parents, key = field.split(".")
    target = meta
    for parent in parents:
        target = target[parent]
    target[key] = value
    path.write_text(json.dumps(meta))
    _refused(path, re.escape(match))


def test_every_spec_field_has_its_json_check():
    import dataclasses

    from mla_verify.problems import generate
    assert set(generate._JSON_FIELDS) == {f.name for f in dataclasses.fields(ProblemSpec)}
