"""gres.conf, Slurm hostlists and `scontrol show node`, as gpuguard.core.gres reads them."""
from __future__ import annotations

import pytest

from gpuguard.core.gres import (
    MAX_NAMES,
    GresError,
    NodeGpus,
    expand_hostlist,
    node_gpus,
    parse_gres_conf,
    scontrol_gpu_count,
)


def no_include(path: str) -> str:
    raise AssertionError(f"unexpected Include {path}")


def gpus_of(text: str, node: str, files: dict[str, str] | None = None) -> NodeGpus:
    def read(path: str) -> str:
        if files is None or path not in files:
            raise FileNotFoundError(2, "No such file or directory")
        return files[path]
    return node_gpus(parse_gres_conf(text, "gres.conf", read), node)


@pytest.mark.parametrize("expression, names", [
    ("gpu1", ["gpu1"]),
    ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
    ("tux[8-10]", ["tux8", "tux9", "tux10"]),
    ("tux[0,3-4,7]", ["tux0", "tux3", "tux4", "tux7"]),
    ("gpu[1-2],big1", ["gpu1", "gpu2", "big1"]),
    ("rack[0-1]-n[1-2]", ["rack0-n1", "rack0-n2", "rack1-n1", "rack1-n2"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("/dev/nvidia[0-3]", ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]),
    ("/dev/nvidia0,/dev/nvidia2", ["/dev/nvidia0", "/dev/nvidia2"]),
])
def test_hostlists_expand_as_slurm_writes_them(expression, names):
    assert expand_hostlist(expression) == names


@pytest.mark.parametrize("expression, fragment", [
    ("gpu[1-", "unbalanced brackets"),
    ("gpu1]", "unbalanced brackets"),
    ("gpu[a-b]", "not a number"),
    ("gpu[4-1]", "goes down"),
    ("gpu1,,gpu2", "empty name"),
    ("n[0-99999999]", f"more than {MAX_NAMES}"),
    ("a[0-999]b[0-999]", f"more than {MAX_NAMES}"),
])
def test_bad_or_huge_hostlists_are_refused(expression, fragment):
    with pytest.raises(GresError, match=fragment.replace("[", r"\[")):
        expand_hostlist(expression)


GRES_CONF = """\
# Slurm's GRES configuration, one file for the whole cluster
AutoDetect=off
NodeName=gpu[01-04] Name=gpu Type=h100 File=/dev/nvidia[0-3] Cores=0-31
NodeName=gpu[05-06] Name=gpu Type=a100 File=/dev/nvidia0,/dev/nvidia2
nodename=gpu07 name=gpu file=/dev/nvidia1   # keys are case-insensitive
NodeName=gpu08 Name=gpu \\
    File=/dev/nvidia5
NodeName=big[1-2] AutoDetect=nvml
NodeName=gpu09 Name=gpu Type=h100 MultipleFiles=/dev/nvidia3,/dev/nvidia-caps/nvidia-cap21,/dev/nvidia-caps/nvidia-cap22
NodeName=gpu10 Name=gpu Count=2
NodeName=gpu[01-04] Name=mps Count=400
"""


@pytest.mark.parametrize("node, minors", [
    ("gpu03", {0, 1, 2, 3}),
    ("gpu06", {0, 2}),
    ("gpu07", {1}),
    ("gpu08", {5}),        # a continued line
    ("gpu09", {3}),
    ("cpu01", set()),      # in no NodeName list
])
def test_file_ranges_of_this_node(node, minors):
    found = gpus_of(GRES_CONF, node)
    assert found.minors == minors and not found.autodetect and not found.counted


def test_mig_capabilities_in_multiple_files_are_kept():
    assert gpus_of(GRES_CONF, "gpu09").caps == {21, 22}


def test_autodetect_on_a_node_line_overrides_the_global_off():
    assert gpus_of(GRES_CONF, "big2").autodetect
    assert not gpus_of(GRES_CONF, "gpu01").autodetect


def test_a_global_autodetect_applies_to_every_node_unless_a_node_line_turns_it_off():
    text = "AutoDetect=nvml\nNodeName=cpu[1-2] AutoDetect=off\n"
    assert gpus_of(text, "gpu1").autodetect
    assert not gpus_of(text, "cpu2").autodetect
    assert not gpus_of("AutoDetect=rsmi\n", "gpu1").autodetect  # AMD's: no NVIDIA GPU is Slurm's by it


def test_gpus_given_by_count_without_files_are_flagged_with_their_line():
    assert gpus_of(GRES_CONF, "gpu10").counted == ("gres.conf:10",)


def test_lines_without_nodename_apply_to_every_node():
    assert gpus_of("Name=gpu File=/dev/nvidia[2-3]\n", "anything").minors == {2, 3}


def test_include_files_are_read_in_place():
    text = "Include /etc/slurm/gres.d/gpus.conf\nNodeName=gpu2 Name=gpu File=/dev/nvidia7\n"
    included = {"/etc/slurm/gres.d/gpus.conf": "NodeName=gpu[1-2] Name=gpu File=/dev/nvidia[0-1]\n"}
    assert gpus_of(text, "gpu2", included).minors == {0, 1, 7}


def test_an_include_loop_is_refused():
    with pytest.raises(GresError, match="Include nested more than"):
        gpus_of("Include /a\n", "gpu1", {"/a": "Include /a\n"})


@pytest.mark.parametrize("text, fragment", [
    ("Name=gpu File\n", "gres.conf:1: expected Key=Value, got 'File'"),
    ("Include\n", "gres.conf:1: expected Include PATH"),
    ("Include /missing\n", "gres.conf:1: cannot read /missing"),
    ("NodeName=gpu[1- Name=gpu File=/dev/nvidia0\n", "gres.conf:1: NodeName: unbalanced brackets"),
    ("Name=gpu File=/dev/nvidia[3-1]\n", "gres.conf:1: File: range '3-1' goes down"),
])
def test_malformed_lines_are_refused_with_where(text, fragment):
    with pytest.raises(GresError) as error:
        gpus_of(text, "gpu1")
    assert fragment in str(error.value)


SCONTROL = """\
NodeName=gpu03 Arch=x86_64 CoresPerSocket=16
   CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.02
   AvailableFeatures=(null)
   Gres=gpu:h100:2(S:0-1),gpu:a100:1(S:0),shard:h100:16
   NodeAddr=gpu03 NodeHostName=gpu03 Version=23.11.4
   State=IDLE ThreadsPerCore=2 TmpDisk=0 Weight=1
"""


@pytest.mark.parametrize("text, count", [
    (SCONTROL, 3),
    (SCONTROL.replace("Gres=gpu:h100:2(S:0-1),gpu:a100:1(S:0),shard:h100:16", "Gres=gpu:4"), 4),
    (SCONTROL.replace("Gres=gpu:h100:2(S:0-1),gpu:a100:1(S:0),shard:h100:16", "Gres=(null)"), 0),
    (SCONTROL.replace("(S:0-1)", "(S:0,1)"), 3),  # a comma inside the socket list
])
def test_scontrol_gpu_count(text, count):
    assert scontrol_gpu_count(text) == count


def test_scontrol_text_without_gres_is_refused():
    with pytest.raises(GresError, match="no Gres= field"):
        scontrol_gpu_count("Node gpu99 not found\n")
