"""`gpuguard doctor`'s judgement: pure checks over facts gathered by cli/doctor_cmd.py.

Each check reads `Facts` and returns one `Finding`: ok, warn or fail, what was seen, and for
anything not ok the command or edit that fixes it. Nothing here touches the system, so every
verdict is tested on made-up facts (tests/unit/test_doctor_checks.py) and on the real thing
(tests/system/test_doctor.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuguard.core.messages import unit_list

OK, WARN, FAIL = "ok", "warn", "FAIL"
MODULE = "pam_gpuguard.so"
PERSISTENCED = "nvidia-persistenced"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str       # OK, WARN or FAIL
    detail: str       # what was seen
    fix: str = ""     # what to do (not for OK)


@dataclass(frozen=True)
class Node:
    """A GPU device node as found (exists False: missing, the rest unset)."""
    path: str
    exists: bool
    is_char: bool = False
    mode: int = 0
    uid: int = 0
    gid: int = 0
    acl_users: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Facts:
    backend: str                                     # "nvml" or "simulated"
    mode: str                                        # access.mode: "gate" or "acl"
    cgroup2: str | None                              # mount point of cgroup v2, None: none
    bpf_error: str | None                            # None: bpf() answered a query on the cgroup root
    gate_name: str
    gate: Mapping[str, Any] | None                             # Gate.status(); None when it could not be read
    gate_current: bool | None                        # program built for today's managed devices
    gate_error: str | None
    gpus: Sequence[tuple[int, str]] | None           # NVML's (minor, name); None: NVML failed
    nvml_error: str | None
    driver_minors: Sequence[int]                     # GPUs the driver has (/proc/driver/nvidia/gpus)
    nodes: Mapping[int, Node]                        # minor -> its node in device_dir
    modify_device_files: str | None                  # /sys/module/nvidia/parameters/ModifyDeviceFiles
    modprobe_option: bool                            # a modprobe.d file sets NVreg_ModifyDeviceFiles=0
    pam_service: str
    pam_session: Sequence[str] | None                # the service's session lines in order (module, then its
                                                     # arguments), includes followed; None: no file
    pam_module_found: bool                           # pam_gpuguard.so exists where the stack names it
    udev_rules: Sequence[str]                        # rule files that RUN gpuguard acl apply
    persistenced_uid: int | None                     # None: no such account
    exempt_uids: frozenset[int]                      # what the config makes exempt now
    daemon: Mapping[str, Any] | None                           # the daemon's status reply (as root)
    daemon_error: str | None
    slurm: str | None                                # what shows Slurm is installed, None: nothing
    slurm_setting: str | None = None                 # coexist.slurm as written; None: not set
    owners: str = ""                                 # who owns which GPU (coexist.Ownership.summary())
    owners_error: str | None = None                  # why that cannot be decided (the daemon refuses to start)
    foreign: frozenset[int] = frozenset()            # GPUs Slurm or Kubernetes own: their nodes are theirs
    fleet: Mapping[str, Any] | None = None           # the daemon's fleet_status reply; None: no [fleet], or unasked
    fleet_error: str | None = None                   # why it could not be asked


def check_cgroup(f: Facts) -> Finding:
    if f.cgroup2:
        return Finding("cgroup v2", OK, f"mounted at {f.cgroup2}")
    if f.mode == "acl":
        return Finding("cgroup v2", WARN, "not mounted; access.mode = acl does without it",
                       "boot with systemd.unified_cgroup_hierarchy=1 to use the gate")
    return Finding("cgroup v2", FAIL, "no cgroup2 mount: the gate cannot attach",
                   "boot with systemd.unified_cgroup_hierarchy=1 (or set access.mode = \"acl\")")


def check_bpf(f: Facts) -> Finding:
    if f.mode == "acl":
        return Finding("bpf", OK, "not used (access.mode = acl)")
    if f.bpf_error is None:
        return Finding("bpf", OK, "bpf() queries device programs on the cgroup root")
    return Finding("bpf", FAIL, f.bpf_error,
                   "run as root on Linux 5.3+ with CONFIG_BPF_SYSCALL and CONFIG_CGROUP_BPF")


def check_gate(f: Facts) -> Finding:
    if f.mode == "acl":
        return Finding("gate", WARN, "no gate: access.mode = acl (file permissions only)",
                       "set access.mode = \"gate\" for kernel enforcement")
    if f.gate is None:
        return Finding("gate", FAIL, f"gate {f.gate_name}: cannot read it: {f.gate_error}", "see the bpf line")
    if not f.gate.get("attached"):
        return Finding("gate", FAIL, f"gate {f.gate_name}: not attached: GPU nodes are not enforced by the kernel",
                       "systemctl start gpuguard (or gpuguard gate attach)")
    if f.gate_current is False:
        return Finding("gate", FAIL, f"gate {f.gate_name}: attached, but built for other devices or an older gpuguard",
                       "systemctl restart gpuguard (the new program replaces it, grants kept)")
    if f.daemon is not None:
        wanted = {(h["uid"], gpu["minor"]) for gpu in f.daemon.get("gpus", []) for h in gpu["holders"]}
        entries = {(int(uid), int(dev.split(":")[1])) for uid, devs in f.gate.get("users", {}).items()
                   for dev in devs if dev.startswith("195:")}
        if entries != wanted:
            return Finding("gate", FAIL, f"gate {f.gate_name}: map has {sorted(entries)}, grants are {sorted(wanted)}",
                           "systemctl restart gpuguard (it rebuilds the map from the store)")
    return Finding("gate", OK, f"gate {f.gate_name}: attached as program {f.gate.get('prog_id')}, "
                               f"{f.gate.get('entries', 0)} grants")


def check_nvml(f: Facts) -> Finding:
    if f.gpus is None:
        return Finding("nvml", FAIL, f"cannot list GPUs: {f.nvml_error}",
                       "check the driver: nvidia-smi; dmesg | grep -i nvrm")
    if not f.gpus:
        return Finding("nvml", FAIL, "NVML lists no GPU", "check the driver: nvidia-smi")
    names = sorted({name for _, name in f.gpus})
    return Finding("nvml", OK, f"{len(f.gpus)} GPUs ({', '.join(names)}), {f.backend}")


def check_minors(f: Facts) -> Finding:
    listed = sorted(minor for minor, _ in f.gpus or ())
    missing = [f.nodes[m].path for m in listed if m in f.nodes and not f.nodes[m].exists]
    if missing:
        return Finding("minors", FAIL, f"no node for {', '.join(missing)}", "gpuguard acl apply")
    if f.backend == "nvml" and sorted(f.driver_minors) != listed:
        return Finding("minors", WARN, f"the driver has GPUs {unit_list(f.driver_minors)}, NVML lists {unit_list(listed)}",
                       "a GPU NVML cannot read stays closed: nvidia-smi -q; dmesg | grep -i nvrm")
    return Finding("minors", OK, f"GPUs {unit_list(listed)} each have their node")


def check_nodes(f: Facts) -> Finding:
    holders: dict[int, set[int]] = {}
    if f.daemon is not None:
        for gpu in f.daemon.get("gpus", []):
            holders[gpu["minor"]] = {h["uid"] for h in gpu["holders"]}
    wrong, foreign_wrong = [], []
    for minor, node in sorted(f.nodes.items()):
        if not node.exists:
            continue
        if minor in f.foreign:  # Slurm's or Kubernetes': as the driver makes them, their cgroups decide
            if (problem := _foreign_node_problem(node)) is not None:
                foreign_wrong.append(problem)
            continue
        if not node.is_char or node.mode != 0o660 or (node.uid, node.gid) != (0, 0):
            wrong.append(f"{node.path} is {oct(node.mode)} {node.uid}:{node.gid} (want 0660 root:root)")
        elif f.daemon is not None and node.acl_users != (holders.get(minor, set()) | f.exempt_uids) - {0}:
            wrong.append(f"{node.path} ACL users {sorted(node.acl_users)}, "
                         f"want {sorted((holders.get(minor, set()) | f.exempt_uids) - {0})}")
    if foreign_wrong:
        return Finding("nodes", FAIL, "; ".join(foreign_wrong + wrong),
                       "systemctl restart gpuguard (it gives their nodes back: 0666, no ACL), "
                       "or setfacl -b NODE && chmod 0666 NODE")
    if wrong:
        return Finding("nodes", FAIL, "; ".join(wrong), "gpuguard acl apply (with the daemon running)")
    checked = "modes and ACLs" if f.daemon is not None else "modes (ACLs need the daemon)"
    others = f", {len(f.foreign)} of another system's (coexist) as its jobs need" if f.foreign else ""
    return Finding("nodes", OK, f"{len(f.nodes)} GPU nodes: {checked} right{others}")


def _foreign_node_problem(node: Node) -> str | None:
    """What keeps the jobs of the GPU's owner (Slurm, Kubernetes) out of a node of theirs, or a user gpuguard
    once let in: their jobs open it as the driver makes it, readable and writable by all with no ACL."""
    if not node.is_char:
        return f"{node.path} is not a character device"
    if node.acl_users:
        return (f"{node.path} is another system's (coexist) but keeps ACL users {sorted(node.acl_users)} "
                "of gpuguard's (want none)")
    if node.mode & 0o006 != 0o006:
        return (f"{node.path} is {oct(node.mode)} {node.uid}:{node.gid}: another system's (coexist), whose jobs "
                "get EACCES (want 0666, as the driver makes it)")
    return None


def check_modprobe(f: Facts) -> Finding:
    if f.backend == "simulated":
        return Finding("modprobe", OK, "simulated GPUs: no driver option to check")
    if f.modify_device_files == "0":
        return Finding("modprobe", OK, "nvidia loaded with NVreg_ModifyDeviceFiles=0")
    if f.modify_device_files is None:
        if f.modprobe_option:
            return Finding("modprobe", WARN, "nvidia not loaded; NVreg_ModifyDeviceFiles=0 is set for its next load",
                           "load the driver (modprobe nvidia) and run gpuguard doctor again")
        return Finding("modprobe", FAIL, "no modprobe.d file sets NVreg_ModifyDeviceFiles=0",
                       "gpuguard enable (it links /etc/modprobe.d/gpuguard.conf)")
    if f.modprobe_option:
        return Finding("modprobe", FAIL, f"nvidia was loaded with ModifyDeviceFiles={f.modify_device_files}: "
                                         "nvidia-modprobe may reset GPU nodes to 0666",
                       "reboot, or unload and reload the nvidia modules, so the option takes effect")
    return Finding("modprobe", FAIL, f"ModifyDeviceFiles={f.modify_device_files} and no modprobe.d file sets 0",
                   "gpuguard enable (it links /etc/modprobe.d/gpuguard.conf), then reboot")


def _module(line: str) -> tuple[str, list[str]]:
    """A session line's module, by its file name (a path or not), and its arguments."""
    module, *arguments = line.split()
    return module.split("/")[-1], arguments


def _is_hook(line: str) -> bool:
    """A pam_exec line that runs gpuguard's hook (`gpuguard pam-hook`, `python3 -m gpuguard.pam_hook`)."""
    module, arguments = _module(line)
    return module == "pam_exec.so" and bool({"pam-hook", "gpuguard.pam_hook"} & set(arguments))


def _reads_user_env(line: str) -> bool:
    module, arguments = _module(line)
    return module == "pam_env.so" and "user_readenv=1" in arguments


def check_pam(f: Facts) -> Finding:
    where = f"/etc/pam.d/{f.pam_service}"
    if f.pam_session is None:
        return Finding("pam", FAIL, f"{where} does not exist", "pass --pam-service NAME for the login service")
    modules = [_module(line)[0] for line in f.pam_session]
    hooks = [i for i, line in enumerate(f.pam_session) if _is_hook(line)]
    # pam_exec runs the hook as root with the PAM environment, which pam_env's user_readenv fills
    # from the user's ~/.pam_environment (LD_PRELOAD, PYTHONPATH): only before that, and only at
    # open_session (at close it is always there), is it root's own (pam/README)
    user_env = next((i for i, line in enumerate(f.pam_session) if _reads_user_env(line)), len(modules))
    if any("type=open_session" not in _module(f.pam_session[i])[1] or i > user_env for i in hooks):
        return Finding("pam", FAIL, f"{where}: gpuguard's pam_exec hook may run with the user's PAM environment "
                                    "(~/.pam_environment), as root",
                       "give its line type=open_session and put it before any pam_env.so user_readenv=1 line "
                       "(pam/README)")
    if MODULE not in modules and not hooks:
        return Finding("pam", FAIL, f"{where}: no {MODULE} in the session stack",
                       "pam-auth-update --enable gpuguard (Debian/Ubuntu), else pam/README")
    if MODULE in modules and not f.pam_module_found:
        return Finding("pam", FAIL, f"{where} names {MODULE}, which is not installed", "reinstall the package")
    first = modules.index(MODULE) if MODULE in modules else hooks[0]
    what = MODULE if MODULE in modules else "gpuguard's pam_exec hook"
    if "pam_systemd.so" in modules and modules.index("pam_systemd.so") > first:
        return Finding("pam", FAIL, f"{where}: {what} runs before pam_systemd.so",
                       "put it after pam_systemd (pam-auth-update does)")
    return Finding("pam", OK, f"{where}: {what} in the session stack"
                              + (", after pam_systemd.so" if "pam_systemd.so" in modules else ""))


def check_udev(f: Facts) -> Finding:
    if f.udev_rules:
        return Finding("udev", OK, f"{', '.join(f.udev_rules)} runs gpuguard acl apply")
    return Finding("udev", FAIL, "no udev rule runs gpuguard acl apply when the driver loads",
                   "gpuguard enable (it links /etc/udev/rules.d/70-gpuguard.rules)")


def check_persistenced(f: Facts) -> Finding:
    if f.persistenced_uid is None:
        return Finding("persistenced", OK, f"no {PERSISTENCED} account")
    if f.persistenced_uid in f.exempt_uids:
        return Finding("persistenced", OK, f"{PERSISTENCED} (uid {f.persistenced_uid}) is exempt")
    return Finding("persistenced", FAIL, f"{PERSISTENCED} (uid {f.persistenced_uid}) is not exempt: "
                                         "persistence mode cannot open the GPUs",
                   f"add \"{PERSISTENCED}\" to access.exempt_users")


def check_daemon(f: Facts) -> Finding:
    if f.daemon is None:
        return Finding("daemon", FAIL, f.daemon_error or "not reachable",
                       "systemctl enable --now gpuguard; journalctl -u gpuguard")
    grants = sum(len(gpu["holders"]) for gpu in f.daemon.get("gpus", []))
    return Finding("daemon", OK, f"answers: {len(f.daemon.get('gpus', []))} GPUs, {grants} grants, "
                                 f"{len(f.daemon.get('sessions', []))} sessions")


def check_coexist(f: Facts) -> Finding:
    decide = ('set [coexist] slurm = "auto" (gres.conf), "off", or Slurm\'s GPU minors '
              '(docs/admin.md: Beside Slurm and Kubernetes)')
    if f.owners_error is not None:
        return Finding("coexist", FAIL, f"the daemon will not start: {f.owners_error}", decide)
    if f.foreign:
        return Finding("coexist", OK, f"{f.owners}; gpuguard manages the other GPUs")
    if f.slurm is not None and f.slurm_setting is None:
        return Finding("coexist", WARN, f"Slurm is installed ({f.slurm}) but this is no Slurm node now (no slurmd "
                                        "running with a gres.conf); once it is one, gpuguard will not start until "
                                        "you decide", decide)
    return Finding("coexist", OK, f"every GPU is gpuguard's (coexist.slurm {f.slurm_setting or 'not set'}, "
                                  "no Kubernetes GPUs)")


def check_fleet(f: Facts) -> Finding:
    """A fleet's node: online, or why not. A fenced database (fleet.fencing) and a node name
    another server holds (fleet.identity) are a FAIL: the node will not write there until an
    admin acts; a database merely unreachable is a warning (logins go on under the offline
    policy, and the node comes back by itself), and so is another server refused under this
    node's name (this one goes on, the other needs a name of its own)."""
    if f.fleet is None:
        if f.fleet_error is not None:
            return Finding("fleet", WARN, f"not asked: {f.fleet_error}", "journalctl -u gpuguard")
        return Finding("fleet", OK, "a single server (no [fleet])")
    node = f.fleet.get("node")
    if f.fleet.get("online"):
        if clash := f.fleet.get("name_clash"):
            return Finding("fleet", WARN, f"node {node} is online; {clash}",
                           "set [fleet] node on the other server (docs/several-servers.md: Node names)")
        held_as = f" as {f.fleet['identity']}" if f.fleet.get("identity") else ""
        return Finding("fleet", OK, f"node {node} is online{held_as}")
    why = str(f.fleet.get("offline_reason") or "the database has not answered yet")
    if why.startswith("fenced"):
        return Finding("fleet", FAIL, f"node {node} offline: {why}",
                       "docs/several-servers.md: Failover and fencing")
    if why.startswith("name taken"):
        return Finding("fleet", FAIL, f"node {node} offline: {why}",
                       "set [fleet] node in gpuguard.toml to a name no other server uses, then restart gpuguard "
                       "(docs/several-servers.md: Node names)")
    return Finding("fleet", WARN, f"node {node} offline: {why}",
                   "check [fleet] database and that the database answers (psql with the same string)")


CHECKS: Sequence[Callable[[Facts], Finding]] = (
    check_cgroup, check_bpf, check_gate, check_nvml, check_minors, check_nodes, check_modprobe,
    check_pam, check_udev, check_persistenced, check_daemon, check_coexist, check_fleet)


def run(facts: Facts) -> list[Finding]:
    return [check(facts) for check in CHECKS]


def failed(findings: Iterable[Finding]) -> bool:
    return any(finding.status == FAIL for finding in findings)


def format_line(finding: Finding) -> str:
    line = f"{finding.status:<4}  {finding.check:<12}  {finding.detail}"
    return f"{line}  -> {finding.fix}" if finding.fix and finding.status != OK else line
