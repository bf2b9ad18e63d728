"""gpuguard.core.readiness on made-up facts: what stops `gpuguard enable`, and what does not."""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_doctor_checks import healthy

from gpuguard.core import readiness
from gpuguard.core.doctor import FAIL, OK, Facts

BPFFS_OK = readiness.check_bpffs("gate", mounted=True, supported=True)


def blocked(facts: Facts, bpffs=BPFFS_OK) -> list[str]:
    return [finding.check for finding in readiness.blockers(facts, bpffs)]


def test_a_host_not_yet_enabled_is_not_blocked_by_what_enable_sets_up() -> None:
    # No daemon, no gate, no PAM line, no modprobe option, no udev rule: doctor fails them all,
    # and enable is what turns them on.
    fresh = replace(healthy(), daemon=None, daemon_error="no socket", gate={"attached": False}, pam_session=[],
                    modprobe_option=False, modify_device_files=None, udev_rules=[])
    assert blocked(fresh) == []


@pytest.mark.parametrize(("change", "check"), [
    ({"gpus": None, "nvml_error": "NVML nvmlInit failed: NVML Shared Library Not Found"}, "nvml"),
    ({"gpus": []}, "nvml"),
    ({"cgroup2": None}, "cgroup v2"),
    ({"bpf_error": "bpf() refused: Operation not permitted"}, "bpf"),
    ({"owners_error": "a Slurm node with no [coexist] slurm decision"}, "coexist"),
], ids=["no-nvml", "no-gpu", "no-cgroup2", "no-bpf", "slurm-undecided"])
def test_what_the_daemon_needs_blocks_enable(change, check) -> None:
    assert blocked(replace(healthy(), **change)) == [check]


def test_acl_mode_needs_neither_cgroup2_nor_bpffs() -> None:
    acl = replace(healthy(), mode="acl", cgroup2=None, bpf_error="no cgroup v2")
    assert blocked(acl, readiness.check_bpffs("acl", mounted=False, supported=False)) == []


@pytest.mark.parametrize(("mounted", "supported", "status"), [
    (True, True, OK), (False, True, OK), (False, False, FAIL)])
def test_bpffs_fails_only_where_the_kernel_has_none(mounted, supported, status) -> None:
    assert readiness.check_bpffs("gate", mounted, supported).status == status


def test_the_reasons_are_one_line_each_with_its_fix() -> None:
    broken = replace(healthy(), gpus=None, nvml_error="NVML nvmlInit failed: NVML Shared Library Not Found",
                     cgroup2=None)
    line = readiness.reasons(readiness.blockers(broken, BPFFS_OK))
    assert line == ("nvml: cannot list GPUs: NVML nvmlInit failed: NVML Shared Library Not Found "
                    "(fix: check the driver: nvidia-smi; dmesg | grep -i nvrm); "
                    "cgroup v2: no cgroup2 mount: the gate cannot attach "
                    "(fix: boot with systemd.unified_cgroup_hierarchy=1 (or set access.mode = \"acl\"))")
