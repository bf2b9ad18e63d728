"""MIG slices through NvmlBackend over the simulated NVML library: pynvml's own MIG wrappers, the
driver's capability table and nodes, real `gpuguard sim burn` processes on slices, `gpuguard sim mig`
layout changes, and `gpuguard gpus`.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import stat
from collections.abc import Iterator
from ctypes import CFUNCTYPE, c_int, c_uint, c_void_p
from pathlib import Path

import pynvml
import pytest
from conftest import run_as
from sim_helpers import GiB, cli, gpuguard, open_backend, write_config

from gpuguard import config as gpuguard_config
from gpuguard.backends import caps_major, mig_caps
from gpuguard.backends.devnodes import caps_node
from gpuguard.backends.nvml import NvmlBackend
from gpuguard.backends.sim_mig import MIG_FILE, MIG_MINORS_FILE
from gpuguard.backends.sim_registry import REGISTRY_DIR
from gpuguard.backends.simulated import SimulatedBackend
from gpuguard.config import SimulatedConfig
from gpuguard.core.errors import EXIT_FAILED, EXIT_USAGE
from gpuguard.core.model import GpuProcess, slice_unit, unit_label

H100 = "NVIDIA H100 80GB HBM3"
LAYOUT = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
MIG_CONFIG = f'name = "{H100}"\nmig = {{ "0" = {json.dumps(list(LAYOUT))}, "2" = [] }}\n'
MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")


pytestmark = pytest.mark.usefixtures("without_gates")


@pytest.fixture
def config(sandbox: Path) -> Path:
    return write_config(sandbox, count=4, extra=MIG_CONFIG)


@pytest.fixture
def gpus(config: Path) -> Iterator[NvmlBackend]:
    """What the root daemon sees; opening it lays out the configured slices and their nodes."""
    with open_backend(config) as backend:
        yield backend


def by_uuid(backend: NvmlBackend) -> dict[str, int]:
    return {gpu.uuid: gpu.unit for gpu in backend.layout().slices}


def test_slices_come_through_pynvml_with_units_names_and_caps(gpus: NvmlBackend, sandbox: Path) -> None:
    whole = {gpu.unit: gpu for gpu in gpus.gpus()}
    assert {minor: gpu.mig_mode for minor, gpu in whole.items()} == {0: True, 1: False, 2: True, 3: False}
    layout = gpus.layout()
    assert (layout.mig_gpus, layout.unread) == ({0, 2}, set())
    # The driver places the largest first and names each GPU instance by its place (swizzle id).
    places = {s.slice.gpu_instance: s.slice.profile for s in layout.slices if s.slice}
    assert sorted(places.values()) == sorted(LAYOUT)
    assert [s.unit for s in layout.slices] == sorted(slice_unit(0, gi, 0) for gi in places)
    minors = mig_caps.read_mig_minors(sandbox / "dev" / REGISTRY_DIR / MIG_MINORS_FILE)
    for each in layout.slices:
        assert each.slice is not None and each.slice.parent == 0 and each.slice.compute_instance == 0
        assert each.name == f"{H100} MIG {each.slice.profile}"
        assert MIG_UUID.fullmatch(each.uuid)
        eighths = {"3g.40gb": 4, "2g.20gb": 2, "1g.10gb": 1}[each.slice.profile]
        assert (each.memory_total, each.memory_used, each.utilization) == (80 * GiB * eighths // 8, 0, None)
        assert (each.index, each.pci_bus_id, each.numa_node) == (whole[0].index, whole[0].pci_bus_id, whole[0].numa_node)
        gi = each.slice.gpu_instance
        assert each.slice.caps == (minors[f"gpu0/gi{gi}/access"], minors[f"gpu0/gi{gi}/ci0/access"])
        for cap in each.slice.caps:  # as nvidia-modprobe makes them
            st = os.lstat(caps_node(sandbox / "dev", cap))
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(caps_major(gpuguard_config.load(
                sandbox / "gpuguard.toml")), cap)
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o444, 0, 0)
    assert len({s.uuid for s in layout.slices}) == 4
    # A GPU in MIG mode cannot tell its utilization; NVML never makes that 0.
    assert whole[0].utilization is None and whole[1].utilization == 0


def test_instances_go_where_they_all_fit_and_are_named_by_place(gpus: NvmlBackend) -> None:
    # 3g.40gb at memory slices 0-3 (GI 1), 2g.20gb at 4-5 (GI 5) and a 1g.10gb at 6 (GI 13) leave
    # no place for the second 1g.10gb (a 1g cannot start at slice 7): so the 3g goes to 4-7 (GI 2),
    # the 2g to 0-1 (GI 3), the 1gs to 2 and 3 (GI 9, 10).
    places = {s.slice.gpu_instance: s.slice.profile for s in gpus.layout().slices if s.slice}
    assert places == {2: "3g.40gb", 3: "2g.20gb", 9: "1g.10gb", 10: "1g.10gb"}


def test_a_layout_change_reuses_gi_ids_with_new_uuids(gpus: NvmlBackend, config: Path) -> None:
    before = gpus.layout()
    result = cli(config, "sim", "mig", "0", *LAYOUT)
    assert result.returncode == 0, result.stderr
    after = gpus.layout()  # the same NVML session sees the new layout
    assert [s.unit for s in after.slices] == [s.unit for s in before.slices]
    assert not {s.uuid for s in after.slices} & {s.uuid for s in before.slices}
    assert all(s.uuid in result.stdout and unit_label(s.unit) in result.stdout for s in after.slices)

    assert cli(config, "sim", "mig", "0", "7g.80gb").returncode == 0
    assert [(s.unit, s.slice.profile if s.slice else None) for s in gpus.layout().slices] == [
        (slice_unit(0, 0, 0), "7g.80gb")]
    assert cli(config, "sim", "mig", "0", "--off").returncode == 0
    assert cli(config, "sim", "mig", "1", "--on").returncode == 0
    layout = gpus.layout()
    assert (layout.mig_gpus, layout.slices) == ({1, 2}, [])
    assert {gpu.unit: gpu.mig_mode for gpu in gpus.gpus()} == {0: False, 1: True, 2: True, 3: False}


def test_processes_land_on_their_slices(gpus: NvmlBackend, config: Path, burns, make_user) -> None:
    units = by_uuid(gpus)
    small = sorted(uuid for uuid, unit in units.items() if unit in (slice_unit(0, 9, 0), slice_unit(0, 10, 0)))
    user = make_user()
    first = burns(config, None, "2GiB", mig=small[0], user=user)
    second = burns(config, None, "unknown", mig=small[1], user=user)
    query = gpus.query_processes()
    assert sorted(query.processes, key=lambda p: p.pid) == sorted(
        [GpuProcess(first.pid, units[small[0]], 2 * GiB), GpuProcess(second.pid, units[small[1]], None)],
        key=lambda p: p.pid)
    assert set(units.values()) <= query.read and {0, 1, 2, 3} <= query.read
    use = gpus.use()
    assert (use[units[small[0]]].memory_used, use[units[small[1]]].memory_used) == (2 * GiB, 0)
    assert use[units[small[0]]].utilization is None and use[0].memory_used == 2 * GiB
    # The driver refuses to destroy instances in use.
    busy = cli(config, "sim", "mig", "0", "7g.80gb")
    assert busy.returncode == EXIT_FAILED and "in use by pids" in busy.stderr
    assert by_uuid(gpus) == units


def test_burn_on_a_slice_needs_its_capability_nodes(gpus: NvmlBackend, config: Path, sandbox: Path, make_user) -> None:
    user = make_user()
    target = gpus.layout().slices[0]
    assert target.slice is not None
    os.chmod(caps_node(sandbox / "dev", target.slice.caps[1]), 0o400)  # the CI capability: root only
    refused = run_as(user, gpuguard(config, "sim", "burn", "--slice", target.uuid, "--mem", "1GiB", "--seconds", "1"))
    assert refused.returncode == EXIT_FAILED
    assert refused.stderr.startswith("CUDA error:") and f"nvidia-cap{target.slice.caps[1]}" in refused.stderr
    whole = run_as(user, gpuguard(config, "sim", "burn", "--gpu", "0", "--mem", "1GiB", "--seconds", "1"))
    assert whole.returncode == EXIT_FAILED and "MIG mode" in whole.stderr
    unknown = run_as(user, gpuguard(config, "sim", "burn", "--slice", "MIG-nope", "--mem", "1GiB"))
    assert unknown.returncode == EXIT_USAGE and "no MIG slice MIG-nope" in unknown.stderr
    assert gpus.query_processes().processes == []


def test_a_layout_file_not_owned_by_root_is_ignored(gpus: NvmlBackend, sandbox: Path, make_user) -> None:
    os.chown(sandbox / "dev" / REGISTRY_DIR / MIG_FILE, make_user().uid, -1)
    assert gpus.layout() == ([], set(), set())
    assert not any(gpu.mig_mode for gpu in gpus.gpus())


def test_slices_without_capabilities_make_their_gpu_unread(gpus: NvmlBackend, sandbox: Path) -> None:
    minors_file = sandbox / "dev" / REGISTRY_DIR / MIG_MINORS_FILE
    text = minors_file.read_text()
    minors_file.write_text("".join(line + "\n" for line in text.splitlines() if not line.startswith("gpu0/")))
    layout = gpus.layout()
    assert (layout.mig_gpus, layout.unread, layout.slices) == ({0, 2}, {0}, [])
    minors_file.unlink()  # nvidia-caps not loaded
    assert gpus.layout().unread == {0}  # GPU 2 has no slices, so none lacks capabilities
    minors_file.write_text(text)
    assert len(gpus.layout().slices) == 4


def test_a_gpu_without_mig_reads_as_mig_off(sandbox: Path) -> None:
    with SimulatedBackend(SimulatedConfig(count=2, name="Test GPU 16GB"), sandbox / "dev") as backend:
        assert not any(gpu.mig_mode for gpu in backend.gpus())
        assert backend.layout() == ([], set(), set())


def test_a_slice_named_without_its_profile_gets_it_from_its_attributes(gpus: NvmlBackend, swap_library) -> None:
    library = pynvml.nvmlLib
    bare_name = CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint)(
        lambda handle, buffer, length: (ctypes.memmove(buffer, b"NVIDIA H100\0", 12), 0)[1])
    swap_library(type("NamesWithoutProfiles", (), {
        "nvmlDeviceGetName": bare_name, "__getattr__": lambda self, name: getattr(library, name)})())
    assert sorted(s.slice.profile for s in gpus.layout().slices if s.slice) == sorted(LAYOUT)


@pytest.mark.parametrize(("mig", "error"), [
    ('{ "0" = ["1g.18gb"] }', "gpu.simulated.mig.0: no MIG profile '1g.18gb' on NVIDIA H100 80GB HBM3"),
    ('{ "0" = ["1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"] }',
     "8 x 1g.10gb do not fit: at most 7"),
    ('{ "0" = ["4g.40gb", "3g.40gb", "1g.10gb"] }', "take 8 compute slices"),
    ('{ "0" = ["1g.20gb", "1g.20gb", "1g.20gb", "1g.20gb", "1g.10gb"] }', "do not fit in the 8 memory slices"),
    ('{ "9" = [] }', "gpu.simulated.mig: GPU 9 does not exist (count = 4)"),
    ('{ "0" = "1g.10gb" }', "gpu.simulated.mig: expected GPU minors and their MIG profiles"),
])
def test_bad_mig_layouts_are_refused_in_the_config(sandbox: Path, mig: str, error: str) -> None:
    config = write_config(sandbox, count=4, extra=f'name = "{H100}"\nmig = {mig}\n')
    with pytest.raises(gpuguard_config.ConfigError, match=re.escape(error)) as raised:
        gpuguard_config.load(config)
    assert "\n" not in str(raised.value)


def test_mig_needs_a_gpu_that_has_it(sandbox: Path) -> None:
    config = write_config(sandbox, count=2, extra='name = "Test GPU 16GB"\nmig = { "0" = [] }\n')
    with pytest.raises(gpuguard_config.ConfigError, match="'Test GPU 16GB' has no MIG"):
        gpuguard_config.load(config)


def test_sim_mig_refuses_bad_requests_in_one_line(gpus: NvmlBackend, config: Path, make_user) -> None:
    before = by_uuid(gpus)
    for args, message in [(["0", "2g.20gb", "2g.20gb", "2g.20gb", "2g.20gb"], "4 x 2g.20gb do not fit"),
                          (["0", "5g.50gb"], "no MIG profile '5g.50gb'"),
                          (["7", "--on"], "no simulated GPU 7"),
                          (["0"], "name the PROFILEs to create, or --on")]:
        result = cli(config, "sim", "mig", *args)
        assert (result.returncode, result.stderr.count("\n")) == (EXIT_USAGE, 1), result.stderr
        assert message in result.stderr
    as_user = cli(config, "sim", "mig", "0", "--off", user=make_user())
    assert as_user.returncode == EXIT_USAGE and "run it as root" in as_user.stderr
    assert by_uuid(gpus) == before


def test_gpus_lists_slices_under_their_gpu(gpus: NvmlBackend, config: Path, burns) -> None:
    target = gpus.layout().slices[-1]
    burns(config, None, "1GiB", mig=target.uuid)
    data = json.loads(cli(config, "gpus", "--json").stdout)
    listed = {gpu["minor"]: gpu for gpu in data["gpus"]}
    assert (listed[0]["mig_mode"], listed[1]["mig_mode"], listed[2]["slices"]) == (True, False, [])
    slices = {s["uuid"]: s for s in listed[0]["slices"]}
    assert set(slices) == set(by_uuid(gpus))
    shown = slices[target.uuid]
    assert (shown["unit"], shown["label"], shown["processes"], shown["memory_used"]) == (
        target.unit, unit_label(target.unit), 1, GiB)
    assert target.slice is not None and shown["caps"] == list(target.slice.caps)
    table = cli(config, "gpus").stdout
    assert f"{H100} (MIG mode)" in table
    row = next(line for line in table.splitlines() if target.uuid in line)
    assert row.split()[:3] == [unit_label(target.unit), "MIG", target.slice.profile]
