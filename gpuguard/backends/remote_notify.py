"""Notices for people without a terminal: a webhook (JSON POST) and e-mail through sendmail.

VS Code remote and Jupyter users never see a line written to a tty, so every notice the
daemon gives a user (warnings, kills, queue grants, expiries, releases) also goes to the
addresses `[notify]` names: a webhook URL (Slack, Mattermost and ntfy take a JSON POST with
a `text` field) and an e-mail through the local MTA's `sendmail` interface. One background
thread delivers them from a bounded queue, each call with a timeout, so the event loop never
waits for a network or an MTA. Each user gets at most `per_user_hour` notices an hour (a user
looping request/release cannot make gpuguard flood a chat or a mail server); the rest are
dropped. Sent, failed and dropped notices are counted per channel (gpuguard_notices_total)
and every failure is logged.
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Mapping
from email.message import EmailMessage

from gpuguard.backends.notify import Worker
from gpuguard.config import NotifyConfig
from gpuguard.logs import event

TIMEOUT = 10.0  # seconds per webhook call or sendmail run
HOUR = 3600.0
WEBHOOK, MAIL = "webhook", "mail"


def addresses(settings: NotifyConfig, user: str) -> dict[str, str]:
    """The user's webhook URL and mail address: their own entry, else the templates (pure)."""
    own = settings.users.get(user, {})
    found = {}
    if url := own.get(WEBHOOK) or settings.webhook:
        found[WEBHOOK] = url.format(user=urllib.parse.quote(user, safe=""))
    if address := own.get(MAIL) or settings.mail:
        found[MAIL] = address.format(user=user)
    return found


def mail_text(address: str, host: str, message: str) -> bytes:
    """The e-mail: the notice's first line as subject, all of it as body (EmailMessage encodes)."""
    mail = EmailMessage()
    mail["To"] = address
    text = message.splitlines()[0].removeprefix("gpuguard: ") if message else ""
    mail["Subject"] = f"gpuguard on {host}: {text[:70]}{'...' if len(text) > 70 else ''}"
    mail.set_content(f"{message}\n\n-- gpuguard on {host}\n")
    return bytes(mail)


class RemoteNotifier:
    def __init__(self, settings: Callable[[], NotifyConfig], clock: Callable[[], float] = time.monotonic):
        self._settings = settings  # the config in force: a reload changes addresses at once
        self._clock = clock
        self._sent: dict[str, deque[float]] = {}  # user -> times of their notices in the last hour
        self._counts: Counter[tuple[str, str]] = Counter()  # (channel, outcome) -> notices
        self._lock = threading.Lock()
        self._host = socket.gethostname()
        self._worker: Worker[tuple[str, str, NotifyConfig]] = Worker("gpuguard-remote-notify", self._deliver)

    def counts(self) -> Mapping[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def tell(self, user: str, message: str) -> None:
        """Queue the notice for the user's addresses; never blocks (called from the event loop)."""
        settings = self._settings()
        channels = addresses(settings, user)
        if not channels:
            return
        if not self._allowed(user, settings.per_user_hour):
            self._count(channels, "dropped")
            event(logging.WARNING, "notify_dropped", user=user, reason=f"over {settings.per_user_hour} an hour")
            return
        if not self._worker.put((user, message, settings)):
            self._count(channels, "dropped")
            event(logging.WARNING, "notify_dropped", user=user, reason="queue full")

    def close(self, timeout: float = 2.0) -> None:
        self._worker.close(timeout)

    def _allowed(self, user: str, per_hour: int) -> bool:
        now = self._clock()
        recent = self._sent.setdefault(user, deque())
        while recent and now - recent[0] >= HOUR:
            recent.popleft()
        if len(recent) >= per_hour:
            return False
        recent.append(now)
        return True

    def _count(self, channels: Mapping[str, str], outcome: str) -> None:
        with self._lock:
            for channel in channels:
                self._counts[(channel, outcome)] += 1

    def _deliver(self, item: tuple[str, str, NotifyConfig]) -> None:
        user, message, settings = item
        for channel, address in addresses(settings, user).items():
            try:
                if channel == WEBHOOK:
                    self._post(address, user, message)
                else:
                    self._mail(settings, address, message)
                outcome = "sent"
            except Exception as exc:  # one bad address must not stop the others
                outcome = "failed"
                event(logging.WARNING, "notify_failed", channel=channel, user=user, error=f"{type(exc).__name__}: {exc}")
            self._count({channel: address}, outcome)

    def _post(self, url: str, user: str, message: str) -> None:
        body = json.dumps({"text": message, "user": user, "host": self._host,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "gpuguard"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:  # the admin's URL
            reply.read(65536)  # a 2xx: urlopen raises HTTPError for the others

    def _mail(self, settings: NotifyConfig, address: str, message: str) -> None:
        done = subprocess.run([str(settings.sendmail), "-oi", "--", address], input=mail_text(address, self._host,
                              message), capture_output=True, timeout=TIMEOUT, check=False)
        if done.returncode != 0:
            raise OSError(f"{settings.sendmail} exited {done.returncode}: "
                          f"{done.stderr.decode(errors='replace').strip()[:200]}")
