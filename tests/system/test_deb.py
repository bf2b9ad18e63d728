"""`make deb`'s package (dpkg-buildpackage on debian/), installed with the real dpkg on this machine:
lintian, install, upgrade, purge; an install that changes nothing until `gpuguard enable`; what a
Python upgrade relies on.

The package goes into the real root. That cannot disturb another test run on this machine: the
tests' PAM services (/etc/pam.d/ggt-*, the sshd and `su -` stacks of ssh_harness and the demo) never
include common-session, and a gpuguard module there without its daemon lets every session open as
before; the modprobe.d option is for the nvidia module, which is not loaded here. The tests attach
the production gate (named `gpuguard`, which no other test or demo uses) or a daemon's own gate
under the gate lock that every gate-attaching test holds. Two runs of these tests wait for each
other (a flock on /usr/share/pam-configs). A machine where gpuguard is installed for real is left alone.

The NVIDIA driver is simulated: "the driver loads" is what the real modprobe configuration
(`modprobe -c`) and the udev rules installed where udev reads them make of it: without
NVreg_ModifyDeviceFiles=0 nvidia-modprobe makes the GPU nodes 0666 root:root, with it none; then
the RUN commands of the rules that match the nvidia module's "add" event run.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, unique
from deb_lock import package_lock
from probes import ALLOWED, open_result
from test_shipped_files import udev_matches, udev_rules

from devtools.harness import gate_test_lock
from gpuguard import __version__, config
from gpuguard.backends.gate import PIN_ROOT, Gate
from gpuguard.core.readiness import EXIT_CANNOT_START

# useradd and groupadd of other test runs hold /etc/passwd.PID, /etc/group.lock and the like for a moment.
SHADOW_LOCK = re.compile(r"\.(\d+|lock)$")
PAM_LINE = re.compile(r"^session\s+optional\s+pam_gpuguard\.so\s*$", re.MULTILINE)
MULTIARCH = subprocess.run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], capture_output=True,
                           text=True).stdout.strip()
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
# Where the package, its scripts and `gpuguard enable` put files, and must leave them as they found
# them: each directory walked whole, /etc by its own entries (other runs add and remove users meanwhile).
WATCHED = ["/opt", "/usr/bin", "/usr/lib/gpuguard", f"{DIST_PACKAGES}/gpuguard", "/usr/lib/systemd/system",
           "/usr/lib/udev/rules.d", "/usr/lib/modprobe.d", f"/usr/lib/{MULTIARCH}/security", "/usr/share/pam-configs",
           "/usr/share/doc/gpuguard", "/usr/share/man/man1", "/usr/share/man/man5", "/usr/share/man/man8",
           "/usr/share/bash-completion/completions", "/usr/share/python3/runtime.d",
           "/etc/pam.d", "/etc/gpuguard", "/etc/systemd/system", "/etc/modprobe.d", "/etc/udev/rules.d",
           "/var/lib/gpuguard", "/var/lib/gpuguard-web", "/var/lib/private", "/var/lib/dpkg/info", "/var/lib/pam",
           "/run/gpuguard"]
# `gpuguard enable` here: --force, as the NVIDIA driver is simulated (enable refuses where NVML cannot load).
ENABLE = ["/usr/bin/gpuguard", "enable", "--force"]
# What `gpuguard enable` links, to what.
LINKS = {Path("/etc/modprobe.d/gpuguard.conf"): "/usr/lib/gpuguard/modprobe.d/gpuguard.conf",
         Path("/etc/udev/rules.d/70-gpuguard.rules"): "/usr/lib/gpuguard/udev/70-gpuguard.rules"}
UDEV_DIRS = ["/etc/udev/rules.d", "/run/udev/rules.d", "/usr/lib/udev/rules.d", "/lib/udev/rules.d"]
GPUS = 4
# What `systemctl enable gpuguard-web` and the web view's first start (DynamicUser=, StateDirectory=)
# make: the wants link, the state directory in /var/lib/private and its link, the session key.
WEB_WANTS = Path("/etc/systemd/system/multi-user.target.wants/gpuguard-web.service")
WEB_STATE = Path("/var/lib/gpuguard-web")
WEB_PRIVATE = Path("/var/lib/private")

pytestmark = [
    pytest.mark.gate,
    pytest.mark.skipif(shutil.which("dpkg-buildpackage") is None, reason="not a Debian system with dpkg-dev"),
]


def dpkg(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["dpkg", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def installed_version() -> str | None:
    result = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", "gpuguard"],
                            capture_output=True, text=True)
    status, _, version = result.stdout.partition(" ")
    return version if result.returncode == 0 and status == "installed" else None


# The version debian/changelog gives this checkout's package.
VERSION = subprocess.run(["dpkg-parsechangelog", "-l", str(REPO / "debian/changelog"), "-S", "Version"],
                         capture_output=True, text=True).stdout.strip()
# Packages released before, built again from the commits that made them, each with its own
# build-deb.sh: the first layout (dpkg-deb, a venv in /opt/gpuguard, the modprobe.d option and the udev
# rule in effect where kmod and udev read them; PAM profile Default: yes), and the native 0.1.0
# (debhelper, inert until `gpuguard enable`).
EARLIER = {"0.1.0-1": ("02bccf2667ea530ac9e580da0081327f9bc7ee79", ["/usr/bin/python3"]),
           "0.1.0": ("8fd6c1936e0a55ce5e75f71d016d3fc8949d5b50", [])}
FIRST_LAYOUT = {Path("/usr/lib/modprobe.d/gpuguard.conf"), Path("/usr/lib/udev/rules.d/70-gpuguard.rules")}
# The profiles pam-auth-update has seen: a `Default: yes` one it has not seen it turns on by itself.
PAM_SEEN = Path("/var/lib/pam/seen")


def build(outdir: Path, version: str | None, repo: Path = REPO, args: tuple[str, ...] = ()) -> Path:
    """The package of `repo` (this checkout, or an older commit's), built by its own build-deb.sh with
    `args` first; `version` is the one this checkout's script is told to give it (None: debian/changelog's),
    or the one an older commit's script gives by itself."""
    argv = [str(repo / "packaging/build-deb.sh"), *args, str(outdir), *([version] if version and repo == REPO else [])]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    deb = Path(result.stdout.strip().splitlines()[-1])
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    assert deb.name == f"gpuguard_{version or VERSION}_{arch}.deb" and deb.is_file()
    return deb


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> dict[str, Path]:
    """Two versions of the package, built from this checkout: its own version, and a rebuild to upgrade to."""
    outdir = tmp_path_factory.mktemp("deb")
    return {VERSION: build(outdir, None), f"{VERSION}+ggt1": build(outdir, f"{VERSION}+ggt1")}


@pytest.fixture(scope="module")
def earlier_debs(tmp_path_factory) -> dict[str, Path]:
    """The packages of EARLIER, each built in a clone of this repository at its commit."""
    outdir = tmp_path_factory.mktemp("deb-earlier")
    built = {}
    for version, (commit, args) in EARLIER.items():
        clone = tmp_path_factory.mktemp(f"src-{version}") / "gpuguard"
        subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(REPO), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
        built[version] = build(outdir, version, clone, tuple(args))
    return built


def package_entries(deb: Path) -> dict[str, str]:
    """Path -> `ls -l` type and mode string (or link target) of every entry the package ships."""
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    entries = {}
    for line in listing.splitlines():
        mode, _owner, _size, _date, _time, name, *link = line.split(maxsplit=6)
        path = name.removeprefix(".").rstrip("/") or "/"
        entries[path] = link[0].removeprefix("-> ") if mode.startswith("l") else mode
    return entries


def snapshot() -> set[str]:
    """Every path under the watched directories; test objects (ggt-*) of any run left out."""
    paths = {f"/etc/{name}" for name in os.listdir("/etc") if "ggt-" not in name and not SHADOW_LOCK.search(name)}
    paths.update(top for top in WATCHED if os.path.lexists(top))
    for top in WATCHED:
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if "ggt-" not in d and not os.path.ismount(os.path.join(root, d))]
            paths.update(os.path.join(root, name) for name in [*dirs, *files] if "ggt-" not in name)
    return paths


@pytest.fixture
def clean_machine() -> Iterator[None]:
    with package_lock():
        if installed_version() or Path("/opt/gpuguard").exists() or Path("/usr/lib/gpuguard").exists():
            pytest.skip("gpuguard is installed on this machine for real: not touching it")
        try:
            yield
        finally:
            if dpkg("-s", "gpuguard").returncode == 0:  # a failure halfway: purge what is there
                dpkg("--purge", "gpuguard")


def pam_lines() -> int:
    return len(PAM_LINE.findall(Path("/etc/pam.d/common-session").read_text()))


def pam_seen() -> bool:
    return "gpuguard" in PAM_SEEN.read_text().split()


def check_installed(deb: Path, version: str) -> None:
    assert installed_version() == version
    entries = package_entries(deb)
    for path, expected in entries.items():
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            assert os.readlink(path) == expected, path
        else:
            assert stat.filemode(st.st_mode) == expected, path
            assert (st.st_uid, st.st_gid) == (0, 0), path
    # gpuguard itself in dist-packages, on Debian's Python; no program but gpuguard, nothing in /opt,
    # only the vendored pynvml besides the inert vendor files in /usr/lib/gpuguard.
    files = {path for path, mode in entries.items() if not mode.startswith("d")}
    assert {p for p in files if p.startswith("/usr/bin/") or p.startswith("/usr/sbin/")} == {"/usr/bin/gpuguard"}
    assert not [p for p in entries if p.startswith("/opt")]
    assert {p for p in files if p.startswith("/usr/lib/gpuguard/")} == {
        "/usr/lib/gpuguard/vendor/pynvml.py", *LINKS.values()}
    assert f"{DIST_PACKAGES}/gpuguard/cli/__init__.py" in files
    assert Path("/usr/bin/gpuguard").read_text().startswith("#!/usr/bin/python3\n")
    for path in ["/usr/lib/systemd/system/gpuguard.service", "/usr/lib/systemd/system/gpuguard-web.service",
                 "/usr/lib/systemd/system/gpuguard-web-login.socket", "/usr/lib/systemd/system/gpuguard-web-login@.service",
                 "/usr/share/pam-configs/gpuguard",
                 f"/usr/lib/{MULTIARCH}/security/pam_gpuguard.so", "/usr/share/doc/gpuguard/copyright",
                 "/usr/share/doc/gpuguard/changelog.gz"]:
        assert Path(path).is_file(), path
    # dpkg recorded a checksum of every file, and they match.
    assert Path("/var/lib/dpkg/info/gpuguard.md5sums").read_text().count("\n") == len(
        [p for p in files if not p.startswith("/etc/")])
    verify = subprocess.run(["dpkg", "--verify", "gpuguard"], capture_output=True, text=True)
    assert verify.returncode == 0, verify
    assert [line for line in verify.stdout.splitlines() if " c /etc/" not in line] == [], verify.stdout  # conffiles may be edited
    # The man pages, found by name and section; gpuguard.toml(5) lists every key the loader knows.
    for name, section in [("gpuguard", "1"), ("gpuguard", "8"), ("gpuguard.toml", "5"), ("pam_gpuguard", "8")]:
        page = Path(f"/usr/share/man/man{section}/{name}.{section}.gz")
        assert gzip.decompress(page.read_bytes()).decode().startswith(f".TH {name.upper()} {section} "), page
        found = subprocess.run(["man", "-w", section, name], capture_output=True, text=True)
        assert found.stdout.strip() == str(page), found
    shown = subprocess.run(["man", "-P", "cat", "gpuguard.toml"], capture_output=True, text=True,
                           env={**os.environ, "MANWIDTH": "200", "LC_ALL": "C.UTF-8"})
    assert shown.returncode == 0, shown.stderr
    for section, table in config.SCHEMA.items():
        assert f"[{section}]" in shown.stdout, section
        for key in table:
            assert re.search(rf"^\s+{re.escape(key)} = ", shown.stdout, re.MULTILINE), f"{section}.{key}"
    completion = Path("/usr/share/bash-completion/completions/gpuguard").read_text()
    assert "_shtab_gpuguard" in completion and "report" in completion
    conffiles = subprocess.run(["dpkg-query", "-W", "-f=${Conffiles}", "gpuguard"], capture_output=True,
                               text=True, check=True).stdout.split()
    assert {"/etc/gpuguard/gpuguard.toml", "/etc/gpuguard/quotas.toml"} <= set(conffiles)
    # A single server never loads psycopg: only a fleet's node needs it, so it is only suggested.
    fields = {field: subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True,
                                    check=True).stdout for field in ("Depends", "Recommends", "Suggests")}
    assert "psycopg" not in fields["Depends"] + fields["Recommends"], fields
    assert "python3-psycopg " in fields["Suggests"] and "python3-psycopg-pool" in fields["Suggests"], fields

    version_line = subprocess.run(["/usr/bin/gpuguard", "--version"], capture_output=True, text=True)
    assert version_line.stdout.strip() == f"gpuguard {__version__}", version_line
    check = subprocess.run(["/usr/bin/gpuguard", "config", "check"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.startswith("/etc/gpuguard/gpuguard.toml: ok"), check
    # NVML's bindings are the vendored copy (Debian has none), and they load.
    pynvml = subprocess.run(["/usr/bin/python3", "-c", "import gpuguard.backends.nvml, pynvml; print(pynvml.__file__)"],
                            capture_output=True, text=True, cwd="/")
    assert pynvml.stdout.strip() == "/usr/lib/gpuguard/vendor/pynvml.py", pynvml
    # The web view's login helper (gpuguard-web-login@.service's ExecStart) imports on Debian's python3.
    helper = subprocess.run(["/usr/bin/python3", "-I", "-c", "import gpuguard.web.login_helper"], capture_output=True,
                            text=True, cwd="/")
    assert helper.returncode == 0, helper.stderr


def check_module_loads_by_name() -> None:
    """PAM finds the installed module by its bare name (the multiarch security directory): a
    `required` line fails the session when the module cannot be loaded."""
    service = Path("/etc/pam.d") / unique()
    service.write_text("auth required pam_permit.so\naccount required pam_permit.so\n"
                       "session required pam_gpuguard.so socket=/nonexistent/ggt.sock\n")
    try:
        result = subprocess.run(["pamtester", service.name, "root", "open_session", "close_session"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result
    finally:
        service.unlink()


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed (make build-deps)")
def test_lintian_finds_no_error_and_no_warning(debs) -> None:
    """What lintian still says (information tags only) is listed, with why, in docs/admin.md."""
    deb = next(iter(debs.values()))
    result = subprocess.run(["lintian", "--allow-root", "--fail-on", "error,warning", str(deb)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"^[EW]: ", result.stdout, re.MULTILINE), result.stdout


def web_view_ran() -> bool:
    """Make what enabling and running gpuguard-web.service leaves (no systemd as PID 1 here to do it);
    True where /var/lib/private was made for it."""
    WEB_WANTS.parent.mkdir(parents=True, exist_ok=True)
    WEB_WANTS.symlink_to("/usr/lib/systemd/system/gpuguard-web.service")
    made_private = not WEB_PRIVATE.exists()
    (WEB_PRIVATE / WEB_STATE.name).mkdir(mode=0o700, parents=True)
    if made_private:
        WEB_PRIVATE.chmod(0o700)
    (WEB_PRIVATE / WEB_STATE.name / "session.key").write_bytes(os.urandom(32))
    WEB_STATE.symlink_to(f"private/{WEB_STATE.name}")
    return made_private


def test_install_upgrade_purge_leaves_nothing(debs, sandbox, clean_machine) -> None:
    common_session = Path("/etc/pam.d/common-session").read_text()
    before = snapshot()
    (first, deb), (second, rebuilt) = debs.items()

    installed = dpkg("-i", str(deb))
    assert installed.returncode == 0, installed.stderr
    check_installed(deb, first)
    check_module_loads_by_name()
    assert pam_lines() == 0  # inert: the profile is registered, not on
    made_private = web_view_ran()

    # State the upgrade must keep: an admin's edit of a conffile, the store, the pinned gate, the
    # PAM profile turned on.
    quotas = Path("/etc/gpuguard/quotas.toml")
    quotas.write_text(quotas.read_text() + "\n[users.ggt-admin-edit]\ngpus = 2\n")
    state = Path("/var/lib/gpuguard/ggt-state")
    state.parent.mkdir(mode=0o700, exist_ok=True)
    state.write_text("grants\n")
    with gate_test_lock():
        enabled = subprocess.run(ENABLE, capture_output=True, text=True, timeout=120)
        attached = subprocess.run(["/usr/bin/gpuguard", "gate", "attach"], capture_output=True, text=True)
        try:
            assert enabled.returncode == 0, enabled.stderr
            assert attached.returncode == 0, attached.stderr

            upgraded = dpkg("-i", str(rebuilt))
            assert upgraded.returncode == 0, upgraded.stderr
            check_installed(rebuilt, second)
            assert "ggt-admin-edit" in quotas.read_text()
            assert state.read_text() == "grants\n"
            assert Gate("gpuguard").find(), "the upgrade detached the gate"
            assert pam_lines() == 1, "the upgrade turned the PAM profile off"
            assert {link: os.readlink(link) for link in LINKS} == {link: str(t) for link, t in LINKS.items()}

            removed = dpkg("--remove", "gpuguard")
            assert removed.returncode == 0, removed.stderr
        finally:
            gate = Gate("gpuguard")
            still_attached = gate.find()
            if still_attached:
                gate.detach()
        assert not still_attached, "removing the package left the gate attached"
    assert not (PIN_ROOT / "gpuguard").exists()
    assert pam_lines() == 0
    assert not [link for link in LINKS if os.path.lexists(link)]  # prerm ran `gpuguard disable`
    assert quotas.exists() and state.exists()  # remove keeps the configuration and the state

    assert (WEB_PRIVATE / WEB_STATE.name / "session.key").exists()  # remove keeps the web view's key

    purged = dpkg("--purge", "gpuguard")
    assert purged.returncode == 0, purged.stderr
    assert dpkg("-s", "gpuguard").returncode != 0
    assert Path("/etc/pam.d/common-session").read_text() == common_session
    # The web view's wants link, state and key are gone; /var/lib/private, systemd's for every
    # DynamicUser= service, stays (emptied, it is removed here where this test made it).
    assert not [path for path in (WEB_WANTS, WEB_STATE, WEB_PRIVATE / WEB_STATE.name) if os.path.lexists(path)]
    if made_private:
        WEB_PRIVATE.rmdir()
    assert snapshot() ^ before == set()


# --- inert until enabled

def nvidia_options() -> dict[str, str]:
    """The options modprobe would load the nvidia module with, from its whole configuration."""
    shown = subprocess.run(["modprobe", "--showconfig"], capture_output=True, text=True, check=True).stdout
    options: dict[str, str] = {}
    for line in shown.splitlines():
        words = line.split()
        if words[:2] == ["options", "nvidia"]:
            options.update(word.split("=", 1) for word in words[2:] if "=" in word)
    return options


def udev_runs_when_the_driver_loads() -> list[str]:
    """The RUN commands of the gpuguard rules udev reads (a file in /etc hides the same name further
    down) that match the nvidia module's "add" event."""
    event = {"ACTION": "add", "SUBSYSTEM": "module", "KERNEL": "nvidia", "DRIVER": ""}
    chosen: dict[str, Path] = {}
    for directory in UDEV_DIRS:
        for path in sorted(Path(directory).glob("*.rules")) if Path(directory).is_dir() else []:
            chosen.setdefault(path.name, path)
    runs = []
    for path in (p for name, p in sorted(chosen.items()) if "gpuguard" in name):
        for tokens in udev_rules(path):
            matches = [(key, op, value) for key, _, op, value in tokens if op in ("==", "!=")]
            if all(udev_matches(value, event.get(key, "")) == (op == "==") for key, op, value in matches):
                runs += [value for key, _, _, value in tokens if key == "RUN"]
    return runs


def load_driver(device_dir: Path, config_path: Path | None) -> list[str]:
    """The (simulated) nvidia driver loads again: the GPU nodes are gone (a reboot's fresh /dev),
    nvidia-modprobe makes them 0666 root:root unless told not to, and udev runs the matching RUN
    commands (with GPUGUARD_CONFIG naming the test's config). Returns those commands."""
    device_dir.mkdir(mode=0o755, exist_ok=True)
    for minor in range(GPUS):
        (device_dir / f"nvidia{minor}").unlink(missing_ok=True)
    if nvidia_options().get("NVreg_ModifyDeviceFiles") != "0":
        for minor in range(GPUS):
            os.mknod(device_dir / f"nvidia{minor}", stat.S_IFCHR | 0o666, os.makedev(195, minor))
            os.chmod(device_dir / f"nvidia{minor}", 0o666)
    runs = udev_runs_when_the_driver_loads()
    for command in runs:
        env = {**os.environ, "GPUGUARD_CONFIG": str(config_path)} if config_path else None
        ran = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60, env=env)
        assert ran.returncode == 0, (command, ran.stderr)
    return runs


def node_results(user, device_dir: Path) -> dict[int, str]:
    return {minor: open_result(user, device_dir / f"nvidia{minor}") for minor in range(GPUS)}


def test_install_is_inert_until_enable_and_disable_opens_the_gpus_again(
        debs, sandbox, clean_machine, start_daemon, make_user) -> None:
    before = snapshot()
    deb = next(iter(debs.values()))
    installed = dpkg("-i", str(deb))
    assert installed.returncode == 0, installed.stderr
    device_dir = sandbox / "dev"
    everyone = make_user()  # not in the GPU group

    # Installed, not enabled: the driver loads as if gpuguard were not there.
    assert "NVreg_ModifyDeviceFiles" not in nvidia_options()
    assert load_driver(device_dir, None) == []
    assert node_results(everyone, device_dir) == dict.fromkeys(range(GPUS), ALLOWED)
    assert pam_lines() == 0
    assert not Path("/etc/systemd/system/multi-user.target.wants/gpuguard.service").exists()

    # A fleet's node on Debian's python3 without the suggested psycopg: enable refuses, saying so.
    fleet = sandbox / "fleet.toml"
    fleet.write_text('[fleet]\ndatabase = "host=/nonexistent"\nnode = "ggt-node"\n')
    refused = subprocess.run(["/usr/bin/gpuguard", "--config", str(fleet), "enable"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == EXIT_CANNOT_START, refused
    assert "fleet: [fleet] is set but psycopg cannot be imported" in refused.stderr, refused.stderr
    assert "apt install python3-psycopg python3-psycopg-pool" in refused.stderr, refused.stderr
    assert pam_lines() == 0 and not [link for link in LINKS if os.path.lexists(link)]

    enabled = subprocess.run(ENABLE, capture_output=True, text=True, timeout=120)
    assert enabled.returncode == 0, enabled.stderr
    assert {link: os.readlink(link) for link in LINKS} == {link: str(t) for link, t in LINKS.items()}
    assert nvidia_options()["NVreg_ModifyDeviceFiles"] == "0"
    assert pam_lines() == 1
    session = Path("/etc/pam.d/common-session").read_text()
    assert session.index("pam_systemd.so") < session.index("pam_gpuguard.so")
    assert "pam_gpuguard" not in Path("/etc/pam.d/common-session-noninteractive").read_text()
    again = subprocess.run(ENABLE, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and pam_lines() == 1, again.stderr  # idempotent

    # Enabled: the daemon runs (here without systemd, started as the unit would: the test's own
    # daemon from this checkout, on the same device directory) and the driver's load closes every GPU
    # but the grants.
    d = start_daemon(count=GPUS)
    assert d.device_dir == device_dir
    member = d.add_member()
    (granted,) = d.open_session(member)["gpus"]
    assert load_driver(device_dir, d.config_path) == ["/usr/bin/gpuguard acl apply"]
    closed = node_results(everyone, device_dir)
    assert not [minor for minor, result in closed.items() if result == ALLOWED], closed
    mine = node_results(member, device_dir)
    assert [minor for minor, result in mine.items() if result == ALLOWED] == [granted], mine

    # Disabled: the daemon stopped (what `systemctl disable --now` does where systemd runs), then
    # everything undone, and the nodes open as the driver makes them, at once and after its next load.
    assert d.stop() == 0
    disabled = subprocess.run(["/usr/bin/gpuguard", "--config", str(d.config_path), "disable",
                               "--gate-name", d.gate_name], capture_output=True, text=True, timeout=120)
    assert disabled.returncode == 0, disabled.stderr
    assert not Gate(d.gate_name).find()
    assert not [link for link in LINKS if os.path.lexists(link)]
    assert pam_lines() == 0 and "NVreg_ModifyDeviceFiles" not in nvidia_options()
    assert node_results(everyone, device_dir) == dict.fromkeys(range(GPUS), ALLOWED)
    assert node_results(member, device_dir) == dict.fromkeys(range(GPUS), ALLOWED)
    assert load_driver(device_dir, d.config_path) == []
    assert node_results(everyone, device_dir) == dict.fromkeys(range(GPUS), ALLOWED)

    purged = dpkg("--purge", "gpuguard")
    assert purged.returncode == 0, purged.stderr
    assert snapshot() ^ before == set()


# --- a Python upgrade

def debian_pythons() -> list[str]:
    """The python3.N interpreters Debian packages installed here (they read dist-packages)."""
    owned = subprocess.run(["dpkg", "-S", "/usr/bin/python3.*"], capture_output=True, text=True).stdout
    return sorted({m for m in re.findall(r"(/usr/bin/python3\.\d+)$", owned, re.MULTILINE)})


def test_the_package_follows_the_distributions_python(debs, clean_machine) -> None:
    """A release upgrade replaces python3.N by python3.N+1: the package holds no file tied to one
    minor version and no upper bound on python3, and the hook dh_python3 installed recompiles its
    private modules when the default Python changes (python3-defaults runs it); every Debian
    python3.N on this machine runs it."""
    deb = next(iter(debs.values()))
    entries = package_entries(deb)
    assert not [p for p in entries if re.match(r"/usr/lib/python3\.\d+/", p)]
    depends = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True).stdout
    assert "python3:any" in depends and "<<" not in depends, depends
    installed = dpkg("-i", str(deb))
    assert installed.returncode == 0, installed.stderr
    pythons = debian_pythons()
    assert pythons, "no Debian python3.N here"
    default = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('python%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    hook = Path("/usr/share/python3/runtime.d/gpuguard.rtupdate")
    ran = subprocess.run([str(hook), "rtupdate", default, default], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    for python in pythons:
        version = subprocess.run([python, "-c", "import gpuguard.cli, gpuguard.backends.nvml, pynvml\n"
                                  "gpuguard.cli.build_parser(); print(gpuguard.__version__)"],
                                 capture_output=True, text=True, cwd="/", timeout=60)
        assert version.stdout.strip() == __version__, (python, version.stderr)
    dpkg("--purge", "gpuguard")


# --- upgrades from the packages released before

def apt_install(deb: Path, *options: str) -> subprocess.CompletedProcess:
    """What an admin runs (apt-get install ./gpuguard_*.deb; its Depends are here already, so no
    network), keeping an edited conffile as answering the prompt with N would, and waiting for
    another apt on this machine to finish."""
    return subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600",
                           "-o", "Dpkg::Options::=--force-confold", *options, str(deb)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def doctor_status() -> dict[str, str]:
    """The installed `gpuguard doctor`'s verdict per check (it exits 1 here: no NVIDIA driver)."""
    shown = subprocess.run(["/usr/bin/gpuguard", "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert shown.stdout, shown.stderr
    return {finding["check"]: finding["status"] for finding in json.loads(shown.stdout)}


def check_guarded(version: str, quotas: Path) -> None:
    """The host is as an enabled gpuguard leaves it, and as the admin left it: the driver's next
    load (kmod's and udev's real configuration) closes the GPUs, doctor agrees, the PAM line is
    there once, the gate attached, the edited conffile kept."""
    assert installed_version() == version
    first_layout = version == "0.1.0-1"
    program = "/opt/gpuguard/bin/gpuguard" if first_layout else "/usr/bin/gpuguard"
    assert nvidia_options().get("NVreg_ModifyDeviceFiles") == "0", version
    assert udev_runs_when_the_driver_loads() == [f"{program} acl apply"], version
    if first_layout:
        assert all(path.is_file() for path in FIRST_LAYOUT) and not [link for link in LINKS if os.path.lexists(link)]
    else:
        assert {link: os.readlink(link) for link in LINKS if os.path.lexists(link)} == {
            link: str(target) for link, target in LINKS.items()}, version
        assert not [path for path in FIRST_LAYOUT if os.path.lexists(path)]
    verdicts = doctor_status()
    assert (verdicts["udev"].lower(), verdicts["modprobe"].lower()) == ("ok", "warn"), verdicts  # warn: no nvidia here
    assert pam_lines() == 1, version
    assert Gate("gpuguard").find(), f"{version}: the gate is not attached"
    assert "ggt-admin-edit" in quotas.read_text(), version


@pytest.mark.parametrize("earlier", list(EARLIER))
def test_upgrade_from_an_earlier_package_keeps_gpuguard_in_effect(earlier, debs, earlier_debs, clean_machine) -> None:
    """apt-get install of this package over one released before, back again (a downgrade dpkg
    allows with --allow-downgrades) and up again: after each, everything `enable` turned on is in
    effect where kmod and udev read it, and the admin's edit and the gate are still there."""
    before = snapshot()
    common_session = Path("/etc/pam.d/common-session").read_text()
    old, new = earlier_debs[earlier], debs[VERSION]
    quotas = Path("/etc/gpuguard/quotas.toml")
    with gate_test_lock():
        try:
            if earlier == "0.1.0-1" and pam_seen():
                # A host that never had gpuguard: the remove of packages before 0.1.1 left the
                # profile seen (prerm's order); a run with the profile gone forgets it.
                forgot = subprocess.run(["pam-auth-update", "--package"], capture_output=True, text=True,
                                        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
                assert forgot.returncode == 0 and not pam_seen(), forgot.stderr
            installed = apt_install(old)
            assert installed.returncode == 0, installed.stdout + installed.stderr
            if earlier == "0.1.0-1":
                # The first layout was in effect once installed: its postinst's `pam-auth-update
                # --package` turned the profile (Default: yes, not seen before) on, and the
                # modprobe.d option and the udev rule lay where kmod and udev read them.
                assert pam_lines() == 1, installed.stdout + installed.stderr
            else:
                # 0.1.0's enable checks nothing (it has no --force): it enables on a host without a driver.
                enabled = subprocess.run(["/usr/bin/gpuguard", "enable"], capture_output=True, text=True, timeout=120)
                assert enabled.returncode == 0, enabled.stderr
            attached = subprocess.run(["/usr/bin/gpuguard", "gate", "attach"], capture_output=True, text=True)
            assert attached.returncode == 0, attached.stderr
            quotas.write_text(quotas.read_text() + "\n[users.ggt-admin-edit]\ngpus = 2\n")
            check_guarded(earlier, quotas)

            upgraded = apt_install(new)
            assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
            assert "downgrade" not in upgraded.stdout.lower(), upgraded.stdout
            check_installed(new, VERSION)
            check_guarded(VERSION, quotas)

            downgraded = apt_install(old, "--allow-downgrades")
            assert downgraded.returncode == 0, downgraded.stdout + downgraded.stderr
            check_guarded(earlier, quotas)

            again = apt_install(new)
            assert again.returncode == 0, again.stdout + again.stderr
            check_guarded(VERSION, quotas)

            removed = dpkg("--remove", "gpuguard")
            assert removed.returncode == 0, removed.stderr
            assert not Gate("gpuguard").find() and pam_lines() == 0
        finally:
            if Gate("gpuguard").find():
                Gate("gpuguard").detach()
    purged = dpkg("--purge", "gpuguard")
    assert purged.returncode == 0, purged.stderr
    assert Path("/etc/pam.d/common-session").read_text() == common_session
    assert not pam_seen(), "the remove left the profile seen: a later install would not turn it on"
    assert snapshot() ^ before == set()
