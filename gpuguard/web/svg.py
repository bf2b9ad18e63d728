"""Inline SVG charts (no JavaScript, no library): bars of GPU-hours granted against busy, and
lines of utilisation and memory over time.

Every label is escaped (pages.h); numbers are formatted here. The bar chart scales to the largest
value and draws one pair of bars per label, granted behind busy, so the idle part shows as the
granted bar's uncovered end. A line chart is one bucket per unit of x and 0-100 on y, stretched to
its box by the stylesheet (the strokes keep their width): its words (title, scale, times) are the
page's HTML around it, and its values are in the page's tables.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpuguard.core.quantities import format_size
from gpuguard.web.pages import h
from gpuguard.web.views import Trend, Usage

WIDTH = 720
LABEL_WIDTH = 180
ROW = 22
MAX_BARS = 200  # many users still make a page under its size budget (days come in weeks past 62)


@dataclass(frozen=True)
class Sorting:
    """How a usage chart's rows are ordered (views.USAGE_SORTS), the page's address without its
    `sort` (each order a link to it), and whether the reader chose it (then its numbers are shown)."""

    by: str
    base: str
    chosen: bool = False
    anchor: str = ""  # the chart's heading's id: a link comes back to it

    def link(self, key: str) -> str:
        return f"{self.base}&sort={key}" + (f"#{self.anchor}" if self.anchor else "")


def usage_chart(title: str, all_rows: Sequence[Usage], sorting: Sorting | None = None) -> str:
    """The rows in their order (the callers put the largest first, or as the reader sorted), the
    first MAX_BARS drawn with a line saying how many more the table below and the CSV hold.
    sorting: a line of links to the other orders above the chart, and the table's headers sort
    too; None: the rows' order is their own (days)."""
    rows = list(all_rows)[:MAX_BARS]
    if not any(r.granted_hours for r in rows):
        return f'<p class="empty">{h(title)}: no usage in this period.</p>'
    top = max(max(r.granted_hours for r in rows), 1e-9)
    plot = WIDTH - LABEL_WIDTH - 130  # room for "21.0 h, 32% busy" after the longest bar
    height = ROW * len(rows) + 30
    # Scaled to the page's width by the stylesheet (a phone's 390 px too); the numbers are also a
    # table below it, for screen readers and for anyone who wants them exact.
    parts = [] if sorting is None else [order_links(sorting)]
    parts += [f'<svg class="chart" role="img" aria-label="{h(title)}; the numbers are in the table below" '
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
    first = "largest" if sorting is None or sorting.by == "granted" else "first"
    note = f'<p class="more">The {len(rows)} {first} of {len(all_rows)}; all are in the numbers below and the CSV.</p>'
    return "".join(parts) + (note if more else "") + numbers(title, all_rows, sorting)


USAGE_COLUMNS = (("name", "who or what"), ("granted", "GPU-hours granted"), ("busy", "GPU-hours busy"),
                 ("share", "busy share"))


ORDER_WORDS = {"granted": "most granted", "busy": "most busy", "share": "highest busy share", "name": "by name"}


def order_links(sorting: Sorting) -> str:
    links = " · ".join(f"<b aria-current=true>{word}</b>" if key == sorting.by else
                       f'<a href="{h(sorting.link(key))}">{word}</a>' for key, word in ORDER_WORDS.items())
    return f'<p class="order">Order: {links}</p>'


def numbers(title: str, rows: Sequence[Usage], sorting: Sorting | None = None) -> str:
    """The chart's values as a table (in a <details>, open when the reader chose an order); with
    `sorting`, each header a link that sorts the chart and the table by its column."""
    heads = []
    for key, word in USAGE_COLUMNS:
        if sorting is None:
            heads.append(f"<th scope=col>{word}</th>")
            continue
        order = "" if key != sorting.by else ' aria-sort="ascending"' if key == "name" else ' aria-sort="descending"'
        heads.append(f'<th scope=col{order}><a href="{h(sorting.link(key))}">{word}</a></th>')
    body = "".join(
        f"<tr><th scope=row>{h(r.label)}</th><td>{r.granted_hours:.2f}</td>"
        f"<td>{'unknown' if r.busy_hours is None else f'{r.busy_hours:.2f}'}</td>"
        f"<td>{'unknown' if r.busy_share is None else f'{r.busy_share:.0%}'}</td></tr>" for r in rows)
    opened = " open" if sorting is not None and sorting.chosen else ""
    return (f'<details class="numbers"{opened}><summary>{h(title)}: the numbers</summary><table><caption>{h(title)}'
            f"</caption><thead><tr>{''.join(heads)}</tr></thead><tbody>{body}</tbody></table></details>")


def _short(label: str, limit: int = 28) -> str:
    return label if len(label) <= limit else label[:limit - 1] + "…"


def trend_scale(trend: Trend) -> tuple[float, float]:
    """The values at the top of the chart: utilisation (100% for a GPU; for a user, whose GPUs add
    up, the peak rounded up to a whole number of GPUs) and memory (the GPU's, or the user's peak)."""
    if trend.kind == "gpu":
        util = 100.0
    else:
        util = max(100.0, math.ceil((trend.util_peak or 0.0) / 100.0) * 100.0)
    memory = float(trend.memory_total or 0) or float(trend.memory_peak or 0) or 1.0
    return util, memory


def trend_chart(trend: Trend, labelled_by: str) -> str:
    """Utilisation (solid) and memory (dashed) over the trend's buckets; `labelled_by`: the id of
    the element whose text a screen reader says of it (its title and numbers in words)."""
    util_top, memory_top = trend_scale(trend)
    width = max(len(trend.points) - 1, 1)
    util = _line([None if p is None else p[0] for p in trend.points], util_top)
    memory = _line([None if p is None else p[2] for p in trend.points], memory_top)
    return (f'<svg class="trend" role="img" aria-labelledby="{h(labelled_by)}" viewBox="0 0 {width} 100" '
            f'preserveAspectRatio="none"><path class="rule" d="M0 50H{width}"/>'
            f'<path class="util" d="{util}"/><path class="mem" d="{memory}"/></svg>')


def trend_words(trend: Trend) -> str:
    """The trend's numbers in a line: means, peaks and the newest bucket."""
    util_top, memory_top = trend_scale(trend)
    total = f" of {format_size(trend.memory_total)}" if trend.memory_total else ""
    latest = trend.latest
    now = "" if latest is None else f"; now {percent(latest[0])}, {size(latest[1])}"
    return (f"utilisation {percent(trend.util)} (peak {percent(trend.util_peak)}), "
            f"memory {size(trend.memory)} (peak {size(trend.memory_peak)}){total}{now}")


def percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f}%"


def size(value: float | None) -> str:
    return "unknown" if value is None else format_size(int(value))


def _line(values: Sequence[float | None], top: float) -> str:
    """An SVG path through (i, 100 - 100 v / top) for the known values, broken where a value is
    not known, in relative steps (`l dx dy`, `h dx`: a few bytes a bucket); a level stretch is
    drawn from its ends only (an idle GPU's line is a few bytes). On a scale of 100 the y of a
    value is 100 less the value as the tables round it."""
    ys = [None if v is None else round(100 - min(max(100 * v / top, 0.0), 100.0)) for v in values]
    parts: list[str] = []
    last = len(ys) - 1
    at: tuple[int, int] | None = None  # the point the path is at, None: between subpaths
    command = ""
    for i, y in enumerate(ys):
        if y is None:
            at = None
            continue
        if at is None:
            alone = i == last or ys[i + 1] is None
            parts.append(f"M{i} {y}" + ("h0" if alone else ""))
            at, command = (i, y), "h" if alone else "M"
        elif ys[i - 1] != y or i == last or ys[i + 1] != y:
            dx, dy = i - at[0], y - at[1]
            step, kind = (str(dx), "h") if dy == 0 else (f"{dx}{dy}" if dy < 0 else f"{dx} {dy}", "l")
            parts.append((" " if kind == command else kind) + step)
            at, command = (i, y), kind
    return "".join(parts)


def line_points(d: str) -> dict[int, int]:
    """_line read back: x -> y of every bucket the path passes through (what the tests check a
    chart's lines by)."""
    found: dict[int, int] = {}
    x = y = 0
    command = ""
    tokens = re.findall(r"[MhlH]|-?\d+", d)
    i = 0
    while i < len(tokens):
        if tokens[i] in ("M", "h", "l"):
            command = tokens[i]
            i += 1
        if command == "M":
            x, y = int(tokens[i]), int(tokens[i + 1])
            found[x] = y
            i += 2
        elif command == "h":
            for _ in range(int(tokens[i])):
                x += 1
                found[x] = y
            i += 1
        else:
            x, y = x + int(tokens[i]), y + int(tokens[i + 1])
            found[x] = y
            i += 2
    return found
