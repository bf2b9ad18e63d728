"""Can the daemon start on this host? What `gpuguard enable` asks before it changes anything.

Enabling where the daemon cannot start puts the module into every login and leaves the unit
failing at each start, so enable refuses unless forced. The verdicts on NVML (it loads and the
GPUs answer), cgroup v2, bpf() and Slurm are doctor's own (core/doctor.py), over the facts
`gpuguard doctor` gathers through the daemon's own backends, so enable and doctor never disagree;
bpffs, which doctor does not judge, is judged here. Pure: cli/enable_cmd.py gathers the facts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuguard.core import doctor

# LSB's "program is not installed": what the daemon needs is missing here (the driver, most
# often). Not 1, so that a script (or a test) tells a refusal, where nothing changed, from a
# step that failed halfway.
EXIT_CANNOT_START = 5

NEEDED: Sequence[Callable[[doctor.Facts], doctor.Finding]] = (
    doctor.check_nvml, doctor.check_cgroup, doctor.check_bpf, doctor.check_coexist)


def check_bpffs(mode: str, mounted: bool, supported: bool) -> doctor.Finding:
    """The gate pins its program in bpffs at /sys/fs/bpf; the daemon (or the unit) mounts it when
    it is missing, so only a kernel without the file system fails."""
    if mode == "acl":
        return doctor.Finding("bpffs", doctor.OK, "not used (access.mode = acl)")
    if mounted:
        return doctor.Finding("bpffs", doctor.OK, "mounted at /sys/fs/bpf")
    if supported:
        return doctor.Finding("bpffs", doctor.OK, "not mounted: the daemon mounts it at /sys/fs/bpf at start")
    return doctor.Finding("bpffs", doctor.FAIL, "the kernel has no bpf file system: the gate cannot pin its program",
                          "a kernel with CONFIG_BPF_SYSCALL (Linux 5.3+), or set access.mode = \"acl\"")


def blockers(facts: doctor.Facts, bpffs: doctor.Finding) -> list[doctor.Finding]:
    """What stops the daemon from starting; empty: it can."""
    return [finding for finding in (*(check(facts) for check in NEEDED), bpffs) if finding.status == doctor.FAIL]


def reasons(found: Sequence[doctor.Finding]) -> str:
    """The blockers in one line, each with its fix."""
    return "; ".join(f"{finding.check}: {finding.detail} (fix: {finding.fix})" for finding in found)
