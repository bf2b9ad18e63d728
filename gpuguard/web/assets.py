"""The stylesheet and the script, served by the app itself: a lab server is often offline, so
the pages load nothing from elsewhere (the Content-Security-Policy forbids it anyway)."""

STYLE = """\
html{color-scheme:light dark}
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{display:flex;flex-wrap:wrap;gap:.4em 1.5em;align-items:center;padding:.6em 1em;background:#1b1f24;color:#fff}
header a{color:#cfd6de}header nav a{color:#cfd6de;margin-right:1em;text-decoration:none}
header nav a[aria-current]{color:#fff;font-weight:600}
header .logout{margin-left:auto}header .who{margin-right:.6em}
main{padding:0 1em 2em}a{color:#0550ae}.cell,p{overflow-wrap:anywhere}h2 small{font-weight:400;color:#57606a;font-size:.7em}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:.5em}
.cell{border:1px solid #d0d7de;border-left:6px solid #999;border-radius:4px;background:#fff;padding:.4em .6em;
color:#57606a;font-size:.9em}.cell b{color:#1b1f24}.cell i{float:right;font-style:normal}.cell p{margin:.2em 0}
.key{border-left:6px solid #999;padding:0 .5em;margin-right:.5em}
[data-state=free]{border-left-color:#2da44e}[data-state=held]{border-left-color:#0969da}
[data-state=idle]{border-left-color:#bf8700;background:#fff8e1}[data-state=over]{border-left-color:#cf222e;background:#ffebe9}
[data-state=drained]{border-left-color:#6e7781;background:#eaeef2}[data-state=other]{border-left-color:#8250df;background:#f5f0ff}
.user{font-weight:600;color:#1b1f24}meter{width:100%}
.cmd{font-family:monospace}.error,.warn{color:#cf222e}.stamp{color:#57606a}
table{border-collapse:collapse;background:#fff;display:block;max-width:100%;overflow-x:auto}
td,th{border:1px solid #d0d7de;padding:.25em .5em;text-align:left}
pre.lines{background:#1b1f24;color:#e6edf3;padding:.6em;border-radius:4px;overflow-x:auto}
.uuid{font-family:monospace;font-size:.85em}
form.login{display:grid;gap:.6em;max-width:20em}
.stale-banner{background:#fff8c5;border:1px solid #bf8700;color:#1b1f24;padding:.4em .6em;border-radius:4px;
font-weight:600}.stale-banner[hidden]{display:none}#live.stale{opacity:.6}
svg.chart{width:100%;max-width:720px;height:auto}svg.chart text{font-size:12px;fill:#1b1f24}
svg.chart .granted{fill:#9ec5fe;stroke:#0a58ca}svg.chart .busy{fill:#0a58ca}
details.numbers{margin:.3em 0 1em}th a{color:inherit}th[aria-sort] a{font-weight:700}.order{margin:.2em 0}
.trends{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:.6em;margin-bottom:.8em}
figure.trend{margin:0;background:#fff;border:1px solid #d0d7de;border-radius:4px;padding:.4em .6em;min-width:0}
figure.trend figcaption{font-size:.9em;overflow-wrap:anywhere}figure.trend small,.axis{color:#57606a}
svg.trend{display:block;width:100%;height:80px;margin:.3em 0}figure.big{max-width:720px}figure.big svg.trend{height:200px}
svg.trend path{fill:none;vector-effect:non-scaling-stroke;stroke-linecap:round;stroke-linejoin:round;stroke-width:2}
svg.trend .rule{stroke:#d0d7de;stroke-width:1}svg.trend .util{stroke:#0a58ca}
svg.trend .mem{stroke:#b35900;stroke-dasharray:5 3}
.key-util{border-bottom:2px solid #0a58ca}.key-mem{border-bottom:2px dashed #b35900}
.axis{display:flex;justify-content:space-between;gap:.5em;margin:0;font-size:.8em}
@media (prefers-color-scheme:dark){
body{color:#e6edf3;background:#0d1117}a{color:#79b8ff}h2 small,.stamp{color:#9da7b3}
.cell{background:#161b22;border-color:#30363d;color:#9da7b3}.cell b,.user{color:#e6edf3}
[data-state=idle]{background:#2b2106}[data-state=over]{background:#3a1418}[data-state=drained]{background:#21262d}
[data-state=other]{background:#241a3a}.error,.warn{color:#ff7b72}
table{background:#161b22}td,th{border-color:#30363d}pre.lines{background:#010409}
.stale-banner{background:#3d2e00;color:#f8e3a1;border-color:#bf8700}
svg.chart text{fill:#e6edf3}svg.chart .granted{fill:#2f5ea8;stroke:#a5cdff}svg.chart .busy{fill:#a5cdff}
figure.trend{background:#161b22;border-color:#30363d}figure.trend small,.axis{color:#9da7b3}
svg.trend .rule{stroke:#30363d}svg.trend .util{stroke:#79b8ff}svg.trend .mem{stroke:#ffa657}
.key-util{border-bottom-color:#79b8ff}.key-mem{border-bottom-color:#ffa657}}
"""

# Replaces each [data-refresh] element's content with its fragment every REFRESH ms; while the
# server does not answer (or takes longer than WAIT ms) the page keeps what it shows, marked stale,
# under a banner saying for how many seconds it has not been updated. A page shown signed in goes to the
# login form once the server says its login has ended (X-Gpuguard-Signed-In: 0): pages without a
# live part ask /fragment/session every SESSION_CHECK ms for that alone.
SCRIPT = """\
"use strict";
const REFRESH = 2000;
const WAIT = 5000;
const SESSION_CHECK = 10000;
const signedIn = document.body.hasAttribute("data-signed-in");
const ended = (reply) => signedIn && reply.headers.get("X-Gpuguard-Signed-In") === "0";
const boxes = document.querySelectorAll("[data-refresh]");
for (const box of boxes) {
  const url = box.dataset.refresh;
  const banner = document.createElement("p");
  banner.className = "stale-banner";
  banner.setAttribute("role", "status");
  banner.hidden = true;
  box.before(banner);
  let updated = Date.now();
  const tick = async () => {
    try {
      const reply = await fetch(url, {credentials: "same-origin", cache: "no-store", signal: AbortSignal.timeout(WAIT)});
      if (ended(reply)) { location.assign("/login"); return; }
      if (!reply.ok) throw new Error(String(reply.status));
      box.innerHTML = await reply.text();
      box.classList.remove("stale");
      banner.hidden = true;
      updated = Date.now();
    } catch (error) {
      box.classList.add("stale");
      const age = Math.round((Date.now() - updated) / 1000);
      banner.textContent = `Not updated for ${age} s: the web server does not answer. What is shown may have changed.`;
      banner.hidden = false;
    }
    setTimeout(tick, REFRESH);
  };
  setTimeout(tick, REFRESH);
}
if (signedIn && boxes.length === 0) {
  const check = async () => {
    try {
      const reply = await fetch("/fragment/session", {credentials: "same-origin", cache: "no-store"});
      if (ended(reply)) { location.assign("/login"); return; }
    } catch (error) { /* the server is away: the login is judged when it answers */ }
    setTimeout(check, SESSION_CHECK);
  };
  setTimeout(check, SESSION_CHECK);
}
"""

# The tab's icon (a GPU board), also answered at /favicon.ico so no page asks for a 404.
ICON = """\
<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32"><rect x="2" y="7" width="28" height="18" rx="3" \
fill="#1b1f24"/><rect x="6" y="11" width="12" height="10" rx="1" fill="#2da44e"/><circle cx="24" cy="16" r="3" \
fill="#cfd6de"/><rect x="6" y="25" width="14" height="3" fill="#bf8700"/></svg>
"""
