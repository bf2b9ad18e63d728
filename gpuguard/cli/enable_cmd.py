"""`gpuguard enable` and `gpuguard disable`: make an installed gpuguard take effect, or undo it.

enable: first whether the daemon can start here at all (core/readiness.py: NVML loads and the
GPUs answer, cgroup v2, bpf(), bpffs, Slurm decided, psycopg where [fleet] is set); where it
cannot, nothing is changed and the reason is said in one line (exit 5) unless --force. Then the
modprobe.d option and the udev rule linked into /etc (gpuguard.activation), udev reloaded, the PAM
profile on (pam-auth-update), the daemon enabled and started (systemctl), and the web view's unit
too where [web] listen is set.
disable: all of it undone, the web view and the daemon stopped first (the daemon would close the
nodes again), the gate detached, and the GPU nodes opened as the driver makes them. Each tool is used where it exists
(a container has no systemd, Fedora no pam-auth-update): what is left to do by hand is printed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gpuguard import activation
from gpuguard import config as configuration
from gpuguard.cli import CommandError, load_config, require_root, summary
from gpuguard.core import readiness
from gpuguard.core.doctor import FAIL, Finding
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK

PAM_PROFILE = Path("/usr/share/pam-configs/gpuguard")
UNIT = "gpuguard.service"
WEB_UNIT = "gpuguard-web.service"
# Where a unit file of the web view may be (the package's, `make install`'s, an admin's own).
UNIT_DIRS = (Path("/etc/systemd/system"), Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
MODULE_LINE = "session optional pam_gpuguard.so"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    enable = subparsers.add_parser(
        "enable", help=summary("enable"),
        description="Make an installed gpuguard take effect, once /etc/gpuguard is configured: the modprobe.d "
                    "option and the udev rule linked into /etc, the PAM profile on, the daemon enabled and started "
                    "(and the web view's unit, where [web] listen is set). "
                    "First it checks that the daemon can start here (NVML loads and the GPUs answer, cgroup v2, "
                    "bpf and bpffs, Slurm decided, psycopg where [fleet] is set); where it cannot, it changes "
                    "nothing and exits 5 with the reason. "
                    "Example: sudo gpuguard enable")
    enable.add_argument("--force", action="store_true",
                        help="enable even where the daemon cannot start yet (e.g. the NVIDIA driver is not installed): "
                             "logins go on without GPUs until it starts")
    enable.set_defaults(func=enable_command)
    disable = subparsers.add_parser(
        "disable", help=summary("disable"),
        description="Undo enable: the web view and the daemon stopped and disabled, the gate detached, the links "
                    "and the PAM profile removed, the GPU nodes open as the driver makes them. Example: sudo gpuguard disable")
    disable.add_argument("--quiet", action="store_true", help="print failures only (the package's prerm)")
    disable.add_argument("--gate-name", default="gpuguard", help=argparse.SUPPRESS)  # tests run gates of their own
    disable.set_defaults(func=disable_command)


def _systemd() -> bool:
    return os.path.isdir("/run/systemd/system")


def _udev() -> bool:
    try:
        return stat.S_ISSOCK(os.stat("/run/udev/control").st_mode)
    except FileNotFoundError:
        return False


def _pam_auth_update() -> bool:
    return PAM_PROFILE.is_file() and shutil.which("pam-auth-update") is not None


class Steps:
    """Runs each step's command, collecting one line per thing done and per failure."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.failed = 0

    def run(self, argv: list[str], done: str) -> None:
        result = subprocess.run(argv, capture_output=True, text=True,
                                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if result.returncode == 0:
            self.say(done)
        else:
            self.failed += 1
            detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            print(f"gpuguard: {' '.join(argv)}: {detail}", file=sys.stderr)


def _cannot_start(config: configuration.Config) -> list[Finding]:
    """What stops the daemon from starting here, from the facts doctor gathers (the same backends
    the daemon opens: NVML or the simulated GPUs, the cgroup root, bpf())."""
    from gpuguard.backends.mounts import bpffs_mounted
    from gpuguard.cli.doctor_cmd import gather
    with open("/proc/filesystems") as filesystems:
        supported = any(line.split()[-1:] == ["bpf"] for line in filesystems)
    found = readiness.blockers(gather(config, "sshd", Path("/")),
                               readiness.check_bpffs(config.access.mode, bpffs_mounted(), supported))
    return [*found, *_fleet_blockers(config)]


def _fleet_blockers(config: configuration.Config) -> list[Finding]:
    """A fleet node's daemon needs psycopg, which the package only suggests (a single server never
    loads it): without it the daemon cannot start."""
    if config.fleet is None:
        return []
    try:
        import psycopg  # noqa: F401  # only whether it imports, as the daemon's fleet code will
        import psycopg_pool  # noqa: F401
    except ImportError as exc:
        return [Finding("fleet", FAIL, f"[fleet] is set but {exc.name or 'psycopg'} cannot be imported: "
                        "the daemon cannot reach the fleet database",
                        "apt install python3-psycopg python3-psycopg-pool (or remove [fleet])")]
    return []


def _web_unit_installed() -> bool:
    return any((directory / WEB_UNIT).exists() for directory in UNIT_DIRS)


def enable_command(args: argparse.Namespace) -> int:
    require_root("enable")
    loaded = load_config(args)  # a broken configuration stops here, before anything changes
    if blockers := _cannot_start(loaded):
        if not args.force:
            raise CommandError(f"enable: the daemon cannot start here, so nothing was changed: "
                               f"{readiness.reasons(blockers)}; --force enables anyway",
                               readiness.EXIT_CANNOT_START)
        print(f"gpuguard: warning: enabled anyway (--force), but the daemon cannot start until this is fixed, "
              f"and logins get no GPUs: {readiness.reasons(blockers)}", file=sys.stderr)
    steps = Steps(print)
    for line in activation.make_links(activation.links()):
        print(line)
    if _udev():
        steps.run(["udevadm", "control", "--reload"], "udev: rules reloaded")
    if _pam_auth_update():
        steps.run(["pam-auth-update", "--enable", "gpuguard"], "PAM: pam_gpuguard.so in common-session")
    else:
        print(f"PAM: add `{MODULE_LINE}` to the session stacks that hand out GPUs (pam_gpuguard(8))")
    if _systemd():
        steps.run(["systemctl", "enable", "--now", UNIT], f"systemd: {UNIT} enabled and started")
        if loaded.web.listen is not None and _web_unit_installed():
            steps.run(["systemctl", "enable", "--now", WEB_UNIT], f"systemd: {WEB_UNIT} enabled and started")
    else:
        print(f"no systemd here: start `gpuguard --config {loaded.source} daemon` as root yourself")
    print("the modprobe.d option takes effect the next time the nvidia module loads (reboot)")
    return EXIT_FAILED if steps.failed else EXIT_OK


def disable_command(args: argparse.Namespace) -> int:
    require_root("disable")
    steps = Steps((lambda _line: None) if args.quiet else print)
    if _pam_auth_update():
        steps.run(["pam-auth-update", "--disable", "gpuguard"], "PAM: pam_gpuguard.so out of common-session")
    if _systemd():
        # The web view first: it asks the daemon, and `enable` (or the admin) may have started it.
        if _web_unit_installed():
            steps.run(["systemctl", "disable", "--now", WEB_UNIT], f"systemd: {WEB_UNIT} stopped and disabled")
        steps.run(["systemctl", "disable", "--now", UNIT], f"systemd: {UNIT} stopped and disabled")
    from gpuguard.backends.gate import Gate  # ctypes and the assembler: only here
    gate = Gate(args.gate_name)
    if gate.find():
        gate.detach()
        steps.say(f"gate {args.gate_name}: detached")
    for line in activation.remove_links(activation.links()):
        steps.say(line)
    if _udev():
        steps.run(["udevadm", "control", "--reload"], "udev: rules reloaded")
    try:
        device_dir = load_config(args).paths.device_dir
    except configuration.ConfigError as exc:  # disabling must not wait for a config that loads
        device_dir = configuration.PathsConfig().device_dir
        print(f"gpuguard: {exc}; using {device_dir}", file=sys.stderr)
    opened = activation.open_nodes(device_dir)
    steps.say(f"opened {', '.join(opened)}" if opened else f"GPU nodes in {device_dir}: open already")
    if steps.failed:
        raise CommandError(f"disable: {steps.failed} step(s) failed (above); the rest is done")
    return EXIT_OK
