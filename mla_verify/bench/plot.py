"""The benchmark's plot: achieved GB/s per case, one bar per backend, as a dependency-free SVG.

Plain SVG rather than matplotlib so every run -- including a bare GPU host -- writes its plot, and the
file diffs as text. A dashed line marks the device copy bandwidth measured in the same run.
"""
from __future__ import annotations

from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .measure import BenchResult

COLORS = ("#4472c4", "#ed7d31", "#70ad47", "#a5a5a5", "#ffc000", "#5b9bd5", "#7030a0", "#c00000")
BAR, GAP, LABEL_W, PLOT_W, TOP = 9, 6, 230, 640, 46
CHAR_W = 6  # px a case key's character takes at font-size 10 (the label column widens for long sparse keys)


def write_svg(result: BenchResult, path: Path) -> None:
    rows = result.timed()
    backends = list(dict.fromkeys(c.backend for c in rows))
    keys = list(dict.fromkeys(c.key for c in rows))
    gbps = {(c.backend, c.key): c.gbps for c in rows}
    copy = result.meta.get("copy_gbps")
    top = max([v for v in gbps.values()] + [copy or 0, 1.0])
    label_w = max([LABEL_W, *(CHAR_W * len(k) + 8 for k in keys)])
    group_h = len(backends) * BAR + GAP
    height = TOP + len(keys) * group_h + 30
    x = lambda v: label_w + PLOT_W * v / top  # noqa: E731
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + PLOT_W + 20}" height="{height}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="4" y="14" font-size="12">Achieved GB/s per case ({escape(str(result.meta.get("device_name")))}, '
           f'{escape(str(result.meta.get("date")))})</text>']
    legend_x = label_w
    for i, b in enumerate(backends):
        svg.append(f'<rect x="{legend_x}" y="22" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
                   f'<text x="{legend_x + 14}" y="31">{escape(b)}</text>')
        legend_x += max(90, CHAR_W * len(b) + 24)
    axis_y = TOP + len(keys) * group_h
    for k in range(6):
        v = top * k / 5
        svg.append(f'<line x1="{x(v):.1f}" y1="{TOP - 4}" x2="{x(v):.1f}" y2="{axis_y}" stroke="#ddd"/>'
                   f'<text x="{x(v):.1f}" y="{axis_y + 12}" text-anchor="middle">{v:.0f}</text>')
    for j, key in enumerate(keys):
        y0 = TOP + j * group_h
        svg.append(f'<text x="{label_w - 4}" y="{y0 + group_h / 2 + 2}" text-anchor="end">{escape(key)}</text>')
        for i, b in enumerate(backends):
            v = gbps.get((b, key))
            if v is not None:
                svg.append(f'<rect x="{label_w}" y="{y0 + i * BAR}" width="{x(v) - label_w:.1f}" '
                           f'height="{BAR - 1}" fill="{COLORS[i % len(COLORS)]}">'
                           f'<title>{escape(b)} {escape(key)}: {v:.0f} GB/s</title></rect>')
    if copy:
        svg.append(f'<line x1="{x(copy):.1f}" y1="{TOP - 4}" x2="{x(copy):.1f}" y2="{axis_y}" stroke="#c00000" '
                   f'stroke-dasharray="4,3"/><text x="{x(copy) - 2:.1f}" y="{TOP - 6}" text-anchor="end" '
                   f'fill="#c00000">device copy {copy:.0f} GB/s</text>')
    svg.append(f'<text x="{label_w + PLOT_W / 2}" y="{axis_y + 26}" text-anchor="middle">GB/s</text></svg>')
    path.write_text("\n".join(svg) + "\n")
