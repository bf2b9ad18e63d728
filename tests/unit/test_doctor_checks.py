"""gpuguard.core.doctor's verdicts on made-up facts: a healthy machine, then each thing that can be wrong."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gpuguard.core import doctor
from gpuguard.core.doctor import FAIL, OK, WARN, Facts, Node

ALICE = 1001
HOOK = "pam_exec.so type=open_session quiet stdout /usr/bin/gpuguard pam-hook"  # pam/README's line


def healthy() -> Facts:
    nodes = {m: Node(f"/dev/nvidia{m}", True, True, 0o660, 0, 0, frozenset({ALICE} if m == 1 else ()))
             for m in range(2)}
    return Facts(
        backend="nvml", mode="gate", cgroup2="/sys/fs/cgroup", bpf_error=None, gate_name="gpuguard",
        gate={"attached": True, "prog_id": 42, "entries": 1, "users": {str(ALICE): ["195:1"]}},
        gate_current=True, gate_error=None, gpus=[(0, "H100"), (1, "H100")], nvml_error=None,
        driver_minors=[0, 1], nodes=nodes, modify_device_files="0", modprobe_option=True,
        pam_service="sshd", pam_session=["pam_unix.so", "pam_systemd.so", "pam_gpuguard.so"],
        pam_module_found=True, udev_rules=["/usr/lib/udev/rules.d/70-gpuguard.rules"],
        persistenced_uid=None, exempt_uids=frozenset({0}),
        daemon={"gpus": [{"minor": 0, "holders": []}, {"minor": 1, "holders": [{"uid": ALICE}]}],
                "sessions": [{}]},
        daemon_error=None, slurm=None)


def verdicts(facts: Facts) -> dict[str, str]:
    return {finding.check: finding.status for finding in doctor.run(facts)}


def test_a_healthy_machine_is_all_ok() -> None:
    findings = doctor.run(healthy())
    assert [f.status for f in findings] == [OK] * len(doctor.CHECKS), findings
    assert not doctor.failed(findings)
    assert doctor.format_line(findings[0]) == "ok    cgroup v2     mounted at /sys/fs/cgroup"


def node(minor: int, **changes) -> dict[int, Node]:
    nodes = dict(healthy().nodes)
    nodes[minor] = replace(nodes[minor], **changes)
    return nodes


@pytest.mark.parametrize("changes, check, status", [
    ({"cgroup2": None}, "cgroup v2", FAIL),
    ({"cgroup2": None, "mode": "acl"}, "cgroup v2", WARN),
    ({"bpf_error": "querying device programs failed: Operation not permitted"}, "bpf", FAIL),
    ({"gate": {"attached": False}}, "gate", FAIL),
    ({"gate_current": False}, "gate", FAIL),
    ({"gate": {"attached": True, "prog_id": 42, "entries": 0, "users": {}}}, "gate", FAIL),  # a grant not in the map
    ({"gate": None, "gate_error": "gate not loaded"}, "gate", FAIL),
    ({"mode": "acl", "gate": None}, "gate", WARN),
    ({"gpus": None, "nvml_error": "NVML_ERROR_DRIVER_NOT_LOADED"}, "nvml", FAIL),
    ({"gpus": []}, "nvml", FAIL),
    ({"nodes": node(1, exists=False)}, "minors", FAIL),
    ({"driver_minors": [0, 1, 2]}, "minors", WARN),
    ({"nodes": node(0, mode=0o666)}, "nodes", FAIL),
    ({"nodes": node(0, uid=ALICE)}, "nodes", FAIL),
    ({"nodes": node(1, acl_users=frozenset())}, "nodes", FAIL),
    ({"nodes": node(0, acl_users=frozenset({ALICE}))}, "nodes", FAIL),
    ({"modify_device_files": "1"}, "modprobe", FAIL),
    ({"modify_device_files": None}, "modprobe", WARN),
    ({"modify_device_files": None, "modprobe_option": False}, "modprobe", FAIL),
    ({"pam_session": None}, "pam", FAIL),
    ({"pam_session": ["pam_unix.so", "pam_systemd.so"]}, "pam", FAIL),
    ({"pam_session": ["pam_gpuguard.so", "pam_systemd.so"]}, "pam", FAIL),
    ({"pam_module_found": False}, "pam", FAIL),
    # the pam_exec hook as pam/README gave it before it said type=open_session: at close_session it
    # runs as root with what pam_env read from the user's ~/.pam_environment
    ({"pam_session": ["pam_unix.so", "pam_systemd.so", HOOK.replace(" type=open_session", "")]}, "pam", FAIL),
    ({"pam_session": ["pam_unix.so", "pam_systemd.so", "pam_env.so user_readenv=1", HOOK]}, "pam", FAIL),
    ({"pam_session": ["pam_unix.so", HOOK, "pam_systemd.so"]}, "pam", FAIL),
    ({"udev_rules": []}, "udev", FAIL),
    ({"persistenced_uid": 105}, "persistenced", FAIL),
    ({"daemon": None, "daemon_error": "not reachable"}, "daemon", FAIL),
    ({"slurm": "slurmd"}, "coexist", WARN),
    ({"owners_error": "this is a Slurm node (slurmd runs, /etc/slurm/gres.conf exists) and [coexist] slurm is not set"},
     "coexist", FAIL),
])
def test_each_problem_is_its_own_line_with_a_fix(changes, check, status) -> None:
    findings = {f.check: f for f in doctor.run(replace(healthy(), **changes))}
    assert findings[check].status == status, findings[check]
    assert findings[check].fix
    assert doctor.failed(findings.values()) == (status == FAIL)


def test_what_is_fine_stays_fine() -> None:
    assert verdicts(replace(healthy(), persistenced_uid=105, exempt_uids=frozenset({0, 105})))["persistenced"] == OK
    simulated = verdicts(replace(healthy(), backend="simulated", modify_device_files=None, modprobe_option=False,
                                 driver_minors=[]))
    assert simulated["modprobe"] == OK and simulated["minors"] == OK
    assert verdicts(replace(healthy(), pam_session=["/opt/x/pam_gpuguard.so"]))["pam"] == OK  # no pam_systemd
    # the fallback without the module, as pam/README gives it, before pam_env reads the user's file
    hooked = ["pam_unix.so", "pam_systemd.so", HOOK, "pam_env.so user_readenv=1 envfile=/etc/default/locale"]
    assert verdicts(replace(healthy(), pam_session=hooked, pam_module_found=False))["pam"] == OK
    # Without the daemon the node check still judges modes, and does not fail on ACLs it cannot judge.
    assert verdicts(replace(healthy(), daemon=None, daemon_error="down"))["nodes"] == OK


def test_slurms_gpus_are_judged_by_their_owner_not_by_gpuguards_rules() -> None:
    """GPU 0 is Slurm's: its 0666 node with no ACL is how Slurm keeps it, not a fault."""
    beside = replace(healthy(), slurm="slurmd", slurm_setting="auto", foreign=frozenset({0}),
                     owners="Slurm: GPUs 0 (/etc/slurm/gres.conf, node gpu1)", nodes=node(0, mode=0o666))
    findings = {f.check: f for f in doctor.run(beside)}
    assert findings["nodes"].status == OK and findings["coexist"].status == OK
    assert findings["coexist"].detail == "Slurm: GPUs 0 (/etc/slurm/gres.conf, node gpu1); gpuguard manages the other GPUs"
    assert verdicts(replace(beside, foreign=frozenset()))["nodes"] == FAIL  # the same node on a GPU of gpuguard's
    assert verdicts(replace(healthy(), slurm="slurmd", slurm_setting="off"))["coexist"] == OK


def test_a_fenced_fleet_database_fails_and_one_merely_unreachable_warns():
    base = replace(healthy(), fleet={"node": "gpu1", "online": True})
    assert doctor.check_fleet(base).status == OK
    fenced = replace(base, fleet={"node": "gpu1", "online": False,
                                  "offline_reason": "fenced: the fleet database is an old leader (timeline 1; ...)"})
    finding = doctor.check_fleet(fenced)
    assert finding.status == FAIL and "old leader" in finding.detail and finding.fix
    unreachable = replace(base, fleet={"node": "gpu1", "online": False, "offline_reason": "connection refused"})
    assert doctor.check_fleet(unreachable).status == WARN
    assert doctor.check_fleet(replace(base, fleet=None, fleet_error="the daemon does not answer")).status == WARN
    assert doctor.check_fleet(replace(base, fleet=None)).detail == "a single server (no [fleet])"
