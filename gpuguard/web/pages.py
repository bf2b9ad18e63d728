"""The pages' HTML: f-strings in which every value passes through `h` (html.escape), the one
escaping helper; numbers are formatted before they go in. Nothing here reads or decides: the
views (views.py) come in ready, names already hidden where the viewer may not see them.
"""
from __future__ import annotations

import html
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuguard.core.messages import clock, cuda_export
from gpuguard.core.model import unit_label
from gpuguard.core.quantities import format_size
from gpuguard.web.views import Cell, FairShare, OwnProcess, Server, Viewer, Waiting, duration, ordinal, plural

NAV = (("/", "Now"), ("/queue", "Queue"), ("/me", "Me"), ("/usage", "Usage"), ("/history", "History"))
STALE_AFTER = 30.0  # seconds: a sample this old is said to be old (the watcher samples every few seconds)


_SPECIAL = re.compile("[&<>\"']")


def h(value: object) -> str:
    """Text for HTML content or a quoted attribute: &, <, >, " and ' escaped (most strings have
    none: looking first halves the grid's time)."""
    text = str(value)
    return html.escape(text, quote=True) if _SPECIAL.search(text) else text


def layout(title: str, path: str, viewer: Viewer, body: str, csrf: str = "") -> str:
    links = "".join(f'<a href="{href}"{" aria-current=page" if href == path else ""}>{name}</a>'
                    for href, name in NAV)
    if viewer.user is None:
        account = '<a href="/login">Log in</a>'
    else:
        role = " (admin)" if viewer.admin else ""
        account = (f'<form method="post" action="/logout" class="logout"><span class="who">{h(viewer.user)}{role}</span>'
                   f'<input type="hidden" name="csrf" value="{h(csrf)}"><button>Log out</button></form>')
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f'<title>{h(title)} - gpuguard</title><link rel=stylesheet href="/static/style.css">'
            '<link rel=icon href="/static/icon.svg" type="image/svg+xml">'
            '<script src="/static/app.js" defer></script></head>'
            f'<body{" data-signed-in" if viewer.user is not None else ""}>'
            f'<header><strong>gpuguard</strong><nav>{links}</nav>{account}</header><main>{body}</main></body></html>')


# --- Now

def stamp(moment: float) -> str:
    """The time to the second (local): an age the reader can work out at a glance."""
    return time.strftime("%H:%M:%S", time.localtime(moment))


def now_page(grid_html: str) -> str:
    return f'<h1>GPUs now</h1><div id="live" data-refresh="/fragment/now">{grid_html}</div>'


def grid(servers: Sequence[Server], now: float) -> str:
    legend = "".join(f'<span class=key data-state="{state}">{word}</span>'
                     for state, word in (("free", "free"), ("held", "held"), ("idle", "held, idle"),
                                         ("over", "over quota"), ("drained", "drained"), ("other", "Slurm / other")))
    parts = [f'<p class="legend">{legend} <span class="stamp">as of {h(stamp(now))}</span></p>']
    for server in servers:
        counts = ", ".join(f"{n} {word}" for state, n in sorted(server.counts.items())
                           for word in [_state_word(state)])
        models = ", ".join(sorted({c.name for c in server.cells}))
        parts.append(f'<section class="server" data-server="{h(server.name)}"><h2>{h(server.name)} '
                     f'<small>{h(counts)}; {h(models)}</small></h2>')
        if server.error is not None:
            parts.append(f'<p class="error">{h(server.error)}</p>')
        if server.age is not None and server.age >= STALE_AFTER:
            parts.append(f'<p class="stale-banner" role="status">The GPUs of {h(server.name)} were last read '
                         f"{server.age:.0f} s ago: what is shown may have changed.</p>")
        parts.append('<div class="grid">' + "".join(_cell(c) for c in server.cells) + "</div></section>")
    return "".join(parts)


def _state_word(state: str) -> str:
    return {"idle": "idle", "over": "over quota", "other": "owned elsewhere", "unknown": "not read"}.get(state, state)


def _cell(c: Cell) -> str:
    """A few hundred bytes: 50 servers of 8 GPUs stay well under the page budget (bench/web_bench.py).
    The state is the data-state attribute the stylesheet colours by; processes are counted, not listed."""
    used = "?" if c.memory_used is None else format_size(c.memory_used)
    util = "?" if c.utilization is None else f"{c.utilization}%"
    procs = "processes unknown" if c.processes is None else plural(len(c.processes), "proc")
    profile = f" {h(c.profile)}" if c.profile else ""
    parts = [f'<div class=cell data-unit="{h(c.label)}" data-state="{h(c.state)}"><b>GPU {h(c.label)}{profile}</b>'
             f"<i>{h(c.words)}</i><br>{used} / {format_size(c.memory_total)}, util {util}, {procs}"
             f"{_meter(c.memory_used, c.memory_total)}"]
    if c.fractions:  # a shared GPU: what its sharers are promised, and what more sharers could be
        left = "?" if c.memory_left is None else format_size(c.memory_left)
        parts.append(f"<p class=shares>{plural(c.fractions, 'fraction')}: {format_size(c.memory_promised)} "
                     f"promised, {left} left</p>")
    for holder in c.holders:
        mine = "?" if holder.memory_used is None else format_size(holder.memory_used)
        quota = f" of {format_size(holder.quota)}{' fraction' if holder.fraction else ''}" if holder.quota else ""
        left = "no time limit" if holder.time_left is None else f"{duration(holder.time_left)} left"
        idle = "" if holder.idle_for is None else f", idle {duration(holder.idle_for)}"
        parts.append(f'<p><span class=user>{h(holder.user)}</span> {mine}{quota}{" OVER" if holder.over else ""}; '
                     f"{left}{idle}</p>")
    return "".join(parts) + "</div>"


def _meter(value: int | None, limit: int) -> str:
    if value is None or not limit:
        return ""
    return f"<meter value={min(1.0, value / limit):.2f} high=.8 optimum=0></meter>"


# --- Queue

def queue_page(rows: Sequence[Waiting], errors: Sequence[str]) -> str:
    return f'<h1>Queue</h1><div id="live" data-refresh="/fragment/queue">{queue_table(rows, errors)}</div>'


def queue_table(rows: Sequence[Waiting], errors: Sequence[str]) -> str:
    problems = "".join(f'<p class="error">{h(e)}</p>' for e in errors)
    if not rows:  # a server not read may have waiters: then its error is all there is to say
        return problems or "<p>Nobody waits for a GPU.</p>"
    body = "".join(
        f"<tr><td>{h(r.server)}</td><td>{r.position}</td><td class=user>{h(r.user)}</td><td>{r.gpus}</td>"
        f"<td>{h(clock(r.since))}</td><td>{r.priority}</td><td>{h(r.why)}</td>"
        f"<td>{h(clock(r.estimate)) if r.estimate else 'unknown'}</td></tr>" for r in rows)
    return (problems + "<table><thead><tr><th>server</th><th>#</th><th>user</th><th>GPUs</th><th>since</th>"
            f"<th>priority</th><th>why</th><th>GPUs expected free</th></tr></thead><tbody>{body}</tbody></table>")


# --- Me

def me_page(user: str, replies: Mapping[str, Mapping[str, Any]], viewer: Viewer, show_users: bool,
            own: bool, standings: Mapping[str, FairShare | None]) -> str:
    """standings: server -> the user's fair-share standing there (None: the source does not know it)."""
    whose = "My GPUs" if own else f"{user}'s GPUs"
    parts = [f"<h1>{h(whose)}</h1>"]
    for server, who in sorted(replies.items()):
        parts.append(f'<section class="me" data-server="{h(server)}"><h2>{h(server)}</h2>')
        quota = who.get("quota")  # the local daemon's; the fleet database has none per node
        if quota:
            parts.append(f"<p>{h(who['user'])} (uid {who['uid']}), {'member' if who['member'] else 'not a member'} of "
                         f"{h(who['group'])}{'; exempt' if who['exempt'] else ''}. Quota: {plural(quota['gpus'], 'GPU')}, "
                         f"memory {h(format_size(quota['gpu_memory']))} per GPU, time "
                         f"{h(duration(quota['max_time']) if quota['max_time'] else 'unlimited')}.</p>")
        grants = who["grants"]
        if grants:
            rows = "".join(f"<tr><td>{h(unit_label(g['minor']))}</td><td>{h(g.get('name') or '')}</td>"
                           f"<td class=uuid>{h(g.get('uuid') or '')}</td><td>{h(clock(g['granted_at']))}</td>"
                           f"<td>{h(clock(g['expires_at'])) if g['expires_at'] else 'no limit'}</td>"
                           f"<td>{h(g['origin'])}</td></tr>" for g in grants)
            uuids = [g["uuid"] for g in grants if g.get("uuid")]
            parts.append("<h3>Grants</h3><table><thead><tr><th>GPU</th><th>name</th><th>UUID</th><th>since</th>"
                         f"<th>until</th><th>how</th></tr></thead><tbody>{rows}</tbody></table>"
                         f'<pre class="lines">ssh {h(who["user"])}@{h(server)}\n{h(cuda_export(uuids))}</pre>')
        else:
            parts.append(f'<p>No GPU held here.</p><pre class="lines">ssh {h(who["user"])}@{h(server)}\n'
                         "gpuguard request</pre>")
        parts.append(_standing(who.get("queue"), viewer, show_users))
        parts.append(_fair_share(standings.get(server), own))
        sessions = who.get("sessions") or []
        if sessions:
            rows = "".join(f"<tr><td>{h(clock(s['opened_at']))}</td><td>{h(s['service'])}</td>"
                           f"<td class=tty>{h(s['tty'])}</td><td class=rhost>{h(s['rhost'])}</td></tr>" for s in sessions)
            parts.append("<h3>Sessions</h3><table><thead><tr><th>since</th><th>service</th><th>tty</th>"
                         f"<th>from</th></tr></thead><tbody>{rows}</tbody></table>")
        parts.append(_events(who.get("events") or []))
        parts.append("</section>")
    return "".join(parts)


def _standing(standing: Mapping[str, Any] | None, viewer: Viewer, show_users: bool) -> str:
    if not standing:
        return "<p>Not waiting for a GPU.</p>"
    ahead = "".join(f"<li>{h(viewer.name(a['user'], show_users))}: {h(a['why'])}</li>" for a in standing["ahead"])
    estimate = f", expected by {h(clock(standing['estimate']))}" if standing.get("estimate") else ""
    return (f"<h3>Queue</h3><p>Place {standing['position']} of {standing['waiting']} for "
            f"{plural(standing['gpus'], 'GPU')}, since {h(clock(standing['since']))}{estimate}.</p>"
            + (f"<p>Ahead of you:</p><ul>{ahead}</ul>" if ahead else ""))


def _fair_share(fair: FairShare | None, own: bool) -> str:
    if fair is None:
        return '<section class="fairshare"><h3>Fair share</h3><p>Not available from this source.</p></section>'
    you = "you" if own else "they"
    priority = f", priority {fair.priority}" if fair.priority else ""
    return ('<section class="fairshare"><h3>Fair share</h3>'
            f'<p>Recent use <span class="hours">{fair.hours:.2f}</span> GPU-hours, share <span class="share">'
            f'{fair.share:g}</span>{priority}: <span class="rank">{ordinal(fair.rank)} of {fair.of}</span> '
            f"by usage per share ({fair.per_share:.2f}); a lower rank is served first.</p>"
            f"<p>When several wait, the queue serves higher priority first, then whoever has used the least "
            f"per share; use counts less as it ages (half every {h(duration(fair.half_life))}), so the more "
            f"{you} used lately, the later {you} go.</p></section>")


def _events(events: Sequence[Mapping[str, Any]]) -> str:
    if not events:
        return "<p>No recent events.</p>"
    rows = "".join(f"<tr><td>{h(clock(e['time']))}</td><td>{h(e['kind'])}</td><td>{h(e['rule'])}</td>"
                   f"<td>{h(unit_label(e['minor'])) if e.get('minor') is not None else ''}</td>"
                   f"<td>{h(e['message'])}</td></tr>" for e in events)
    return ("<h3>Recent events</h3><table><thead><tr><th>when</th><th>what</th><th>rule</th><th>GPU</th>"
            f"<th>message</th></tr></thead><tbody>{rows}</tbody></table>")


# --- Usage

def usage_page(form: Mapping[str, str], charts: Iterable[tuple[str, str]], csv_href: str, scope: str) -> str:
    fields = (f'<label>from <input type=date name=since value="{h(form["since"])}"></label> '
              f'<label>to <input type=date name=until value="{h(form["until"])}"></label> <button>Show</button>')
    body = "".join(f'<h2 id="by-{h(title.rsplit(" ", 1)[-1])}">{h(title)}</h2>{chart}' for title, chart in charts)
    return (f'<h1>GPU usage</h1><p>{h(scope)}</p><form method="get" action="/usage" class="period">{fields}</form>'
            f'<p><a href="{h(csv_href)}" download>Download CSV</a></p>{body}')


# --- login and errors

def login_page(csrf: str, message: str = "", user: str = "") -> str:
    note = f'<p class="error" role="alert">{h(message)}</p>' if message else ""
    return (f"<h1>Log in</h1>{note}<form method=post action=/login class=login>"
            f'<input type=hidden name=csrf value="{h(csrf)}">'
            f'<label>User <input name=user autocomplete=username required value="{h(user)}"></label>'
            '<label>Password <input type=password name=password autocomplete=current-password required></label>'
            "<button>Log in</button></form>")


def needs_https_page(host: str, port: int) -> str:
    """Why a login over plain HTTP to another host's name cannot work, and what works instead."""
    return ("<h1>Log in needs HTTPS</h1>"
            f'<p class="notice">This page came over plain HTTP to {h(host)}. The login is kept in a cookie '
            "that browsers keep only over HTTPS (or on this machine's own localhost), so a login here "
            "cannot work, and your password would cross the network in the clear.</p>"
            "<p>Open the page over <b>https://</b> if the server has it, or through an SSH tunnel: "
            f"<span class=cmd>ssh -L 9448:localhost:{port} you@{h(host)}</span>, then "
            "<span class=cmd>http://localhost:9448/</span>. The administrators can set <span class=cmd>[web] "
            "tls_cert</span> and <span class=cmd>tls_key</span>, or put the page behind a TLS proxy.</p>")


def processes_section(name: str, own: bool, table: str) -> str:
    whose = "My processes" if own else f"{name}'s processes"
    return (f'<section class="procs"><h2>{h(whose)} on GPUs</h2>'
            f'<div id="live" data-refresh="/fragment/processes/{h(name)}">{table}</div></section>')


def processes_table(rows: Sequence[OwnProcess], errors: Sequence[str]) -> str:
    problems = "".join(f'<p class="error">{h(e)}</p>' for e in errors)
    if not rows:
        return problems or "<p>No process on a GPU now.</p>"
    body = "".join(f"<tr><td>{h(r.server)}</td><td>{h(r.gpu)}</td><td>{r.pid}</td><td class=cmd>{h(r.command)}</td>"
                   f"<td>{'?' if r.memory is None else h(format_size(r.memory))}</td></tr>" for r in rows)
    return (problems + "<table><thead><tr><th>server</th><th>GPU</th><th>pid</th><th>command</th><th>memory</th>"
            f"</tr></thead><tbody>{body}</tbody></table>")


def end_logins_form(name: str, csrf: str) -> str:
    """An admin's button that ends every login of `name` (their open pages go to the login form)."""
    return (f'<form method=post action="/users/{h(name)}/logout" class="end-logins">'
            f'<input type=hidden name=csrf value="{h(csrf)}"><button>End {h(name)}\'s logins</button></form>')


def not_member_page(user: str, group: str | None, contact: str | None, admin_group: str | None) -> str:
    """What a non-member gets for a right password: why, and whom to ask; no quota, no queue."""
    whom = (h(contact) if contact else
            f"the server's administrators (the members of the group <b>{h(admin_group)}</b>)" if admin_group
            else "the server's administrators")
    group_name = f"<b>{h(group)}</b>" if group else "the GPU group"
    return (f'<h1>Not in the GPU group</h1><p class="notice">{h(user)} is not in {group_name}, so this '
            f"server gives you no GPUs and this page shows you nothing more. To use the GPUs, ask "
            f"{whom} to add you to it.</p>")


def message_page(title: str, message: str) -> str:
    return f'<h1>{h(title)}</h1><p class="error">{h(message)}</p>'
