"""What this host says about Slurm: a slurmd running, its gres.conf, and `scontrol show node`.

Gathered for gpuguard.core.coexist, which decides. gres.conf decides which GPUs gpuguard leaves
alone, so only a file root alone can change is believed (and the files it includes): a gres.conf
another user can write would let them open every GPU. A slurmd is counted only when root runs it
(Slurm's SlurmdUser is root): any user can name a process slurmd. scontrol asks slurmctld over the
network, which the systemd unit does not allow by default (IPAddressAllow=localhost): it is a
cross-check, bounded by SCONTROL_TIMEOUT, and without an answer gres.conf alone decides.

Which gres.conf: the one coexist.gres_conf names when the admin set it; at its default, the one
slurmd itself reads. A slurmd started with `--conf-server` (or with no slurm.conf of its own: DNS
SRV) is configless: it fetches slurm.conf and gres.conf from slurmctld into SlurmdSpoolDir/conf-cache
and points the symlink /run/slurm/conf there (Slurm 20.02 and later; Debian 12 ships 22.05), so that
cache is read: /run/slurm/conf first, then the SlurmdSpoolDir `scontrol show config` names, then
Slurm's default spool directory (a gpuguard started before slurmd at boot finds the cache there).
A file found this way is believed only when every directory on its way is root's alone too.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from gpuguard.backends import procfs
from gpuguard.config import CoexistConfig
from gpuguard.core import coexist, gres
from gpuguard.core.coexist import Ownership, SlurmFacts

SLURMD = "slurmd"
SCONTROL_TIMEOUT = 5.0  # seconds; slurmctld answers in milliseconds when it is reachable at all
MAX_GRES_BYTES = 1 << 20  # a gres.conf is a few lines; more is not one
DEFAULT_GRES_CONF = CoexistConfig().gres_conf  # at this value, slurmd's own gres.conf is looked for
DEFAULT_SLURM_CONF = Path("/etc/slurm/slurm.conf")  # where slurmd reads slurm.conf without -f or SLURM_CONF
RUN_CONF = Path("/run/slurm/conf")  # a configless slurmd's symlink to its cache
DEFAULT_SPOOL = Path("/var/spool/slurmd")  # Slurm's default SlurmdSpoolDir (Debian's build too)
CONF_CACHE = "conf-cache"
MAX_LINKS = 40  # symlinks followed on the way to a gres.conf, as the kernel's limit


@dataclass(frozen=True)
class Slurmd:
    """A root slurmd's command line, as far as where its config comes from."""

    conf_server: str | None = None  # --conf-server HOST[:PORT]: configless
    conf_file: str | None = None    # -f FILE, else SLURM_CONF in its environment
    node: str | None = None         # -N NAME: its NodeName

    def configless(self) -> bool:
        """Whether it fetches its config from slurmctld (Slurm's own precedence: --conf-server, else a
        slurm.conf from -f, SLURM_CONF or the default path, else DNS SRV records)."""
        return self.conf_server is not None or (self.conf_file is None and not DEFAULT_SLURM_CONF.exists())


def ownership(config: CoexistConfig, present: Collection[int], ask_scontrol: bool = True) -> Ownership:
    """Who owns which of the `present` GPU minors (coexist.decide on this host's facts). Raises CoexistError."""
    facts = gather(config, ask_scontrol) if config.slurm in (None, "auto") else None
    return coexist.decide(config, facts, present)


def gather(config: CoexistConfig, ask_scontrol: bool = True) -> SlurmFacts:
    """The facts coexist.decide needs for `slurm = "auto"` or unset (scontrol only with ask_scontrol)."""
    daemon = slurmd()
    node = config.slurm_node or (daemon.node if daemon else None) or socket.gethostname().split(".", 1)[0]
    asked = ask_scontrol and config.slurm == "auto"
    path, trusted_dirs = locate_gres_conf(config, daemon, node, ask_scontrol)
    present = path.exists()
    node_gpus, error = None, None
    if present and config.slurm is not None:
        try:
            if not trusted_dirs:
                _check_directories(path)
            node_gpus = gres.node_gpus(read_gres_conf(path), node)
        except gres.GresError as exc:
            error = str(exc)
    return SlurmFacts(node=node, slurmd_running=daemon is not None, gres_conf_present=present, gres=node_gpus,
                      gres_error=error, scontrol_gpus=scontrol_gpus(node) if asked else None,
                      gres_conf=str(path))


def locate_gres_conf(config: CoexistConfig, daemon: Slurmd | None, node: str, ask_scontrol: bool) -> tuple[Path, bool]:
    """The gres.conf slurmd reads, and whether it is one the admin placed (its directories not checked):
    coexist.gres_conf when set; else beside the slurm.conf of a slurmd that reads one (without a slurmd,
    /etc/slurm/gres.conf); where that has none (configless, or a slurm.conf with only SlurmctldHost),
    the first configless cache that has one. When none has one: the first place looked (absent)."""
    if config.gres_conf != DEFAULT_GRES_CONF:
        return config.gres_conf, True
    local = None
    if daemon is None:
        local = config.gres_conf
    elif not daemon.configless():
        local = Path(daemon.conf_file or DEFAULT_SLURM_CONF).parent / "gres.conf"
    if local is not None and local.exists():
        return local, True
    caches = [RUN_CONF]
    # slurmctld is asked only where a slurmd runs and its symlink is not there (a host merely with scontrol waits on nothing)
    if ask_scontrol and daemon is not None and not (RUN_CONF / "gres.conf").exists() \
            and (spool := scontrol_spool_dir(node)) is not None:
        caches.append(spool / CONF_CACHE)
    caches.append(DEFAULT_SPOOL / CONF_CACHE)
    found = next((cache / "gres.conf" for cache in caches if (cache / "gres.conf").exists()), None)
    if found is not None:
        return found, False
    return (local, True) if local is not None else (caches[0] / "gres.conf", False)


def slurmd() -> Slurmd | None:
    """The command line of a root process named slurmd; None when there is none."""
    for entry in os.scandir(procfs.PROC):
        if not entry.name.isdigit() or procfs.comm(int(entry.name)) != SLURMD:
            continue
        try:
            if entry.stat().st_uid != 0:
                continue
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile (or not root's to read: not believed)
        return _parse_slurmd([arg.decode(errors="replace") for arg in argv[1:] if arg],
                             {key: value for key, _, value in (item.decode(errors="replace").partition("=")
                                                               for item in environ if item)})
    return None


def _parse_slurmd(args: list[str], environ: dict[str, str]) -> Slurmd:
    """slurmd's options that say where its config comes from (slurmd(8)); the rest are skipped."""
    found: dict[str, str] = {}
    options = {"--conf-server": "conf_server", "-f": "conf_file", "-N": "node"}
    words = iter(args)
    for word in words:
        name, equals, value = word.partition("=")
        if name in options and equals:
            found[options[name]] = value
        elif word in options:
            found[options[word]] = next(words, "")
        elif word[:2] in ("-f", "-N") and len(word) > 2:  # getopt's -fFILE, -NNAME
            found[options[word[:2]]] = word[2:]
    conf_file = found.get("conf_file") or environ.get("SLURM_CONF") or None
    return Slurmd(conf_server=found.get("conf_server"), conf_file=conf_file, node=found.get("node") or None)


def _check_directories(path: Path) -> None:
    """Raise GresError unless every directory the kernel walks to reach `path` (symlinks followed) is
    root's and writable by root alone, or sticky with a root-owned entry (as /tmp)."""
    parts, current, links = list(path.parent.parts[1:]), Path("/"), 0
    _check_directory(current, None)
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        step = current / name
        try:
            st = os.lstat(step)
        except OSError as exc:
            raise gres.GresError(f"cannot read {step}: {exc.strerror or exc}") from None
        _check_directory(current, st)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise gres.GresError(f"{path}: too many symlinks on the way")
            target = Path(os.readlink(step))
            if target.is_absolute():
                current = Path("/")
                parts = list(target.parts[1:]) + parts
            else:
                parts = list(target.parts) + parts
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise gres.GresError(f"{step} is not a directory")
        current = step
    _check_directory(current, None)


def _check_directory(directory: Path, entry: os.stat_result | None) -> None:
    """`directory` root's alone, or sticky with `entry` (the next step in it) root's."""
    st = os.stat(directory)
    writable = st.st_mode & 0o022
    if st.st_uid == 0 and (not writable or (st.st_mode & stat.S_ISVTX and (entry is None or entry.st_uid == 0))):
        return
    raise gres.GresError(f"{directory}: not believed: a directory on the way to Slurm's gres.conf must be root's and "
                         f"writable by root alone (it is {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")


def read_gres_conf(path: Path) -> list[gres.GresLine]:
    """gres.conf's lines, Include files read in place (relative ones next to it, as Slurm does).
    Raises GresError (one line) for a file that cannot be read, is not root's alone, or is malformed."""
    def read(name: str) -> str:
        included = Path(name) if Path(name).is_absolute() else path.parent / name
        return _read_trusted(included)
    try:
        text = _read_trusted(path)
    except OSError as exc:
        raise gres.GresError(f"cannot read {path}: {exc.strerror or exc}") from None
    return gres.parse_gres_conf(text, str(path), read)


def _read_trusted(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise gres.GresError(f"{path}: not believed: it must be a file of root's that only root can write "
                                 f"(it is {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")
        data = os.read(fd, MAX_GRES_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_GRES_BYTES:
        raise gres.GresError(f"{path}: larger than {MAX_GRES_BYTES} bytes: not a gres.conf")
    return data.decode(errors="replace")


def scontrol_gpus(node: str) -> int | None:
    """GPUs `scontrol show node NODE` gives this node; None when scontrol is absent, fails (no
    controller, not a node) or says something else."""
    output = _scontrol("show", "node", node)
    if output is None:
        return None
    try:
        return gres.scontrol_gpu_count(output)
    except gres.GresError:
        return None


def scontrol_spool_dir(node: str) -> Path | None:
    """SlurmdSpoolDir as `scontrol show config` gives it (`%n` and `%h` as slurmd replaces them);
    None without an answer or an absolute path there."""
    output = _scontrol("show", "config")
    if output is None:
        return None
    for line in output.splitlines():
        key, equals, value = line.partition("=")
        if equals and key.strip() == "SlurmdSpoolDir":
            spool = value.strip().replace("%n", node).replace("%h", socket.gethostname())
            return Path(spool) if spool.startswith("/") else None
    return None


def _scontrol(*args: str) -> str | None:
    """scontrol's output, or None when it is absent, fails or takes longer than SCONTROL_TIMEOUT."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        # A session of its own: on timeout its whole process group goes, so no child of it keeps
        # the pipe open and the wait really ends at SCONTROL_TIMEOUT.
        proc = subprocess.Popen([scontrol, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    except OSError:
        return None
    try:
        output, _ = proc.communicate(timeout=SCONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return output if proc.returncode == 0 else None
