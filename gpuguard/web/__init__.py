"""`gpuguard web`: a read-only web view of the lab's GPUs (aiohttp).

- sources.py: where the data comes from (the `Source` protocol; the local daemon's socket);
- views.py: what a page shows, from the daemon's replies (pure: states, names hidden, plots' numbers);
- pages.py, svg.py, assets.py: HTML, inline SVG plots, the one stylesheet and script (no CDN);
- sessions.py: signed cookie sessions, CSRF tokens, the login rate limit (pure but for the key file);
- app.py: the aiohttp application (routes, PAM login, security headers).
"""
