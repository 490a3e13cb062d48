"""Benchmark mode on CPU: byte/FLOP counts, the regression gate with a fake clock, outputs, and the no-GPU exit."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.bench import grid as bench
from mla_verify.bench import measure
from mla_verify.bench.grid import BenchCase
from mla_verify.bench.measure import BenchResult, bench_main, compare_results, run_bench
from mla_verify.bench.timing import WallClockTimer
from mla_verify.core.dims import MLADims
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import canonical_cache
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode

TINY_AXES = {"batch": (2, 3), "heads": (2,), "max_seq_len": (40,), "page_size": (32,), "dtype": ("bf16",),
             "q_len": (1, 2)}


class FakeClock:
    """A clock that only moves when a fake kernel says it spent time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_kernel(clock: FakeClock, seconds: float, correct: bool = False):
    """A trtllm-style kernel that 'takes' ``seconds`` on the fake clock; correct (the reference) or all zeros
    (cheap: enough wherever the output is not checked)."""

    def kernel(query, kv_cache, workspace, qk_nope, kv_lora_rank, rope, block_tables, seq_lens, max_seq_len,
               out=None, bmm1_scale=1.0, bmm2_scale=1.0, return_lse=False, **kwargs):
        clock.now += seconds
        dims = MLADims(kv_lora_rank, rope, qk_nope, 128, query.shape[2])
        if correct:
            p = DecodeProblem(query, canonical_cache(kv_cache), block_tables, seq_lens, dims, bmm1_scale, bmm2_scale)
            o = reference_decode(p, precision=torch.float32).out.to(torch.bfloat16)
        else:
            o = torch.zeros(*query.shape[:3], kv_lora_rank, dtype=torch.bfloat16)
        if out is None:
            return o
        out.copy_(o)
        return out
    return kernel


def fake_backends(clock: FakeClock, costs: dict[str, float], correct: bool = False) -> list[TrtllmStyleBackend]:
    return [TrtllmStyleBackend(name, timed_kernel(clock, s, correct)) for name, s in costs.items()]


def fake_run(costs: dict[str, float], reference: bool = False, correct: bool = True) -> BenchResult:
    """A CPU run of fake backends; the kernels compute real outputs only when the reference checks them."""
    clock = FakeClock()
    return run_bench(fake_backends(clock, costs, correct and reference), bench.make_grid(TINY_AXES), "cpu",
                     timer=WallClockTimer(clock=clock, samples=3), reference=reference)


# -------------------------------------------------------------------------------------------- counting
@pytest.mark.parametrize("dtype,q_len", [("bf16", 1), ("bf16", 3), ("fp8", 2)])
def test_bytes_and_flops_match_a_hand_count(dtype: str, q_len: int) -> None:
    spec = ProblemSpec((5, 17, 3), q_len=q_len, num_heads=4, page_size=8, dtype=dtype)
    problem = build_problem(spec)
    # Bytes, counted from the built tensors: cache rows a sequence owns are exactly the non-NaN ones
    # (build_problem poisons every other slot), plus the whole query, plus a bf16 [B, q_len, H, 512] output.
    owned_rows = int((~torch.isnan(problem.kv_cache.float()[..., 0])).sum())
    item = problem.kv_cache.element_size()
    hand_bytes = (owned_rows * 576 * item + problem.query.numel() * problem.query.element_size()
                  + 3 * q_len * 4 * 512 * 2)
    assert bench.case_bytes(spec) == hand_bytes
    # FLOPs: enumerate (query token, head, KV token) triples the causal mask lets through; each costs a
    # 576-long dot product (q.k) and a 512-long axpy (p * v), 2 FLOPs per multiply-add.
    visible = sum(1 for n in spec.seq_lens for i in range(q_len) for t in range(n) if t <= n - q_len + i)
    assert bench.case_flops(spec) == visible * 4 * (2 * 576 + 2 * 512)


def test_rotation_covers_twice_l2_and_never_repeats_back_to_back() -> None:
    l2 = 60 << 20
    for set_bytes in (1 << 10, 19 << 20, 59 << 20, 61 << 20, 5 << 30):
        n = measure.rotation_sets(set_bytes, l2)
        assert n >= 2
        assert n * set_bytes >= 2 * l2 or n == measure.MAX_SETS
    assert measure.rotation_sets(1 << 20, 0) == 1  # CPU: no cache size to defeat


def test_ragged_lengths_are_seeded_and_in_range() -> None:
    case = BenchCase(batch=64, heads=16, max_seq_len=300, page_size=32, q_len=2)
    lens = case.seq_lens(seed=0)
    assert lens == case.seq_lens(seed=0)
    assert lens != case.seq_lens(seed=1)
    assert len(lens) == 64 and min(lens) >= 2 and max(lens) <= 300 and len(set(lens)) > 10
    assert case.spec(0, 0).seq_lens == case.spec(0, 3).seq_lens
    assert case.spec(0, 0).case_id() != case.spec(0, 3).case_id()  # other values and page order


def test_default_grid_holds_the_anchor_case_and_the_modest_grid() -> None:
    grid = bench.make_grid(bench.GRIDS["default"])
    assert BenchCase(batch=512, heads=16, max_seq_len=4096, page_size=64, dtype="bf16", q_len=1) in grid
    assert {c.heads for c in grid} == {16, 128} and {c.batch for c in grid} == {32, 128, 512}
    assert {c.max_seq_len for c in grid} == {1024, 4096, 16384} and {c.page_size for c in grid} == {32, 64}
    assert len({c.key for c in grid}) == len(grid) == 72


# ------------------------------------------------------------------------------------------------- gate
def test_compare_flags_a_slowed_backend_and_passes_an_unchanged_one() -> None:
    baseline = fake_run({"steady": 1e-3, "victim": 1e-3})
    current = fake_run({"steady": 1e-3, "victim": 1.25e-3})
    cmp = compare_results(current, baseline, threshold=0.10)
    assert {d.backend for d in cmp.regressions} == {"victim"}
    assert len(cmp.regressions) == len(bench.make_grid(TINY_AXES))
    assert math.isclose(cmp.max_abs_rel.rel, 0.25, rel_tol=1e-9)
    unchanged = compare_results(fake_run({"steady": 1e-3, "victim": 1e-3}), baseline, threshold=0.10)
    assert unchanged.regressions == [] and unchanged.max_abs_rel.rel == 0.0
    within = compare_results(fake_run({"steady": 1e-3, "victim": 1.05e-3}), baseline, threshold=0.10)
    assert within.regressions == []  # 5% slower: the run-to-run spread we accept, not a regression


def test_sub_microsecond_differences_are_not_regressions() -> None:
    baseline = fake_run({"tiny": 2e-7})
    assert compare_results(fake_run({"tiny": 4e-7}), baseline).regressions == []  # +100% but only 0.2 us


def test_compare_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path end to end: run with --compare against a saved baseline -> exit 1 naming the slowed case."""
    fake_run({"steady": 1e-3, "victim": 1e-3}).save(tmp_path / "base")
    base_json = str(tmp_path / "base" / "bench.json")

    def run(costs: dict[str, float], out: str) -> int:
        clock = FakeClock()
        ns = _parse(["--device", "cpu", "--no-reference", "--out", str(tmp_path / out), "--compare", base_json]
                    + _grid_args())
        return measure.bench_command(ns, resolve=lambda names, kernels: fake_backends(clock, costs),
                                   timer=WallClockTimer(clock=clock, samples=3))

    assert run({"steady": 1e-3, "victim": 1e-3}, "same") == 0
    assert "no regression" in capsys.readouterr().out
    assert run({"steady": 1e-3, "victim": 2e-3}, "slow") == 1
    out = capsys.readouterr().out
    assert "REGRESSION victim" in out and "REGRESSION steady" not in out
    assert (tmp_path / "slow" / "compare.txt").read_text().count("REGRESSION") == len(bench.make_grid(TINY_AXES))
    # comparing two stored results (the run-to-run check) is the same gate, no run needed
    assert bench_main(["--result", str(tmp_path / "slow" / "bench.json"), "--compare", base_json]) == 1
    assert bench_main(["--result", str(tmp_path / "same" / "bench.json"), "--compare", base_json,
                       "--threshold", "0.05"]) == 0


def test_unreadable_baseline_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    assert bench_main(["--result", str(bad), "--compare", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a benchmark result" in err


# ---------------------------------------------------------------------------------------------- outputs
def test_results_round_trip_and_every_output_is_written(tmp_path: Path) -> None:
    result = fake_run({"a": 1e-3, "b": 2e-3})
    paths = result.save(tmp_path)
    loaded = BenchResult.load(paths[0])
    assert loaded.to_json() == json.loads(json.dumps(result.to_json()))
    rows = paths[1].read_text().strip().splitlines()
    assert len(rows) == 1 + len(result.cases)
    svg = ET.parse(paths[2]).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    bars = [e for e in svg.iter(f"{ns}rect") if e.find(f"{ns}title") is not None]  # legend swatches have none
    assert len(bars) == len(result.timed())
    for key in ("date", "device_name", "torch", "flashinfer", "grid", "formulas", "copy_gbps"):
        assert key in result.meta
    assert result.meta["complete"] is True
    a = [c for c in result.cases if c.backend == "a"][0]
    assert math.isclose(a.median_ms, 1.0) and math.isclose(a.gbps, a.bytes / 1e-3 / 1e9)


def test_each_finished_case_is_checkpointed() -> None:
    seen: list[tuple[int, bool]] = []
    clock = FakeClock()
    run_bench(fake_backends(clock, {"a": 1e-3}), bench.make_grid(TINY_AXES), "cpu", reference=False,
              timer=WallClockTimer(clock=clock, samples=2),
              checkpoint=lambda partial: seen.append((len(partial.cases), partial.meta["complete"])))
    assert seen == [(i + 1, False) for i in range(len(bench.make_grid(TINY_AXES)))]


def test_the_timed_output_is_checked_against_the_reference() -> None:
    right = fake_run({"right": 1e-3}, reference=True)
    assert {c.status for c in right.cases} == {"ok"} and all(c.rel_l2 < measure.SANITY_REL_L2 for c in right.cases)
    assert all(c.reference_ms is not None for c in right.cases)
    wrong = fake_run({"zeros": 1e-3}, reference=True, correct=False)
    assert {c.status for c in wrong.cases} == {"wrong"}
    assert "WRONG" in wrong.table()


def test_a_case_outside_the_envelope_is_skipped_with_its_reason() -> None:
    clock = FakeClock()
    backend = TrtllmStyleBackend("q1only", timed_kernel(clock, 1e-3),
                                 envelope=TRTLLM_ENVELOPE.narrowed(q_len=(1, 1)))
    result = run_bench([backend], bench.make_grid(TINY_AXES), "cpu", timer=WallClockTimer(clock=clock, samples=2),
                       reference=False)
    skipped = [c for c in result.cases if c.status == "skipped"]
    assert {c.case["q_len"] for c in skipped} == {2} and all("q_len 2" in c.reason for c in skipped)
    assert {c.case["q_len"] for c in result.timed()} == {1}


def test_bench_main_times_the_registered_cpu_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No test doubles: the registry's cpu-peer backend, the real wall clock, the files on disk."""
    argv = ["--device", "cpu", "--backend", "cpu-peer", "--samples", "2", "--out", str(tmp_path)] + _grid_args()
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "host wall-clock" in out
    result = BenchResult.load(tmp_path / "bench.json")
    assert {(c.backend, c.status) for c in result.cases} == {("cpu-peer", "ok")}
    assert len(result.cases) == len(bench.make_grid(TINY_AXES))
    assert all(c.median_ms > 0 and c.rel_l2 < measure.SANITY_REL_L2 for c in result.cases)


def test_an_internal_error_is_one_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m mla_verify.bench` as `mla-verify bench`: the CLI's catch-all, not a traceback
    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(measure, "_run_from_options", broken)
    monkeypatch.delenv("MLA_VERIFY_TRACEBACK", raising=False)
    assert bench_main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mla-verify bench: internal error: RuntimeError: boom")


# ----------------------------------------------------------------------------------------------- no GPU
def test_no_gpu_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]


# -------------------------------------------------------------------------------------------- helpers
def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    measure.add_bench_arguments(parser)
    return parser.parse_args(argv)


def _grid_args() -> list[str]:
    """TINY_AXES as command-line overrides."""
    args = []
    for axis, values in TINY_AXES.items():
        args += [f"--{axis.replace('_', '-')}", ",".join(map(str, values))]
    return args


# ---------------------------------------------------------------------------------------------- on a GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _call(invoke):
    from mla_verify.backends.base import PreparedCall

    return PreparedCall(invoke, {}, None, lambda r: (r, None))


@pytest.mark.gpu
@needs_cuda
def test_a_call_that_cannot_be_captured_is_timed_with_plain_launches() -> None:
    from mla_verify.bench.timing import EAGER, CudaTimer

    x = torch.ones(1 << 20, device="cuda")
    timer = CudaTimer(torch.device("cuda"), samples=3)
    armed = timer.arm([_call(lambda: float(x.sum()))])  # a host sync: illegal while capturing
    assert armed.method == EAGER and "capture failed" in armed.note
    assert timer.measure(armed).median_s > 0


@pytest.mark.parametrize("argv", [["--threshold", "nan"], ["--threshold", "inf"], ["--threshold", "0"],
                                  ["--batch", "0"], ["--heads", "4,-1"], ["--q-len", "x"]])
def test_bad_numbers_are_refused_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # --threshold nan would turn the regression gate off (no slowdown compares greater than nan)
    with pytest.raises(SystemExit) as exit_:
        bench_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argv[0] in err
