"""`gpuguard enable` on a host where the daemon cannot start, and what logins say until it does.

- Where NVML cannot load (no NVIDIA driver) or no GPU answers (the simulated GPUs, through
  pynvml's wrappers as the daemon opens them, all lost), enable refuses in one line naming the
  reason, with exit 5, and changes nothing: the PAM files, the links in /etc, systemd's.
- `--force` enables all the same, and says what will not work; where the daemon can start,
  enable needs no --force.
- The unit gives up on a start that keeps failing (a start limit) instead of looping.
- A login while the daemon has never started opens, and tells the user in one line what the
  admin should run.

Enable runs for real, as root, from this checkout: the inert files an install leaves in
/usr/lib/gpuguard and /usr/share/pam-configs are staged as `make install` puts them, under the
package lock (tests/system/deb_lock.py), and removed afterwards with every trace of the profile.
"""
from __future__ import annotations

import ctypes.util
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from deb_lock import package_lock
from sim_helpers import cli, set_fault, write_config
from ssh_harness import PamStacks, hook_line, info_lines, module_line, pamtester
from test_shipped_files import UNIT, setting, unit_sections

from gpuguard import activation, pam_hook
from gpuguard.backends.sim_registry import make_registry
from gpuguard.cli.enable_cmd import PAM_PROFILE
from gpuguard.core.quantities import parse_duration
from gpuguard.core.readiness import EXIT_CANNOT_START

COMMON_SESSION = Path("/etc/pam.d/common-session")
MODULE_LINE = "pam_gpuguard.so"
# What enable may change, and a refused enable must leave as it was.
WATCHED = [Path("/etc/pam.d"), Path("/var/lib/pam"), Path("/etc/modprobe.d"), Path("/etc/udev/rules.d"),
           Path("/etc/systemd/system")]


def snapshot() -> dict[str, str]:
    """Every file under WATCHED with its text (a link: its target); other tests' ggt-* files left out."""
    found = {}
    for top in WATCHED:
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if "ggt-" not in d]
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                path = os.path.join(root, name)
                if "ggt-" not in name:
                    found[path] = f"-> {os.readlink(path)}" if os.path.islink(path) else Path(path).read_text()
    return found


def links_on() -> list[str]:
    return [str(link.path) for link in activation.links() if link.state() == "on"]


@pytest.fixture
def inert_install() -> Iterator[None]:
    """The files `make install` leaves inert (modprobe.d option, udev rule, PAM profile) in place,
    as enable needs them; afterwards gone, and the PAM configuration as it was."""
    if shutil.which("pam-auth-update") is None:
        pytest.skip("no pam-auth-update: not a Debian system")
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd runs here: enable would start the host's own gpuguard.service")
    with package_lock():
        if activation.VENDOR_DIR.exists() or PAM_PROFILE.exists() or links_on():
            pytest.skip("gpuguard is installed on this machine for real: not touching it")
        before = snapshot()
        try:
            for source, target in [(REPO / "etc/modprobe.d/gpuguard.conf", "modprobe.d/gpuguard.conf"),
                                   (REPO / "udev/70-gpuguard.rules", "udev/70-gpuguard.rules")]:
                (activation.VENDOR_DIR / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, activation.VENDOR_DIR / target)
            shutil.copy(REPO / "pam/gpuguard", PAM_PROFILE)
            yield
        finally:
            activation.remove_links(activation.links())
            if PAM_PROFILE.exists():
                subprocess.run(["pam-auth-update", "--package", "--remove", "gpuguard"], check=True,
                               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True)
                PAM_PROFILE.unlink()
            shutil.rmtree(activation.VENDOR_DIR, ignore_errors=True)
        assert snapshot() == before


def no_nvml(sandbox: Path) -> Path:
    """The real backend on a host without the driver: NVML's library cannot load."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real NVIDIA driver")
    path = sandbox / "gpuguard.toml"
    path.write_text(f'[paths]\ndevice_dir = "{sandbox / "dev"}"\nstate_dir = "{sandbox / "state"}"\n'
                    f'socket = "{sandbox / "run" / "gpuguard.sock"}"\n\n[gpu]\nbackend = "nvml"\n')
    return path


def gpus_lost(sandbox: Path) -> Path:
    """Simulated GPUs, every one fallen off the bus: NVML loads, and no GPU answers."""
    path = write_config(sandbox)
    (sandbox / "dev").mkdir()
    make_registry(sandbox / "dev")
    set_fault(sandbox / "dev", "NVML_ERROR_GPU_IS_LOST 0 1 2 3")
    return path


BROKEN = {"no-nvml": (no_nvml, "NVML nvmlInit failed: NVML Shared Library Not Found"),
          "gpus-lost": (gpus_lost, "NVML cannot reach the GPU at NVML index 0: GPU is lost")}


def pam_lines() -> int:
    return sum(MODULE_LINE in line.split() for line in COMMON_SESSION.read_text().splitlines())


def disable(config: Path) -> None:
    result = cli(config, "disable", "--gate-name", f"ggt-{secrets.token_hex(3)}")  # no test's gate is detached
    assert result.returncode == 0, result.stderr
    assert links_on() == [] and pam_lines() == 0


@pytest.mark.parametrize("case", BROKEN)
def test_enable_refuses_where_the_daemon_cannot_start(inert_install, sandbox, case) -> None:
    make, reason = BROKEN[case]
    config = make(sandbox)
    before = snapshot()

    result = cli(config, "enable")

    assert result.returncode == EXIT_CANNOT_START, result
    assert result.stdout == ""
    assert result.stderr.startswith("gpuguard: enable: the daemon cannot start here, so nothing was changed: "
                                    f"nvml: cannot list GPUs: {reason} (fix: check the driver: nvidia-smi")
    assert result.stderr.endswith("; --force enables anyway\n") and result.stderr.count("\n") == 1, result.stderr
    assert snapshot() == before  # PAM, the links, systemd: untouched
    assert links_on() == [] and pam_lines() == 0
    assert not (sandbox / "state").exists()


@pytest.mark.parametrize("case", BROKEN)
def test_force_enables_all_the_same_and_says_what_will_not_work(inert_install, sandbox, case) -> None:
    make, reason = BROKEN[case]
    config = make(sandbox)

    result = cli(config, "enable", "--force")

    assert result.returncode == 0, result.stderr
    warning, *rest = result.stderr.splitlines()
    assert warning.startswith("gpuguard: warning: enabled anyway (--force), but the daemon cannot start until "
                              "this is fixed, and logins get no GPUs: nvml: cannot list GPUs: ") and reason in warning
    assert rest == []
    assert sorted(links_on()) == sorted(str(link.path) for link in activation.links())
    assert pam_lines() == 1
    disable(config)


def test_enable_needs_no_force_where_the_daemon_can_start(inert_install, sandbox) -> None:
    config = write_config(sandbox)  # simulated GPUs that answer, opened as the daemon opens them

    result = cli(config, "enable")

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "PAM: pam_gpuguard.so in common-session" in result.stdout.splitlines()
    assert pam_lines() == 1 and len(links_on()) == 2
    disable(config)


def test_the_unit_gives_up_on_a_start_that_keeps_failing() -> None:
    sections = unit_sections(UNIT)
    interval = parse_duration(setting(sections, "Unit", "StartLimitIntervalSec"))
    burst = int(setting(sections, "Unit", "StartLimitBurst"))
    restart = parse_duration(setting(sections, "Service", "RestartSec"))
    assert setting(sections, "Service", "Restart") == "on-failure"
    assert restart is not None and interval is not None
    # systemd restarts a failed start every RestartSec: `burst` of them must fit in the interval,
    # even where each failing start takes as long again (ExecStartPre, NVML's own timeout).
    assert burst * 2 * restart <= interval
    assert burst >= 3  # a daemon that crashes now and then is still restarted


@pytest.mark.usefixtures("pam_module")
@pytest.mark.parametrize("path", ["module", "hook"])
def test_a_login_before_the_daemon_ever_started_says_what_to_do(sandbox, make_user, path) -> None:
    never = sandbox / "run" / "gpuguard.sock"  # not even its directory: the daemon never ran
    line = module_line(never, control="required") if path == "module" else \
        hook_line("--socket", str(never), control="required")
    stacks = PamStacks()
    try:
        result = pamtester(stacks.make(line), make_user().name)
    finally:
        stacks.remove_all()
    assert result.returncode == 0 and "successfully opened a session" in result.stdout, result
    assert info_lines(result.stdout) == [pam_hook.UNAVAILABLE]  # the module and the hook say the same
    assert "tell your admin" in pam_hook.UNAVAILABLE and "sudo gpuguard doctor" in pam_hook.UNAVAILABLE
