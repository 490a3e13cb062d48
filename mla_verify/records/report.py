"""Run reports: JSON (the record), JUnit XML (for CI systems), Markdown and HTML with plots (for people).

``--report out.json`` writes ``out.json`` and, beside it, ``out.xml``, ``out.md``, ``out.html`` and two SVG
plots (``out.err-vs-seq.svg``, ``out.err-vs-heads.svg``) that the Markdown links and the HTML inlines.
Everything but the JSON is rendered from the JSON alone, so ``mla-verify report out.json`` re-renders them.
Plots are plain SVG drawn here: no plotting dependency, and every runner can write them.

Backends and cases of every problem kind are recorded alike: each backend and each case says its ``kind`` (dense,
sparse); a case of another kind than dense carries its ``description``, since its spec is another schema. (A
report of version 2 kept sparse cases apart, in ``sparse_cases``: they are read from there.)
"""
from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import UsageError
from .fixtures import check_writable_dir
from .run_table import settings_rows, time_table

if TYPE_CHECKING:
    from ..run.engine import EngineResult
    from ..run.harness import CaseResult

FORMAT = "mla-verify-report"
FORMAT_VERSION = 3  # 3: every kind's cases in cases; 2: sparse ones in sparse_cases; 1: dense only
RENDERED = {"xml": ".xml", "md": ".md", "html": ".html"}
PLOTS = {"seq": ("err-vs-seq", "longest sequence in the case (sparse: top-k), tokens", "max_seq"),
         "heads": ("err-vs-heads", "heads", "heads")}
WORST_SHOWN = 20  # the Markdown/HTML list the worst cases; the JSON has all of them


def output_paths(json_path: Path) -> dict[str, Path]:
    """Every file a report at ``json_path`` consists of."""
    stem = json_path.with_suffix("") if json_path.suffix == ".json" else json_path
    paths = {"json": json_path}
    paths.update({k: stem.with_name(stem.name + ext) for k, ext in RENDERED.items()})
    paths.update({k: stem.with_name(f"{stem.name}.{name}.svg") for k, (name, _, _) in PLOTS.items()})
    return paths


def check_report_path(value: str) -> Path:
    """Validate ``--report`` before anything runs: the JSON path, in a directory we can write to (or can
    create: ``write_report`` creates it, once the run is over)."""
    path = Path(value)
    if path.suffix in (".xml", ".md", ".html", ".svg"):
        raise UsageError(f"--report takes the JSON path (e.g. {path.with_suffix('.json')}); "
                         "the .xml/.md/.html/.svg files are written beside it")
    for p in output_paths(path).values():
        if p.is_dir():
            raise UsageError(f"--report: {p} is a directory")
    check_writable_dir(path.parent, "--report")
    return path


def write_report(path: Path, report: dict[str, Any]) -> list[Path]:
    """Write the JSON record and render the rest beside it; returns every path written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    except OSError as e:  # checked writable before the run; a full disk or lost permission since
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    return [path] + render(report, path)


def load_report(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON report for re-rendering; one-line UsageError when it is missing or not ours."""
    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such report") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable JSON report ({type(e).__name__})") from None
    if not isinstance(report, dict) or report.get("format") != FORMAT or not isinstance(report.get("cases"), list):
        raise UsageError(f"{path}: not an mla-verify report (no \"format\": \"{FORMAT}\" with a cases list)")
    return report


def render(report: dict[str, Any], json_path: Path) -> list[Path]:
    """JUnit XML, SVG plots, Markdown and HTML beside ``json_path``, all from the JSON record."""
    paths = output_paths(json_path)
    try:
        paths["xml"].write_text(junit_xml(report))
        aliases = {b["name"]: list(b["resolved"]) for b in report.get("backends", []) if b.get("resolved")}
        svgs = {k: scatter_svg(all_cases(report), k, aliases) for k in PLOTS}
        for k, svg in svgs.items():
            paths[k].write_text(svg)
        blocks = _document(report, {k: paths[k].name for k in PLOTS}, svgs)
        paths["md"].write_text(to_markdown(blocks))
        paths["html"].write_text(to_html(blocks))
    except OSError as e:
        raise UsageError(f"cannot write the report beside {json_path}: {e.strerror}") from None
    return [paths[k] for k in ("xml", *PLOTS, "md", "html")]


# ---------------------------------------------------------------- JUnit
def junit_xml(report: dict[str, Any]) -> str:
    """One <testsuite> per backend, one <testcase> per case; an unavailable backend is one skipped case."""
    root = ET.Element("testsuites", name="mla-verify")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for backend in report.get("backends", []):
        suite = ET.SubElement(root, "testsuite", name=f"mla-verify.{backend['name']}")
        counts = {"tests": 0, "failures": 0, "skipped": 0}
        if backend.get("unavailable"):
            tc = ET.SubElement(suite, "testcase", classname=f"mla-verify.{backend['name']}", name="available")
            ET.SubElement(tc, "skipped", message=backend["unavailable"])
            counts["tests"], counts["skipped"] = 1, 1
        for c in backend_cases(report, backend):
            tc = ET.SubElement(suite, "testcase", classname=f"mla-verify.{c['backend']}",
                               name=f"{c['id']} {_short(c)}", time=f"{c.get('seconds', 0):.3f}")
            counts["tests"] += 1
            if c["verdict"] == "fail":
                counts["failures"] += 1
                fail = ET.SubElement(tc, "failure", message=c.get("reason") or "failed")
                fail.text = "\n".join(c.get("failures", []) + [f"diagnosis: {d}" for d in c.get("diagnosis", [])]
                                      + [f"case: {json.dumps(c['spec'])}"]
                                      + ([f"layout: {json.dumps(c['layout'])}"] if "layout" in c else []))
            elif c["verdict"] == "skip":
                counts["skipped"] += 1
                ET.SubElement(tc, "skipped", message=c.get("reason") or "skipped")
        suite.set("time", f"{backend.get('seconds', 0):.3f}")
        for k, v in counts.items():
            suite.set(k, str(v))
            totals[k] += v
    for k, v in totals.items():
        root.set(k, str(v))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def backend_cases(report: dict[str, Any], backend: dict[str, Any]) -> list[dict[str, Any]]:
    """A backend's cases (of a version 2 report, a sparse one's from ``sparse_cases``)."""
    return [c for c in all_cases(report) if c["backend"] == backend["name"]]


def all_cases(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of the report, whatever its kind and the report's version."""
    return [*report["cases"], *report.get("sparse_cases", [])]


def _short(c: dict[str, Any]) -> str:
    if "description" in c:  # another kind than dense: its own spec schema, described when it was recorded
        return str(c["description"])
    s = c["spec"]
    lens = s["seq_lens"]
    q = s["q_len"] if s.get("q_lens") is None else f"{s['q_len']}(ragged)"
    return (f"B={len(lens)} H={s['num_heads']} q={q} page={s['page_size']} "
            f"({s['kv_lora_rank']},{s['qk_rope_head_dim']}) {s['dtype']} max_seq={max(lens)}")


# ---------------------------------------------------------------- SVG plots
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
FAIL_COLOR = "#d62728"
W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 360, 64, 24, 30, 46
LEGEND_LINE = 16
CHAR_W = 6.5  # px per character of 11 px sans-serif, generously: legend names are never cut
RATIO_FLOOR = 1e-4  # error ratios below this (near-exact kernels, exact zeros included) sit on the bottom edge
RATIO_CEIL = 1e3  # above it on the top edge, as do failures with non-finite or no output
# how a point is drawn, and what the legend says of it (only the marks a plot uses are listed)
MARKS = {
    "inside": "",
    "above": f"error over {RATIO_CEIL:g}x what is allowed, drawn on the top edge",
    "below": f"error under {RATIO_FLOOR:g} of what is allowed (exact 0 included: out equals the reference "
             "after its bf16 rounding), drawn on the bottom edge",
    "broken": "failed with NaN/inf in out, or no output at all, drawn on the top edge",
    "other": "failed a check other than the error bound (bits, inputs, out buffer): its error is within it",
}


def _x_value(case: dict[str, Any], key: str) -> float:
    spec = case["spec"]
    if key != "max_seq":
        return float(spec["num_heads"])
    # sparse: the keys a token sees; a batch of empty requests (kv_len 0) sits at 1 on the log axis
    return float(max(1, max(spec["seq_lens"]) if "seq_lens" in spec else spec["topk"]))


def _error_ratio(case: dict[str, Any]) -> float | None:
    """error / allowed as recorded; None when the case has no finite output to measure."""
    stats = case.get("stats") or {}
    r = stats.get("error_ratio")
    return None if r is None or stats.get("nonfinite") else float(r)


def _mark(case: dict[str, Any]) -> tuple[float, str]:
    """Where a judged case is drawn (its ratio, clipped to the plot) and how (a MARKS key)."""
    r = _error_ratio(case)
    failed = case["verdict"] == "fail"
    if r is None:
        return RATIO_CEIL, "broken"
    if failed and r <= 1:
        return max(r, RATIO_FLOOR), "other"
    if r > RATIO_CEIL:
        return RATIO_CEIL, "above"
    if r < RATIO_FLOOR:
        return RATIO_FLOOR, "below"
    return r, "inside"


def _sort_key(case: dict[str, Any]) -> tuple[bool, bool, float]:
    """Worst first when sorted in reverse: failures, then those without a finite output, then by ratio."""
    r = _error_ratio(case)
    return case["verdict"] == "fail", r is None, r or 0.0


def _ratio_text(case: dict[str, Any]) -> str:
    r = _error_ratio(case)
    if r is not None:
        return f"{r:.3g}"
    return "non-finite" if (case.get("stats") or {}).get("nonfinite") else "no output"


def _shape(kind: str, x: float, y: float, fill: str, extra: str) -> str:
    """An SVG element (without its end) for one point: circle, triangles for clipped, cross, square."""
    if kind in ("inside", "ring"):  # a ring (a policy backend's point) is drawn around the filled dot
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{3 if kind == "inside" else 5.5}" fill="{fill}" ' \
               f'fill-opacity="0.7"{extra}>'
    if kind == "broken":
        return (f'<path d="M{x - 4:.1f},{y - 4:.1f}L{x + 4:.1f},{y + 4:.1f}M{x - 4:.1f},{y + 4:.1f}'
                f'L{x + 4:.1f},{y - 4:.1f}" stroke="{fill}" stroke-width="2.5"{extra}>')
    if kind == "other":
        return (f'<rect x="{x - 3.5:.1f}" y="{y - 3.5:.1f}" width="7" height="7" fill="{fill}" '
                f'fill-opacity="0.7"{extra}>')
    tip = -5 if kind == "above" else 5  # a triangle pointing off the plot, to where the value lies
    return (f'<path d="M{x:.1f},{y + tip:.1f}L{x + 4.5:.1f},{y - tip * 0.6:.1f}L{x - 4.5:.1f},{y - tip * 0.6:.1f}Z" '
            f'fill="{fill}" fill-opacity="0.8"{extra}>')


def _end(element: str) -> str:
    return "</" + element[1:element.index(" ")] + ">"


def scatter_svg(cases: list[dict[str, Any]], which: str, aliases: dict[str, list[str]] | None = None) -> str:
    """Error ratio (error / allowed; < 1 passes) against sequence length or heads, one colour per backend,
    failing cases outlined red; clipped, non-finite and other-check failures marked (MARKS).

    ``aliases`` maps a policy backend (fa-auto) to the kernels it ran as: its points lie on theirs when both
    ran the same cases, so it is drawn as open rings around them, drawn last, and its legend says so."""
    _, x_label, key = PLOTS[which]
    aliases = aliases or {}
    points = [c for c in cases if c.get("stats") is not None or c["verdict"] == "fail"]
    points.sort(key=lambda c: c["backend"] in aliases)  # stable: rings over the filled marks they surround
    backends = list(dict.fromkeys(c["backend"] for c in cases))
    marks = {c["id"]: _mark(c) for c in points}
    used = [k for k in MARKS if k != "inside" and any(m == k for _, m in marks.values())]
    names = {b: b + (f" (open rings: ran as {', '.join(aliases[b])})" if b in aliases else "") for b in backends}
    legend = [(b, "") for b in backends] + [("", k) for k in used]
    width = max(W, int(LEFT + 30 + CHAR_W * max((len(names[b] if b else MARKS[k]) for b, k in legend),
                                                default=0)))
    height = H + LEGEND_LINE * len(legend) + (LEGEND_LINE if points else 0)
    xs = [_x_value(c, key) for c in points] or [1.0]
    x_lo, x_hi = math.log10(min(xs)), math.log10(max(xs))
    pad = max(0.05 * (x_hi - x_lo), 0.2)  # keep edge points off the frame
    x_lo, x_hi = x_lo - pad, x_hi + pad
    y_lo, y_hi = math.log10(RATIO_FLOOR), math.log10(RATIO_CEIL)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(v: float) -> float:
        return LEFT + pw * (math.log10(v) - x_lo) / (x_hi - x_lo)

    def py(v: float) -> float:
        return TOP + ph * (1 - (math.log10(v) - y_lo) / (y_hi - y_lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{LEFT}" y="18" font-size="13">Error / allowed vs {escape(x_label)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for e in range(math.ceil(x_lo), math.floor(x_hi) + 1):
        x = px(10.0 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" stroke="#e5e5e5"/>'
                   f'<text x="{x:.1f}" y="{TOP + ph + 14}" text-anchor="middle">{10 ** e:g}</text>')
    for e in range(int(y_lo), int(y_hi) + 1):
        y = py(10.0 ** e)
        label = ("&lt;" if e == y_lo else "&gt;" if e == y_hi else "") + f"{10.0 ** e:g}"  # the edges hold the rest
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    y1 = py(1.0)
    out.append(f'<line x1="{LEFT}" y1="{y1:.1f}" x2="{LEFT + pw}" y2="{y1:.1f}" stroke="{FAIL_COLOR}" '
               f'stroke-dasharray="5,3"/><text x="{LEFT + pw - 4}" y="{y1 - 4:.1f}" text-anchor="end" '
               f'fill="{FAIL_COLOR}">allowed (fails above)</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 8}" text-anchor="middle">{escape(x_label)} (log scale)</text>'
               f'<text x="14" y="{TOP + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {TOP + ph / 2})">error / allowed (log scale)</text>')
    for c in points:
        color = COLORS[backends.index(c["backend"]) % len(COLORS)]
        y, kind = marks[c["id"]]
        failed = c["verdict"] == "fail"
        fill = FAIL_COLOR if kind == "broken" else color
        ring = f' stroke="{FAIL_COLOR}" stroke-width="2"' if failed and kind != "broken" else ""
        if c["backend"] in aliases and kind != "broken":
            fill, ring = "none", f' stroke="{FAIL_COLOR if failed else color}" stroke-width="1.5"'
            kind = "ring" if kind == "inside" else kind
        element = _shape(kind, px(_x_value(c, key)), py(y), fill, ring)
        note = f" ({MARKS[kind].split(',')[0]})" if kind not in ("inside", "ring") else ""
        out.append(f'{element}<title>{escape(c["backend"])} {c["id"]} {c["verdict"]}: error/allowed '
                   f'{_ratio_text(c)}{escape(note)}; {escape(_short(c))}</title>{_end(element)}')
    ly = H + 4
    for i, (b, k) in enumerate(legend):
        y = ly + LEGEND_LINE * i
        color = COLORS[i % len(COLORS)]
        sample = (f'<circle cx="{LEFT + 6}" cy="{y}" r="5" fill="none" stroke="{color}" stroke-width="1.5"/>'
                  if b in aliases else f'<circle cx="{LEFT + 6}" cy="{y}" r="4" fill="{color}"/>' if b else
                  _shape(k, LEFT + 6, y, FAIL_COLOR if k == "broken" else "#888", "")[:-1] + "/>")
        out.append(f'{sample}<text x="{LEFT + 18}" y="{y + 4}">{escape(names[b] if b else MARKS[k])}</text>')
    if points:
        y = ly + LEGEND_LINE * len(legend)
        out.append(f'<circle cx="{LEFT + 6}" cy="{y}" r="4" fill="none" stroke="{FAIL_COLOR}" stroke-width="2"/>'
                   f'<text x="{LEFT + 18}" y="{y + 4}">red outline: a failing case</text>')
    else:
        out.append(f'<text x="{LEFT + pw / 2}" y="{TOP + ph / 2}" text-anchor="middle">no judged cases</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- Markdown / HTML
Block = tuple  # ("h", level, text) | ("p", text) | ("pre", text) | ("table", headers, rows) | ("img", key, alt)
#              | ("banner", verdict, text)
BANNER_COLORS = {"FAIL": ("#fde2e1", FAIL_COLOR), "PASS": ("#e3f4e1", "#2ca02c"),
                 "INTERRUPTED": ("#fff3d6", "#ff7f0e"), "NOTHING RAN": ("#eeeeee", "#777")}


def verdict_banner(report: dict[str, Any]) -> tuple[str, str]:
    """The run's verdict at a glance -- FAIL, PASS, INTERRUPTED (Ctrl-C before any failure: a partial run
    proves nothing) or NOTHING RAN -- and one line on why."""
    backends = report.get("backends", [])
    failed = [b for b in backends if b["verdict"] == "fail"]
    passed = [b for b in backends if b["verdict"] == "pass"]
    skipped = len(backends) - len(failed) - len(passed)
    selfcheck = report.get("selfcheck") or ""
    parts = [f"{len(failed)} of {len(backends)} backends failed"] if failed else []
    parts += [f"{b['name']}: {((b.get('failure') or {}).get('failures') or ['failed'])[0]}" for b in failed]
    parts += [f"{len(passed)} passed"] + ([f"{skipped} could not run here"] if skipped else [])
    if selfcheck.startswith("FAILED"):
        parts.insert(0, f"the reference self-check {selfcheck}")
    interrupted = bool((report.get("run") or {}).get("interrupted"))
    if interrupted:
        parts.append("interrupted: only the cases judged until then")
    verdict = ("FAIL" if failed or selfcheck.startswith("FAILED") else "INTERRUPTED" if interrupted
               else "PASS" if passed else "NOTHING RAN")
    return verdict, "; ".join(parts)


def _document(report: dict[str, Any], plot_names: dict[str, str], svgs: dict[str, str]) -> list[Block]:
    cases = all_cases(report)
    blocks: list[Block] = [("h", 1, "mla-verify report"), ("banner", *verdict_banner(report))]
    if report.get("platform"):
        blocks.append(("p", f"platform: {report['platform']}"))
    if report.get("selfcheck"):
        blocks.append(("p", f"reference self-check: {report['selfcheck']}"))
    blocks.append(("h", 2, "Backends"))
    rows = []
    for b in report.get("backends", []):
        mine = backend_cases(report, b)
        count = count_verdicts(c["verdict"] for c in mine)
        judged = [c for c in mine if c.get("stats") or c["verdict"] == "fail"]
        worst = _ratio_text(max(judged, key=_sort_key)) if judged else ""
        rows.append([b["name"], b["verdict"] + (" (time limit reached)" if b.get("timed_out") else ""),
                     str(len(mine)), str(count["pass"]), str(count["fail"]), str(count["skip"]),
                     worst, f"{b.get('seconds', 0):.1f}", b.get("unavailable") or ""])
    blocks.append(("table", ["backend", "verdict", "cases", "pass", "fail", "skip", "worst error/allowed",
                             "seconds", "not run because"], rows))
    blocks += [("p", resolution_line(b["name"], b["resolved"])) for b in report.get("backends", [])
               if b.get("resolved")]
    for b in report.get("backends", []):
        failure = b.get("failure")
        if not failure:
            continue
        blocks.append(("h", 2, f"Failure: {b['name']}"))
        lines = [f"minimal case: {failure['case']}"] + [f"  - {f}" for f in failure.get("failures", [])]
        lines += [f"diagnosis: {d}" for d in failure.get("diagnosis", [])]  # none: no output to diagnose
        first = failure.get("first_failing")
        if first:  # both cases' diagnoses, always: the report is the whole record
            lines += [f"first failing case: {first['case']}"] + [f"  diagnosis: {d}" for d in first["diagnosis"]]
        if failure.get("fixture"):
            lines += [f"reproducer: {failure['fixture']}", f"re-run: mla-verify replay {failure['fixture']}"]
        blocks.append(("pre", "\n".join(lines)))
    run = report.get("run") or {}
    blocks += [("h", 2, "Run"), ("table", ["setting", "value"], settings_rows(run))]
    if run.get("throughput"):
        resolved = {b["name"]: b["resolved"] for b in report.get("backends", []) if b.get("resolved")}
        blocks += [("h", 2, "Where the time went"), ("table", *time_table(run["throughput"], resolved))]
    blocks.append(("h", 2, "Error against sequence length and head count"))
    blocks.append(("p", "Each point is one judged case: its error divided by what the tolerance model allows "
                        "(below 1 passes). Failing cases are outlined red; a failure with NaN/inf or no output "
                        f"is a red cross on the top edge. Errors past {RATIO_CEIL:g}x are triangles on the top "
                        f"edge; errors under {RATIO_FLOOR:g} of what is allowed, exact zeros included (the output "
                        "equals the reference after its bf16 rounding), are triangles on the bottom edge."))
    for k in PLOTS:
        blocks.append(("img", plot_names[k], svgs[k]))
    judged = sorted((c for c in cases if c.get("stats") or c["verdict"] == "fail"), key=_sort_key, reverse=True)
    blocks.append(("h", 2, f"Worst {min(WORST_SHOWN, len(judged))} of {len(cases)} cases"))
    blocks.append(("table", ["id", "backend", "verdict", "error/allowed", "case", "reason"],
                   [[c["id"], c["backend"], c["verdict"], _ratio_text(c), _short(c), c.get("reason", "")]
                    for c in judged[:WORST_SHOWN]]))
    return blocks


def to_markdown(blocks: Iterable[Block]) -> str:
    out = []
    for b in blocks:
        if b[0] == "h":
            out.append("#" * b[1] + " " + b[2])
        elif b[0] == "p":
            out.append(b[1])
        elif b[0] == "pre":
            out.append("```\n" + b[1] + "\n```")
        elif b[0] == "img":
            out.append(f"![{b[1]}]({b[1]})")
        elif b[0] == "banner":
            out.append(f"> **{b[1]}** -- {b[2]}")
        else:
            cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            out.append("\n".join(["| " + " | ".join(map(cell, b[1])) + " |", "|" + "---|" * len(b[1])]
                                 + ["| " + " | ".join(map(cell, r)) + " |" for r in b[2]]))
    return "\n\n".join(out) + "\n"


def to_html(blocks: Iterable[Block]) -> str:
    out = ['<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>mla-verify report</title><style>'
           "body{font-family:sans-serif;max-width:1100px;margin:1em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}pre{background:#f5f5f5;padding:8px;"
           "white-space:pre-wrap}</style></head><body>"]
    for b in blocks:
        if b[0] == "h":
            out.append(f"<h{b[1]}>{escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            out.append(f"<p>{escape(b[1])}</p>")
        elif b[0] == "pre":
            out.append(f"<pre>{escape(b[1])}</pre>")
        elif b[0] == "img":
            out.append(f"<figure>{b[2]}</figure>")
        elif b[0] == "banner":
            background, edge = BANNER_COLORS[b[1]]
            out.append(f'<div style="background:{background};border-left:6px solid {edge};padding:8px;'
                       f'font-size:15px"><b>{escape(b[1])}</b> -- {escape(b[2])}</div>')
        else:
            head = "".join(f"<th>{escape(h)}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{escape(str(x))}</td>" for x in r) + "</tr>" for r in b[2])
            out.append(f"<table><tr>{head}</tr>{body}</table>")
    return "\n".join(out) + "\n</body></html>\n"


# ---------------------------------------------------------------- the record
def distinct_cases(result: EngineResult) -> list[CaseResult]:
    """Each case id once, as first judged: a shrinking search revisits cases and the failure repeats one."""
    first: dict[str, CaseResult] = {}
    for c in [*result.cases, *([result.failure] if result.failure is not None else [])]:
        first.setdefault(c.id, c)
    return list(first.values())


def count_verdicts(verdicts: Iterable[str]) -> dict[str, int]:
    """How many of ``verdicts`` are pass, fail and skip."""
    counts = Counter(verdicts)
    return {v: counts[v] for v in ("pass", "fail", "skip")}


def resolutions(resolved: Iterable[str | None]) -> dict[str, int]:
    """Cases per kernel a policy backend (fa-auto) resolved to, most first; empty for every other backend."""
    return dict(Counter(r for r in resolved if r is not None).most_common())


def resolution_line(backend: str, counts: dict[str, int]) -> str:
    """E.g. "fa-auto resolved to fa3 on 57 cases, fa2 on 3"."""
    (first, n), *rest = counts.items()
    return f"{backend} resolved to {first} on {n} case{'s' * (n != 1)}" + "".join(f", {k} on {m}" for k, m in rest)


def invariance_counts(cases: Iterable[Any]) -> dict[str, int]:
    """Cases per way the metamorphic check was judged ("bits", "tolerance"), cases without one left out; and
    "moved": the cases whose relation moved bits within tolerance (a note each), when there are any."""
    cases = list(cases)
    counts = dict(Counter(c.invariance for c in cases if c.invariance).most_common())
    moved = sum(bool(c.notes) for c in cases)
    return {**counts, "moved": moved} if moved else counts


def invariance_line(backend: str, counts: dict[str, int], kind: str = "dense") -> str | None:
    """E.g. "flashmla: metamorphic relations judged within tolerance (no bit-level claim) on 12 cases, bit for bit
    on 30; bits moved within tolerance on 2 (notes, not failures)"; None when every one compared bits. A sparse
    backend's are also the relations that reorder a row's sum."""
    n = counts.get("tolerance", 0)
    if not n:
        return None
    why = "no bit-level claim" if kind == "dense" else "a row's reordered entries, or no bit-level claim"
    moved = counts.get("moved", 0)
    return (f"{backend}: metamorphic relations judged within tolerance ({why}) on {n} case{'s' * (n != 1)}, "
            f"bit for bit on {counts.get('bits', 0)}"
            + (f"; bits moved within tolerance on {moved} (notes, not failures)" if moved else ""))


def emulations(cases: Iterable[Any]) -> dict[str, int]:
    """Cases per declared arithmetic their baseline emulated (ErrorStats.emulation), most first; empty when every
    case was judged against the plain baseline."""
    return dict(Counter(c.stats.emulation for c in cases if c.stats is not None and c.stats.emulation).most_common())


def emulation_line(backend: str, counts: dict[str, int]) -> str | None:
    """E.g. "flashmla-fp8: judged against an emulation of its declared arithmetic, FlashMLA dense fp8, on 60 cases"."""
    if not counts:
        return None
    return f"{backend}: judged against an emulation of its declared arithmetic, " + ", ".join(
        f"{name} on {n} case{'s' * (n != 1)}" for name, n in counts.items())


def build_report(run: dict[str, Any], results: list[EngineResult], fixtures: dict[str, str],
                 platform: str | None = None, selfcheck: str | None = None) -> dict[str, Any]:
    """The JSON record of a ``check`` run: one entry per backend, one per distinct case (by stable id), of every
    problem kind. ``fixtures`` maps a backend name to the reproducer written for its failure."""
    cases: list[dict[str, Any]] = []
    recorded: set[str] = set()  # ids hash the backend's name: one run twice (--kernel X twice) repeats them
    backends = []
    for r in results:
        distinct = distinct_cases(r)
        cases += [c.to_json() for c in distinct if c.id not in recorded]
        recorded.update(c.id for c in distinct)
        failure = None
        if r.failure is not None:
            failure = {"id": r.failure.id, "case": r.failure.describe(), "failures": r.failure.failures,
                       "diagnosis": r.failure.diagnosis, "fixture": fixtures.get(r.backend),
                       "first_failing": r.failure.to_json()["first_failing"]}
        backends.append({"name": r.backend, "kind": r.kind, "verdict": r.verdict, "unavailable": r.unavailable,
                         "cases": len(distinct), "seconds": round(r.seconds, 3),
                         "timed_out": r.timed_out, "interrupted": r.interrupted, "failure": failure,
                         "resolved": resolutions(c.resolved_backend for c in distinct),
                         "invariance": invariance_counts(distinct), "emulations": emulations(distinct)})
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "run": run, "platform": platform,
            "selfcheck": selfcheck, "backends": backends, "cases": cases}
