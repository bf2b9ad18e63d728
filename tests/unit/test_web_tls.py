"""[web] over plain HTTP from elsewhere: what `config check` warns and what the login page says;
HTTPS from tls_cert and tls_key (the real server with a certificate: tests/system/test_web.py)."""
from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from test_web_app import run

from gpuguard import config
from gpuguard.core import config_warnings
from gpuguard.web.wiring import tls_context


def web_warnings(tmp_path: Path, table: str) -> list[str]:
    (tmp_path / "gpuguard.toml").write_text("[web]\n" + table)
    (tmp_path / "quotas.toml").write_text("")
    loaded = config.load(tmp_path / "gpuguard.toml")
    return [w for w in config_warnings.warnings(loaded, lambda n: True, lambda n: True) if w.startswith("web.")]


def test_config_check_warns_of_a_listen_others_reach_without_tls(tmp_path):
    assert web_warnings(tmp_path, 'listen = "127.0.0.1:9448"\n') == []
    assert web_warnings(tmp_path, 'listen = "localhost:9448"\n') == []
    [plain] = web_warnings(tmp_path, 'listen = "0.0.0.0:9448"\n')
    assert plain.startswith("web.listen: 0.0.0.0 is reachable") and "nobody can log in" in plain
    [clear] = web_warnings(tmp_path, 'listen = "192.0.2.2:9448"\nsecure_cookies = false\n')
    assert "in the clear" in clear
    assert web_warnings(tmp_path, 'listen = "0.0.0.0:9448"\ntls_cert = "/c.pem"\ntls_key = "/k.pem"\n') == []
    [half] = web_warnings(tmp_path, 'listen = "0.0.0.0:9448"\ntls_cert = "/c.pem"\n')
    assert "set both or neither" in half


def test_tls_needs_both_files_and_names_a_bad_one(tmp_path):
    assert tls_context(config.WebConfig()) is None
    with pytest.raises(OSError, match="go together"):
        tls_context(config.WebConfig(tls_cert=tmp_path / "c.pem"))
    with pytest.raises(OSError, match="c.pem"):
        tls_context(config.WebConfig(tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem"))


def test_the_login_page_over_plain_http_by_another_name_says_why_it_cannot_work():
    async def scenario(client, source):
        elsewhere = {"Host": "gpu1.lab.example:9448"}
        page = await client.get("/login", headers=elsewhere)
        text = await page.text()
        assert page.status == 403 and "<h1>Log in needs HTTPS</h1>" in text and "gpu1.lab.example" in text
        assert "ssh -L 9448:localhost:9448" in text and 'name="password"' not in text and "type=password" not in text
        posted = await client.post("/login", data={"user": "alice", "password": "right", "csrf": "x"}, headers=elsewhere)
        assert posted.status == 403 and "Log in needs HTTPS" in await posted.text()
        assert (await client.get("/login")).status == 200  # 127.0.0.1: browsers keep Secure cookies there
        assert (await client.get("/login", headers={"Host": "localhost:9448"})).status == 200
    run(scenario, secure_cookies=True)


def test_behind_a_trusted_tls_proxy_the_login_works():
    async def scenario(client, source):
        proxied = {"Host": "gpu1.lab.example", "X-Forwarded-Proto": "https"}
        assert (await client.get("/login", headers=proxied)).status == 200
    run(scenario, secure_cookies=True, trusted_proxies=(ipaddress.ip_network("127.0.0.1"),))
