"""`gpuguard doctor`: is this machine set up right? One line per check, a fix for each problem.

This module gathers the facts (the kernel, NVML, the nodes, the files that PAM, udev and kmod
read, the daemon); gpuguard/doctor.py judges them. Exit 1 when any check fails (warnings do not).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
from pathlib import Path

from gpuguard import client
from gpuguard.backends import GateError, GpuError, accounts, driver_minors, open_gate, open_gpu_backend, slurm
from gpuguard.cli import load_config, print_json, require_root, summary
from gpuguard.config import AccessMode, Config
from gpuguard.core import doctor
from gpuguard.core.coexist import CoexistError, Ownership
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK, UnknownUser

TYPE_CHECKING = False  # not typing's: importing it costs every command a few ms
if TYPE_CHECKING:
    from typing import Any

PAM_SECURITY_DIRS = ("lib/*/security", "usr/lib/*/security", "lib64/security", "usr/lib64/security",
                     "lib/security", "usr/lib/security")
UDEV_DIRS = ("etc/udev/rules.d", "run/udev/rules.d", "usr/lib/udev/rules.d", "lib/udev/rules.d",
             "usr/local/lib/udev/rules.d")
MODPROBE_DIRS = ("etc/modprobe.d", "run/modprobe.d", "usr/lib/modprobe.d", "lib/modprobe.d",
                 "usr/local/lib/modprobe.d")
MODIFY_DEVICE_FILES = "sys/module/nvidia/parameters/ModifyDeviceFiles"
_PAM_INCLUDE = re.compile(r"^-?session\s+(?:include|substack)\s+(\S+)|^@include\s+(\S+)")
_PAM_SESSION = re.compile(r"^-?session\s+(?:\[[^]]*\]|\S+)\s+(\S.*)")  # the module and its arguments


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("doctor", help=summary("doctor"),
                                   description="One line per check; exit 1 if any fails. "
                                               "Examples: sudo gpuguard doctor; sudo gpuguard doctor --json")
    parser.add_argument("--pam-service", default="sshd", metavar="NAME",
                        help="the login service whose session stack should run the module (default sshd)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    # Tests read PAM, udev and modprobe files under a root of their own, never the machine's.
    parser.add_argument("--files-root", default="/", help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_root("doctor")
    findings = doctor.run(gather(load_config(args), args.pam_service, Path(args.files_root)))
    if args.json:
        print_json([finding.__dict__ for finding in findings])
    else:
        for finding in findings:
            print(doctor.format_line(finding))
    return EXIT_FAILED if doctor.failed(findings) else EXIT_OK


def gather(config: Config, pam_service: str, root: Path) -> doctor.Facts:
    status, daemon_error = _daemon(config)
    fleet, fleet_error = ((None, None) if config.fleet is None else
                          _daemon(config, "fleet_status") if status else (None, "the daemon does not answer"))
    gate_name = (status or {}).get("gate") or "gpuguard"
    driver = sorted(driver_minors(config))
    try:
        ownership, owners_error = slurm.ownership(config.coexist, driver), None
    except CoexistError as exc:
        ownership, owners_error = Ownership(), exc.line()
    cgroup2, bpf_error, gate, gate_current, gate_error = _kernel(config, gate_name, ownership)
    gpus, nvml_error = _gpus(config)
    minors = sorted(set(driver) | {minor for minor, _ in gpus or ()})
    session = _pam_session(root / "etc/pam.d", pam_service)
    exempt = frozenset(status["exempt"]) if status and "exempt" in status else frozenset(accounts.exempt_uids(config.access))
    return doctor.Facts(
        backend=config.gpu.backend, mode=config.access.mode,
        cgroup2=cgroup2, bpf_error=bpf_error, gate_name=gate_name, gate=gate, gate_current=gate_current,
        gate_error=gate_error, gpus=gpus, nvml_error=nvml_error, driver_minors=driver,
        nodes={minor: _node(config.paths.device_dir / f"nvidia{minor}") for minor in minors},
        modify_device_files=_read(root / MODIFY_DEVICE_FILES),
        modprobe_option=any(_sets_modify_device_files(path) for path in _files(root, MODPROBE_DIRS, "*.conf")),
        pam_service=pam_service, pam_session=session,
        pam_module_found=session is not None and _module_found(root, session),
        udev_rules=[str(path) for path in _files(root, UDEV_DIRS, "*.rules")
                    if re.search(r"RUN\+?=\"\S*gpuguard acl apply\"", path.read_text(errors="replace"))],
        persistenced_uid=_uid(doctor.PERSISTENCED), exempt_uids=exempt,
        daemon=status, daemon_error=daemon_error,
        slurm=next((what for what in ("slurmd", "slurmctld") if shutil.which(what)), None)
        or ("/etc/slurm" if (root / "etc/slurm").is_dir() else None),
        slurm_setting=_setting(config.coexist.slurm), owners=ownership.summary(), owners_error=owners_error,
        foreign=frozenset(ownership.foreign), fleet=fleet, fleet_error=fleet_error)


def _setting(slurm: str | tuple[int, ...] | None) -> str | None:
    return ",".join(map(str, slurm)) if isinstance(slurm, tuple) else slurm


def _daemon(config: Config, op: str = "status") -> tuple[dict[str, Any] | None, str | None]:
    try:
        return client.call(str(config.paths.socket), op, timeout=5), None
    except (client.DaemonUnreachable, client.Refused) as exc:
        return None, str(exc)


def _kernel(config: Config, gate_name: str, ownership: Ownership) \
        -> tuple[str | None, str | None, dict[str, Any] | None, bool | None, str | None]:
    """(cgroup2 mount, bpf error, gate status, gate current, gate error)."""
    from gpuguard.backends.bpf import attached_ids  # ctypes: only for this command
    from gpuguard.backends.mounts import cgroup2_root
    try:
        root = cgroup2_root()
    except GateError:
        return None, "no cgroup v2", None, None, "no cgroup v2"
    try:
        attached_ids(root)
    except GateError as exc:
        return str(root), exc.line(), None, None, "bpf() refused"
    if config.access.mode == AccessMode.ACL:
        return str(root), None, None, None, None
    try:
        with open_gate(config, gate_name, ownership) as gate:
            status = gate.status()
            return str(root), None, status, gate.is_current() if status["prog_id"] else None, None
    except GateError as exc:
        return str(root), None, None, None, exc.line()


def _gpus(config: Config) -> tuple[list[tuple[int, str]] | None, str | None]:
    try:
        backend = open_gpu_backend(config)
    except GpuError as exc:
        return None, exc.line()
    try:
        return [(gpu.unit, gpu.name) for gpu in backend.gpus()], None
    except GpuError as exc:
        return None, exc.line()
    finally:
        backend.close()


def _node(path: Path) -> doctor.Node:
    from gpuguard.backends.posix_acl import acl_users
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return doctor.Node(str(path), exists=False)
    users = frozenset(acl_users(path)) if stat.S_ISCHR(st.st_mode) else frozenset()
    return doctor.Node(str(path), True, stat.S_ISCHR(st.st_mode), stat.S_IMODE(st.st_mode),
                       st.st_uid, st.st_gid, users)


def _pam_session(pam_dir: Path, service: str, seen: frozenset[str] = frozenset()) -> list[str] | None:
    """The service's session lines in order (the module, then its arguments), includes followed;
    None when it has no file."""
    path = pam_dir / service
    if service in seen or not path.is_file():
        return None
    modules: list[str] = []
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if include := _PAM_INCLUDE.match(line):
            modules += _pam_session(pam_dir, include[1] or include[2], seen | {service}) or []
        elif module := _PAM_SESSION.match(line):
            modules.append(module[1])
    return modules


def _module_found(root: Path, session: list[str]) -> bool:
    named = [module for module in (line.split()[0] for line in session) if module.split("/")[-1] == doctor.MODULE]
    if not named:
        return False
    if named[0].startswith("/"):
        return Path(named[0]).is_file()
    return any(root.glob(f"{directory}/{doctor.MODULE}") for directory in PAM_SECURITY_DIRS)


def _files(root: Path, directories: tuple[str, ...], pattern: str) -> list[Path]:
    return sorted(path for directory in directories for path in (root / directory).glob(pattern) if path.is_file())


def _sets_modify_device_files(path: Path) -> bool:
    return bool(re.search(r"^\s*options\s+nvidia\s.*\bNVreg_ModifyDeviceFiles=0\b", path.read_text(errors="replace"),
                          re.MULTILINE))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _uid(name: str) -> int | None:
    try:
        return accounts.by_name(name).uid
    except UnknownUser:
        return None
