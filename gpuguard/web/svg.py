"""Inline SVG bar charts of GPU-hours granted against busy (no JavaScript, no library).

Every label is escaped (pages.h); numbers are formatted here. The chart scales to the largest
value and draws one pair of bars per label, granted behind busy, so the idle part shows as the
granted bar's uncovered end.
"""
from __future__ import annotations

from collections.abc import Sequence

from gpuguard.web.pages import h
from gpuguard.web.views import Usage

WIDTH = 720
LABEL_WIDTH = 180
ROW = 22
MAX_BARS = 200  # many users still make a page under its size budget (days come in weeks past 62)


def usage_chart(title: str, all_rows: Sequence[Usage]) -> str:
    """The rows in their order (the callers put the largest first), the first MAX_BARS drawn
    with a line saying how many more the table below and the CSV hold."""
    rows = list(all_rows)[:MAX_BARS]
    if not any(r.granted_hours for r in rows):
        return f'<p class="empty">{h(title)}: no usage in this period.</p>'
    top = max(max(r.granted_hours for r in rows), 1e-9)
    plot = WIDTH - LABEL_WIDTH - 130  # room for "21.0 h, 32% busy" after the longest bar
    height = ROW * len(rows) + 30
    # Scaled to the page's width by the stylesheet (a phone's 390 px too); the numbers are also a
    # table below it, for screen readers and for anyone who wants them exact.
    parts = [f'<svg class="chart" role="img" aria-label="{h(title)}; the numbers are in the table below" '
             f'viewBox="0 0 {WIDTH} {height}" preserveAspectRatio="xMinYMin meet">', f"<title>{h(title)}</title>"]
    for i, r in enumerate(rows):
        y = 20 + i * ROW
        granted = plot * r.granted_hours / top
        busy = "busy unknown" if r.busy_hours is None else f"{r.busy_hours:.2f} h busy"
        share = "" if r.busy_share is None else f", {r.busy_share:.0%} busy"
        bar = "" if r.busy_hours is None else (
            f'<rect class="busy" x="{LABEL_WIDTH}" y="{y + 6}" width="{plot * r.busy_hours / top:.1f}" height="{ROW - 14}"/>')
        parts.append(
            f'<g><title>{h(r.label)}: {r.granted_hours:.2f} h granted, {busy}{share}</title>'
            f'<text x="{LABEL_WIDTH - 6}" y="{y + 14}" text-anchor="end">{h(_short(r.label))}</text>'
            f'<rect class="granted" x="{LABEL_WIDTH}" y="{y + 2}" width="{granted:.1f}" height="{ROW - 6}"/>{bar}'
            f'<text x="{LABEL_WIDTH + granted + 4:.1f}" y="{y + 14}">{r.granted_hours:.1f} h'
            f'{"" if r.busy_share is None else f", {r.busy_share:.0%} busy"}</text></g>')
    parts.append(f'<text x="{LABEL_WIDTH}" y="12" class="legend">'
                 "GPU-hours: granted (the outlined bar), busy (the bar inside it)</text>")
    parts.append("</svg>")
    more = len(all_rows) - len(rows)
    note = f'<p class="more">The {len(rows)} largest of {len(all_rows)}; all are in the numbers below and the CSV.</p>'
    return "".join(parts) + (note if more else "") + numbers(title, all_rows)


def numbers(title: str, rows: Sequence[Usage]) -> str:
    """The chart's values as a table (in a <details>, closed at first)."""
    body = "".join(
        f"<tr><th scope=row>{h(r.label)}</th><td>{r.granted_hours:.2f}</td>"
        f"<td>{'unknown' if r.busy_hours is None else f'{r.busy_hours:.2f}'}</td>"
        f"<td>{'unknown' if r.busy_share is None else f'{r.busy_share:.0%}'}</td></tr>" for r in rows)
    return (f'<details class="numbers"><summary>{h(title)}: the numbers</summary><table><caption>{h(title)}</caption>'
            "<thead><tr><th scope=col>who or what</th><th scope=col>GPU-hours granted</th>"
            f"<th scope=col>GPU-hours busy</th><th scope=col>busy share</th></tr></thead><tbody>{body}</tbody></table>"
            "</details>")


def _short(label: str, limit: int = 28) -> str:
    return label if len(label) <= limit else label[:limit - 1] + "…"
