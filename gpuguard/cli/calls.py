"""What the user and admin commands share: asking the daemon, and printing times."""
from __future__ import annotations

import argparse
from typing import Any

from gpuguard import client
from gpuguard.cli import load_config

TIMEOUT = 30.0  # revoke and release scan /proc for holders; status of a busy server is large


def ask(args: argparse.Namespace, op: str, **fields: Any) -> dict[str, Any]:
    """One request to the daemon on the configured socket; the reply's fields without the envelope."""
    socket = load_config(args).paths.socket
    reply = client.call(str(socket), op, timeout=TIMEOUT, **{k: v for k, v in fields.items() if v is not None})
    return {key: value for key, value in reply.items() if key not in ("v", "ok")}
