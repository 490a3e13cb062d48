"""``check --fib-solution``: flashinfer-bench solutions judged as any kernel, and handed back as workloads.

The definitions are flashinfer-bench's own (fixtures/fib, commit ecafa9c2): MLA paged decode (dense) and DSA
sparse attention (sparse). The solutions are the suite's kernels wrapped by fib/contract1.py -- the CPU peer and
the dense mutants, the sparse stand-in and the sparse mutants -- and the definitions' own reference code, built
as a value-returning solution by flashinfer-bench's builder. The independent check of the layouts is that
reference: run on a problem as the adapter lays it out, it must agree with mla-verify's reference.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mla_verify.cli.fib import hand_back
from mla_verify.cli.main import main
from mla_verify.core.bits import same_bits
from mla_verify.core.errors import UsageError
from mla_verify.fib.contract1 import not_expressible, write_solution
from mla_verify.fib.definition import DENSE, SPARSE, dense_inputs, read_definition
from mla_verify.fib.judgement import fib_judgement
from mla_verify.fib.solution import fib_backend, run_as_evaluator
from mla_verify.fib.workload import export_workload, load_workload_inputs
from mla_verify.kernels.mutants import MUTANTS, SPARSE_MUTANTS
from mla_verify.kinds import kind_named
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.reference import reference_decode
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseSpec, build_sparse_problem
from mla_verify.problems.sparse_reference import sparse_reference
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify
from mla_verify.run.harness import CaseResult, run_case

pytest.importorskip("flashinfer_bench", reason="flashinfer-bench is not installed: pip install 'mla-verify[fib]'")

DATASET = Path(__file__).resolve().parents[1] / "fixtures" / "fib"
PEER = "mla_verify.backends.cpu_peer:cpu_peer_decode"
STAND_IN = "correct_sparse_kernel"  # the sparse stand-in (kernels/mutants.py), as the sparse mutants' kernel is named
DENSE_NAMES = {ps: f"mla_paged_decode_h16_ckv512_kpe64_ps{ps}" for ps in (1, 64)}
H8 = "mla_paged_decode_h8_ckv512_kpe64_ps1"
DSA = {ps: f"dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{ps}" for ps in (1, 64)}


def definition_path(name: str) -> Path:
    return next(DATASET.rglob(f"{name}.json"))


def definition(name: str):
    path = definition_path(name)
    return read_definition(json.loads(path.read_text()), str(path))


@pytest.fixture(autouse=True)
def fib_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer-bench's builder writes a python solution's sources under its cache: one per worker."""
    monkeypatch.setenv("FIB_CACHE_PATH", str(tmp_path_factory.getbasetemp() / "fib-cache"))


def sparse_target(kernel: str) -> str:
    """A sparse kernel of kernels/mutants.py by its ``trtllm-sparse`` face, which takes a bf16 cache."""
    return f"mla_verify.kernels.mutants:{kernel}.trtllm_sparse"


@pytest.fixture(scope="module")
def solutions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU peer and every mutant as solutions of each dense definition, the sparse stand-in and every sparse
    mutant of each DSA definition: <dir>/<kernel>_<definition>.json."""
    where = tmp_path_factory.mktemp("solutions")
    for name in (*DENSE_NAMES.values(), H8):
        read = definition(name)
        write_solution(where / f"peer_{name}.json", f"cpu_peer_{name}", PEER, read)
        for mutant in MUTANTS:
            write_solution(where / f"{mutant}_{name}.json", f"{mutant}_{name}",
                           f"mla_verify.kernels.mutants:{mutant}", read)
    for name in DSA.values():
        for kernel in (STAND_IN, *SPARSE_MUTANTS):
            write_solution(where / f"{kernel}_{name}.json", f"{kernel}_{name}", sparse_target(kernel),
                           definition(name))
    return where


def reference_solution(tmp_path: Path, name: str) -> Path:
    """The definition's own reference as a value-returning python solution (as flashinfer-bench builds it)."""
    read = json.loads(definition_path(name).read_text())
    solution = {"name": f"reference_{name}", "definition": name, "author": "flashinfer-bench",
                "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "main.py::run",
                         "destination_passing_style": False},
                "sources": [{"path": "main.py", "content": read["reference"]}]}
    path = tmp_path / f"reference_{name}.json"
    path.write_text(json.dumps(solution))
    return path


def run_main(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the definitions
def test_the_definitions_constant_axes_become_the_envelope() -> None:
    for ps in (1, 64):
        read = definition(DENSE_NAMES[ps])
        env = read.envelope(("cpu", "cuda"), pass_out=True)
        assert (read.kind, read.heads, read.page_size) == (DENSE, 16, ps)
        assert env.page_sizes == (ps,) and env.heads == (16,) and env.dims == ((512, 64),)
        assert env.dtypes == ("bf16",) and env.q_len == (1, 1) and env.lse_base == 2.0
        assert ("kv_last_page_len" in read.inputs) == (ps > 1)
    assert definition(H8).heads == 8
    for ps in (1, 64):
        read = definition(DSA[ps])
        sparse = read.envelope(("cpu",), pass_out=True)
        assert (read.kind, read.topk, read.page_size) == (SPARSE, 2048, ps) and sparse.kind == SPARSE
        assert sparse.formats == ("bf16",) and sparse.max_topk == sparse.topk_multiple == 2048 and not sparse.sinks
        assert sparse.heads == (16,) and sparse.page_sizes == (ps,) and sparse.pass_out == (True,)
        assert sparse.topk_length_formats == () and sparse.lse_base == 2.0


@pytest.mark.parametrize("change, says", [
    (lambda d: d["inputs"].update(qo_indptr={"shape": ["len_indptr"], "dtype": "int32"}), "has inputs"),
    (lambda d: d["axes"]["num_qo_heads"].update(type="var"), "must be a constant"),
    (lambda d: d["inputs"]["q_nope"].update(dtype="float16"), "q_nope is float16"),
    (lambda d: d["inputs"].pop("kv_last_page_len"), "no kv_last_page_len"),
])
def test_a_definition_mla_verify_does_not_read_is_one_line(change, says) -> None:
    data = json.loads(definition_path(DENSE_NAMES[64]).read_text())
    change(data)
    with pytest.raises(UsageError, match=says):
        read_definition(data, "d.json")


@pytest.mark.parametrize("name", [DENSE_NAMES[1], DENSE_NAMES[64], H8])
def test_the_definitions_reference_agrees_with_ours_on_the_adapters_layout(name: str, tmp_path: Path) -> None:
    """flashinfer-bench's own reference code, on a problem laid out by dense_inputs, against reference_decode:
    the layout (CSR page lists, kv_last_page_len, split caches, sm_scale) means what the definition means."""
    read = definition(name)
    backend = fib_backend(reference_solution(tmp_path, name), definition_path(name))
    spec = ProblemSpec(seq_lens=(1, 63, 64, 65, 130), num_heads=read.heads, page_size=read.page_size, extra_pages=2,
                       softmax_scale=0.1352, seed=3)
    problem = build_problem(spec)
    refs, _ = run_as_evaluator(backend, list(dense_inputs(read, problem).values()), trials=1)
    ours = reference_decode(problem, torch.float64)
    out, lse = refs[0]
    # fp32 against float64: a few bf16 ulps of the output (its rounding), fp32 sums in the LSE
    torch.testing.assert_close(out.double(), ours.out[:, 0].to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ours.lse[:, 0] / math.log(2), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("ps", [1, 64])
def test_the_dsa_reference_agrees_with_ours_and_its_empty_rows_convention_is_declared(ps: int,
                                                                                     tmp_path: Path) -> None:
    """DSA: the definition's reference on sparse_inputs agrees with sparse_reference; on a row with no valid
    entry it gives LSE -inf where ours gives +inf, which the definition's envelope declares (and the case
    passes); and flashinfer-bench's evaluator fails that -inf -- its own reference's output -- as non-finite."""
    name = DSA[ps]
    backend = fib_backend(reference_solution(tmp_path, name), definition_path(name))
    assert backend.kind == SPARSE
    spec = SparseSpec(batch=2, q_len=2, num_heads=16, topk=2048, page_size=ps, used_pages=4096 // ps, fmt="bf16",
                      invalid=0.3, softmax_scale=0.1352, seed=5)
    problem = build_sparse_problem(spec)
    problem.indices[1, 0] = -1  # request 1's first query token: no valid entry
    ours = sparse_reference(problem)
    prepared = backend.prepare(problem, SPARSE_LAYOUT)
    out, lse = prepared.to_canonical(prepared.invoke())
    assert lse is not None and float(lse[1, 0, 0]) == -math.inf and float(ours.lse[1, 0, 0]) == math.inf
    assert backend.envelope.empty_lse == -math.inf
    assert run_case(backend, spec, SPARSE_LAYOUT, "cpu", problem=problem).verdict == "pass"
    valid = torch.isfinite(ours.lse)
    torch.testing.assert_close(out.double(), ours.out.to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[valid].double(), ours.lse[valid] / math.log(2), atol=1e-4, rtol=1e-5)
    exported = export_workload(tmp_path / "dataset", definition_path(name), "sparse",
                               backend.definition_inputs(problem))
    _, args = load_workload_inputs(tmp_path / "dataset", name, exported.uuid)  # as its evaluator loads it
    refs, sols = run_as_evaluator(backend, args, trials=1)
    assert float(refs[0][1][2, 0]) == -math.inf  # flattened: token 2 is request 1's first
    verdict = fib_judgement(refs, sols)
    assert verdict.status == "INCORRECT_NUMERICAL" and "non-finite" in verdict.detail
    assert verdict.reference_nonfinite and "fails every solution here" in verdict.line()


# ---------------------------------------------------------------- the command
@pytest.mark.parametrize("name, profile", [(DENSE_NAMES[1], "premerge"), (DENSE_NAMES[64], "premerge"),
                                           (H8, "dev")])
def test_the_cpu_peer_as_a_solution_passes(capsys, tmp_path: Path, solutions: Path, name: str, profile: str) -> None:
    code, out, err = run_main(capsys, "check", "--fib-solution", solutions / f"peer_{name}.json", "--fib-dataset",
                              DATASET, "--profile", profile, "--fixtures-dir", tmp_path)
    assert code == 0, out + err
    assert f"fib:cpu_peer_{name}: PASS" in out and " 0 failed" in out


def test_the_definitions_reference_as_a_value_returning_solution_passes(capsys, tmp_path: Path) -> None:
    path = reference_solution(tmp_path, DENSE_NAMES[64])
    code, out, err = run_main(capsys, "check", "--fib-solution", path, "--fib-definition",
                              definition_path(DENSE_NAMES[64]), "--profile", "dev", "--fixtures-dir", tmp_path)
    assert code == 0, out + err


def _expressible() -> list[tuple[str, str]]:
    """(definition, mutant): every dense mutant each MLA decode definition can express and a CPU can catch (one
    shows only past 2^32 elements of the pool: Mutant.device), every sparse one each DSA definition can."""
    cpu = {m for m, mutant in MUTANTS.items() if mutant.device == "cpu"} | set(SPARSE_MUTANTS)
    return [(name, m) for names, mutants in ((DENSE_NAMES, MUTANTS), (DSA, SPARSE_MUTANTS))
            for name in names.values() for m in sorted(mutants)
            if m in cpu and not_expressible(m, definition(name)) is None]


@pytest.mark.parametrize("name, mutant", _expressible())
def test_every_mutant_a_definition_can_express_is_caught_with_a_minimal_case(solutions: Path, name: str,
                                                                             mutant: str) -> None:
    result = verify(fib_backend(solutions / f"{mutant}_{name}.json", definition_path(name)), "cpu", "premerge")
    assert result.verdict == "fail", f"{mutant} survived {len(result.cases)} cases on {name}"
    spec = result.failure.spec
    if mutant in SPARSE_MUTANTS:
        # every sparse fault shows on one query token of one request, over a pool of at most two pages
        assert (spec.batch, spec.q_len, spec.num_heads) == (1, 1, 16) and spec.used_pages <= 2, spec.describe()
    else:
        # every fault shows on at most three short requests: a few pages, or (split-KV) one sequence past 128
        # tokens
        page = definition(name).page_size
        assert spec.batch <= 3 and max(spec.seq_lens) <= 2 * page + 130, spec.describe()
    assert result.failure.failures and failure_lines(result.failure, None)[0].startswith(f"FAIL fib:{mutant}_")


def check_a_failure_and_its_workload(capsys, fx: Path, solution: Path, name: str) -> tuple[Path, Path]:
    """``check`` a failing solution: the evaluator's note flags its minimal case, whose workload flashinfer-bench
    loads back bit for bit. (the reproducer, the workload's JSON lines)"""
    code, out, err = run_main(capsys, "check", "--fib-solution", solution, "--fib-dataset", DATASET,
                              "--fixtures-dir", fx)
    assert code == 1, out + err
    assert "flashinfer-bench's evaluator on it: would flag it: INCORRECT_NUMERICAL" in out
    jsonl = fx / "flashinfer-bench" / "workloads" / definition(name).op_type / f"{name}.jsonl"
    uuid = json.loads(jsonl.read_text().splitlines()[0])["workload"]["uuid"]
    _, loaded = load_workload_inputs(fx / "flashinfer-bench", name, uuid)
    fixture = next(fx.glob("*.json"))
    backend = fib_backend(solution, definition_path(name))
    kind = kind_named(backend.kind)
    problem = kind.build(kind.spec_from_json(json.loads(fixture.read_text())["spec"]), "cpu")
    for got, want in zip(loaded, backend.definition_inputs(problem).values()):  # the round trip keeps every bit
        assert same_bits(got, want) if isinstance(want, torch.Tensor) else got == want
    return fixture, jsonl


def test_a_failure_becomes_a_workload_flashinfer_bench_loads_and_judges(capsys, tmp_path: Path,
                                                                         solutions: Path) -> None:
    name = DENSE_NAMES[64]
    solution = solutions / f"halves_swapped_{name}.json"
    fixture, jsonl = check_a_failure_and_its_workload(capsys, tmp_path / "fx", solution, name)
    # the same case again is not exported twice
    run_main(capsys, "replay", fixture)
    again, out2, _ = run_main(capsys, "check", "--fib-solution", solution, "--fib-dataset", DATASET,
                              "--fixtures-dir", tmp_path / "fx")
    assert again == 1 and "already there" in out2 and len(jsonl.read_text().splitlines()) == 1


def test_the_evaluator_passes_what_only_a_repeat_catches(tmp_path: Path, solutions: Path) -> None:
    """A nondeterministic solution, within its tolerance on every call: mla-verify fails it (two calls differ),
    flashinfer-bench's evaluator passes the very case, and the note says so."""
    name = DENSE_NAMES[1]
    backend = fib_backend(solutions / f"nondeterministic_{name}.json", definition_path(name))
    problem = build_problem(ProblemSpec(seq_lens=(40,), num_heads=16, page_size=1, seed=2))
    exported = export_workload(tmp_path, definition_path(name), "case", backend.definition_inputs(problem))
    _, args = load_workload_inputs(tmp_path, name, exported.uuid)
    verdict = fib_judgement(*run_as_evaluator(backend, args))
    assert not verdict.flagged and verdict.line().startswith("would pass it")
    result = verify(backend, "cpu", "dev")
    assert result.verdict == "fail" and "not bit-identical" in result.failure.reason


def test_a_solution_claims_no_bits_so_its_relations_are_judged_within_tolerance(solutions: Path) -> None:
    """A solution's JSON has no place to claim bit-level invariance: ``pages_sorted`` at page size 1 -- the same
    keys, summed in physical page order -- passes, the bits it moved when the pages moved a note (the repeat call
    stays bit for bit: the test above)."""
    name = DENSE_NAMES[1]
    assert all(definition(n).envelope(("cpu",), pass_out=True).bit_invariant == () for n in (name, DSA[1]))
    assert not_expressible("pages_sorted", definition(name)) and not not_expressible("pages_sorted",
                                                                                     definition(DENSE_NAMES[64]))
    result = verify(fib_backend(solutions / f"pages_sorted_{name}.json", definition_path(name)), "cpu", "premerge")
    assert result.verdict == "pass", result.failure and result.failure.reason
    assert any("bits moved with physical pages permuted" in note for case in result.cases for note in case.notes)


def test_a_fib_reproducer_replays(capsys, tmp_path: Path, solutions: Path) -> None:
    name = DENSE_NAMES[1]
    code, _, _ = run_main(capsys, "check", "--fib-solution", solutions / f"heads_reversed_{name}.json",
                          "--fib-dataset", DATASET, "--fixtures-dir", tmp_path, "--profile", "dev")
    assert code == 1
    fixture = next(p for p in tmp_path.glob("*.json"))
    code, out, _ = run_main(capsys, "replay", fixture)
    assert code == 1 and f"fib:heads_reversed_{name}" in out and "verdict: FAIL" in out


# ---------------------------------------------------------------- usage errors
@pytest.mark.parametrize("argv, says", [
    (["--fib-definition", "x.json"], "names the definition of a --fib-solution"),
    (["--fib-solution", "nowhere.json"], "does not exist"),
    (["--fib-solution", "{peer}", "--fib-dataset", "{tmp}"], "has no definitions/ folder"),
    (["--fib-solution", "{peer}"], "not found in a dataset above the solution"),
    (["--fib-solution", "{peer}", "--fib-definition", "{other}"], "solves definition"),
    (["--fib-solution", "{broken}", "--fib-dataset", "{dataset}"], "could not build"),
    (["--fib-solution", "{peer}", "--kernel", "a:b"], "not allowed with argument"),
])
def test_bad_fib_usage_is_one_line_and_exit_2(capsys, tmp_path: Path, solutions: Path, argv, says) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads((solutions / f"peer_{DENSE_NAMES[64]}.json").read_text()),
                                  "sources": [{"path": "main.py", "content": "def run(:\n"}]}))
    values = {"peer": solutions / f"peer_{DENSE_NAMES[64]}.json", "tmp": tmp_path, "dataset": DATASET,
              "other": definition_path(DENSE_NAMES[1]), "broken": broken}
    code, out, err = run_main(capsys, "check", *[a.format(**values) for a in argv])
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_case_outside_the_definition_is_refused_before_the_kernel(solutions: Path) -> None:
    backend = fib_backend(solutions / f"peer_{DENSE_NAMES[64]}.json", definition_path(DENSE_NAMES[64]))
    spec = ProblemSpec(seq_lens=(5,), num_heads=16, page_size=64)
    assert backend.why_not(spec, LayoutSpec(), torch.device("cpu")) is None
    for other in (replace(spec, page_size=1), replace(spec, num_heads=8), replace(spec, q_len=2),
                  replace(spec, dtype="fp8")):
        assert backend.why_not(other, LayoutSpec(), torch.device("cpu")).startswith("outside its envelope")
    sparse = fib_backend(solutions / f"{STAND_IN}_{DSA[64]}.json", definition_path(DSA[64]))
    spec = SparseSpec(batch=1, num_heads=16, topk=2048, page_size=64, fmt="bf16")
    layout = replace(SPARSE_LAYOUT, pass_out=True)  # destination passing
    assert sparse.why_not(spec, layout, torch.device("cpu")) is None
    for other in (replace(spec, page_size=1), replace(spec, num_heads=8), replace(spec, topk=64),
                  replace(spec, fmt="V32"), replace(spec, sink="finite"), replace(spec, q_len=3)):
        assert sparse.why_not(other, layout, torch.device("cpu")).startswith("outside its envelope")
    assert sparse.why_not(spec, SPARSE_LAYOUT, torch.device("cpu")) == "outside its envelope: out not passed"


@pytest.mark.parametrize("name, kernel", [(DENSE_NAMES[64], "length_minus_1"), (DSA[1], "minus1_unmasked")])
def test_isolated_cases_load_the_solution_in_their_worker(capsys, tmp_path: Path, solutions: Path, name: str,
                                                          kernel: str) -> None:
    """--isolate: each case worker loads the backend from what the run records (the solution's and the
    definition's files), as a replay does; of either kind."""
    code, out, err = run_main(capsys, "check", "--fib-solution", solutions / f"{kernel}_{name}.json",
                              "--fib-dataset", DATASET, "--isolate", "--profile", "dev", "--fixtures-dir", tmp_path)
    assert code == 1 and f"FAIL fib:{kernel}_{name}:" in out, out + err


# ---------------------------------------------------------------- DSA (sparse) definitions
@pytest.mark.parametrize("ps", [1, 64])
def test_the_sparse_stand_in_as_a_dsa_solution_passes(capsys, tmp_path: Path, solutions: Path, ps: int) -> None:
    """Premerge, every case inside the definition: none is skipped (the strategies draw its one head count, its
    topk and page size, bf16 rows, no sink)."""
    name = DSA[ps]
    code, out, err = run_main(capsys, "check", "--fib-solution", solutions / f"{STAND_IN}_{name}.json",
                              "--fib-dataset", DATASET, "--fixtures-dir", tmp_path)
    assert code == 0, out + err
    assert f"fib:{STAND_IN}_{name}: PASS" in out and " 0 failed, 0 skipped)" in out, out


def test_a_dsa_solution_gives_an_empty_rows_lse_as_minus_inf_and_is_judged_so(solutions: Path) -> None:
    """The empty-row convention, the solution's side: the wrapped stand-in gives -inf (as the definition's
    reference does) where Contract 1 -- and the canonical sparse problem -- has +inf; the definition's envelope
    declares -inf, and the case passes."""
    name = DSA[64]
    backend = fib_backend(solutions / f"{STAND_IN}_{name}.json", definition_path(name))
    spec = SparseSpec(batch=2, num_heads=16, topk=2048, page_size=64, used_pages=3, fmt="bf16", invalid=0.2, seed=4)
    problem = build_sparse_problem(spec)
    problem.indices[1, 0] = -1  # request 1's only query token: no valid entry
    refs, sols = run_as_evaluator(backend, list(backend.definition_inputs(problem).values()), trials=1)
    assert not isinstance(sols[0], Exception)
    assert float(sols[0][1][1, 0]) == float(refs[0][1][1, 0]) == -math.inf
    layout = replace(SPARSE_LAYOUT, pass_out=True)
    prepared = backend.prepare(problem, layout)
    _, lse = prepared.to_canonical(prepared.invoke())
    assert lse is not None and bool((lse[1, 0] == -math.inf).all()) and bool(lse[0].isfinite().all())
    assert run_case(backend, spec, layout, "cpu", problem=problem).verdict == "pass"


def test_a_dsa_failure_becomes_a_workload_flashinfer_bench_loads_and_replays(capsys, tmp_path: Path,
                                                                             solutions: Path) -> None:
    name = DSA[64]
    fixture, _ = check_a_failure_and_its_workload(capsys, tmp_path / "fx", solutions / f"v_rope_dims_{name}.json",
                                                  name)
    code, out, _ = run_main(capsys, "replay", fixture)
    assert code == 1 and f"fib:v_rope_dims_{name}" in out and "verdict: FAIL" in out


def test_a_workload_with_an_empty_row_is_one_flashinfer_bench_cannot_judge(capsys, tmp_path: Path,
                                                                          solutions: Path) -> None:
    """The empty-row convention, the evaluator's side: an all -1 row's LSE is -inf in the definition's own
    reference, and the evaluator fails any non-finite output -- the note says so."""
    name = DSA[1]
    code, out, err = run_main(capsys, "check", "--fib-solution", solutions / f"empty_row_nan_{name}.json",
                              "--fib-dataset", DATASET, "--fixtures-dir", tmp_path)
    assert code == 1, out + err
    assert "its own reference's outputs are non-finite on this workload" in out, out


def test_a_crashed_case_is_exported_but_not_run_again_here(tmp_path: Path, solutions: Path) -> None:
    """A case whose solution crashed its (isolated) worker: its workload is written, and flashinfer-bench's
    evaluator is not run on it in the checking process, which the crash would take down."""
    name = DENSE_NAMES[1]
    backend = fib_backend(solutions / f"peer_{name}.json", definition_path(name))
    failure = CaseResult(backend.name, ProblemSpec(seq_lens=(3, 5), num_heads=16, page_size=1), LayoutSpec(), "none",
                         "fail", crash="killed by SIGSEGV (Segmentation fault)")
    lines = hand_back(backend, failure, tmp_path, torch.device("cpu"))
    assert lines[0].startswith("  flashinfer-bench workload: ") and len(lines) == 2
    assert lines[1] == "  flashinfer-bench's evaluator on it: not run here (the solution crashed on this case)"
