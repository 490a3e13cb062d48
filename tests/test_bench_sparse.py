"""Sparse rows of ``mla-verify bench`` on CPU: the grid, the bytes counted from each format's definition, the
CPU stand-in timed through the real command, the regression gate on sparse rows, and GPU-only backends'
reasons."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import flashinfer.mla
import pytest
import torch
from test_bench import TINY_AXES, FakeClock, fake_backends

from mla_verify.backends import Backend, all_backends
from mla_verify.backends.base import PreparedCall
from mla_verify.backends.flashmla_api import FlashMLAApi
from mla_verify.bench import grid as bench
from mla_verify.bench import measure
from mla_verify.bench.grid import SPARSE_GRIDS, SparseBenchCase, sparse_case_bytes, sparse_case_flops
from mla_verify.bench.measure import BenchResult, bench_main, compare_results, run_bench
from mla_verify.bench.timing import WallClockTimer
from mla_verify.kernels.flashmla_cpu import SparseStandIn, sparse_stand_in_backend
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseDecodeProblem, SparseSpec, build_sparse_problem

STAND_IN = "mla_verify.kernels.mutants:correct_sparse_kernel"
# 4 heads (the stand-in pads them to 64, as FlashMLA does), topk 64 of a 128-token context: milliseconds a case
TINY_SPARSE = {"batch": (2,), "heads": (4,), "topk": (64,), "fmt": ("bf16", "V32", "V32_NO_ROPE", "V4"),
               "q_len": (1, 2), "page_size": (64,), "context": (128,)}
TINY_SPARSE_ARGS = ["--batch", "2", "--heads", "4", "--topk", "64", "--q-len", "1,2", "--page-size", "64",
                    "--context", "128"]

# One token's cache row, from each format's definition (docs/reference.md, "Sparse decode"; problems/packed.py's
# docstring): fp8 values are 1 byte, fp32 scales 4, bf16 values 2, a ue8m0 scale 1.
ROW_BYTES = {
    "V32": 512 * 1 + (512 // 128) * 4 + 64 * 2,  # 512 fp8, one fp32 scale per 128 values, 64 bf16 rope
    "V32_NO_ROPE": 512 * 1 + (512 // 128) * 4,  # the same without the rope
    "V4": 448 * 1 + 64 * 2 + (448 // 64 + 1),  # 448 fp8, 64 bf16 rope; 7 ue8m0 scales (one per 64) and a pad byte
    "bf16": 576 * 2,  # 512 + 64 values, unpacked
}


# ---------------------------------------------------------------------------------------------------- grid
def test_the_sparse_grid_covers_the_serving_shapes() -> None:
    grid = bench.make_grid(SPARSE_GRIDS["default"], SparseBenchCase)
    assert {c.heads for c in grid} == {64, 128} and {c.topk for c in grid} == {512, 2048}
    assert {c.q_len for c in grid} == {1} and {c.fmt for c in grid} == set(ROW_BYTES)
    assert all(c.context >= c.topk for c in grid)
    assert len({c.key for c in grid}) == len(grid)
    dense_keys = {c.key for c in bench.make_grid(bench.GRIDS["default"])}
    assert not dense_keys & {c.key for c in grid}  # compare matches on (backend, key): no kind may meet the other
    anchor = bench.make_grid(SPARSE_GRIDS["anchor"], SparseBenchCase)
    assert {(c.heads, c.topk, c.q_len) for c in anchor} == {(128, 2048, 1)}  # DeepSeek V3.2's decode shape


@pytest.mark.parametrize("fmt", sorted(ROW_BYTES))
@pytest.mark.parametrize("q_len", [1, 2])
def test_bytes_and_flops_match_a_count_from_the_format(fmt: str, q_len: int) -> None:
    case = SparseBenchCase(batch=3, heads=4, topk=64, fmt=fmt, q_len=q_len, context=96)
    spec = case.spec(seed=0)
    problem = build_sparse_problem(spec)
    idx = problem.indices.view(-1, spec.topk)
    # every entry is a valid slot, distinct within its row: each is one cache row the kernel must read
    assert bool((idx >= 0).all()) and all(len(set(row.tolist())) == spec.topk for row in idx)
    if fmt != "bf16":  # the packer agrees with the definition: a page of token rows (V4: padded past them)
        page_bytes = problem.packed.shape[-1]
        assert page_bytes == spec.page_size * ROW_BYTES[fmt] if fmt != "V4" else page_bytes >= 64 * ROW_BYTES[fmt]
    entries = idx.numel()
    query = problem.query.numel() * problem.query.element_size()
    out = 3 * q_len * 4 * 512 * 2  # bf16 [B, q_len, H, 512]
    assert sparse_case_bytes(spec) == entries * ROW_BYTES[fmt] + query + out
    d_qk = problem.query.shape[-1]  # q.k over the whole row, p * v over its first 512
    assert sparse_case_flops(spec) == entries * 4 * (2 * d_qk + 2 * 512)


def test_a_context_smaller_than_topk_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--device", "cpu", "--kernel", STAND_IN, "--topk", "64,128", "--context", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--context 100 is smaller than --topk 128" in err
    assert bench_main(["--device", "cpu", "--kernel", STAND_IN, "--format", "V9"]) == 2
    assert "--format: unknown ['V9']" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- the real command
def test_the_cpu_stand_in_is_timed_through_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No test doubles: the stand-in named by --kernel, the wall clock, the files; then --compare on them."""
    argv = ["--device", "cpu", "--kernel", STAND_IN, "--samples", "2", "--out", str(tmp_path)] + TINY_SPARSE_ARGS
    assert bench_main(argv) == 0
    assert "host wall-clock" in capsys.readouterr().out
    result = BenchResult.load(tmp_path / "bench.json")
    grid = bench.make_grid(TINY_SPARSE, SparseBenchCase)
    assert [c.key for c in result.cases if c.case["fmt"] != "bf16"] == [c.key for c in grid if c.fmt != "bf16"]
    assert {c.kind for c in result.cases} == {"sparse"}
    skipped = [c for c in result.cases if c.status == "skipped"]
    assert {c.case["fmt"] for c in skipped} == {"bf16"} and all("format bf16" in c.reason for c in skipped)
    timed = result.timed()
    assert len(timed) == 6 and {c.status for c in timed} == {"ok"}  # 3 packed formats x q_len 1, 2
    for c in timed:
        assert c.rel_l2 < measure.SANITY_REL_L2 and c.reference_ms is not None
        assert c.bytes == sparse_case_bytes(SparseBenchCase(**c.case).spec(0))
        assert math.isclose(c.gbps, c.bytes / (c.median_ms * 1e-3) / 1e9, rel_tol=1e-9)
    with (tmp_path / "bench.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["kind"], r["fmt"], r["topk"]) for r in rows] == [("sparse", c.case["fmt"], "64") for c in result.cases]
    svg = ET.parse(tmp_path / "bench_gbps.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len([e for e in svg.iter(f"{ns}rect") if e.find(f"{ns}title") is not None]) == len(timed)
    assert bench_main(["--result", str(tmp_path / "bench.json"), "--compare", str(tmp_path / "bench.json")]) == 0
    report = capsys.readouterr().out
    assert f"compared {len(timed)} case(s)" in report and "no regression" in report


# ------------------------------------------------------------------------------------------------- gate
def sparse_backends() -> dict[str, Backend]:
    return {name: b for name, b in all_backends().items() if b.kind == "sparse"}


class ClockedSparse(Backend):
    """The CPU stand-in behind a fake clock: each call 'takes' ``seconds``."""

    def __init__(self, name: str, clock: FakeClock, seconds: float):
        self.inner = sparse_stand_in_backend()
        self.name, self.envelope, self.clock, self.seconds = name, self.inner.envelope, clock, seconds

    def prepare(self, problem: SparseDecodeProblem, layout: LayoutSpec = SPARSE_LAYOUT) -> PreparedCall:
        call = self.inner.prepare(problem, layout)

        def invoke() -> object:
            self.clock.now += self.seconds
            return call.invoke()
        return dataclasses.replace(call, invoke=invoke)


def mixed_run(sparse_s: float) -> BenchResult:
    """A dense fake and a clocked sparse stand-in in one run, over a dense and a sparse grid."""
    clock = FakeClock()
    backends = [*fake_backends(clock, {"dense": 1e-3}), ClockedSparse("sparse", clock, sparse_s)]
    grid = bench.make_grid(TINY_AXES) + bench.make_grid({**TINY_SPARSE, "fmt": ("V32",)}, SparseBenchCase)
    return run_bench(backends, grid, "cpu", timer=WallClockTimer(clock=clock, samples=3), reference=False)


def test_compare_flags_a_slowed_sparse_backend_among_dense_rows() -> None:
    baseline = mixed_run(1e-3)
    assert {(c.backend, c.kind) for c in baseline.cases} == {("dense", "dense"), ("sparse", "sparse")}
    cmp = compare_results(mixed_run(1.25e-3), baseline, threshold=0.10)
    assert {(d.backend, d.key.startswith("sparse-")) for d in cmp.regressions} == {("sparse", True)}
    assert len(cmp.regressions) == 2  # q_len 1 and 2
    assert compare_results(mixed_run(1e-3), baseline).regressions == []


def test_a_result_of_schema_1_still_reads_as_dense_rows(tmp_path: Path) -> None:
    """The stored H200 baselines predate the kind column: --compare must still take them."""
    old = mixed_run(1e-3).to_json()
    old["schema"] = "mla-verify-bench/1"
    old["cases"] = [{k: v for k, v in c.items() if k != "kind"} for c in old["cases"] if c["kind"] == "dense"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = BenchResult.load(path)
    assert {c.kind for c in loaded.cases} == {"dense"}
    assert compare_results(mixed_run(1e-3), loaded).regressions == []


# --------------------------------------------------------------------------------------- GPU-only backends
@pytest.mark.parametrize("name", sorted(sparse_backends()))
def test_a_named_gpu_only_sparse_backend_is_refused_with_its_reason(name: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    reason = sparse_backends()[name].unavailable_reason(torch.device("cpu"))
    assert reason  # each needs a GPU, or a library only GPU hosts have
    assert bench_main(["--device", "cpu", "--backend", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"backend {name} cannot run on cpu: {reason}" in err[0]


def test_unnamed_sparse_backends_are_skipped_with_their_reason(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    args = []
    for axis, values in TINY_AXES.items():
        args += [f"--{axis.replace('_', '-')}", ",".join(map(str, values))]
    assert bench_main(["--device", "cpu", "--samples", "1", "--no-reference", "--out", str(tmp_path)] + args) == 0
    err = capsys.readouterr().err
    for name, backend in sparse_backends().items():
        assert f"skipping {name}: {backend.unavailable_reason(torch.device('cpu'))}" in err
    result = BenchResult.load(tmp_path / "bench.json")
    assert {c.kind for c in result.cases} == {"dense"} and result.timed()


# ---------------------------------------------------------------------------------------- widened formats
class PlanOnly:
    """FlashInfer's MLA wrapper, planned but never run (what fa3-sparse's prepare touches)."""

    def __init__(self, *args: object, **kwargs: object) -> None: ...

    def plan(self, **kwargs: object) -> None: ...


@pytest.mark.parametrize("name", sorted(sparse_backends()))
def test_widened_formats_are_those_whose_packed_bytes_the_call_never_gets(name: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench skips a backend's widened formats as bf16 traffic: true only if its prepared call hands the kernel
    no packed (uint8) bytes for exactly those formats."""
    monkeypatch.setattr(flashinfer.mla, "BatchMLAPagedAttentionWrapper", PlanOnly)
    backend = sparse_backends()[name]
    if name == "flashmla-sparse":  # the wheel is not installed here: its calling convention on CPU
        stand_in = SparseStandIn()
        backend.api = FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache)
    for fmt in backend.envelope.formats:
        if fmt == "bf16":
            continue
        spec = SparseSpec(batch=1, num_heads=4, topk=64, page_size=64, used_pages=2, fmt=fmt, invalid=0.0)
        call = backend.prepare(build_sparse_problem(spec))
        reads_packed = any(t.dtype == torch.uint8 for t in call.inputs.values())
        assert reads_packed == (fmt not in backend.widened_formats), fmt


def test_the_bench_times_a_widened_format_only_as_bf16() -> None:
    clock = FakeClock()
    backend = ClockedSparse("widening", clock, 1e-3)
    backend.widened_formats = ("V4",)
    grid = bench.make_grid({**TINY_SPARSE, "fmt": ("V32", "V4"), "q_len": (1,)}, SparseBenchCase)
    result = run_bench([backend], grid, "cpu", timer=WallClockTimer(clock=clock, samples=2), reference=False)
    by_fmt = {c.case["fmt"]: c for c in result.cases}
    assert by_fmt["V32"].status == "ok"
    assert by_fmt["V4"].status == "skipped" and "bf16 rows" in by_fmt["V4"].reason
