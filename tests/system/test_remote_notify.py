"""Notices that reach people without a terminal (issue 22, §5): a real HTTP receiver on the
loopback and a captured `sendmail` executable get what the daemon tells a user; failures are
logged and counted in the metrics; the per-user rate holds; a slow receiver never holds up
the caller."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_queue_daemon import waiting_request

from devtools.harness import wait_for
from gpuguard.backends.remote_notify import RemoteNotifier, mail_text
from gpuguard.config import NotifyConfig


class Receiver:
    """A webhook receiver on 127.0.0.1: POST /ok answers 200, /fail 500, /slow waits for `release`."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []
        self.arrived = threading.Event()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.posts.append((self.path, body))
                receiver.arrived.set()
                if self.path.startswith("/slow"):
                    receiver.release.wait(30)
                self.send_response(500 if self.path.startswith("/fail") else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: tests run side by side
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


@pytest.fixture
def sendmail(sandbox) -> Path:
    """A sendmail that keeps each message (its arguments, then the mail) in sandbox/mail/N, whole:
    written aside and renamed, so that a test never reads a message half written."""
    (sandbox / "mail").mkdir()
    script = sandbox / "sendmail"
    script.write_text(f'#!/bin/sh\n{{ printf "%s\\n" "$@"; cat; }} > "{sandbox}/mail/.$$" '
                      f'&& mv "{sandbox}/mail/.$$" "{sandbox}/mail/$$"\n')
    script.chmod(0o755)
    return script


def mails(sandbox: Path) -> list[str]:
    return [path.read_text() for path in sorted((sandbox / "mail").iterdir()) if not path.name.startswith(".")]


def test_a_queue_grant_reaches_the_users_webhook_and_mailbox(start_daemon, receiver, sendmail, sandbox):
    textfile = sandbox / "metrics.prom"
    d = start_daemon(count=1, gate=False, metrics={"textfile": str(textfile)},
                     notify={"webhook": f"{receiver.url}/ok/{{user}}", "mail": "{user}@lab.example",
                             "sendmail": str(sendmail)})
    alice, bob = d.add_member(), d.add_member()
    d.call_as(alice, "request")
    with waiting_request(d, bob) as waiting:
        assert d.cli_as(alice, "release").returncode == 0
        waiting.communicate(timeout=60)

    assert wait_for(lambda: receiver.posts and mails(sandbox))
    ((path, body),) = receiver.posts
    assert path == f"/ok/{bob.name}"
    assert body["user"] == bob.name and body["host"] == socket.gethostname()
    assert body["text"].startswith("gpuguard: GPU 0 (") and "from the queue" in body["text"]
    assert body["text"].endswith(f"export CUDA_VISIBLE_DEVICES={d.uuid(0)}")
    (mail,) = mails(sandbox)
    assert mail.startswith(f"-oi\n--\n{bob.name}@lab.example\n")
    assert f"To: {bob.name}@lab.example" in mail and f"Subject: gpuguard on {socket.gethostname()}: GPU 0" in mail
    # The textfile is first written after the daemon's first tick, which may come after the grant.
    assert wait_for(lambda: textfile.exists()
                    and 'gpuguard_notices_total{channel="webhook",outcome="sent"} 1.0' in textfile.read_text()
                    and 'gpuguard_notices_total{channel="mail",outcome="sent"} 1.0' in textfile.read_text())


def test_per_user_addresses_from_a_file_and_failures_logged_and_counted(start_daemon, receiver, sandbox):
    textfile = sandbox / "metrics.prom"
    addresses = sandbox / "notify.toml"
    addresses.write_text("")  # filled once the users exist
    d = start_daemon(count=1, gate=False, metrics={"textfile": str(textfile)},
                     notify={"webhook": f"{receiver.url}/ok/{{user}}", "addresses": str(addresses),
                             "sendmail": str(sandbox / "no-such-sendmail"), "mail": "{user}@lab.example"})
    alice, bob = d.add_member(), d.add_member()
    addresses.write_text(f'[users.{bob.name}]\nwebhook = "{receiver.url}/fail/bob"\n')
    d.reload()
    d.call_as(alice, "request")
    with waiting_request(d, bob) as waiting:
        assert d.cli_as(alice, "release").returncode == 0
        waiting.communicate(timeout=60)

    assert wait_for(lambda: textfile.exists() and 'outcome="failed"} 1.0' in textfile.read_text()
                    and textfile.read_text().count('outcome="failed"') == 2)
    assert [path for path, _ in receiver.posts] == ["/fail/bob"]  # bob's own address, over the template
    log = d.log()
    assert f"event=notify_failed channel=webhook user={bob.name}" in log and "HTTP Error 500" in log
    assert f"event=notify_failed channel=mail user={bob.name}" in log
    assert d.granted_minors(bob) == [0]  # the grant itself never depended on it


def test_the_rate_per_user_holds_and_a_slow_receiver_does_not_block_the_caller(receiver):
    settings = NotifyConfig(webhook=f"{receiver.url}/slow/{{user}}", per_user_hour=2)
    clock = [0.0]
    notifier = RemoteNotifier(lambda: settings, clock=lambda: clock[0])
    try:
        notifier.tell("alice", "gpuguard: one")
        assert receiver.arrived.wait(30)  # the receiver holds the first POST open ...
        notifier.tell("alice", "gpuguard: two")  # ... and tell() still returns: it only queues
        notifier.tell("alice", "gpuguard: three")  # over 2 an hour: dropped
        notifier.tell("bob", "gpuguard: for bob")  # another user's own budget
        assert len(receiver.posts) == 1
        receiver.release.set()
        assert wait_for(lambda: len(receiver.posts) == 3)
        assert sorted(body["text"] for _, body in receiver.posts) == ["gpuguard: for bob", "gpuguard: one",
                                                                      "gpuguard: two"]
        assert wait_for(lambda: notifier.counts() == {("webhook", "sent"): 3, ("webhook", "dropped"): 1})
        clock[0] = 3600.0  # an hour later alice may be told again
        notifier.tell("alice", "gpuguard: four")
        assert wait_for(lambda: len(receiver.posts) == 4)
    finally:
        notifier.close()


def test_a_mail_cannot_carry_extra_headers():
    text = mail_text("bob@lab.example", "gpu1", "gpuguard: line\nBcc: everyone@lab.example").decode()
    headers = text.split("\n\n", 1)[0]
    assert "\nBcc:" not in headers and "everyone@lab.example" in text.split("\n\n", 1)[1]
