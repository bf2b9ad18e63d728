"""Which install a fleet's node is (gpuguard.fleet.identity): the key kept in the state directory,
drawn again when the directory is found on another machine (a cloned image, a copied state
directory), and what `doctor` says of a node name another server holds (gpuguard.core.doctor)."""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from test_doctor_checks import healthy

from gpuguard.core import doctor
from gpuguard.core.doctor import FAIL, OK, WARN
from gpuguard.fleet import identity
from gpuguard.fleet.identity import IDENTITY_FILE, describe


def machine(root: Path, machine_id: str, hardware_id: str | None) -> tuple[Path, list[Path]]:
    """A machine's /etc/machine-id and hardware id, as files under `root` (None: it has none)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "machine-id").write_text(machine_id + "\n")
    hardware = root / "product_uuid"
    if hardware_id is not None:
        hardware.write_text(hardware_id + "\n")
    return root / "machine-id", [hardware]


def test_the_key_is_kept_on_its_machine_and_drawn_again_on_a_copy_elsewhere(tmp_path, caplog):
    state = tmp_path / "state"
    machine_id, hardware = machine(tmp_path / "a", "3d1219c7c4c5404aaa1f6d2a48adfda4", "4c4c4544-0042")
    with caplog.at_level("INFO", logger="gpuguard"):
        first = identity.load(state, machine_id, hardware)
    assert "event=fleet_install_key" in caplog.text and "first start" in caplog.text
    assert identity.load(state, machine_id, hardware) == first  # a restart: the same install
    assert len(first.key) == 16 and len(first.machine) == 12
    assert "3d1219c7" not in first.install  # the machine-id itself is never sent (machine-id(5))
    assert (state / IDENTITY_FILE).stat().st_mode & 0o077 == 0

    # an image cloned with gpuguard's state in it, the machine-id copied too: the hardware differs
    copy = tmp_path / "clone-state"
    shutil.copytree(state, copy)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpuguard"):
        clone = identity.load(copy, *machine(tmp_path / "b", "3d1219c7c4c5404aaa1f6d2a48adfda4", "4c4c4544-0099"))
    assert clone.machine == first.machine and clone.key != first.key
    assert "made on another machine" in caplog.text and first.key in caplog.text
    # the machine-id made anew (a prepared image), on hardware with no id of its own (a container)
    shutil.rmtree(copy)
    shutil.copytree(state, copy)
    other = identity.load(copy, *machine(tmp_path / "c", "0000aaaa0000aaaa0000aaaa0000aaaa", None))
    assert other.machine != first.machine and other.key != first.key
    # two installs on one machine (the tests' nodes): one state directory each, one key each
    assert identity.load(tmp_path / "second", machine_id, hardware).key != first.key


def test_a_node_is_named_by_host_machine_and_install_and_a_row_is_made_printable():
    assert describe("gpu1", "3f2a9c1b0d4e/9c1d2e3f4a5b6c7d") == "gpu1 (machine 3f2a9c1b0d4e, install 9c1d2e3f4a5b6c7d)"
    assert describe("", "5e2a") == "a host (an older gpuguard, outbox 5e2a)"
    assert describe("gpu1\n\x1b[2J", "-/k") == "gpu1\\n\\x1b[2J (machine -, install k)"


def test_a_node_name_another_server_holds_fails_and_a_clash_on_the_holder_warns():
    base = replace(healthy(), fleet={"node": "gpu1", "online": True, "identity": "vm (machine m, install k)",
                                     "name_clash": None})
    assert doctor.check_fleet(base).status == OK
    assert doctor.check_fleet(base).detail == "node gpu1 is online as vm (machine m, install k)"
    taken = replace(base, fleet={"node": "gpu1", "online": False,
                                 "offline_reason": "name taken: fleet node gpu1 is held by vm (...)"})
    finding = doctor.check_fleet(taken)
    assert finding.status == FAIL and "held by vm" in finding.detail and "[fleet] node" in finding.fix
    clash = replace(base, fleet={**base.fleet, "name_clash": "name clash: vm2 (...) tried to join ..."})
    finding = doctor.check_fleet(clash)
    assert finding.status == WARN and "vm2" in finding.detail
