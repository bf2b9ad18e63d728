"""gpuguard.core.coexist's decisions on made-up facts, and the gate ranges they leave managed."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.backends.gate import DeviceRange, managed_ranges
from gpuguard.config import CoexistConfig
from gpuguard.core.coexist import CoexistError, Owner, Ownership, SlurmFacts, check_some_left, decide
from gpuguard.core.errors import EXIT_NOT_CONFIGURED
from gpuguard.core.gres import NodeGpus
from gpuguard.core.model import NVIDIA_MAJOR

PRESENT = range(8)
AUTO = CoexistConfig(slurm="auto", gres_conf=Path("/etc/slurm/gres.conf"))


def facts(gres: NodeGpus | None = None, **changes) -> SlurmFacts:
    fields = {"node": "gpu03", "slurmd_running": True, "gres_conf_present": gres is not None, "gres": gres}
    return SlurmFacts(**{**fields, **changes})


def test_auto_leaves_the_files_of_gres_conf_to_slurm():
    owned = decide(AUTO, facts(NodeGpus(False, frozenset({0, 1}))), PRESENT)
    assert owned.foreign == {0: Owner.SLURM, 1: Owner.SLURM}
    assert owned.owner(2) == Owner.GPUGUARD
    assert owned.summary() == "Slurm: GPUs 0,1 (/etc/slurm/gres.conf, node gpu03)"


def test_autodetect_gives_slurm_every_gpu_present():
    owned = decide(AUTO, facts(NodeGpus(True)), [0, 1, 2])
    assert set(owned.foreign) == {0, 1, 2}
    with pytest.raises(CoexistError, match="nothing for gpuguard to hand out"):
        check_some_left(owned, [0, 1, 2])


def test_k8s_gpus_are_kubernetes_and_overlap_with_slurm_is_refused():
    config = CoexistConfig(slurm="auto", k8s_gpus=(6, 7))
    owned = decide(config, facts(NodeGpus(False, frozenset({0}))), PRESENT)
    assert owned.foreign == {0: Owner.SLURM, 6: Owner.K8S, 7: Owner.K8S}
    check_some_left(owned, PRESENT)  # 1-5 are left: no refusal
    with pytest.raises(CoexistError, match="GPU 6 is Slurm's"):
        decide(config, facts(NodeGpus(False, frozenset({5, 6}))), PRESENT)


def test_an_explicit_list_or_off_needs_no_facts():
    assert set(decide(CoexistConfig(slurm=(2, 3)), None, PRESENT).foreign) == {2, 3}
    assert decide(CoexistConfig(slurm="off"), None, PRESENT).foreign == {}


def test_an_undecided_slurm_node_is_refused_with_exit_6():
    with pytest.raises(CoexistError) as error:
        decide(CoexistConfig(), facts(NodeGpus(False, frozenset({0}))), PRESENT)
    assert error.value.code == EXIT_NOT_CONFIGURED == 6
    assert "this is a Slurm node" in str(error.value) and 'slurm = "auto"' in str(error.value)


@pytest.mark.parametrize("changes", [{"slurmd_running": False}, {"gres_conf_present": False}])
def test_slurmd_without_gres_conf_or_the_reverse_is_not_a_slurm_node(changes):
    assert decide(CoexistConfig(), facts(NodeGpus(False, frozenset({0})), **changes), PRESENT).foreign == {}


@pytest.mark.parametrize("found, fragment", [
    (facts(NodeGpus(False, counted=("gres.conf:4",))), "gres.conf:4: Slurm gets GPUs on node gpu03 by Count"),
    (facts(NodeGpus(False, frozenset({0})), scontrol_gpus=2), "gives it 2 GPUs but /etc/slurm/gres.conf names only 0"),
    (facts(None, scontrol_gpus=4), "names none"),
    (facts(None, gres_error="/etc/slurm/gres.conf: not believed"), "coexist.slurm = auto: /etc/slurm/gres.conf: not"),
])
def test_auto_refuses_what_it_cannot_place(found, fragment):
    with pytest.raises(CoexistError, match=fragment):
        decide(AUTO, found, PRESENT)


def test_scontrol_agreeing_with_gres_conf_changes_nothing():
    owned = decide(AUTO, facts(NodeGpus(False, frozenset({0, 1})), scontrol_gpus=2), PRESENT)
    assert set(owned.foreign) == {0, 1}


def test_unmanaged_nodes_include_the_mig_capabilities_of_foreign_gpus():
    owned = Ownership(foreign={1: Owner.SLURM}, caps=frozenset({500}))
    table = {"config": 1, "monitor": 2, "gpu0/gi1/access": 3, "gpu1/gi1/access": 138, "gpu1/gi1/ci0/access": 139}
    assert owned.unmanaged(None, table) == [(NVIDIA_MAJOR, 1)]
    assert owned.unmanaged(240, table) == [(NVIDIA_MAJOR, 1), (240, 138), (240, 139), (240, 500)]


def test_managed_ranges_split_around_unmanaged_nodes():
    assert managed_ranges(None, [(NVIDIA_MAJOR, 0), (NVIDIA_MAJOR, 3), (NVIDIA_MAJOR, 4)]) == (
        DeviceRange(NVIDIA_MAJOR, 1, 2), DeviceRange(NVIDIA_MAJOR, 5, 253))
    assert managed_ranges(240, [(240, 138), (240, 139), (NVIDIA_MAJOR, 253)]) == (
        DeviceRange(NVIDIA_MAJOR, 0, 252), DeviceRange(240, 0, 137), DeviceRange(240, 140))
    assert managed_ranges(None) == (DeviceRange(NVIDIA_MAJOR, 0, 253),)
