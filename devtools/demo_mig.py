"""`sudo make demo-mig`: one simulated H200 cut into seven 1g.18gb MIG slices, and seven users
who log in and get one slice each, kernel-enforced like whole GPUs.

The stage is the main tour's (devtools/demo.py): real users, real PAM logins through `su -`,
a daemon with a gate of its own, all named `ggt-*` and removed at the end.
"""
from __future__ import annotations

from contextlib import ExitStack

from devtools.demo import Tour, stage, step
from gpuguard import client

NAMES = ("ada", "ben", "cy", "dee", "eli", "fay", "gus")

H200_CUT_IN_SEVEN = """\
[defaults]
gpus = 1

[gpu.simulated]
count = 1
name = "NVIDIA H200"
memory = "141GiB"
# The admin's layout (nvidia-smi mig -cgi ... -C on a real server): GPU 0 in MIG mode, seven slices.
mig = { "0" = ["1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb", "1g.18gb"] }
"""


def slice_of(t: Tour, name: str) -> str:
    """The MIG UUID of the slice `name` holds."""
    return client.call(str(t.socket), "whoami", user=t.users[name])["grants"][0]["uuid"]


def tour(t: Tour) -> None:
    step("1. One H200 in MIG mode, cut by the admin into seven 1g.18gb slices")
    t.admin("gpus")

    step("2. The daemon starts: the gate covers the GPU node and the MIG capability nodes")
    t.start_daemon()
    t.admin("gate", "status", "--name", t.gate)

    step("3. Seven users log in: each gets a slice of their own, named in CUDA_VISIBLE_DEVICES, and trains on it")
    for name in NAMES:
        t.login(name, """
echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
nohup gpuguard sim burn --slice $CUDA_VISIBLE_DEVICES --mem 12GiB --seconds 20 > train.log 2>&1 &
sleep 0.5; cat train.log
""")

    step("4. ada's neighbour's slice is closed to her by the kernel (its capability nodes)")
    t.login("ada", f"""
gpuguard whoami | head -n 5
gpuguard sim burn --slice {slice_of(t, "ben")} --mem 1GiB --seconds 0
""")

    step("5. Everyone sees the slices, who holds them and what runs there")
    t.admin("status")

    step("6. The jobs end; their owners are logged out, so the slices go back")
    t.wait_until_free()
    t.admin("status", "--csv")

    step("7. The admin gives ada and ben a slice each for the afternoon")
    t.admin("grant", t.users["ada"], "--gpus", "1", "--for", "4h")
    t.admin("grant", t.users["ben"], "--gpus", "1", "--for", "4h")

    step("8. The admin re-cuts the GPU into two 3g.71gb slices (no process may run on it, as with nvidia-smi): "
         "the grants on changed slices end, and their users are told")
    t.admin("sim", "mig", "0", "3g.71gb", "3g.71gb")
    t.wait_for_event("ada", "revoke")
    t.admin("whoami", "--user", t.users["ada"])
    t.admin("gpus")

    step("9. ada logs in again: she gets one of the new slices")
    t.login("ada", "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES")


def main() -> int:
    def play(stack: ExitStack) -> None:
        t = Tour(stack, members=NAMES, outsiders=())
        t.setup(lab=H200_CUT_IN_SEVEN)
        tour(t)
    return stage(play, "demo-mig")


if __name__ == "__main__":
    raise SystemExit(main())
