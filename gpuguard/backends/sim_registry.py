"""The simulated GPUs' shared directory, `device_dir/.gpuguard-sim/` (mode 1777, made by the
backend): the process registry that simulated CUDA programs write and the fake NVML library
reads, and the fault file.

Processes. `gpuguard sim burn` stands in for a CUDA program: after opening its GPU's node it
registers itself here, one file `<pid>-<random>.json` per process:
    {"pid": 123, "uid": 1000, "start_time": 4567, "minor": 2,
     "memory": 4294967296 or null (NVML cannot tell), "util": 100, "type": "C" | "G" | "C+G"}
`start_time` is field 22 of /proc/<pid>/stat. Any process (the root daemon included) reads
the directory; a record counts only while the file owner, the record's uid and the real uid
of the live process all agree and the start time still matches, so dead processes, reused
pids and records planted for someone else's process are ignored (and removed when the
reader may). The fake reports the memory of live processes as used on their GPU and the
sum of their utilization (capped at 100%) as the GPU's utilization.

Fault injection. While `fail` here exists and is owned by root, it holds an NVML error name,
optionally followed by minors:
    NVML_ERROR_UNKNOWN          every process query (nvmlDeviceGet{Compute,Graphics}RunningProcesses_v3)
                                returns that code: NVML itself fails, NvmlBackend raises GpuError
    NVML_ERROR_GPU_IS_LOST 2 3  every call on GPUs 2 and 3 (anything taking their handle) returns
                                it, as for GPUs that fell off the bus; the others answer
Remove the file to heal. It persists rather than firing once so that a watcher's confirming
re-sample sees the same failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

import pynvml

from gpuguard.backends import GpuError, procfs
from gpuguard.core.model import ProcessIdentity

REGISTRY_DIR = ".gpuguard-sim"
FAIL_FILE = "fail"
PROCESS_TYPES = ("C", "G", "C+G")   # as nvidia-smi shows them: compute, graphics, both
_MAX_RECORD = 4096               # bytes; records are tiny, anything bigger is not ours


@dataclass(frozen=True)
class SimProcess:
    pid: int
    uid: int
    start_time: int           # clock ticks after boot, /proc/<pid>/stat field 22
    minor: int
    memory: int | None        # bytes; None = NVML cannot tell
    util: int                 # percent of the GPU this process keeps busy
    type: str = "C"
    gpu_instance: int | None = None      # the MIG slice it runs on (both ids, or neither)
    compute_instance: int | None = None

    def running(self) -> bool:
        """Whether the process this record describes still runs (not a later one with its pid)."""
        identity = _running(self.pid)
        return identity is not None and identity.start_time == self.start_time


def _running(pid: int) -> ProcessIdentity | None:
    """uid and start time of a running process; None when it is gone or a zombie (NVML drops
    a process as soon as it exits, before its parent reaps it)."""
    info = procfs.inspect(pid)
    return info.identity if info is not None and info.state not in ("Z", "X") else None


def register_process(device_dir: Path, pid: int, minor: int, memory: int | None, util: int,
                     type: str = "C", mig: tuple[int, int] | None = None) -> Path:
    """Announce that process `pid` uses GPU `minor` (its MIG slice `mig`: GI and CI ids); the
    record lives until the process does. Raises OSError (FileNotFoundError: no simulated GPUs in device_dir)."""
    identity = _running(pid)
    if identity is None:
        raise ProcessLookupError(f"no running process {pid}")
    gpu_instance, compute_instance = mig if mig is not None else (None, None)
    record = SimProcess(pid, identity.uid, identity.start_time, minor, memory, util, type,
                        gpu_instance, compute_instance)
    directory = device_dir / REGISTRY_DIR
    path = directory / f"{pid}-{secrets.token_hex(4)}.json"  # unguessable: nobody can pre-create it
    temp = directory / f".{path.name}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o644)  # whatever the umask: every reader must see it
        json.dump(asdict(record), handle)
    os.rename(temp, path)  # readers only ever see complete records
    return path


def _parse_record(entry: os.DirEntry[str]) -> SimProcess | None:
    """The record in this file if it is well formed and really describes its writer's process."""
    try:
        owner = entry.stat(follow_symlinks=False).st_uid
        with open(entry.path, "rb") as handle:
            data = json.loads(handle.read(_MAX_RECORD))
        record = SimProcess(**data)
    except (OSError, ValueError, TypeError):
        return None
    numbers = (record.pid, record.uid, record.start_time, record.minor, record.util)
    ids = (record.gpu_instance, record.compute_instance)
    if not (all(type(n) is int for n in numbers)
            and (record.memory is None or type(record.memory) is int and record.memory >= 0)
            and record.type in PROCESS_TYPES and 0 <= record.util <= 100
            and (ids == (None, None) or all(type(i) is int and i >= 0 for i in ids))):
        return None
    # The directory is world-writable: a record counts only for its writer's own process,
    # or anyone could make the watcher blame (and kill) another user's process.
    if not owner == record.uid == procfs.user_of(record.pid):
        return None
    return record


class Registry:
    """Live simulated processes, read from the registry directory on every query.

    Parsed records are cached by (name, inode): a record is written once and renamed into
    place, so the pair identifies its content. Liveness is checked on every read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._parsed: dict[tuple[str, int], SimProcess] = {}

    def processes(self, minor: int) -> list[SimProcess]:
        live, parsed = [], {}
        for entry in os.scandir(self.directory):
            if not entry.name[:1].isdigit() or not entry.name.endswith(".json"):  # records are <pid>-*.json
                continue
            key = (entry.name, entry.inode())
            record = self._parsed.get(key) or _parse_record(entry)
            if record is not None and record.minor != minor:
                parsed[key] = record  # the query for its own GPU checks that it still runs
            elif record is not None and record.running():
                parsed[key] = record
                live.append(record)
            else:
                with contextlib.suppress(OSError):  # dead, reused pid or bogus; root may remove any
                    os.unlink(entry.path)
        self._parsed = parsed  # every scan sees every file: forget the ones that went away
        return sorted(live, key=lambda p: p.pid)

    def fault(self) -> tuple[int, frozenset[int] | None]:
        """The injected NVML error (NVML_SUCCESS: none) and the minors it hits (None: NVML itself)."""
        path = self.directory / FAIL_FILE
        try:
            if path.lstat().st_uid != 0:  # world-writable directory: only root injects faults
                return pynvml.NVML_SUCCESS, None
            words = path.read_text().split()
        except FileNotFoundError:
            return pynvml.NVML_SUCCESS, None
        name, minors = (words[0], words[1:]) if words else ("", [])
        if not name.startswith("NVML_ERROR_") or not hasattr(pynvml, name) or not all(m.isdigit() for m in minors):
            raise ValueError(f"{path}: expected an NVML error name and optional GPU minors, got {words}")
        return getattr(pynvml, name), frozenset(map(int, minors)) if minors else None




def make_registry(device_dir: Path) -> Path:
    directory = device_dir / REGISTRY_DIR
    try:
        directory.mkdir()
        os.chmod(directory, 0o1777)  # like /tmp: every user registers, nobody removes others' records
    except FileExistsError:
        pass
    except OSError as exc:
        raise GpuError(f"cannot create {directory}: {exc.strerror}") from None
    return directory
