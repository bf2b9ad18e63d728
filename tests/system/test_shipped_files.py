"""The files gpuguard ships for a real server, parsed as the programs that read them would.

- udev/70-gpuguard.rules: GPU nodes 0660 root:root, never TAG "uaccess" (udev's uaccess builtin
  would rewrite their ACLs and flush gpuguard's grants), RUN commands that gpuguard accepts;
- etc/modprobe.d/gpuguard.conf: NVreg_ModifyDeviceFiles=0 for the nvidia module;
- etc/gpuguard.toml: passes `gpuguard config check`;
- etc/gpuguard.service: Type=notify, ExecStart runs `gpuguard daemon` where the package puts gpuguard
  (`make install` names its own), Documentation= names the man pages, and `systemd-analyze verify`
  has nothing to say (when systemd-analyze is there);
- pam/: `make -C pam install` with DESTDIR installs the module and the pam-auth-update profile
  into the staging directory and nowhere else.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, REPO
from deb_lock import package_lock
from sim_helpers import cli

from gpuguard.cli import build_parser

RULES = REPO / "udev" / "70-gpuguard.rules"
MODPROBE = REPO / "etc" / "modprobe.d" / "gpuguard.conf"
CONFIG = REPO / "etc" / "gpuguard.toml"
UNIT = REPO / "etc" / "gpuguard.service"
PAM = REPO / "pam"

# --- udev rules

# KEY{attr}<op>"value", the pieces of a rule line (man udev); values may hold escaped quotes.
_UDEV_TOKEN = re.compile(r'\s*([A-Z_]+)(?:\{([^}]*)\})?\s*(==|!=|\+=|-=|:=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UDEV_MATCH_OPS = ("==", "!=")


def udev_rules(path: Path) -> list[list[tuple[str, str | None, str, str]]]:
    """Each rule as its (key, attribute, operator, value) tokens; a line that does not parse fails."""
    rules, pending = [], ""
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = pending + raw.strip()
        if line.endswith("\\"):  # continued on the next line
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith("#"):
            continue
        tokens, position = [], 0
        while position < len(line):
            token = _UDEV_TOKEN.match(line, position)
            assert token and token.end() > position, f"{path}:{number}: cannot parse {line[position:]!r}"
            tokens.append(token.groups())
            position = token.end()
        rules.append(tokens)
    assert not pending, f"{path}: ends in a continuation"
    return rules


def udev_matches(pattern: str, name: str) -> bool:
    """udev's glob: shell patterns, '|' between alternatives."""
    return any(fnmatch.fnmatchcase(name, alternative) for alternative in pattern.split("|"))


def rules_for_node(rules, name: str) -> list[dict[str, str]]:
    """Assignments of every rule that applies to a device node called `name` whatever the event
    (rules whose only match is KERNEL==)."""
    applied = []
    for tokens in rules:
        matches = [(key, op, value) for key, _, op, value in tokens if op in _UDEV_MATCH_OPS]
        if matches and all(key == "KERNEL" and op == "==" for key, op, _ in matches) \
                and all(udev_matches(value, name) for _, _, value in matches):
            applied.append({key: value for key, _, op, value in tokens if op not in _UDEV_MATCH_OPS})
    return applied


# Where the Debian package puts the command (dh_python3's entry point), as the unit and the udev rule name it.
INSTALLED_GPUGUARD = "/usr/bin/gpuguard"


def installed_gpuguard() -> str:
    return INSTALLED_GPUGUARD


def appdir_gpuguard() -> str:
    """The gpuguard command of `make install`: in the application's venv (the Makefile's APPDIR)."""
    appdirs = re.findall(r"^APPDIR\s*\?=\s*(\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert len(appdirs) == 1, appdirs
    return f"{appdirs[0]}/bin/gpuguard"


def test_udev_rules_keep_gpu_nodes_to_root_and_grantees() -> None:
    rules = udev_rules(RULES)
    for name in ("nvidia0", "nvidia7", "nvidia253", "nvidia-cap1", "nvidia-cap130"):
        assert rules_for_node(rules, name) == [{"OWNER": "root", "GROUP": "root", "MODE": "0660"}], name
    # The shared control nodes stay as the driver makes them (0666): CUDA opens them for any GPU.
    for name in ("nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"):
        assert rules_for_node(rules, name) == [], name


def test_udev_rules_never_tag_uaccess() -> None:
    text = RULES.read_text()
    assert "uaccess" in text  # the comment that explains why not: the search below is not vacuous
    for tokens in udev_rules(RULES):
        for key, attribute, _, value in tokens:
            assert not (key == "TAG" and "uaccess" in value.split()), tokens
            assert not (key in ("RUN", "IMPORT") and attribute == "builtin" and "uaccess" in value), tokens


def test_udev_runs_a_gpuguard_command_that_exists() -> None:
    runs = [value for tokens in udev_rules(RULES) for key, _, op, value in tokens if key == "RUN"]
    assert runs, "the rules make gpuguard re-apply node modes when the driver loads"
    for command in runs:
        program, *args = shlex.split(command)
        assert program == installed_gpuguard()
        assert build_parser().parse_args(args).func  # e.g. `acl apply`: a real command


# --- modprobe.d

def modprobe_options(path: Path) -> dict[str, dict[str, str]]:
    """`options MODULE key=value...` lines (man modprobe.d), later lines winning."""
    options: dict[str, dict[str, str]] = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        assert words[0] in ("alias", "blacklist", "install", "options", "remove", "softdep"), line
        if words[0] == "options":
            for pair in words[2:]:
                key, equals, value = pair.partition("=")
                assert equals, line
                options.setdefault(words[1], {})[key] = value
    return options


def test_modprobe_stops_nvidia_modprobe_from_touching_the_nodes() -> None:
    assert modprobe_options(MODPROBE)["nvidia"]["NVreg_ModifyDeviceFiles"] == "0"


# --- the example configuration

def test_shipped_config_passes_config_check() -> None:
    result = cli(None, "config", "check", str(CONFIG))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{CONFIG}: ok"), result.stdout


# --- the systemd unit

def unit_sections(path: Path) -> dict[str, list[tuple[str, str]]]:
    """[Section] -> (key, value) in order (keys may repeat), as systemd reads a unit file."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current, pending = None, ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        if line.startswith(("#", ";")) or not line:
            pending = ""
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.startswith("["):
            assert line.endswith("]"), line
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, equals, value = line.partition("=")
        assert current is not None and equals, line
        sections[current].append((key.strip(), value.strip()))
    return sections


def setting(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = [value for k, value in sections[section] if k == key]
    assert len(values) == 1, (section, key, values)
    return values[0]


def test_unit_is_type_notify_and_runs_the_installed_daemon() -> None:
    sections = unit_sections(UNIT)
    assert setting(sections, "Service", "Type") == "notify"
    program, *args = shlex.split(setting(sections, "Service", "ExecStart"))
    assert program == installed_gpuguard()
    assert args[:1] == ["daemon"] and build_parser().parse_args(args).func
    assert setting(sections, "Install", "WantedBy") == "multi-user.target"
    # `man gpuguard`, `systemctl help gpuguard`: the admin's page first, then the configuration's and the module's.
    documentation = setting(sections, "Unit", "Documentation").split()
    assert documentation[:3] == ["man:gpuguard(8)", "man:gpuguard.toml(5)", "man:pam_gpuguard(8)"], documentation


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_has_nothing_to_say(sandbox) -> None:
    """verify also checks that ExecStart's program exists, and that `man` finds each man: page of
    Documentation=: the copy it reads runs this checkout's gpuguard instead of the package's
    (test_unit_is_type_notify_and_runs_the_installed_daemon checks that path), and MANPATH holds
    the pages packaging/manpages.py makes."""
    unit = sandbox / UNIT.name  # verify loads the unit from a directory of its own
    unit.write_text(UNIT.read_text().replace(installed_gpuguard(), str(BIN / "gpuguard")))
    built = sandbox / "built"
    subprocess.run([str(BIN / "python"), str(REPO / "packaging/manpages.py"), str(built)], check=True,
                   env={"PYTHONPATH": str(REPO)}, timeout=120)
    for page in built.iterdir():
        section = sandbox / "man" / f"man{page.suffix[1:]}"
        section.mkdir(parents=True, exist_ok=True)
        page.rename(section / page.name)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MANPATH": str(sandbox / "man")})
    # verify exits 0 even on unknown keys or bad values: any message at all is a finding.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), result


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_security_rates_the_unit_below_5(sandbox) -> None:
    unit = sandbox / UNIT.name
    shutil.copy(UNIT, unit)
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                            capture_output=True, text=True, timeout=120)
    level = re.search(r"Overall exposure level for gpuguard\.service: ([0-9.]+)", result.stdout)
    assert level, result
    assert float(level[1]) < 5.0, result.stdout


# --- make -C pam install

def tree(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under path: (mode, size, mtime_ns); {} if it does not exist."""
    if not path.exists():
        return {}
    entries = {}
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            st = os.lstat(os.path.join(root, name))
            entries[os.path.relpath(os.path.join(root, name), path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return entries


def system_pam_dirs() -> list[Path]:
    """Where the module and the profile would land without DESTDIR."""
    found: set[Path] = set()
    for pattern in ("/lib/*/security", "/usr/lib/*/security", "/lib/security", "/usr/lib/security",
                    "/lib64/security", "/usr/lib64/security"):
        found.update(Path("/").glob(pattern.lstrip("/")))
    return sorted(found) + [Path("/lib/security"), Path("/usr/share/pam-configs")]


@pytest.fixture
def no_package_install() -> Iterator[None]:
    """test_deb installs the package into the directories these tests watch: not meanwhile."""
    with package_lock():
        yield


def test_pam_install_stays_inside_destdir(sandbox, pam_module, no_package_install) -> None:
    stage = sandbox / "stage"
    pamdir = "/lib/security"
    before = {path: tree(path) for path in system_pam_dirs()}
    make = ["make", "-s", "-C", str(PAM), f"PAMDIR={pamdir}", f"DESTDIR={stage}"]

    result = subprocess.run([*make, "install"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    module = stage / pamdir.lstrip("/") / "pam_gpuguard.so"
    profile = stage / "usr/share/pam-configs/gpuguard"
    staged = {module: pam_module, profile: PAM / "gpuguard"}  # a staged install carries the profile
    assert sorted(p for p in stage.rglob("*") if p.is_file()) == sorted(staged)
    for installed, source in staged.items():
        st = installed.stat()
        assert stat.S_IMODE(st.st_mode) == 0o644 and (st.st_uid, st.st_gid) == (0, 0)
        assert installed.read_bytes() == source.read_bytes()
    # The profile names the module that was installed.
    fields = re.findall(r"^Session:\n((?:\s.*\n)+)", profile.read_text(), re.MULTILINE)
    assert [line.split() for line in fields[0].splitlines()] == [["optional", module.name]]

    result = subprocess.run([*make, "uninstall"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not [p for p in stage.rglob("*") if p.is_file()]
    assert {path: tree(path) for path in system_pam_dirs()} == before  # nothing outside the stage


# --- make install / make uninstall (distributions without the Debian package)

def test_make_install_honours_destdir_and_prefix_and_uninstall_keeps_the_configuration(sandbox, no_package_install) -> None:
    stage = sandbox / "stage"
    watched = [Path(p) for p in ("/opt", "/usr/local/bin", "/usr/lib/systemd/system", "/usr/lib/gpuguard",
                                 "/usr/lib/udev/rules.d", "/usr/lib/modprobe.d", "/etc/gpuguard")] + system_pam_dirs()
    # The man pages and the completion, by name (apt may add others to those directories meanwhile).
    pages = ["man1/gpuguard.1", "man8/gpuguard.8", "man8/pam_gpuguard.8", "man5/gpuguard.toml.5"]
    outside = [p for p in [*(Path("/usr/share/man") / page for page in pages),
                           Path("/usr/share/bash-completion/completions/gpuguard")] if not p.exists()]
    before = {path: tree(path) for path in watched}
    make = ["make", "-s", "-C", str(REPO), f"DESTDIR={stage}", "PREFIX=/usr"]

    result = subprocess.run([*make, "install"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert os.readlink(stage / "usr/bin/gpuguard") == appdir_gpuguard()
    # The unit and the rule name this install's gpuguard; the modprobe option and the rule lie inert
    # where `gpuguard enable` links them from.
    for path, source in [("usr/lib/systemd/system/gpuguard.service", UNIT),
                         ("usr/lib/systemd/system/gpuguard-web.service", REPO / "etc/gpuguard-web.service"),
                         ("etc/pam.d/gpuguard-web", REPO / "etc/pam.d/gpuguard-web"),
                         ("usr/lib/gpuguard/udev/70-gpuguard.rules", RULES),
                         ("usr/lib/gpuguard/modprobe.d/gpuguard.conf", MODPROBE), ("etc/gpuguard/gpuguard.toml", CONFIG)]:
        assert (stage / path).read_text() == source.read_text().replace(installed_gpuguard(), appdir_gpuguard()), path
        assert stat.S_IMODE((stage / path).stat().st_mode) == 0o644, path
    assert not (stage / "usr/lib/udev").exists() and not (stage / "usr/lib/modprobe.d").exists()
    assert list(stage.rglob("pam_gpuguard.so")) and (stage / "usr/share/pam-configs/gpuguard").is_file()
    # The man pages and the bash completion under PREFIX, generated (packaging/manpages.py).
    for page in pages:
        name, section = page.split("/")[1].rsplit(".", 1)
        assert (stage / "usr/share/man" / page).read_text().startswith(f".TH {name.upper()} {section} "), page
    assert "_shtab_gpuguard" in (stage / "usr/share/bash-completion/completions/gpuguard").read_text()
    # The application's venv runs from the stage (its interpreter is the system's), and names only
    # where it will be installed: nothing refers to the stage.
    venv_python = stage / appdir_gpuguard().lstrip("/").replace("bin/gpuguard", "bin/python")
    version = subprocess.run([str(venv_python), "-m", "gpuguard", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("gpuguard "), version
    leaks = subprocess.run(["grep", "-rlF", str(stage), str(stage)], capture_output=True, text=True)
    assert leaks.stdout == "", leaks.stdout
    # No test tool was installed with it (pamtester, sshd, the compiler are `make deps`' business).
    assert not [p for p in stage.rglob("*") if p.name in ("pamtester", "sshd", "pytest")]

    # An admin's edit survives a reinstall; uninstall leaves only the configuration.
    (stage / "etc/gpuguard/quotas.toml").write_text("# ggt edited\n")
    assert subprocess.run([*make, "install"], capture_output=True, timeout=600).returncode == 0
    assert (stage / "etc/gpuguard/quotas.toml").read_text() == "# ggt edited\n"
    result = subprocess.run([*make, "uninstall"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.is_file()) == \
        ["etc/gpuguard/gpuguard.toml", "etc/gpuguard/quotas.toml", "etc/pam.d/gpuguard-web"]
    assert {path: tree(path) for path in watched} == before  # nothing outside the stage
    assert not [p for p in outside if p.exists()]
