"""Which install of gpuguard a node is, so that two servers under one node name are told apart.

A node name is unique in the fleet (the database's rows are keyed by it), but the default is the
short host name and servers are made from cloned images: two of them under one name would
overwrite each other's mirror. Each node therefore sends who it is with every heartbeat and
grant-time check, and the database refuses a second install under a name a live node holds
(schema.py, heartbeat_v3 and reserve_v2).

Who it is: the host name (for people), the machine and an install key.

- machine: an app-specific hash of /etc/machine-id (machine-id(5) asks that the id itself not be
  shown; systemd's sd_id128_get_machine_app_specific does the same). It tells most hosts apart,
  but an image cloned without being prepared (no `systemd-machine-id-setup` or virt-sysprep)
  copies it.
- key: drawn at random into the state directory (IDENTITY_FILE) at the first start. It tells two
  installs on one machine apart (the tests' nodes), and a clone made before gpuguard first ran.
  A clone made after copies the state directory, key included, so the file also records the
  machine it was drawn on (a hash of the machine-id and the hardware's own id, which a cloned
  disk does not carry: the firmware's system UUID, or the device tree's serial number); a key
  found on another machine is drawn again. A copied image on copied hardware ids (a VM whose
  definition was copied with its UUID) is indistinguishable: nothing on it differs.

A new key (a reinstalled or moved state directory) is a new install: it takes the name over
once the old holder has been silent past lease + grace, or at once after `gpuguard fleet remove`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuguard.core.escape import printable
from gpuguard.logs import event
from gpuguard.services import state_files

IDENTITY_FILE = "fleet-identity.json"  # in the state directory
MACHINE_ID = Path("/etc/machine-id")
# The hardware's own id, the first of these that reads (root only; absent in containers).
HARDWARE_IDS = (Path("/sys/class/dmi/id/product_uuid"), Path("/sys/firmware/devicetree/base/serial-number"))
APP_ID = b"gpuguard fleet node"  # the key of the machine-id's app-specific hash


@dataclass(frozen=True)
class Identity:
    host: str     # socket.gethostname(): for the people reading the refusal
    machine: str  # 12 hex digits: an app-specific hash of /etc/machine-id ('' where it has none)
    key: str      # 16 hex digits, this install's (IDENTITY_FILE)

    @property
    def install(self) -> str:
        """What the database compares: machine and key (the host name may change, the install stays)."""
        return f"{self.machine or '-'}/{self.key}"

    def __str__(self) -> str:
        return describe(self.host, self.install)


def describe(host: str, install: str) -> str:
    """A node as the refusal names it: `gpu1 (machine 3f2a9c1b0d4e, install 9c1d2e3f4a5b6c7d)`
    (what a database row says, made printable: it may hold anything)."""
    host, install = printable(host) or "a host", printable(install)
    machine, _, key = install.partition("/")
    if not key:  # a node of a release before names (its outbox's incarnation only)
        return f"{host} (an older gpuguard, outbox {install})"
    return f"{host} (machine {machine}, install {key})"


def _read(path: Path) -> str:
    try:
        return path.read_bytes().strip(b"\x00\n ").decode(errors="replace")
    except OSError:
        return ""


def machine_hash(machine_id: str) -> str:
    return hmac.new(machine_id.encode(), APP_ID, hashlib.sha256).hexdigest()[:12] if machine_id else ""


def load(state_dir: Path, machine_id: Path = MACHINE_ID, hardware: Sequence[Path] = HARDWARE_IDS) -> Identity:
    """This install's identity; the key is drawn (and logged) at the first start, and again when
    the state directory is found on another machine than the one it was drawn on."""
    machine = machine_hash(_read(machine_id))
    hardware_id = next((text for text in map(_read, hardware) if text), "")
    drawn_on = hashlib.sha256(f"{machine}\n{hardware_id}".encode()).hexdigest()[:16]
    path = state_dir / IDENTITY_FILE
    kept = state_files.read(path)
    if isinstance(kept, dict) and isinstance(kept.get("key"), str) and kept.get("drawn_on") == drawn_on:
        return Identity(socket.gethostname(), machine, kept["key"])
    key = secrets.token_hex(8)
    if isinstance(kept, dict) and isinstance(kept.get("key"), str):
        event(logging.WARNING, "fleet_install_key", key=key, before=kept["key"],
              why="the state directory was made on another machine (its machine-id or hardware id differs: a "
                  "cloned image or a copied state directory): a new install key, so that it is not taken for the "
                  "original")
    else:
        event(logging.INFO, "fleet_install_key", key=key, why="the first start of this install in a fleet")
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    state_files.write(path, {"key": key, "drawn_on": drawn_on})
    return Identity(socket.gethostname(), machine, key)
