"""What this host says about Slurm: a slurmd running, its gres.conf, and `scontrol show node`.

Gathered for gpuguard.core.coexist, which decides. gres.conf decides which GPUs gpuguard leaves
alone, so only a file root alone can change is believed (and the files it includes): a gres.conf
another user can write would let them open every GPU. A slurmd is counted only when root runs it
(Slurm's SlurmdUser is root): any user can name a process slurmd. scontrol asks slurmctld over the
network, which the systemd unit does not allow by default (IPAddressAllow=localhost): it is a
cross-check, bounded by SCONTROL_TIMEOUT, and without an answer gres.conf alone decides.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
from collections.abc import Collection
from pathlib import Path

from gpuguard.backends import procfs
from gpuguard.config import CoexistConfig
from gpuguard.core import coexist, gres
from gpuguard.core.coexist import Ownership, SlurmFacts

SLURMD = "slurmd"
SCONTROL_TIMEOUT = 5.0  # seconds; slurmctld answers in milliseconds when it is reachable at all
MAX_GRES_BYTES = 1 << 20  # a gres.conf is a few lines; more is not one


def ownership(config: CoexistConfig, present: Collection[int], ask_scontrol: bool = True) -> Ownership:
    """Who owns which of the `present` GPU minors (coexist.decide on this host's facts). Raises CoexistError."""
    facts = gather(config, ask_scontrol) if config.slurm in (None, "auto") else None
    return coexist.decide(config, facts, present)


def gather(config: CoexistConfig, ask_scontrol: bool = True) -> SlurmFacts:
    """The facts coexist.decide needs for `slurm = "auto"` or unset (scontrol only with ask_scontrol)."""
    node = config.slurm_node or socket.gethostname().split(".", 1)[0]
    present = config.gres_conf.exists()
    node_gpus, error = None, None
    if present and config.slurm is not None:
        try:
            node_gpus = gres.node_gpus(read_gres_conf(config.gres_conf), node)
        except gres.GresError as exc:
            error = str(exc)
    return SlurmFacts(node=node, slurmd_running=slurmd_running(), gres_conf_present=present, gres=node_gpus,
                      gres_error=error,
                      scontrol_gpus=scontrol_gpus(node) if ask_scontrol and config.slurm == "auto" else None)


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


def slurmd_running() -> bool:
    """Whether a process named slurmd runs as root."""
    for entry in os.scandir(procfs.PROC):
        if entry.name.isdigit() and procfs.comm(int(entry.name)) == SLURMD:
            try:
                if entry.stat().st_uid == 0:
                    return True
            except FileNotFoundError:
                continue  # exited meanwhile
    return False


def scontrol_gpus(node: str) -> int | None:
    """GPUs `scontrol show node NODE` gives this node; None when scontrol is absent, fails (no
    controller, not a node) or says something else."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        # A session of its own: on timeout its whole process group goes, so no child of it keeps
        # the pipe open and the wait really ends at SCONTROL_TIMEOUT.
        proc = subprocess.Popen([scontrol, "show", "node", node], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    except OSError:
        return None
    try:
        output, _ = proc.communicate(timeout=SCONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    if proc.returncode != 0:
        return None
    try:
        return gres.scontrol_gpu_count(output)
    except gres.GresError:
        return None
