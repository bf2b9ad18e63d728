"""The daemon under exactly the capabilities etc/gpuguard.service leaves it, doing every privileged
thing it does: make GPU nodes (mknod), attach and fill the gate (bpf), take over a node someone
else made (chown, ACL), find and end a process of another user holding a revoked GPU (/proc fds,
kill). setpriv stands in for systemd's CapabilityBoundingSet= (this machine's PID 1 is no systemd).
Each capability of the set is also dropped in turn, to see that the daemon then fails at the job
it is there for: the set is what the daemon needs, not a guess. (Found this way: CAP_FOWNER is not
needed, since the daemon chowns a node to root before it touches its mode and ACL, and CAP_BPF adds
nothing to CAP_SYS_ADMIN, which bpf() needs anyway to query and open programs by id. CAP_NET_ADMIN:
on this kernel (6.18) anyone may subscribe to process events, so without it the daemon still
follows processes, but with the kernel's default receive buffer, which a burst of forks overflows.)
"""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess

import pytest
from conftest import PYTHON, REPO, popen_as
from probes import open_node
from test_daemon import access, only
from test_shipped_files import setting, unit_sections

from devtools.harness import wait_for
from gpuguard import client
from gpuguard.backends.posix_acl import acl_users
from gpuguard.backends.proc_events import RECEIVE_BUFFER
from gpuguard.core.model import NVIDIA_MAJOR

pytestmark = pytest.mark.gate

UNIT = REPO / "etc" / "gpuguard.service"
CAPABILITIES = setting(unit_sections(UNIT), "Service", "CapabilityBoundingSet").split()
# Each capability of the unit's set (its number in linux/capability.h), and the job the daemon
# cannot do without it.
NEEDED = {"CAP_CHOWN": (0, "take a node back"), "CAP_DAC_READ_SEARCH": (2, "find holders"),
          "CAP_KILL": (5, "end holders"), "CAP_SYS_PTRACE": (19, "find holders"),
          "CAP_SYS_ADMIN": (21, "start"),  # query, attach and open the gate by id
          "CAP_MKNOD": (27, "start"),      # the GPU nodes NVML opens at start
          "CAP_NET_ADMIN": (12, "follow processes")}  # process events, with their full receive buffer


def setpriv(capabilities: list[str]) -> tuple[str, ...]:
    names = ",".join("+" + cap.removeprefix("CAP_").lower() for cap in capabilities)
    return ("setpriv", "--bounding-set", f"-all,{names}", "--")


def bounding_set(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1], 16) for line in status if line.startswith("CapBnd:"))


def test_the_unit_names_only_capabilities_this_test_knows() -> None:
    assert sorted(CAPABILITIES) == sorted(NEEDED)


def following_processes(d) -> bool:
    """Whether the daemon's process index is subscribed with the receive buffer it asks for (the kernel
    grants it doubled, socket(7); without CAP_NET_ADMIN at most net.core.rmem_max doubled: 4 MiB here)."""
    if not wait_for(lambda: "event=process_index" in d.log(), timeout=10):
        return False
    started = next(line for line in d.log().splitlines() if "event=process_index " in line or
                   "event=process_index_unavailable" in line)
    granted = re.search(r"receive_buffer=(\d+)", started)
    return granted is not None and int(granted.group(1)) >= 2 * RECEIVE_BUFFER


def jobs_undone(d) -> list[str]:
    """Run the daemon's privileged jobs; the names of those it did not do ([]: all done)."""
    undone = []
    if not following_processes(d):
        undone.append("follow processes")
    if not all(stat.S_ISCHR((st := os.stat(d.node(m))).st_mode) and stat.S_IMODE(st.st_mode) == 0o660
               and st.st_uid == 0 for m in range(4) if d.node(m).exists()) or not d.node(0).exists():
        undone.append("make nodes")  # mknod, root:root 0660
    alice = d.add_member()
    opened = d.open_session(alice)
    (minor,) = opened["gpus"] or (0,)
    if not opened["gpus"] or access(d, alice) != only(d, minor):
        undone.append("grant")  # the gate map and the node ACLs

    # A node remade by someone else, owned by alice: the daemon takes it back (chown, chmod, ACL).
    d.node(minor).unlink(missing_ok=True)
    open_node(d.node(minor), (NVIDIA_MAJOR, minor))
    os.chown(d.node(minor), alice.uid, alice.gid)
    if not wait_for(lambda: os.stat(d.node(minor)).st_uid == 0 and acl_users(d.node(minor)) == {alice.uid}
                    and stat.S_IMODE(os.stat(d.node(minor)).st_mode) == 0o660, timeout=5):
        undone.append("take a node back")

    # Revoke: alice's process holding the node (no CUDA context) is found through /proc and ended.
    code = "import os, sys, time; os.open(sys.argv[1], os.O_PATH); print('held', flush=True); time.sleep(600)"
    holder = popen_as(alice, [PYTHON, "-c", code, str(d.node(minor))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        try:
            holders = d.call("revoke", user=alice.name)["holders"]
        except client.Refused as exc:
            print(f"revoke: {exc}")
            holders = None
        if holders != [{"pid": holder.pid, "minor": minor}]:
            undone.append("find holders")
        try:
            ended = holder.wait(5) == -signal.SIGTERM
        except subprocess.TimeoutExpired:
            ended = False
        if not ended:
            undone.append("end holders")
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    return undone


def test_the_daemon_does_its_whole_job_with_the_units_capabilities(start_daemon) -> None:
    d = start_daemon(wrapper=setpriv(CAPABILITIES))
    assert bounding_set(d.proc.pid) == sum(1 << NEEDED[cap][0] for cap in CAPABILITIES)
    assert jobs_undone(d) == []


@pytest.mark.parametrize("dropped", sorted(NEEDED))
def test_without_any_one_of_them_a_job_is_left_undone(start_daemon, dropped) -> None:
    try:
        d = start_daemon(wrapper=setpriv([cap for cap in CAPABILITIES if cap != dropped]))
    except AssertionError as exc:  # not ready: it said why on stderr, which the fixture shows
        print(exc)
        undone = ["start"]
    else:
        undone = jobs_undone(d)
    assert NEEDED[dropped][1] in undone, undone
