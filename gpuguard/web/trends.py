"""The History page's HTML: every GPU's and the viewer's users' utilisation and memory over the
last hour, day or week, as small line charts (svg.trend_chart), tables of their numbers that sort
by any column (links: no script needed), and one series on a page of its own with every
bucket's numbers in a table. Values are escaped (pages.h) and formatted (svg) before they go in.
"""
from __future__ import annotations

import time
import urllib.parse
from collections.abc import Mapping, Sequence

from gpuguard.core.quantities import format_size
from gpuguard.web.pages import h
from gpuguard.web.svg import percent, size, trend_chart, trend_scale, trend_words
from gpuguard.web.views import SPANS, Trend, sorted_trends

BUCKET_WORDS = {"hour": "minute", "day": "ten minutes", "week": "hour"}
ONE_BUCKET = {"hour": "a minute", "day": "ten minutes", "week": "an hour"}
MAX_USER_CHARTS = 16  # an admin's page of 100 users draws the first 16 in the table's order, lists all
COLUMNS = (("name", "name"), ("util", "utilisation"), ("util_peak", "peak"), ("memory", "memory"),
           ("memory_peak", "peak"))
SORT_WORDS = {"name": "by name", "util": "by utilisation", "util_peak": "by peak utilisation",
              "memory": "by memory", "memory_peak": "by peak memory"}


def href(**query: str) -> str:
    return "/history?" + urllib.parse.urlencode({k: v for k, v in query.items() if v})


def series_href(trend: Trend, span: str) -> str:
    """The address of the series' own page."""
    return href(span=span, server=trend.server, **{trend.kind: trend.key})


def history_page(span: str, gpus: Sequence[Trend], users: Sequence[Trend], sort: str, user_sort: str,
                 admin: bool, known: bool) -> str:
    """sort, user_sort: the GPUs' and the users' tables' orders (views.TREND_SORTS); known: some
    server's history was read (the fleet database keeps none)."""
    links = " ".join(f'<a href="{h(href(span=s, sort=sort, usort=user_sort))}"'
                     f'{" aria-current=page" if s == span else ""}>{s}</a>' for s in SPANS)
    parts = [f"<h1>Utilisation and memory</h1><p class=spans>The last {links}.</p>",
             f"<p>{_key()} Each point is the mean of the daemon's samples over {ONE_BUCKET[span]}; a peak is "
             "the largest single sample. A user's utilisation adds up the GPUs their processes are on, each "
             "GPU's shared among the users on it (100% is one GPU busy).</p>"]
    if not known:
        parts.append("<p>Not known from this source: each server keeps its own (its daemon's samples).</p>")
        return "".join(parts)
    drawn = sorted_trends(gpus, "name")
    parts.append("<h2>GPUs</h2>")
    parts.append('<div class="trends">' + "".join(figure(t, span, n) for n, t in enumerate(drawn)) + "</div>" if drawn else
                 "<p>No GPU was sampled in this span.</p>")
    parts.append(table("GPUs", gpus, span, "sort", sort, {"usort": user_sort}))
    who = "Users" if admin else "You"
    ordered = sorted_trends(users, user_sort)
    parts.append(f"<h2>{who}</h2>")
    if not ordered:
        parts.append("<p>No GPU held and no process on one in this span.</p>" if not admin else
                     "<p>Nobody held a GPU or ran on one in this span.</p>")
        return "".join(parts)
    parts.append('<div class="trends">' + "".join(figure(t, span, len(drawn) + n)
                                                  for n, t in enumerate(ordered[:MAX_USER_CHARTS])) + "</div>")
    if len(ordered) > MAX_USER_CHARTS:
        parts.append(f'<p class="more">The first {MAX_USER_CHARTS} of {len(ordered)} {SORT_WORDS[user_sort]} are '
                     "drawn; all are in the table below.</p>")
    parts.append(table(who, users, span, "usort", user_sort, {"sort": sort}))
    return "".join(parts)


def figure(trend: Trend, span: str, n: int, big: bool = False) -> str:
    """One series: its title (a link to its own page), its numbers in words (what a screen reader
    says of the chart: the caption's id is `trend-n`), the chart and its scale."""
    util_top, memory_top = trend_scale(trend)
    words = trend_words(trend)
    title = h(trend.title) if big else f'<a href="{h(series_href(trend, span))}">{h(trend.title)}</a>'
    model = f" <small>{h(trend.model)}</small>" if trend.model else ""
    scale = ("0-100%" if trend.kind == "gpu" else
             f"utilisation 0-{util_top:.0f}%, memory 0-{format_size(int(memory_top))}")
    return (f'<figure class="trend{" big" if big else ""}" data-kind="{trend.kind}" data-key="{h(trend.key)}">'
            f'<figcaption id="trend-{n}"><b>{title}</b>{model}<br><span class="words">{h(words)}</span>'
            f"</figcaption>{trend_chart(trend, f'trend-{n}')}"
            f'<p class="axis"><span>{h(_stamp(trend.start, span))}</span><span>{h(scale)}</span><span>now</span></p>'
            "</figure>")


def table(caption: str, rows: Sequence[Trend], span: str, param: str, sort: str, keep: Mapping[str, str]) -> str:
    """The series' numbers over the span, one row each, in `sort`'s order; each column's header
    a link that sorts by it (`param` in the address, the other table's order kept)."""
    heads = []
    for key, word in COLUMNS:
        order = ' aria-sort="ascending"' if key == sort == "name" else ' aria-sort="descending"' if key == sort else ""
        link = href(span=span, **{param: key}, **keep)
        heads.append(f'<th scope=col{order}><a href="{h(link)}">{word}</a></th>')
    heads.append("<th scope=col>now</th>")
    body = []
    for t in sorted_trends(rows, sort):
        latest = t.latest
        total = f" of {format_size(t.memory_total)}" if t.memory_total else ""
        body.append(f'<tr><th scope=row><a href="{h(series_href(t, span))}">'
                    f"{h(t.title)}</a></th><td>{percent(t.util)}</td><td>{percent(t.util_peak)}</td>"
                    f"<td>{size(t.memory)}</td><td>{size(t.memory_peak)}{total}</td>"
                    f"<td>{'unknown' if latest is None else f'{percent(latest[0])}, {size(latest[1])}'}</td></tr>")
    return (f'<table class="trend-numbers"><caption>{h(caption)}, the last {span}: means and peaks</caption>'
            f"<thead><tr>{''.join(heads)}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def detail_page(trend: Trend, span: str) -> str:
    """One series on its own: a larger chart, and every bucket's numbers."""
    links = " ".join(f'<a href="{h(series_href(trend, s))}"'
                     f'{" aria-current=page" if s == span else ""}>{s}</a>' for s in SPANS)
    rows = []
    for i, p in enumerate(trend.points):
        at = _stamp(trend.start + i * trend.step, span)
        if p is None:
            rows.append(f"<tr><th scope=row>{h(at)}</th><td colspan=4>not sampled</td></tr>")
            continue
        rows.append(f"<tr><th scope=row>{h(at)}</th><td>{percent(p[0])}</td><td>{percent(p[1])}</td>"
                    f"<td>{size(p[2])}</td><td>{size(p[3])}</td></tr>")
    return (f"<h1>{h(trend.title)}</h1><p class=spans>The last {links}. <a href=\"{h(href(span=span))}\">"
            f"All GPUs and users</a></p><p>{_key()}</p>{figure(trend, span, 0, big=True)}"
            f'<table class="trend-numbers"><caption>{h(trend.title)}, every {BUCKET_WORDS[span]} of the last {span}'
            "</caption><thead><tr><th scope=col>from</th><th scope=col>utilisation</th><th scope=col>peak</th>"
            f"<th scope=col>memory</th><th scope=col>peak</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _key() -> str:
    return '<span class="key-util">utilisation</span> solid, <span class="key-mem">memory</span> dashed.'


def _stamp(moment: float, span: str) -> str:
    return time.strftime("%a %H:%M" if span == "week" else "%H:%M", time.localtime(moment))
