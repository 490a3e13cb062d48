"""Reports: path validation, the JSON record, JUnit XML, SVG plots, Markdown/HTML and re-rendering."""
from __future__ import annotations

import dataclasses
import json
import re
import xml.etree.ElementTree as ET

import pytest

from mla_verify.core.errors import UsageError
from mla_verify.judge.compare import ErrorStats
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseSpec
from mla_verify.records.report import (
    build_report,
    check_report_path,
    load_report,
    output_paths,
    render,
    resolution_line,
    scatter_svg,
    to_markdown,
    verdict_banner,
    write_report,
)
from mla_verify.run.engine import EngineResult
from mla_verify.run.harness import CaseResult

SVG = "{http://www.w3.org/2000/svg}"


def _case(backend: str, seq: int, heads: int, ratio: float | None, verdict: str = "pass") -> CaseResult:
    stats = None
    if ratio is not None:  # max_abs / allowed_max_abs carries the ratio; rel_l2 stays below it
        stats = ErrorStats(ratio * 1e-2, 1e-2, ratio * 1e-4, 1e-3, 5e-3, 1e-3, 1e-7, (0, 0, 0, 0))
    r = CaseResult(backend, ProblemSpec(seq_lens=(seq, 1), num_heads=heads, seed=seq), LayoutSpec(), "none",
                   verdict, seconds=0.01, stats=stats)
    if verdict == "fail":
        r.failures = ["max |out - ref| too large"]
        r.reason = r.failures[0]
        r.diagnosis = ["softmax scale 1/sqrt(576)"]
    if verdict == "skip":
        r.reason = "outside its envelope: page size"
    return r


def _results() -> list[EngineResult]:
    good = EngineResult("peer", "dev", 1, cases=[_case("peer", 10, 2, 0.1), _case("peer", 1000, 64, 0.4),
                                                 _case("peer", 50, 8, None, "skip")], seconds=1.5)
    bad_case = _case("mutant", 300, 16, 30.0, "fail")
    bad = EngineResult("mutant", "dev", 1, cases=[_case("mutant", 20, 4, 0.2), bad_case, bad_case], seconds=2.0,
                       failure=bad_case)
    gone = EngineResult("trtllm-gen", "dev", 1, unavailable="trtllm-gen: needs SM100/SM103; this GPU is SM90")
    return [good, bad, gone]


def _report():
    return build_report({"command": "mla-verify check", "device": "cpu"}, _results(),
                        {"mutant": "fixtures/regressions/x.json"}, platform="test", selfcheck="ok")


def test_record(tmp_path):
    rep = _report()
    ids = [c["id"] for c in rep["cases"]]
    assert len(ids) == len(set(ids)) == 5  # the failing case was judged twice and appears once
    by_name = {b["name"]: b for b in rep["backends"]}
    assert by_name["mutant"]["verdict"] == "fail" and by_name["mutant"]["cases"] == 2
    assert by_name["mutant"]["failure"]["fixture"] == "fixtures/regressions/x.json"
    assert by_name["trtllm-gen"]["verdict"] == "skip" and "SM90" in by_name["trtllm-gen"]["unavailable"]
    assert json.loads(json.dumps(rep)) == rep


def test_write_and_rerender(tmp_path):
    path = tmp_path / "out.json"
    written = write_report(path, _report())
    assert sorted(p.name for p in written) == sorted(
        ["out.json", "out.xml", "out.md", "out.html", "out.err-vs-seq.svg", "out.err-vs-heads.svg"])
    first = {p.name: p.read_text() for p in written}
    for p in written[1:]:
        p.unlink()
    render(load_report(path), path)
    assert {p.name: p.read_text() for p in written} == first


def test_junit(tmp_path):
    root = ET.fromstring(_junit(tmp_path))
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("6", "1", "2")
    suites = {s.get("name"): s for s in root}
    fail = suites["mla-verify.mutant"].find("testcase/failure")
    assert fail.get("message") == "max |out - ref| too large" and "softmax scale 1/sqrt(576)" in fail.text
    assert "SM90" in suites["mla-verify.trtllm-gen"].find("testcase/skipped").get("message")


def _junit(tmp_path) -> str:
    path = tmp_path / "r.json"
    write_report(path, _report())
    return output_paths(path)["xml"].read_text()


def test_markdown_and_html(tmp_path):
    path = tmp_path / "r.json"
    write_report(path, _report())
    md = output_paths(path)["md"].read_text()
    assert "| mutant | fail | 2 | 1 | 1 | 0 | 30 |" in md
    assert "mla-verify replay fixtures/regressions/x.json" in md
    assert "![r.err-vs-seq.svg](r.err-vs-seq.svg)" in md
    html = output_paths(path)["html"].read_text()
    assert html.count("<svg") == 2 and "needs SM100/SM103" in html


def test_svg_places_points_by_value():
    cases = _report()["cases"]
    svg = ET.fromstring(scatter_svg(cases, "seq"))
    points = [c for c in svg.iter(SVG + "circle") if c.find(SVG + "title") is not None]
    assert len(points) == 4  # judged cases only: the skipped one has no error to plot
    by_title = {c.find(SVG + "title").text.split(":")[0]: c for c in points}
    fail = next(c for t, c in by_title.items() if t.endswith("fail"))
    assert fail.get("stroke") == "#d62728"
    ys = {float(c.get("cy")): t for t, c in by_title.items()}
    assert ys[min(ys)].endswith("fail")  # the largest error sits highest
    xs = sorted((float(c.get("cx")), t) for t, c in by_title.items())
    assert xs[-1][1].endswith("pass") and xs[-1][1].startswith("peer")  # seq 1000 sits rightmost


def test_a_case_of_empty_requests_is_plotted_at_one_token():
    """kv_len 0 for every request (a drawn case of an envelope that takes them): the log axis has no 0."""
    case = _case("peer", 5, 4, 0.5)
    case.spec = ProblemSpec(seq_lens=(0,), num_heads=4)
    svg = ET.fromstring(scatter_svg([case.to_json()], "seq"))
    assert [c for c in svg.iter(SVG + "circle") if c.find(SVG + "title") is not None]


def test_check_report_path(tmp_path):
    assert check_report_path(str(tmp_path / "ok.json")) == tmp_path / "ok.json"
    assert list(tmp_path.iterdir()) == []  # the write probe is gone
    (tmp_path / "file").write_text("")
    (tmp_path / "dir.json").mkdir()
    for bad, match in [(tmp_path / "file" / "r.json", "not a directory"),
                       (tmp_path / "file" / "sub" / "r.json", "not a directory"),
                       (tmp_path / "r.xml", "takes the JSON path"), (tmp_path / "dir.json", "is a directory")]:
        with pytest.raises(UsageError, match=match):
            check_report_path(str(bad))


def test_report_creates_its_folder_once_the_run_is_over(tmp_path):
    path = tmp_path / "new" / "sub" / "out.json"
    assert check_report_path(str(path)) == path
    assert list(tmp_path.iterdir()) == []  # validated before the run: nothing made yet
    written = write_report(path, _report())
    assert all(p.parent == path.parent and p.is_file() for p in written)


def test_load_report_errors(tmp_path):
    with pytest.raises(UsageError, match="no such report"):
        load_report(tmp_path / "missing.json")
    (tmp_path / "g.json").write_text("{garbage")
    with pytest.raises(UsageError, match="not a readable JSON report"):
        load_report(tmp_path / "g.json")
    (tmp_path / "o.json").write_text('{"cases": []}')
    with pytest.raises(UsageError, match="not an mla-verify report"):
        load_report(tmp_path / "o.json")


# ---------------------------------------------------------------- read at a glance
LONG_NAME = "kernels/mykernels.py:bug_causal_mask_offset_by_one"


def _glance_cases() -> list[dict]:
    """A NaN failure whose finite part is tiny, a clipped failure, an exact pass, a pass, a long backend name."""
    nan_fail = _case(LONG_NAME, 64, 8, 0.01, "fail")
    nan_fail.stats.nonfinite = 512
    cases = [nan_fail, _case(LONG_NAME, 128, 8, 5e4, "fail"), _case(LONG_NAME, 32, 4, 0.0),
             _case(LONG_NAME, 16, 2, 0.3)]
    return [c.to_json() for c in cases]


def _points(svg_text: str) -> dict[str, ET.Element]:
    """Plotted cases (elements with a <title>) by their id."""
    svg = ET.fromstring(svg_text)
    return {e.find(SVG + "title").text.split()[1]: e for e in svg.iter() if e.find(SVG + "title") is not None}


def _y(element: ET.Element) -> float:
    if element.tag == SVG + "circle":
        return float(element.get("cy"))
    return sum(float(v) for v in re.findall(r",(-?[\d.]+)", element.get("d"))) / len(re.findall(",", element.get("d")))


def test_nonfinite_and_clipped_failures_sit_on_the_top_edge_marked():
    cases = _glance_cases()
    svg = scatter_svg(cases, "seq")
    points = _points(svg)
    nan_fail, clipped, exact, plain = (points[c["id"]] for c in cases)
    allowed_line = float(re.search(r'<line x1="\d+" y1="([\d.]+)"[^>]*stroke-dasharray', svg).group(1))
    assert _y(nan_fail) < allowed_line and _y(clipped) < allowed_line  # above the line: failures look failed
    assert nan_fail.tag == SVG + "path" and "non-finite" in nan_fail.find(SVG + "title").text
    assert clipped.tag == SVG + "path" and "5e+04" in clipped.find(SVG + "title").text
    assert _y(exact) > _y(plain) > allowed_line  # the exact pass on the bottom edge, marked as a floor
    assert exact.tag == SVG + "path" and "exact 0 included" in svg
    legend = [t.text for t in ET.fromstring(svg).iter(SVG + "text")]
    assert LONG_NAME in legend  # the whole name, however long


def test_worst_cases_table_says_nonfinite_not_a_small_ratio(tmp_path):
    rep = _report()
    rep["cases"] += _glance_cases()
    md = to_markdown(_document_blocks(rep, tmp_path))
    assert "| fail | non-finite |" in md


def _document_blocks(report, tmp_path):
    from mla_verify.records.report import _document
    return _document(report, {"seq": "s.svg", "heads": "h.svg"}, {"seq": "", "heads": ""})


@pytest.mark.parametrize("change, verdict, words", [
    (lambda r: None, "FAIL", "1 of 3 backends failed; mutant: max |out - ref| too large; 1 passed; "
     "1 could not run here"),
    (lambda r: r["backends"].pop(1), "PASS", "1 passed; 1 could not run here"),
    (lambda r: [r["backends"].pop(0), r["backends"].pop(0)], "NOTHING RAN", "0 passed; 1 could not run here"),
    (lambda r: [r["backends"].pop(1), r["run"].update(interrupted=True)], "INTERRUPTED",
     "1 passed; 1 could not run here; interrupted: only the cases judged until then"),
])
def test_a_verdict_banner_heads_the_report(tmp_path, change, verdict, words):
    rep = _report()
    change(rep)
    assert verdict_banner(rep) == (verdict, words)
    path = tmp_path / "r.json"
    write_report(path, rep)
    md = output_paths(path)["md"].read_text().splitlines()
    assert md[2] == f"> **{verdict}** -- {words}"  # right under the title
    assert f"<b>{verdict}</b> -- " in output_paths(path)["html"].read_text()


def test_a_policy_backends_kernels_are_counted_per_distinct_case(tmp_path):
    kernels = ["fa3", "fa2", "fa3", None, "fa3"]  # None: a skipped case, never planned
    cases = [_case("fa-auto", 10 + i, 8, 0.1 if k else None, "pass" if k else "skip") for i, k in enumerate(kernels)]
    for case, kernel in zip(cases, kernels):
        case.resolved_backend = kernel
    auto = EngineResult("fa-auto", "dev", 1, cases=[*cases, cases[0]], seconds=1.0)  # a revisit counts once
    path = tmp_path / "r.json"
    write_report(path, build_report({"device": "cuda"}, [auto, *_results()], {}))
    report = load_report(path)
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["fa-auto"]["resolved"] == {"fa3": 3, "fa2": 1}
    assert by_name["peer"]["resolved"] == {} == by_name["trtllm-gen"]["resolved"]
    assert [c["resolved_backend"] for c in report["cases"] if c["backend"] == "fa-auto"] == kernels
    assert {c["resolved_backend"] for c in report["cases"] if c["backend"] != "fa-auto"} == {None}
    for kind in ("md", "html"):
        text = output_paths(path)[kind].read_text()
        assert text.count("resolved to") == 1 and "fa-auto resolved to fa3 on 3 cases, fa2 on 1" in text


def test_one_resolved_case_is_one_case() -> None:
    assert resolution_line("fa-auto", {"fa2": 1}) == "fa-auto resolved to fa2 on 1 case"


def test_a_failed_backend_without_failure_lines_still_has_a_banner() -> None:
    from mla_verify.records.report import verdict_banner

    # hand-edited or truncated reports: an empty failures list read as its first line was an IndexError
    report = {"backends": [{"name": "k", "verdict": "fail", "failure": {"failures": []}}]}
    verdict, text = verdict_banner(report)
    assert verdict == "FAIL" and "k: failed" in text


# ---------------------------------------------------------------- the run as tables, aliases drawn apart
def _aliased_report() -> dict:
    """fa-auto ran as fa3 on the same cases as fa3: their points coincide."""
    from mla_verify.run import stage_times

    draws = [(64, 8, 0.1), (900, 16, 0.3)]
    fa3 = EngineResult("fa3", "dev", 1, cases=[_case("fa3", s, h, r) for s, h, r in draws], seconds=0.5)
    auto = EngineResult("fa-auto", "dev", 1, cases=[_case("fa-auto", s, h, r) for s, h, r in draws], seconds=0.5)
    for c in auto.cases:
        c.resolved_backend = "fa3"
    for c in fa3.cases + auto.cases:
        c.stages = {"draw": 0.002, "kernel": 0.006}
    run = {"device": "cuda", "seed": None, "interrupted": False, "seconds": 1.0,
           "throughput": {r.backend: stage_times.breakdown(r) for r in (fa3, auto)}}
    return build_report(run, [fa3, auto], {})


def test_a_policy_backend_is_drawn_as_rings_around_the_kernel_it_ran_as(tmp_path):
    path = tmp_path / "r.json"
    write_report(path, _aliased_report())
    for plot in ("seq", "heads"):
        svg = ET.fromstring(output_paths(path)[plot].read_text())
        points = [(c.find(SVG + "title").text.split()[0], c) for c in svg.iter(SVG + "circle")
                  if c.find(SVG + "title") is not None]
        dots = {(c.get("cx"), c.get("cy")) for b, c in points if b == "fa3" and c.get("fill") != "none"}
        rings = {(c.get("cx"), c.get("cy")) for b, c in points if b == "fa-auto" and c.get("fill") == "none"}
        assert len(dots) == 2 and rings == dots  # every fa3 dot shows, ringed by fa-auto's point
        assert "fa-auto (open rings: ran as fa3)" in [t.text for t in svg.iter(SVG + "text")]


def test_the_run_section_is_a_table_in_markdown_and_html(tmp_path):
    report = _aliased_report()
    report["run"]["throughput"]["fa3"]["warmup_s"] = 12.5  # a warm-up phase, timed apart from the cases
    path = tmp_path / "r.json"
    write_report(path, report)
    md = output_paths(path)["md"].read_text()
    fa3 = report["run"]["throughput"]["fa3"]
    assert "| per backend | fa3 | fa-auto (ran as fa3) |" in md
    assert f"| judged cases | {fa3['judged']} | {fa3['judged']} |" in md
    assert f"| kernel, mean per judged case | {fa3['mean_ms']['kernel']:.1f} ms (75%) |" in md  # 6 of 8 ms
    assert "| warm-up (apart from the cases) | 12.5 s | - |" in md
    assert "| interrupted | no |" in md and "seed" not in md  # unset settings are left out
    html = output_paths(path)["html"].read_text()
    assert "<td>judged per second</td>" in html
    for text in (md, html):
        assert not re.search(r"\{'|\['|\[\(|True|False|None", text), "a raw Python repr in the report"


def _sparse_runs() -> list[EngineResult]:
    spec = SparseSpec(batch=1, num_heads=64, topk=64, page_size=64, used_pages=4, invalid=0.0)
    layout = SPARSE_LAYOUT
    stats = ErrorStats(30e-2, 1e-2, 30e-4, 1e-3, 5e-3, 1e-3, 1e-7, (0, 0, 0, 0))
    fail = CaseResult("sparse-mutant", spec, layout, "none", "fail", ["max |out - ref| too large"],
                      "max |out - ref| too large", stats=stats, stages={"kernel": 0.25})
    diagnosed = CaseResult("sparse-mutant", spec, layout, "none", "fail", fail.failures, fail.reason, stats=stats,
                           diagnosis=["reads each tile with the next tile's scale [tile_scale_shifted]"])
    skip = CaseResult("sparse-mutant", dataclasses.replace(spec, seed=1), layout, "none", "skip",
                      reason="outside its envelope")
    bad = EngineResult("sparse-mutant", "dev", 1, "sparse", [skip, fail, fail], failure=diagnosed, seconds=0.5)
    gone = EngineResult("flashmla-sparse", "dev", 1, "sparse",
                        unavailable="flashmla-sparse: runs on cuda devices, not cpu")
    return [bad, gone]


def test_sparse_backends_and_cases_are_recorded_as_dense_ones_are(tmp_path):
    rep = build_report({"command": "mla-verify check"}, _results()[:1] + _sparse_runs(),
                       {"sparse-mutant": "fixtures/regressions/x.json"}, selfcheck="ok")
    bad, gone = rep["backends"][1:]
    assert (bad["kind"], bad["verdict"], bad["cases"], gone["verdict"], gone["cases"]) == ("sparse", "fail", 2,
                                                                                           "skip", 0)
    assert bad["failure"]["fixture"] == "fixtures/regressions/x.json"
    sparse = [c for c in rep["cases"] if c["kind"] == "sparse"]
    failing = [c for c in sparse if c["verdict"] == "fail"]
    assert len(sparse) == 2 and failing[0]["description"] == SparseSpec(**failing[0]["spec"]).describe()
    assert verdict_banner(rep)[0] == "FAIL"
    path = tmp_path / "r.json"
    write_report(path, rep)
    root = ET.fromstring(output_paths(path)["xml"].read_text())
    suites = {s.get("name"): s for s in root}
    mutant = suites["mla-verify.sparse-mutant"]
    assert (mutant.get("tests"), mutant.get("failures"), mutant.get("skipped")) == ("2", "1", "1")
    assert suites["mla-verify.flashmla-sparse"].get("skipped") == "1"
    assert "max |out - ref|" in mutant.find("testcase/failure").text
    md = output_paths(path)["md"].read_text()
    assert "| sparse-mutant | fail | 2 | 0 | 1 | 1 | 30 |" in md and "mla-verify replay fixtures/regressions/x" in md
    assert "tile_scale_shifted" in md  # its failure's diagnosis
    assert "sparse-mutant" in output_paths(path)["seq"].read_text()  # plotted at its top-k, as dense at its length


def test_a_version_2_report_with_sparse_cases_apart_still_renders(tmp_path):
    rep = build_report({"command": "mla-verify check"}, _results()[:1] + _sparse_runs(), {}, selfcheck="ok")
    rep["format_version"] = 2
    rep["sparse_cases"] = [c for c in rep["cases"] if c["kind"] == "sparse"]
    rep["cases"] = [c for c in rep["cases"] if c["kind"] != "sparse"]
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(rep))
    render(load_report(path), path)
    assert "| sparse-mutant | fail | 2 | 0 | 1 | 1 | 30 |" in output_paths(path)["md"].read_text()


def test_a_version_1_report_still_renders(tmp_path):
    """Before sparse backends were recorded: no kind on a backend, no sparse_cases."""
    rep = _report()
    rep["format_version"] = 1
    for b in rep["backends"]:
        del b["kind"]
    for c in rep["cases"]:
        del c["kind"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(rep))
    render(load_report(path), path)
    assert "| mutant | fail | 2 | 1 | 1 | 0 | 30 |" in output_paths(path)["md"].read_text()
