"""Run as a test user: open device nodes and report what the kernel answered, as one JSON line.

    gate_probe.py [--wait] [--detach] PATH...   {"uid", "pid", "sid", "cgroup", "results": {PATH: "ok" | errno name}}
    gate_probe.py --hold PATH                    open PATH, print "held", keep it open until stdin closes

--wait reads a line from stdin first (the test moves the process into a cgroup meanwhile).
--detach probes from a grandchild in a session of its own (setsid + double fork), like a daemon.
Only the standard library: it runs with `python -I -S`.
"""
from __future__ import annotations

import errno
import json
import os
import sys


def probe(paths: list[str]) -> dict[str, str]:
    results = {}
    for path in paths:
        try:
            os.close(os.open(path, os.O_RDWR))
            results[path] = "ok"
        except OSError as exc:
            results[path] = errno.errorcode[exc.errno]
    return results


def main(args: list[str]) -> None:
    if args[0] == "--hold":
        fd = os.open(args[1], os.O_RDWR)
        print("held", flush=True)
        sys.stdin.read()
        os.close(fd)
        return
    if args[0] == "--wait":
        sys.stdin.readline()
        args = args[1:]
    if args[0] == "--detach":
        args = args[1:]
        if os.fork():
            os._exit(0)
        os.setsid()
        if os.fork():
            os._exit(0)
    with open("/proc/self/cgroup") as cgroups:
        cgroup = next(line.split(":", 2)[2].strip() for line in cgroups if line.startswith("0::"))
    json.dump({"uid": os.getuid(), "pid": os.getpid(), "sid": os.getsid(0), "cgroup": cgroup,
               "results": probe(args)}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
