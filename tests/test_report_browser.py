"""The HTML report as a reader sees it: rendered by headless Chromium, its visible text and its plots checked.

``.ci/run`` installs Chromium (apt-get, as it installs redis-server); where there is none the test skips with
that reason. One Chromium run (about a second) both writes a screenshot, kept for CI as
``ci-artifacts/report-in-browser.png`` (git-ignored), and dumps the page after a probe script has measured it.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mla_verify.judge.compare import ErrorStats
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.records.report import PLOTS, build_report, output_paths, write_report
from mla_verify.run import stage_times
from mla_verify.run.engine import EngineResult
from mla_verify.run.harness import CaseResult

ARTIFACT = Path(__file__).resolve().parents[1] / "ci-artifacts" / "report-in-browser.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
# What a Python repr looks like in running text: a dict, list, tuple or string literal, an object's address
REPR = r"\{'|\['|\[\(|\('|object at 0x|<mla_verify\."
# Measures the page once it has loaded; the result goes into the title, which the dumped DOM carries
PROBE = """<script>
window.addEventListener("load", () => {
  const top = e => e.getBoundingClientRect().top;
  const shown = [...document.body.children].filter(e => e.tagName !== "SCRIPT" && e.getBoundingClientRect().height);
  shown.sort((a, b) => top(a) - top(b));
  const plots = [...document.querySelectorAll("figure > svg")].map(s => ({
    width: s.getBoundingClientRect().width, height: s.getBoundingClientRect().height,
    points: s.querySelectorAll("title").length}));
  const text = document.body.innerText;
  document.title = "PROBE" + JSON.stringify({order: shown.slice(0, 2).map(e => e.tagName + " " + e.innerText),
    plots, reprs: text.match(new RegExp(REPR, "g")) || [], text});
});
</script>"""


def _browser() -> str:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    pytest.skip(f"no headless Chromium here ({', '.join(BROWSERS)} not on PATH): .ci/run installs it with "
                "apt-get install chromium")


def _case(backend: str, seq: int, heads: int, ratio: float, resolved: str | None = None) -> CaseResult:
    stats = ErrorStats(ratio * 1e-2, 1e-2, ratio * 1e-4, 1e-3, 5e-3, 1e-3, 1e-7, (0, 0, 0, 0))
    case = CaseResult(backend, ProblemSpec(seq_lens=(seq, 3), num_heads=heads, seed=seq), LayoutSpec(), "none",
                      "pass", seconds=0.02, stats=stats, stages={"draw": 0.004, "kernel": 0.01, "compare": 0.006},
                      resolved_backend=resolved)
    return case


def _report() -> dict:
    """A run as `check --report` records it: a policy backend that ran as fa3, fa3 itself, a failure, a
    backend that could not run, and each one's throughput (stage_times.breakdown)."""
    draws = [(64, 8, 0.1), (900, 16, 0.3), (3000, 128, 0.05)]
    fa3 = EngineResult("fa3", "dev", 1, cases=[_case("fa3", s, h, r) for s, h, r in draws], seconds=0.3)
    auto = EngineResult("fa-auto", "dev", 1, cases=[_case("fa-auto", s, h, r, "fa3") for s, h, r in draws],
                        seconds=0.3)
    bad = _case("mutant", 300, 16, 30.0)
    bad.verdict, bad.failures, bad.reason = "fail", ["max |out - ref| too large"], "max |out - ref| too large"
    mutant = EngineResult("mutant", "dev", 1, cases=[_case("mutant", 20, 4, 0.2), bad], seconds=0.2, failure=bad)
    gone = EngineResult("trtllm-gen", "dev", 1, unavailable="trtllm-gen: needs SM100/SM103; this GPU is SM90")
    results = [fa3, auto, mutant, gone]
    run = {"command": "mla-verify check --device cuda --report out.json", "device": "cuda", "profile": "dev",
           "seed": None, "max_examples": None, "minutes": None, "seconds": 1.2, "interrupted": False,
           "throughput": {r.backend: stage_times.breakdown(r) for r in results if r.unavailable is None}}
    return build_report(run, results, {"mutant": "fixtures/regressions/x.json"}, platform="test", selfcheck="ok")


def test_the_html_report_reads_right_in_a_browser(tmp_path):
    browser = _browser()
    html = output_paths(tmp_path / "out.json")["html"]
    write_report(tmp_path / "out.json", _report())
    probe = tmp_path / "probe.html"
    probe.write_text(html.read_text().replace("</body>", PROBE.replace("REPR", json.dumps(REPR)) + "</body>"))
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.unlink(missing_ok=True)
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,2400",
                           f"--screenshot={ARTIFACT}", "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r"<title>PROBE(.*?)</title>", done.stdout, re.S)
    assert found, f"Chromium did not render the page (exit {done.returncode}): {done.stderr[-2000:]}"
    seen = json.loads(found.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    print(f"screenshot of the report: {ARTIFACT}")
    assert seen["reprs"] == [], f"raw Python reprs in what a reader sees: {seen['reprs']}"
    title, banner = seen["order"]
    assert title == "H1 mla-verify report" and banner.startswith("DIV FAIL -- 1 of 4 backends failed"), \
        f"the verdict banner is not first under the title: {seen['order']}"
    assert len(seen["plots"]) == len(PLOTS)
    for plot in seen["plots"]:
        assert plot["width"] > 0 and plot["height"] > 0 and plot["points"] > 0, seen["plots"]
    assert ARTIFACT.stat().st_size > 0
