"""Backends judged side by side (run/side_by_side.py): each judged as it is alone, the cases in flight within the
device memory one case may take, Ctrl-C and errors reaching every search."""
from __future__ import annotations

import _thread
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mla_verify.cli.main import main
from mla_verify.core.memory import case_bytes
from mla_verify.draw.strategies import Case
from mla_verify.kinds import kind_named
from mla_verify.problems.envelope import DENSE
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.metamorphic import LARGE_POOL
from mla_verify.run.engine import EngineResult
from mla_verify.run.harness import SKIP_DEVICE, SKIP_MEMORY, CaseResult
from mla_verify.run.side_by_side import DeviceLedger, Ledgered, side_by_side

KERNELS = ("cli_kernels:good", "cli_kernels:wrong_scale")


def _cases(report, backend):
    return [(c["id"], c["verdict"]) for c in json.loads(report.read_text())["cases"] if c["backend"] == backend]


def test_each_backend_judged_side_by_side_gets_the_cases_and_verdicts_it_gets_alone(capsys, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # cli_kernels, in the workers too
    run = ["check", "--device", "cpu", "--isolate", "--profile", "premerge", "--fixtures-dir", str(tmp_path / "reg")]
    together = tmp_path / "together.json"
    assert main([*run, "--kernel", KERNELS[0], "--kernel", KERNELS[1], "--report", str(together)]) == 1
    assert "judging 2 backends side by side" in capsys.readouterr().out
    for kernel in KERNELS:
        alone = tmp_path / f"{kernel.split(':')[1]}.json"
        main([*run, "--kernel", kernel, "--report", str(alone)])
        assert "side by side" not in capsys.readouterr().out
        # the same seed, budget and Hypothesis state: a search that shared any with the other would differ
        assert _cases(together, kernel) == _cases(alone, kernel) and _cases(alone, kernel)


def _hold(ledger, nbytes, seconds, log, name):
    with ledger.holding(nbytes):
        log.append(("in", name, ledger.held))
        time.sleep(seconds)
        log.append(("out", name, ledger.held))


def test_the_cases_in_flight_hold_no_more_than_the_ledger_and_a_larger_one_runs_alone():
    ledger, log = DeviceLedger(capacity=10), []
    sizes = {"a": 4, "b": 4, "c": 4, "huge": 25, "d": 1}
    threads = []
    for name, nbytes in sizes.items():  # started in this order: each asks after the previous one
        threads.append(threading.Thread(target=_hold, args=(ledger, nbytes, 0.05, log, name)))
        threads[-1].start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    inside: set[str] = set()
    for event, name, _ in log:
        inside.add(name) if event == "in" else inside.discard(name)
        # larger than the ledger: alone; the others together within it
        assert inside == {"huge"} or ("huge" not in inside and sum(sizes[n] for n in inside) <= 10)
    assert ledger.held == 0 and ledger.in_flight == 0
    entered = [name for event, name, _ in log if event == "in"]
    assert entered.index("huge") < entered.index("d")  # in turn: the small case after it waited, it did not pass


def test_a_case_holds_its_problem_and_its_relation_memory():
    dense = kind_named(DENSE)
    spec = ProblemSpec(seq_lens=(100, 30), num_heads=4, page_size=64)  # bf16
    plain = Case(spec, LayoutSpec(), "none")
    tokens, rows = dense.footprint(spec)
    assert dense.device_bytes(plain) == case_bytes(tokens, rows)  # a plain case: its problem's memory alone
    large = replace(plain, transform=LARGE_POOL)
    # the large pool reaches past 2^32 elements, each held twice in bf16 (the pool and its input snapshot) and
    # once as a bool (the bit comparison's mask): at least 2^32 x 5 bytes on top of the problem's own
    assert dense.device_bytes(large) - dense.device_bytes(plain) >= 2**32 * (2 * 2 + 1)


def _until_stopped(stop):
    """A search that ends when stopped (interrupted), or after 5 s as if it had not heard (not interrupted)."""
    return EngineResult("x", "dev", 1, interrupted=stop.wait(5.0))


def _ctrl_c_then_until_stopped(stop):
    time.sleep(0.3)  # the calling thread waits for the searches by now
    _thread.interrupt_main()  # Ctrl-C reaches the calling thread, not this one
    return _until_stopped(stop)


def test_ctrl_c_stops_every_search_and_the_run_reports_them():
    done: list[EngineResult] = []
    first = _ctrl_c_then_until_stopped

    results = side_by_side([first, _until_stopped], lanes=2, on_done=done.append)
    assert len(done) == 2 and all(r is not None and r.interrupted for r in results)


def test_a_search_not_started_when_ctrl_c_came_is_reported_as_not_run():
    # one lane: the second search waits for the first to end, and Ctrl-C comes before it does
    results = side_by_side([_ctrl_c_then_until_stopped, _until_stopped], lanes=1, on_done=lambda r: None)
    assert results[0] is not None and results[0].interrupted and results[1] is None


def test_an_error_in_one_search_stops_the_others_and_is_raised_once_they_end():
    ended = []

    def failing(stop):
        raise RuntimeError("its worker could not start")

    def waiting(stop):
        result = _until_stopped(stop)
        ended.append(result)
        return result

    with pytest.raises(RuntimeError, match="could not start"):
        side_by_side([waiting, failing], lanes=2, on_done=lambda r: None)
    assert len(ended) == 1  # the other search ended before the error was raised here


class _Kind:
    def device_bytes(self, case):
        return 1


def _judge_short_of_memory_beside_others(ledger, skip_kind, always=False):
    """A backend whose cases are ``skip_kind`` skips while another case is in flight (or ``always``)."""
    def judge(spec, layout, transform, diagnose):
        crowded = ledger.in_flight > 1
        time.sleep(0.1)  # long enough for the other thread's case to be in flight too
        short = always or crowded
        return CaseResult("k", spec, layout, transform, "skip" if short else "pass",
                          skip_kind=skip_kind if short else "", reason="short of memory" if short else "")
    return judge


@pytest.mark.parametrize("always", [False, True])
@pytest.mark.parametrize("skip_kind", [SKIP_MEMORY, SKIP_DEVICE])  # out of memory; no spare memory for the relation
def test_a_case_short_of_memory_beside_others_is_judged_again_alone(always, skip_kind):
    ledger = DeviceLedger(capacity=10)  # room for both: the estimate lets them run together
    judged = Ledgered(_judge_short_of_memory_beside_others(ledger, skip_kind, always), _Kind(), ledger)
    results: list[CaseResult] = []

    def judge_one() -> None:
        results.append(judged(ProblemSpec(seq_lens=(4,)), LayoutSpec(), "none", False))

    threads = [threading.Thread(target=judge_one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # alone it passes, as a run of that backend alone judges it; short of memory alone too, it stays a skip
    assert [r.skip_kind for r in results] == [skip_kind if always else ""] * 2
