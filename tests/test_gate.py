"""The gate on the real kernel, with real users, processes and cgroups.

There is no NVIDIA driver here, so a 195:N node that the gate lets through fails with ENXIO
and one that it stops fails with EPERM. The nodes are 0666 copies made with mknod in a sandbox,
because file permissions are checked before the device cgroup. Each test attaches a gate of its
own (a unique `ggt-` name) and the fixture detaches it and checks nothing of it is left.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE

import pytest
from conftest import PYTHON, REPO, popen_as, run_as, unique
from leftovers import detach_by_id
from probes import ALLOWED, bare_nodes, holding, probe, probe_argv
from probes import GATE_DENIED as DENIED
from sim_helpers import cli

from devtools.harness import gate_test_lock
from gpuguard.backends import GateError, procfs
from gpuguard.backends.bpf import (
    attach_program,
    attached_ids,
    attached_programs,
    detach_program,
    load_device_program,
    prog_info,
)
from gpuguard.backends.bpf_asm import R0, assemble, exit_, mov_imm
from gpuguard.backends.gate import DeviceRange, Gate, object_name
from gpuguard.backends.mounts import cgroup2_root

GPU0, GPU1, GPU2, GPU3, MODESET, CTL = (195, 0), (195, 1), (195, 2), (195, 3), (195, 254), (195, 255)


def ours_attached(name: str) -> int:
    """How many programs of the gate called `name` are attached to the cgroup v2 root."""
    return list(attached_programs(cgroup2_root()).values()).count(object_name(name))


@pytest.fixture
def gate_name() -> Iterator[str]:
    """A fresh instance name; whatever gate carries it is gone afterwards (program, maps, pins)."""
    name = unique()
    with gate_test_lock():
        Gate(name).detach()  # a leftover of our own name goes first
        yield name
        gate = Gate(name)
        gate.detach()
    assert ours_attached(name) == 0
    assert not gate.pin_dir.exists()


@pytest.fixture
def gate(gate_name: str) -> Iterator[Gate]:
    with Gate(gate_name) as attached:
        attached.attach()
        yield attached


@pytest.fixture
def nodes(sandbox: Path) -> dict[tuple[int, int], str]:
    """0666 nodes for nvidia0..3, nvidia-modeset (254) and nvidiactl (255), by device number."""
    made = bare_nodes(sandbox, [dev[1] for dev in (GPU0, GPU1, GPU2, GPU3, MODESET, CTL)])
    return {(195, minor): str(path) for minor, path in made.items()}


def opens(report: dict, nodes: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """A probe report's results by device number."""
    return {dev: report["results"][path] for dev, path in nodes.items()}


def only(granted: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """What a user granted exactly `granted` gets: those and the always-open nodes, nothing else."""
    expected = {dev: DENIED for dev in (GPU0, GPU1, GPU2, GPU3)}
    expected.update({dev: ALLOWED for dev in (*granted, MODESET, CTL)})
    return expected


def root_open(path: str) -> str:
    try:
        os.close(os.open(path, os.O_RDWR))
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]


@pytest.mark.gate
def test_user_reaches_exactly_the_granted_node(gate, nodes, make_user) -> None:
    alice, bob = make_user(), make_user()
    gate.grant(alice.uid, GPU1)

    report = probe(alice, [*nodes.values(), "/dev/null", "/dev/full"])
    assert opens(report, nodes) == only({GPU1})
    assert report["results"]["/dev/null"] == report["results"]["/dev/full"] == "ok"
    assert opens(probe(bob, list(nodes.values())), nodes) == only(set())
    # Root is always exempt.
    assert {root_open(path) for path in nodes.values()} == {ALLOWED}


@pytest.mark.gate
def test_exempt_uids_change_without_reload(gate, nodes, make_user) -> None:
    carol = make_user()
    prog_id = gate.prog_id()

    gate.set_exempt([carol.uid])
    assert gate.exempt() == {0, carol.uid}
    assert set(opens(probe(carol, list(nodes.values())), nodes).values()) == {ALLOWED}

    gate.set_exempt([])
    assert gate.exempt() == {0}
    assert opens(probe(carol, list(nodes.values())), nodes) == only(set())
    assert gate.prog_id() == prog_id


@pytest.mark.gate
def test_revoke_stops_new_opens_and_holders_finds_earlier_ones(gate_name, make_user) -> None:
    # No 195:N node can really be opened here, so this gate manages /dev/full (1:7) instead.
    full = (1, 7)
    gate = Gate(gate_name, managed=[DeviceRange(1, 7, 7)])
    gate.attach()
    user = make_user()
    gate.grant(user.uid, full)
    try:
        with holding(user, "/dev/full") as holder:
            gate.revoke(user.uid, full)
            assert probe(user, ["/dev/full"])["results"]["/dev/full"] == DENIED
            # The gate only checks open(): the earlier holder is still there, and holders() finds it.
            assert holder.pid in procfs.holders(full)
            assert procfs.user_of(holder.pid) == user.uid
    finally:
        gate.detach()
    assert holder.pid not in procfs.holders(full)


@pytest.mark.gate
def test_detached_process_is_held_to_its_grants(gate, nodes, make_user) -> None:
    user = make_user()
    gate.grant(user.uid, GPU2)
    report = probe(user, list(nodes.values()), "--detach")
    assert report["sid"] != os.getsid(0) and report["pid"] != report["sid"]  # own session, not its leader
    assert opens(report, nodes) == only({GPU2})


@pytest.mark.gate
def test_user_namespace_root_is_still_the_user(gate, nodes, make_user) -> None:
    user = make_user()
    gate.grant(user.uid, GPU3)
    report = probe(user, list(nodes.values()), wrap=("unshare", "-U", "-r"))
    assert report["uid"] == 0  # root inside the namespace ...
    assert opens(report, nodes) == only({GPU3})  # ... and the gate still sees the user


@pytest.mark.gate
def test_child_cgroup_with_its_own_allow_all_program(gate, nodes, make_user) -> None:
    user = make_user()
    gate.grant(user.uid, GPU0)
    child = cgroup2_root() / unique()
    child.mkdir()
    cgroup_fd = os.open(child, os.O_RDONLY | os.O_DIRECTORY)
    allow_all = load_device_program(assemble([mov_imm(R0, 1), exit_()]), "ggt_allow_all")
    proc = None
    try:
        attach_program(cgroup_fd, allow_all)
        assert prog_info(allow_all).id in attached_ids(child)
        proc = popen_as(user, probe_argv("--wait", *nodes.values()), stdin=PIPE, stdout=PIPE, text=True)
        (child / "cgroup.procs").write_text(str(proc.pid))
        report = json.loads(proc.communicate("go\n", timeout=60)[0])
        assert report["cgroup"] == f"/{child.name}"
        assert opens(report, nodes) == only({GPU0})
    finally:
        if proc is not None and proc.poll() is None:  # one that timed out keeps the cgroup busy (EBUSY)
            proc.kill()
            proc.communicate()
        detach_program(cgroup_fd, allow_all)
        os.close(allow_all)
        os.close(cgroup_fd)
        child.rmdir()


@pytest.mark.gate
def test_a_foreign_program_on_the_root_survives_our_attach_swap_and_detach(gate_name) -> None:
    """Another tool's device program (systemd's, a container runtime's) attached with
    BPF_F_ALLOW_MULTI to the cgroup v2 root is never detached or replaced by ours."""
    root = cgroup2_root()
    foreign = load_device_program(assemble([mov_imm(R0, 1), exit_()]), "ggt_foreign")  # allows all
    foreign_id = prog_info(foreign).id
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        attach_program(root_fd, foreign)
        with Gate(gate_name) as gate:
            gate.attach()
            ours = gate.prog_id()
            assert attached_ids(root).count(foreign_id) == 1 and ours_attached(gate_name) == 1
        # New managed ranges: ours is swapped in one step (F_REPLACE names our program only).
        with Gate(gate_name, managed=[*Gate(gate_name).managed, DeviceRange(1, 7, 7)]) as wider:
            wider.attach()
            assert wider.prog_id() != ours and ours not in attached_ids(root)
            assert attached_ids(root).count(foreign_id) == 1 and ours_attached(gate_name) == 1
        Gate(gate_name).detach()
        assert ours_attached(gate_name) == 0
        assert attached_ids(root).count(foreign_id) == 1
    finally:
        if foreign_id in attached_ids(root):
            detach_program(root_fd, foreign)
        os.close(foreign)
        os.close(root_fd)
    assert foreign_id not in attached_ids(root)


@pytest.mark.gate
def test_1000_grant_revoke_cycles_keep_one_program_and_an_exact_map(gate, nodes, make_user) -> None:
    user = make_user()
    uids = [user.uid, 60001, 60002, 60003]
    devices = [GPU0, GPU1, GPU2, GPU3]
    expected: set[tuple[int, tuple[int, int]]] = set()
    start = time.monotonic()
    for i in range(1000):
        entry = (uids[i % 4], devices[i * 7 % 4])
        gate.grant(*entry)
        gate.revoke(uids[(i + 1) % 4], devices[i * 3 % 4])
        expected.add(entry)
        expected.discard((uids[(i + 1) % 4], devices[i * 3 % 4]))
        if i % 250 == 0:
            gate.attach()  # idempotent: never a second program
    elapsed = time.monotonic() - start
    print(f"1000 grant/revoke cycles: {elapsed * 1000:.0f} ms")

    assert gate.entries() == expected
    assert ours_attached(gate.name) == 1
    granted = {dev for uid, dev in expected if uid == user.uid}
    assert opens(probe(user, list(nodes.values())), nodes) == only(granted)
    assert gate.status()["entries"] == len(expected)


@pytest.mark.gate
def test_a_later_process_finds_and_reuses_the_gate(gate_name) -> None:
    script = ("import sys; from gpuguard.backends.gate import Gate; g = Gate(sys.argv[1]); "
              "g.attach([4242]); g.grant(1000, (195, 1)); print(g.prog_id())")
    first = subprocess.run([PYTHON, "-c", script, gate_name], capture_output=True, text=True, check=True, cwd=REPO)
    prog_id = int(first.stdout)

    with Gate(gate_name) as gate:
        assert gate.find() and ours_attached(gate_name) == 1
        assert gate.prog_id() == prog_id
        assert gate.entries() == {(1000, GPU1)}
        assert gate.exempt() == {0, 4242}

    # Several processes attaching at once still leave one program, the same one.
    racers = [subprocess.Popen([PYTHON, "-c", script, gate_name], stdout=PIPE, text=True, cwd=REPO) for _ in range(4)]
    try:
        assert {int(racer.communicate(timeout=60)[0]) for racer in racers} == {prog_id}
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.communicate()
    assert ours_attached(gate_name) == 1


@pytest.mark.gate
def test_found_by_name_when_the_pins_are_gone(gate) -> None:
    gate.grant(1000, GPU2)
    prog_id = gate.prog_id()
    for pin in ("prog", "grants", "exempt"):
        (gate.pin_dir / pin).unlink()

    with Gate(gate.name) as again:
        assert again.find() and again.prog_id() == prog_id
        assert again.entries() == {(1000, GPU2)}
        again.attach()  # re-pins, attaches nothing new
        assert (gate.pin_dir / "prog").exists()
        assert ours_attached(gate.name) == 1


@pytest.mark.gate
def test_attach_swaps_in_a_program_for_new_managed_ranges(gate, nodes, make_user) -> None:
    user = make_user()
    gate.grant(user.uid, GPU1)
    old_id = gate.prog_id()
    gate.attach()
    assert gate.prog_id() == old_id  # same ranges: the same program

    # A driver appeared since (nvidia-caps in real life; /dev/full here): one program, swapped.
    with Gate(gate.name, managed=[*gate.managed, DeviceRange(1, 7, 7)]) as wider:
        wider.attach()
        assert wider.prog_id() != old_id
        assert ours_attached(gate.name) == 1
        assert wider.entries() == {(user.uid, GPU1)}  # the maps, and so the grants, are kept
        report = probe(user, [*nodes.values(), "/dev/full"])
        assert opens(report, nodes) == only({GPU1})
        assert report["results"]["/dev/full"] == DENIED
        with Gate(gate.name) as again:
            assert again.find() and again.prog_id() == wider.prog_id()  # the pin follows


@pytest.mark.gate
def test_a_gate_detached_behind_its_back_is_reported_and_reattached(gate, nodes, make_user) -> None:
    user = make_user()
    gate.grant(user.uid, GPU1)
    assert gate.verify().problems == [] and gate.repair([]) == []
    root = cgroup2_root()
    detach_by_id(root, gate.prog_id())  # what `bpftool cgroup detach` would do
    assert set(opens(probe(user, list(nodes.values())), nodes).values()) == {ALLOWED}  # really open

    health = gate.verify()
    assert (health.loaded, health.attached, health.current, health.pinned) == (True, False, True, True)
    assert health.problems == [f"not attached to the cgroup v2 root {root}"]
    status = gate.status()
    assert status["attached"] is False and status["problems"] == health.problems
    assert gate.repair([]) == health.problems
    assert ours_attached(gate.name) == 1 and gate.verify().problems == []
    assert opens(probe(user, list(nodes.values())), nodes) == only({GPU1})  # the same map, the same grant
    assert gate.status()["attached"] is True


@pytest.mark.gate
def test_missing_pins_are_reported_and_pinned_again(gate) -> None:
    prog_id = gate.prog_id()
    (gate.pin_dir / "exempt").unlink()
    assert gate.verify().problems == ["pins missing in bpffs"]
    assert gate.repair([]) == ["pins missing in bpffs"]
    assert (gate.pin_dir / "exempt").exists() and gate.prog_id() == prog_id
    assert gate.verify().problems == []


@pytest.mark.gate
def test_repair_follows_a_gate_replaced_behind_its_back(gate) -> None:
    gate.grant(1000, GPU1)
    with Gate(gate.name) as other:  # an admin's `gpuguard gate detach` and `gate attach`
        other.detach()
        other.attach()
        new_id = other.prog_id()
    health = gate.verify()
    assert not health.held and not health.attached
    assert gate.repair([]) == health.problems
    assert gate.prog_id() == new_id and ours_attached(gate.name) == 1
    assert gate.entries() == set()  # the new gate's map: the store refills it (enforcement.check_and_repair)


@pytest.mark.gate
def test_repair_swaps_in_a_program_for_a_device_range_that_appeared(gate_name, nodes, make_user) -> None:
    """nvidia-caps loaded after start: a new dynamic major (/dev/full, 1:7, stands in for it)."""
    ranges = [DeviceRange(195, 0, 253)]
    user = make_user()
    with Gate(gate_name, managed=lambda: ranges) as gate:
        gate.attach()
        gate.grant(user.uid, GPU1)
        old_id = gate.prog_id()
        assert gate.repair([]) == []
        assert probe(user, ["/dev/full"])["results"]["/dev/full"] == "ok"

        ranges.append(DeviceRange(1, 7, 7))
        health = gate.verify()
        assert health.attached and not health.current
        assert gate.repair([]) == ["program outdated: built for other device ranges than those managed now"]
        assert gate.prog_id() != old_id and ours_attached(gate_name) == 1
        assert gate.managed == (DeviceRange(195, 0, 253), DeviceRange(1, 7, 7))
        report = probe(user, [*nodes.values(), "/dev/full"])
        assert opens(report, nodes) == only({GPU1}) and report["results"]["/dev/full"] == DENIED
        assert gate.verify().problems == []


@pytest.mark.gate
def test_status_reports_grants_per_user(gate) -> None:
    gate.grant(1000, GPU1)
    gate.grant(1000, GPU3)
    gate.grant(1001, GPU0)
    gate.set_exempt([77])
    status = json.loads(json.dumps(gate.status()))
    assert status["attached"] is True and status["prog_id"] == gate.prog_id()
    assert status["cgroup"] == str(cgroup2_root())
    assert status["entries"] == 3
    assert status["users"] == {"1000": ["195:1", "195:3"], "1001": ["195:0"]}
    assert status["exempt"] == [0, 77]


def test_status_of_a_gate_that_does_not_exist() -> None:
    status = Gate(unique()).status()
    assert status["attached"] is False and status["prog_id"] is None and status["entries"] == 0
    assert status["problems"] == ["not loaded: no program or maps of this gate exist"]


@pytest.mark.gate  # gate_name holds the gate test lock
def test_grant_outside_the_managed_range_is_a_bug(gate_name) -> None:
    with pytest.raises(ValueError, match="not managed"):
        Gate(gate_name).grant(1000, CTL)


def test_refused_load_carries_the_verifier_log() -> None:
    with pytest.raises(GateError) as caught:
        load_device_program(assemble([exit_()]), "ggt_bad")  # returns R0 without setting it
    message = str(caught.value)
    assert message.splitlines()[0].startswith("loading the device program refused")
    assert "verifier log:" in message and "R0 !read_ok" in message


@pytest.mark.gate
def test_no_cgroup2_mount_is_named(gate_name) -> None:
    root = cgroup2_root()
    script = "import sys; from gpuguard.backends.gate import Gate; Gate(sys.argv[1]).attach()"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f'umount "{root}" && exec "$0" -c "$1" "$2"', PYTHON, script, gate_name],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0
    assert "GateError: no cgroup v2 mount" in proc.stderr


@pytest.mark.gate
def test_non_root_is_refused_with_the_cause(gate_name, make_user) -> None:
    user = make_user()
    script = ("import sys; from gpuguard.backends.gate import Gate, GateError\n"
              "try: Gate(sys.argv[1]).status()\n"
              "except GateError as exc: print(exc)")
    proc = run_as(user, [PYTHON, "-c", script, gate_name])
    assert "Operation not permitted (bpf() needs root" in proc.stdout, proc.stderr


def test_object_names_fit_the_kernel() -> None:
    assert object_name("gpuguard") == "gpuguard"
    short = object_name("ggt-1a2b3c")
    assert short == object_name("ggt-1a2b3c") != object_name("ggt-1a2b3d")
    for name in ("ggt-1a2b3c", "a" * 64, "x.y-z"):
        assert len(object_name(name)) <= 12 and object_name(name).replace("_", "").isalnum()
    with pytest.raises(ValueError):
        Gate("../escape")
    with pytest.raises(ValueError):
        Gate("ggt-x", managed=[])
    with pytest.raises(ValueError):
        DeviceRange(195, 10, 2)


# --- the admin commands: gpuguard gate status|attach|detach


@pytest.mark.gate
def test_gate_commands_attach_status_detach(gate_name: str, sandbox: Path) -> None:
    config = sandbox / "gpuguard.toml"
    config.write_text("")
    assert cli(None, "gate", "status", "--name", gate_name).returncode == 1  # not attached: says so

    attached = cli(config, "gate", "attach", "--name", gate_name)
    assert attached.returncode == 0, attached.stderr
    Gate(gate_name).grant(4242, GPU1)

    status = json.loads(cli(None, "gate", "status", "--json", "--name", gate_name).stdout)
    assert status["attached"] is True and status["prog_id"] == Gate(gate_name).prog_id()
    assert status["users"] == {"4242": ["195:1"]} and status["entries"] == 1 and 0 in status["exempt"]
    assert ours_attached(gate_name) == 1

    again = cli(config, "gate", "attach", "--name", gate_name)
    assert again.returncode == 0 and ours_attached(gate_name) == 1  # never attached twice

    (Gate(gate_name).pin_dir / "grants").unlink()
    broken = cli(None, "gate", "status", "--name", gate_name)
    assert broken.returncode == 1 and "  problem: pins missing in bpffs" in broken.stdout.splitlines()
    assert cli(config, "gate", "attach", "--name", gate_name).returncode == 0  # repairs
    assert cli(None, "gate", "status", "--name", gate_name).returncode == 0

    detached = cli(None, "gate", "detach", "--name", gate_name)
    assert detached.returncode == 0, detached.stderr
    assert ours_attached(gate_name) == 0
    assert cli(None, "gate", "detach", "--name", gate_name).returncode == 1


@pytest.mark.gate
def test_gate_commands_refuse_non_root(make_user, gate: Gate) -> None:
    user = make_user()
    for action in ("status", "attach", "detach"):
        result = cli(None, "gate", action, "--name", gate.name, user=user)
        assert result.returncode == 1
        assert result.stderr.strip() == f"gpuguard: gate {action} needs root"
    assert ours_attached(gate.name) == 1
