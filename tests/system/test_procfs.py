"""holders() and process identity against real processes of real users; driver majors from
/proc/devices, the real one and (in a private mount namespace) one with NVIDIA's drivers loaded."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import popen_as
from probes import holding, open_node
from sim_helpers import run_with_proc_devices

from devtools.harness import no_gate_attached
from gpuguard.backends import procfs
from gpuguard.backends.gate import DeviceRange, default_managed
from gpuguard.backends.procfs import IdentityCache, char_major, holders, process_identity, user_of
from gpuguard.core.model import NVIDIA_MAJOR


def psutil_ticks(pid: int) -> int:
    """The start time in clock ticks after boot as psutil sees it: a reference independent of ours."""
    return round((psutil.Process(pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))


def test_holders_match_the_device_not_the_path(sandbox, make_user) -> None:
    # A private copy of /dev/full: the holder opens it by a path nobody else uses.
    node = open_node(sandbox / "full", (1, 7))
    user = make_user()
    # test_gate has gates manage 1:7 too: while one is attached (in any test run), the open fails.
    with no_gate_attached(), holding(user, node) as holder:
        assert holder.pid in holders((1, 7))
        assert holder.pid not in holders((1, 3))
    assert holder.pid not in holders((1, 7))


def test_identity_of_a_user_process(make_user) -> None:
    user = make_user()
    proc = popen_as(user, ["sleep", "30"])
    try:
        identity = process_identity(proc.pid)
        assert identity is not None
        assert (identity.pid, identity.uid) == (proc.pid, user.uid)
        assert user_of(proc.pid) == user.uid
        # The start time is what tells this process from a later one with the same pid.
        assert identity.start_time == psutil_ticks(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert process_identity(proc.pid) is None and user_of(proc.pid) is None


def test_identity_survives_an_awkward_command_name(sandbox) -> None:
    # comm may contain spaces and parentheses; fields are counted after the last ')'.
    odd = sandbox / "a) b ("
    shutil.copy("/bin/sleep", odd)
    proc = subprocess.Popen([str(odd), "30"])
    try:
        identity = process_identity(proc.pid)
        assert identity is not None and identity.uid == 0
        assert identity.start_time == psutil_ticks(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def proc_devices_chars() -> dict[str, int]:
    """Character drivers in the real /proc/devices, read here independently of procfs.char_major."""
    section, chars = "", {}
    for line in Path("/proc/devices").read_text().splitlines():
        if line.endswith(":"):
            section = line
        elif line.strip() and section == "Character devices:":
            number, name = line.split(None, 1)
            chars.setdefault(name, int(number))
    return chars


def test_char_major() -> None:
    assert char_major("mem") == 1
    assert char_major("ggt-no-such-driver") is None
    for name, major in proc_devices_chars().items():
        assert char_major(name) == major


def test_default_managed_has_nvidia_caps_only_when_its_driver_is_loaded() -> None:
    caps = proc_devices_chars().get("nvidia-caps")
    expected = [DeviceRange(NVIDIA_MAJOR, 0, 253), *([DeviceRange(caps)] if caps is not None else [])]
    assert list(default_managed()) == expected


LOADED = """Character devices:
  1 mem
195 nvidia-frontend
234 nvidia-caps
508 nvidia-uvm

Block devices:
  7 loop
259 blkext
"""


def test_majors_come_from_proc_devices_as_the_driver_registers_them(sandbox) -> None:
    """With NVIDIA's drivers loaded (a /proc/devices of our own, in a private mount namespace):
    the caps major is whatever the kernel gave nvidia-caps, and only character devices count."""
    code = ("import json\nfrom gpuguard.backends import gate, procfs\n"
            "print(json.dumps({'caps': procfs.char_major('nvidia-caps'), 'uvm': procfs.char_major('nvidia-uvm'),"
            " 'loop': procfs.char_major('loop'), 'mem': procfs.char_major('mem'),"
            " 'managed': [[r.major, r.first, r.last] for r in gate.default_managed()]}))")
    seen = run_with_proc_devices(LOADED, code, sandbox)
    assert seen == {"caps": 234, "uvm": 508, "loop": None, "mem": 1,
                    "managed": [[NVIDIA_MAJOR, 0, 253], [234, 0, (1 << 20) - 1]]}
    # nvidia-caps as a block device name is not the caps driver.
    unloaded = LOADED.replace("234 nvidia-caps\n", "").replace("259 blkext", "234 nvidia-caps")
    seen = run_with_proc_devices(unloaded, code, sandbox)
    assert seen["caps"] is None and seen["managed"] == [[NVIDIA_MAJOR, 0, 253]]


SETUID_ON_LINE = ("import os, sys\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                  "os.setresuid(int(sys.argv[1]), int(sys.argv[1]), 0)\nprint('changed', flush=True)\ninput()")


def test_identity_cache_reads_again_a_process_that_changed(make_user) -> None:
    """Reused for a process seen before; read again once it is not the process it was (here: its
    uid changed), and forgotten once it is gone."""
    user = make_user()
    changer = subprocess.Popen([sys.executable, "-c", SETUID_ON_LINE, str(user.uid)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    sleeper = popen_as(user, ["sleep", "300"])
    cache = IdentityCache()
    try:
        assert changer.stdout.readline().strip() == "ready"
        pids = [changer.pid, sleeper.pid]
        first = cache.identities(pids)
        assert first == {pid: process_identity(pid) for pid in pids} and first[changer.pid].uid == 0
        assert cache.identities(pids) == first
        changer.stdin.write("\n")
        changer.stdin.flush()
        assert changer.stdout.readline().strip() == "changed"
        assert cache.identities(pids)[changer.pid] == process_identity(changer.pid)
        assert cache.identities(pids)[changer.pid].uid == user.uid
        sleeper.kill()
        sleeper.wait()
        assert sleeper.pid not in cache.identities(pids)
    finally:
        changer.kill()
        changer.wait()
        sleeper.kill()
        sleeper.wait()


def test_holders_of_some_users_reads_only_their_processes(make_user, sandbox):
    node = sandbox / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    alice, bob = make_user(), make_user()
    code = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('held', flush=True); time.sleep(600)"
    procs = [popen_as(user, [sys.executable, "-c", code, str(node)], stdout=subprocess.PIPE, text=True)
             for user in (alice, bob)]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "held\n"
        everyone = procfs.openers_of([(1, 3)])[(1, 3)]
        assert {p.pid for p in procs} <= set(everyone)
        assert procfs.openers_of([(1, 3)], owners={alice.uid})[(1, 3)] == [procs[0].pid]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_comm_is_the_name_stat_has_in_one_read() -> None:
    """procfs.comm (the sample names each GPU process with it, each tick) agrees with inspect(),
    which parses the name out of /proc/<pid>/stat, also for a name with spaces and parentheses."""
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'ggt a) (b', 0, 0, 0)\n"
            "print('named', flush=True); sys.stdin.readline()")
    named = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert named.stdout.readline() == "named\n"
        assert procfs.comm(named.pid) == procfs.inspect(named.pid).comm == "ggt a) (b"
    finally:
        named.communicate("\n", timeout=30)
    assert procfs.comm(named.pid) is None
