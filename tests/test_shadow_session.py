"""A shadow-mode session: sampling and the overhead budget, reports once per call site and kind of finding, the
summary, reproducers (capped, replayable by ``mla-verify replay``), nesting, its own failures kept from the
engine, and the three ways to turn it on: the context manager, MLA_VERIFY_SHADOW (also for ``python -m
mla_verify.shadow``), ``--mla-shadow``."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_verify.backends.trtllm_style import make_workspace
from mla_verify.cli import main as cli
from mla_verify.core.errors import UsageError
from mla_verify.kernels.mutants import correct_kernel, halves_swapped
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.records.fixtures import load_fixture
from mla_verify.shadow import ShadowError, current_session, session_from_env, shadow
from mla_verify.shadow.tally import Sampler

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]
SPEC = ProblemSpec(seq_lens=(37, 100), num_heads=4, page_size=32, extra_pages=6, seed=3)
PROBLEM = build_problem(SPEC)
WORKSPACE = make_workspace(torch.device("cpu"))


def call(kernel, problem=PROBLEM):
    return kernel(problem.query, problem.kv_cache, WORKSPACE, 128, 512, 64, problem.block_table,
                  problem.seq_lens, int(problem.seq_lens.max()), bmm1_scale=problem.bmm1_scale)


@pytest.fixture(autouse=True)
def reproducers_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a mismatch keeps its reproducer under ./fixtures/shadow


def session(mode: str = "record", **kwargs):
    kwargs.setdefault("kernels", [correct_kernel, halves_swapped])
    return shadow(mode, stream=io.StringIO(), summary=False, **kwargs)


def sites(s) -> list:
    return list(s.tally.sites.values())


def test_every_nth_call_at_each_site_is_checked() -> None:
    p = PROBLEM
    with session(every=3) as s:
        for _ in range(7):  # one site: calls 1, 4 and 7 are checked
            correct_kernel(p.query, p.kv_cache, WORKSPACE, 128, 512, 64, p.block_table, p.seq_lens, 100)
        call(correct_kernel)  # another site: its first call is checked
    first, second = sites(s)
    assert (first.calls, first.checked, second.calls, second.checked) == (7, 3, 1, 1)
    assert first.not_checked["sampling (1 call in 3 at each site is checked)"] == 4


def test_the_overhead_budget_is_per_minute() -> None:
    now = [0.0]
    sampler = Sampler(budget_s_per_min=1.0, clock=lambda: now[0])
    assert sampler.skip_reason(1) is None
    sampler.charge(0.6)
    now[0] = 10.0
    assert sampler.skip_reason(2) is None  # 0.6 s of the budget's 1 s spent: the next check may run
    sampler.charge(0.6)
    now[0] = 30.0
    assert "budget" in sampler.skip_reason(3)  # 1.2 s spent within the last minute
    now[0] = 60.5
    assert sampler.skip_reason(4) is None  # the first check has left the window


def test_a_spent_budget_skips_checks_but_never_calls() -> None:
    with session(budget_s_per_min=1e-9) as s:  # the first check alone spends it
        outs = [call(correct_kernel) for _ in range(3)]
    site, = sites(s)
    assert (site.calls, site.checked, site.compared) == (3, 1, 1) and len(outs) == 3
    assert site.not_checked["overhead budget (1e-09 s per minute) spent"] == 2


def test_strict_raises_at_every_bad_call_but_reports_a_site_once(tmp_path: Path) -> None:
    with session("strict", fixtures_dir=tmp_path) as s:
        for _ in range(2):
            with pytest.raises(ShadowError, match="MISMATCH"):
                call(halves_swapped)
    site, = sites(s)
    assert (site.calls, site.mismatched) == (2, 2)
    assert s.stream.getvalue().count("MISMATCH") == 1
    assert len(list(tmp_path.glob("*.json"))) == 1  # one reproducer per site


def test_the_summary_counts_per_entry_point_and_site(tmp_path: Path) -> None:
    with session(fixtures_dir=tmp_path) as s:
        call(correct_kernel)
        call(halves_swapped)
    lines = s.summary_lines()
    assert lines[0].startswith("mla-verify shadow (record, every call checked, no overhead budget): 2 calls")
    assert "1 mismatched" in lines[0]
    entries = [line.strip() for line in lines if line.startswith("  kernel ")]
    assert entries == ["kernel mla_verify.kernels.mutants:correct_kernel",
                       "kernel mla_verify.kernels.mutants:halves_swapped"]
    site_lines = [line for line in lines if "test_shadow_session.py:" in line]
    assert len(site_lines) == 2 and "0 mismatched" in site_lines[0] and "1 mismatched" in site_lines[1]


def test_a_reproducer_replays_with_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with session(fixtures_dir=tmp_path):
        call(halves_swapped)
    path, = tmp_path.glob("*.json")
    fixture = load_fixture(path)
    assert fixture.meta["kind"] == "shadow" and fixture.meta["backend"] == "mla_verify.kernels.mutants:halves_swapped"
    assert "test_shadow_session.py:" in fixture.meta["call_site"]
    assert fixture.problem.num_pages == int(PROBLEM.pages_used().sum())  # only the pages the call read
    assert cli.main(["replay", str(path)]) == 1
    printed = capsys.readouterr().out
    assert "[cache_rope_first]" in printed and "bit-identical to the recorded run" in printed
    assert cli.main(["replay", str(path), "--kernel", "mla_verify.kernels.mutants:correct_kernel"]) == 0


def test_a_cpu_reproducer_replays_with_its_recorded_thread_count(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the caller's process, not `check`'s one thread
        with session(fixtures_dir=tmp_path):
            call(halves_swapped)
        path, = tmp_path.glob("*.json")
        assert load_fixture(path).meta["torch_threads"] == 2
        torch.set_num_threads(1)
        assert cli.main(["replay", str(path)]) == 1
        assert torch.get_num_threads() == 2 and "bit-identical to the recorded run" in capsys.readouterr().out
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the environment's count wins, and the replay says so
        torch.set_num_threads(1)
        cli.main(["replay", str(path)])
        assert "recorded with 2 torch threads, replayed with 1" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_reproducers_are_capped(tmp_path: Path) -> None:
    whole = int(PROBLEM.pages_used().sum()) * 32 * 576 * 2
    with session(fixtures_dir=tmp_path / "one", fixture_cap_mib=0.9 * whole / 2**20):
        call(halves_swapped)
    path, = (tmp_path / "one").glob("*.json")
    meta = json.loads(path.read_text())
    assert meta["rows_kept"] == [meta["stats"]["worst"][0]] and load_fixture(path).problem.batch == 1
    with session(fixtures_dir=tmp_path / "none", fixture_cap_mib=0.01) as s:
        call(halves_swapped)
    assert not (tmp_path / "none").exists() and "reproducer not kept: even its worst sequence" in s.stream.getvalue()


def test_the_shadows_own_failure_never_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the shadow")
    monkeypatch.setattr("mla_verify.shadow.session.judge", broken)
    plain = call(halves_swapped)
    with session("strict") as s:
        seen = call(halves_swapped)
    assert torch.equal(seen, plain)
    assert sites(s)[0].not_checked["shadow failed: RuntimeError: a bug in the shadow"] == 1


def test_sessions_nest_and_put_everything_back() -> None:
    original = halves_swapped
    with session(kernels=[halves_swapped]) as outer:
        wrapped = globals()["halves_swapped"]
        with session(kernels=[halves_swapped]) as inner:
            assert current_session() is inner and globals()["halves_swapped"] is wrapped
            call(globals()["halves_swapped"])
        call(globals()["halves_swapped"])
    assert current_session() is None and globals()["halves_swapped"] is original
    assert sites(inner)[0].calls == 1 and sites(outer)[0].calls == 1


def test_a_kernel_no_module_binds_is_said_to_be_unseen() -> None:
    def private(*args, **kwargs):
        return correct_kernel(*args, **kwargs)
    with session(kernels=[private]) as s:
        pass
    assert any("no module binds this object" in note for note in s.tally.notes)
    with pytest.raises(UsageError, match="not found"):
        shadow(kernels=["no_such_module:kernel"])


def test_a_kernel_given_as_a_file_path_is_shadowed(tmp_path: Path) -> None:
    # a file is imported under a module name of its own (user_kernel.load_kernel), not its path
    path = tmp_path / "my_kernels.py"
    path.write_text("from mla_verify.kernels.mutants import halves_swapped\n")
    with session("record", kernels=[f"{path}:halves_swapped"]) as s:
        pass
    assert len(s.kernels) == 1
    with pytest.raises(UsageError, match="does not exist"):
        shadow(kernels=[f"{tmp_path / 'missing.py'}:halves_swapped"])


def test_the_environment_turns_it_on() -> None:
    assert session_from_env({}) is None and session_from_env({"MLA_VERIFY_SHADOW": "0"}) is None
    s = session_from_env({"MLA_VERIFY_SHADOW": "record", "MLA_VERIFY_SHADOW_EVERY": "4",
                          "MLA_VERIFY_SHADOW_BUDGET": "2.5",
                          "MLA_VERIFY_SHADOW_KERNEL": "mla_verify.kernels.mutants:correct_kernel"})
    assert (s.mode, s.sampler.every, s.sampler.budget, len(s.kernels)) == ("record", 4, 2.5, 1)
    assert session_from_env({"MLA_VERIFY_SHADOW": "1"}).mode == "strict"
    for bad in ({"MLA_VERIFY_SHADOW": "yes"}, {"MLA_VERIFY_SHADOW": "1", "MLA_VERIFY_SHADOW_EVERY": "0"},
                {"MLA_VERIFY_SHADOW": "1", "MLA_VERIFY_SHADOW_BUDGET": "soon"}):
        with pytest.raises(UsageError):
            session_from_env(bad)


SCRIPT = """
import torch
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.kernels.mutants import halves_swapped as kernel
p = build_problem(ProblemSpec((37, 100), num_heads=4, page_size=32, seed=3))
kernel(p.query, p.kv_cache, None, 128, 512, 64, p.block_table, p.seq_lens, 100, bmm1_scale=p.bmm1_scale)
print("engine done")
"""


def test_python_dash_m_runs_a_script_under_shadow_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MLA_VERIFY_SHADOW_FIXTURES": str(tmp_path / "fx")}
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    for mode, status in (("record", 0), ("strict", 1)):
        env.update(MLA_VERIFY_SHADOW=mode, MLA_VERIFY_SHADOW_KERNEL="mla_verify.kernels.mutants:halves_swapped")
        run = subprocess.run([sys.executable, "-m", "mla_verify.shadow", str(script)], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
        assert run.returncode == status, run.stderr
        assert ("engine done" in run.stdout) == (status == 0)
        assert f"mla-verify shadow ({mode}, every call checked" in run.stderr  # the summary at exit
    bad = subprocess.run([sys.executable, "-m", "mla_verify.shadow", str(script)], capture_output=True, text=True,
                         env={**env, "MLA_VERIFY_SHADOW": "maybe"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "maybe" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "mla_verify.shadow", str(tmp_path / "nope.py")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and missing.stderr == f"mla_verify.shadow: {tmp_path / 'nope.py'}: no such script\n"


ENGINE_TEST = """
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.kernels.mutants import halves_swapped

def test_attention():
    p = build_problem(ProblemSpec((37, 100), num_heads=4, page_size=32, seed=3))
    halves_swapped(p.query, p.kv_cache, None, 128, 512, 64, p.block_table, p.seq_lens, 100, bmm1_scale=p.bmm1_scale)
"""
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")


@pytest.fixture
def engine_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in ("SHADOW", "SHADOW_KERNEL", "SHADOW_EVERY", "SHADOW_BUDGET", "SHADOW_FIXTURES"):
        monkeypatch.delenv(f"MLA_VERIFY_{name}", raising=False)
    pytester.makepyfile(test_shadowed_engine=ENGINE_TEST)  # a name no module of tests/ has
    return pytester


def test_pytest_option_strict_fails_the_test_at_the_bad_call(engine_suite: pytest.Pytester) -> None:
    result = engine_suite.runpytest(*QUIET, "--mla-shadow", "strict", "--mla-shadow-kernel",
                                               "mla_verify.kernels.mutants:halves_swapped")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ShadowError: mla-verify shadow: MISMATCH at test_shadowed_engine.py:6*",
                                 "*mla-verify shadow (strict*1 mismatched*"])


def test_pytest_environment_and_ini_record_mode(engine_suite: pytest.Pytester,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLA_VERIFY_SHADOW", "record")
    engine_suite.makeini("[pytest]\nmla_shadow_kernel =\n    mla_verify.kernels.mutants:halves_swapped\n")
    result = engine_suite.runpytest(*QUIET)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*mla-verify shadow (record*", "*test_shadowed_engine.py:6: 1 calls*1 mismatched*",
                                 "mla-verify shadow: MISMATCH at test_shadowed_engine.py:6*",
                                 "*diagnosis: *cache_rope_first*"])


def test_pytest_without_the_option_shadows_nothing(engine_suite: pytest.Pytester) -> None:
    result = engine_suite.runpytest(*QUIET, "--mla-shadow-kernel", "mla_verify.kernels.mutants:halves_swapped")
    result.assert_outcomes(passed=1)
    assert "mla-verify shadow" not in result.stdout.str()


def test_xdist_workers_counts_and_reports_reach_the_controller(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mla_verify import pytest_shadow as shadow_pytest
    from mla_verify.shadow.tally import Tally

    with session(fixtures_dir=tmp_path) as worker:  # what one worker saw
        call(correct_kernel)
        call(halves_swapped)
    controller = SimpleNamespace(stash=pytest.Stash())
    for _ in range(2):  # two workers that saw the same
        node = SimpleNamespace(config=controller, workeroutput={"mla_verify_shadow": worker.tally.to_json()})
        shadow_pytest.pytest_testnodedown(node, None)
    merged = controller.stash[shadow_pytest._MERGED_KEY]
    total = merged.total()
    assert (total.calls, total.compared, total.mismatched) == (4, 4, 2)
    assert len(merged.reports) == 2 and "MISMATCH" in merged.reports[0]
    assert Tally.from_json(json.loads(json.dumps(merged.to_json()))).to_json() == merged.to_json()


def test_pytest_bad_shadow_settings_are_usage_errors(engine_suite: pytest.Pytester) -> None:
    result = engine_suite.runpytest(*QUIET, "--mla-shadow", "loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--mla-shadow: 'loud' is not one of 1, strict, record, 0, off*"])


def heads_2_up_doubled(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                       block_tables, seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0):
    """A fault outside the diagnosis catalog: heads 2 and up come out twice too large."""
    result = correct_kernel(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                            block_tables, seq_lens, max_seq_len, out=out, bmm1_scale=bmm1_scale,
                            bmm2_scale=bmm2_scale)
    result[:, :, 2:] *= 2
    return result


def test_a_live_mismatch_says_where_as_replay_does_and_pytest_hides_the_shadows_frames() -> None:
    with session("strict", kernels=[heads_2_up_doubled]) as s:
        with pytest.raises(ShadowError) as info:
            call(heads_2_up_doubled)
    assert "diagnosis: where: out is wrong in heads 2-3" in s.stream.getvalue()
    shown = [str(entry.path) for entry in info.traceback.filter(info)]
    assert not any(p.endswith(os.path.join("shadow", "session.py")) for p in shown), shown


def test_each_distinct_finding_at_a_site_is_reported(tmp_path: Path) -> None:
    with session("record", fixtures_dir=tmp_path) as s:
        for longest in (100, 50, 100):  # a mismatch; a max_seq_len below the longest sequence too; again
            halves_swapped(PROBLEM.query, PROBLEM.kv_cache, WORKSPACE, 128, 512, 64, PROBLEM.block_table,
                           PROBLEM.seq_lens, longest, bmm1_scale=PROBLEM.bmm1_scale)
    site, = sites(s)
    assert site.calls == 3
    first, second = s.tally.reports  # the third call found nothing new
    assert "MISMATCH" in first and "max_seq_len" not in first
    assert "max_seq_len" in second, second
