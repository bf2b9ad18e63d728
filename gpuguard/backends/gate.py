"""The gate: a cgroup v2 device program that lets a user open only the GPUs granted to them.

One BPF_PROG_TYPE_CGROUP_DEVICE program is attached with BPF_F_ALLOW_MULTI to the root of the
cgroup v2 hierarchy, so it judges every open() of a device node on the machine: login sessions,
cron and at jobs, nohup'd work after logout, containers, user namespaces. It reads two hash maps:
grants {(uid, major<<20|minor)} and exempt {uid}; a grant or a revoke is one map write.

The program and maps are pinned in bpffs under /sys/fs/bpf/gpuguard/<name>/, so the attachment
outlives the process that made it and a later process finds it; when the pins are gone the
program is found by its object name among those attached to the root. Everything is built with
raw bpf() syscalls through ctypes (bpf.py; the program is assembled by bpf_asm.py): no compiler
and no libbpf at run time. verify() asks the kernel whether all of this still holds, repair()
puts it right.

The kernel checks access only at open(): revoking must also end processes that hold the node
(see procfs.holders).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gpuguard.backends import GateError, bpf
from gpuguard.backends.bpf_asm import (
    ADD,
    AND,
    GET_CURRENT_UID_GID,
    JEQ,
    JGT,
    JLT,
    JNE,
    LSH,
    MAP_LOOKUP_ELEM_HELPER,
    OR,
    R0,
    R1,
    R2,
    R6,
    R7,
    R8,
    R9,
    R10,
    Insn,
    Label,
    alu,
    alu_imm,
    assemble,
    call,
    exit_,
    goto,
    jump_imm,
    load32,
    load_map,
    mov,
    mov32,
    mov_imm,
    store32,
)
from gpuguard.backends.mounts import BPFFS, cgroup2_root, ensure_bpffs
from gpuguard.backends.procfs import char_major
from gpuguard.core.model import NVIDIA_MAJOR, Device

# --- the device program ------------------------------------------------------------------------

MINOR_BITS = 20
MINOR_MAX = (1 << MINOR_BITS) - 1
CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR = 0, 4, 8  # struct bpf_cgroup_dev_ctx
DEV_CHAR = 2  # BPF_DEVCG_DEV_CHAR, in the low 16 bits of access_type
ALLOW, DENY = 1, 0


@dataclass(frozen=True)
class DeviceRange:
    """Character devices major:first..last (inclusive) that only grantees may open."""

    major: int
    first: int = 0
    last: int = MINOR_MAX

    def __post_init__(self) -> None:
        if not (0 <= self.major < 1 << 12 and 0 <= self.first <= self.last <= MINOR_MAX):
            raise ValueError(f"bad device range {self}")

    def covers(self, dev: Device) -> bool:
        return dev[0] == self.major and self.first <= dev[1] <= self.last

    def __str__(self) -> str:
        return f"{self.major}:{self.first}-{self.last}"


def managed_ranges(caps_major: int | None, unmanaged: Collection[Device] = ()) -> tuple[DeviceRange, ...]:
    """/dev/nvidia0..253 (254 and 255 are nvidia-modeset and nvidiactl, open to all), plus every
    node of the nvidia-caps major (MIG capabilities: the slices' access, and config and monitor,
    which no grant ever opens) when there is one; less the `unmanaged` nodes (GPUs another system
    owns: gpuguard.core.coexist), which split a range in two."""
    ranges = [DeviceRange(NVIDIA_MAJOR, 0, 253)]
    if caps_major is not None:
        ranges.append(DeviceRange(caps_major))
    return tuple(part for rng in ranges for part in _without(rng, sorted(m for major, m in unmanaged
                                                                         if major == rng.major)))


def _without(rng: DeviceRange, minors: list[int]) -> list[DeviceRange]:
    """The parts of a range left between the (sorted) minors taken out of it."""
    parts, first = [], rng.first
    for minor in minors:
        if first <= minor <= rng.last:
            if minor > first:
                parts.append(DeviceRange(rng.major, first, minor - 1))
            first = minor + 1
    if first <= rng.last:
        parts.append(DeviceRange(rng.major, first, rng.last))
    return parts


def default_managed() -> tuple[DeviceRange, ...]:
    """The ranges for the nvidia-caps major the loaded driver registered (/proc/devices)."""
    return managed_ranges(char_major("nvidia-caps"))


def device_program(managed: Sequence[DeviceRange], grants_fd: int, exempt_fd: int) -> list[Insn | Label]:
    """allow unless the device is managed and the caller's uid is neither exempt nor granted it."""
    program: list[Insn | Label] = [
        # R1 (ctx) is clobbered by helper calls: keep it in R6. Block devices are never managed.
        mov(R6, R1),
        load32(R2, R6, CTX_ACCESS_TYPE),
        alu_imm(AND, R2, 0xFFFF),
        jump_imm(JNE, R2, DEV_CHAR, "allow"),
        load32(R7, R6, CTX_MAJOR),
        load32(R8, R6, CTX_MINOR),
    ]
    # One block per managed range: a hit jumps to "managed", anything else falls through to allow.
    for i, rng in enumerate(managed):
        miss = f"not_range_{i}"
        program.append(jump_imm(JNE, R7, rng.major, miss))
        if rng.first > 0:
            program.append(jump_imm(JLT, R8, rng.first, miss))
        if rng.last < MINOR_MAX:
            program.append(jump_imm(JGT, R8, rng.last, miss))
        program += [goto("managed"), Label(miss)]
    program += [
        goto("allow"),

        Label("managed"),
        # uid as seen from the initial user namespace (low half), so `unshare -U -r` changes nothing.
        call(GET_CURRENT_UID_GID),
        mov32(R9, R0),
        # Root is always exempt: the daemon and admins must never lock themselves out.
        jump_imm(JEQ, R9, 0, "allow"),
        # Build the key {u32 uid; u32 major<<20|minor} on the stack at fp-8.
        store32(R10, -8, R9),
        alu_imm(LSH, R7, MINOR_BITS),
        alu(OR, R7, R8),
        store32(R10, -4, R7),

        # Exempt uid (key: the first 4 bytes)?
        *load_map(R1, exempt_fd),
        mov(R2, R10),
        alu_imm(ADD, R2, -8),
        call(MAP_LOOKUP_ELEM_HELPER),
        jump_imm(JNE, R0, 0, "allow"),

        # Granted (uid, device)?
        *load_map(R1, grants_fd),
        mov(R2, R10),
        alu_imm(ADD, R2, -8),
        call(MAP_LOOKUP_ELEM_HELPER),
        jump_imm(JNE, R0, 0, "allow"),

        mov_imm(R0, DENY),
        exit_(),

        Label("allow"),
        mov_imm(R0, ALLOW),
        exit_(),
    ]
    return program


# --- where things live ---------------------------------------------------------------------

PIN_ROOT = BPFFS / "gpuguard"
GRANTS_MAX = 16384  # (uid, device) pairs: 100 users x 8 GPUs x MIG slices fit many times over
EXEMPT_MAX = 1024
_GRANT_KEY = struct.Struct("<II")  # {u32 uid; u32 major<<20|minor}
_EXEMPT_KEY = struct.Struct("<I")


PINS = ("prog", "grants", "exempt")

Entry = tuple[int, Device]  # (uid, (major, minor)): one grant in the map


def object_name(name: str) -> str:
    """A deterministic BPF object name for an instance: at most 12 of the kernel's 15 characters
    (map suffixes follow), letters, digits and '_' only (the kernel refuses '-')."""
    if re.fullmatch(r"[A-Za-z0-9_]{1,12}", name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:3] + "_" + digest


def _built_from(prog_fd: int, code: bytes) -> bool:
    """Whether the loaded program is `code` (assembled with map fds 0): the kernel's tag hashes
    the instructions with map fds zeroed, with SHA-256 on recent kernels and SHA-1 before."""
    tag = bytes(bpf.prog_info(prog_fd).tag)
    return tag in (hashlib.sha256(code).digest()[:8], hashlib.sha1(code).digest()[:8])


def _dev_code(dev: Device) -> int:
    major, minor = dev
    return major << MINOR_BITS | minor


@dataclass(frozen=True)
class Health:
    """What Gate.verify() found: each field True when that part of the gate is right."""

    loaded: bool     # a program and maps of this gate exist (pinned, or attached to the root)
    held: bool       # the objects this process holds are the ones pinned (not a detached predecessor)
    attached: bool   # that program is attached to the cgroup v2 root
    current: bool    # it is the program built now for the managed ranges (nvidia-caps loaded since: not)
    pinned: bool     # all of program, grants and exempt are pinned in bpffs
    cgroup: str

    @property
    def problems(self) -> list[str]:
        """One line per thing wrong, for the log and `gate status`; empty when all is right."""
        if not self.loaded:
            return ["not loaded: no program or maps of this gate exist"]
        found = []
        if not self.held:
            found.append("replaced behind our back: the pinned gate is not the one this process holds")
        if not self.attached:
            found.append(f"not attached to the cgroup v2 root {self.cgroup}")
        if not self.current:
            found.append("program outdated: built for other device ranges than those managed now")
        if not self.pinned:
            found.append("pins missing in bpffs")
        return found


# --- the gate ---------------------------------------------------------------------------------

class Gate:
    """One gate instance: program + grants map + exempt map, attached to the cgroup v2 root.

    Methods find the pinned (or attached) objects on first use, so a new process can
    grant, revoke or detach a gate that another process attached.
    """

    def __init__(self, name: str = "gpuguard",
                 managed: Sequence[DeviceRange] | Callable[[], Sequence[DeviceRange]] = default_managed):
        """managed: the device ranges only grantees may open, or where to ask for them. A callable
        is asked again at every attach() and verify(): with default_managed, an nvidia-caps module
        loaded after start (a new dynamic major) is managed from the next repair() on."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
            raise ValueError(f"bad gate name {name!r}: use letters, digits, '_', '.', '-'")
        self.name = name
        if callable(managed):
            self._managed_now = managed
        else:
            fixed = tuple(managed)
            self._managed_now = lambda: fixed
        self.managed = self._wanted_managed()
        self.object_name = object_name(name)
        self.pin_dir = PIN_ROOT / name
        self._fds: dict[str, int] = {}  # "prog", "grants", "exempt"

    # finding and attaching

    def find(self) -> bool:
        """Open an existing gate of this name (pinned, or attached to the root); False if none."""
        self.close()
        return self._open_pins() or self._open_attached()

    def attach(self, exempt_uids: Iterable[int] = ()) -> None:
        """Make sure this gate is loaded, pinned and attached exactly once, reusing what exists.

        A program built for other managed ranges (nvidia-caps loaded since, gpuguard upgraded)
        is swapped for a new one in a single step, keeping the maps and so every grant.
        """
        root = cgroup2_root()
        ensure_bpffs()
        bpf.raise_memlock()  # before any map or program is made, here or swapped in below
        self.managed = self._wanted_managed()
        with self._locked():
            if not self._fds and not self.find():
                self._create()
            self.set_exempt(exempt_uids)
            old = self._fds["prog"]
            current = self.is_current()
            new = old if current else bpf.load_device_program(
                self._code(self._fds["grants"], self._fds["exempt"]), self.object_name)
            attached = bpf.prog_info(old).id in bpf.attached_ids(root)
            try:
                with bpf.opened(root) as cgroup_fd:
                    if not attached:
                        bpf.attach_program(cgroup_fd, new)
                    elif not current:
                        bpf.attach_program(cgroup_fd, new, replace=old)
            except OSError as exc:
                if not current:
                    os.close(new)
                raise bpf.error(f"attaching the gate to {root} refused", exc) from None
            if not current:
                (self.pin_dir / "prog").unlink(missing_ok=True)
                os.close(old)
                self._fds["prog"] = new
            self._pin()

    def detach(self) -> None:
        """Detach and unpin this gate; programs that are not this gate's are never touched."""
        if self._fds or self.find():
            root = cgroup2_root()
            if self.prog_id() in bpf.attached_ids(root):
                try:
                    with bpf.opened(root) as cgroup_fd:
                        bpf.detach_program(cgroup_fd, self._fds["prog"])
                except OSError as exc:
                    raise bpf.error(f"detaching the gate from {root} refused", exc) from None
            self.close()
        for pin in PINS:
            (self.pin_dir / pin).unlink(missing_ok=True)
        for directory in (self.pin_dir, PIN_ROOT):
            try:
                directory.rmdir()
            except OSError:
                pass  # absent, or another instance still lives there

    def is_attached(self) -> bool:
        if not self._fds and not self.find():
            return False
        return self.prog_id() in bpf.attached_ids(cgroup2_root())

    def prog_id(self) -> int:
        return int(bpf.prog_info(self._need("prog")).id)

    def is_current(self) -> bool:
        """Whether the loaded program is the one this gpuguard builds for today's managed devices
        (attach() swaps any other for it)."""
        return _built_from(self._need("prog"), self._code(0, 0))

    def close(self) -> None:
        """Close our descriptors; the gate stays attached and pinned."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # checking and repairing

    def verify(self) -> Health:
        """Ask the kernel whether this gate is as attach() left it: loaded, attached to the root,
        the program current for the ranges managed now, pinned, and the pinned objects the ones
        this process writes grants to. Changes nothing."""
        root = cgroup2_root()
        if not self._fds and not self.find():
            return Health(loaded=False, held=False, attached=False, current=False, pinned=False, cgroup=str(root))
        prog_id = self.prog_id()
        pinned_id = self._pinned_prog_id()
        code = assemble(device_program(self._wanted_managed(), 0, 0))
        return Health(loaded=True, held=pinned_id in (None, prog_id),
                      attached=prog_id in bpf.attached_ids(root),
                      current=_built_from(self._fds["prog"], code),
                      pinned=all((self.pin_dir / pin).exists() for pin in PINS), cgroup=str(root))

    def repair(self, exempt_uids: Iterable[int]) -> list[str]:
        """verify(), and put right what it found: re-attach, swap in the current program in one
        step (the maps and their grants stay), re-pin; a gate replaced behind our back is opened
        afresh (its map is then the caller's to refill from the store). Returns the problems
        repaired, empty when all was right."""
        health = self.verify()
        problems = health.problems
        if problems:
            if not health.held:
                self.find()
            self.attach(exempt_uids)
        return problems

    # grants and exemptions

    def grant(self, uid: int, dev: Device) -> None:
        self._check_managed(dev)
        try:
            bpf.map_update(self._need("grants"), _GRANT_KEY.pack(uid, _dev_code(dev)), b"\1")
        except OSError as exc:
            raise bpf.error(f"granting {dev[0]}:{dev[1]} to uid {uid} failed", exc) from None

    def revoke(self, uid: int, dev: Device) -> None:
        """Remove a grant (no error when absent). Processes that hold the node keep it open."""
        try:
            bpf.map_delete(self._need("grants"), _GRANT_KEY.pack(uid, _dev_code(dev)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise bpf.error(f"revoking {dev[0]}:{dev[1]} from uid {uid} failed", exc) from None

    def entries(self) -> set[Entry]:
        """Every grant as (uid, (major, minor))."""
        found = set()
        for key in bpf.map_keys(self._need("grants"), _GRANT_KEY.size):
            uid, code = _GRANT_KEY.unpack(key)
            found.add((uid, (code >> MINOR_BITS, code & MINOR_MAX)))
        return found

    def set_entries(self, wanted: Iterable[Entry]) -> tuple[set[Entry], set[Entry]]:
        """Make the grants map exactly `wanted`; returns (removed, added)."""
        wanted = set(wanted)
        present = self.entries()
        for uid, dev in present - wanted:
            self.revoke(uid, dev)
        for uid, dev in wanted - present:
            self.grant(uid, dev)
        return present - wanted, wanted - present

    def set_exempt(self, uids: Iterable[int]) -> set[int]:
        """Make exactly these uids exempt (root always is); takes effect without a reload.
        Returns the uids whose exemption changed."""
        fd = self._need("exempt")
        wanted = set(uids) - {0}
        current = self.exempt() - {0}
        try:
            for uid in current - wanted:
                bpf.map_delete(fd, _EXEMPT_KEY.pack(uid))
            for uid in wanted - current:
                bpf.map_update(fd, _EXEMPT_KEY.pack(uid), b"\1")
        except OSError as exc:
            raise bpf.error("updating exempt uids failed", exc) from None
        return current ^ wanted

    def exempt(self) -> set[int]:
        return {0} | {_EXEMPT_KEY.unpack(key)[0] for key in bpf.map_keys(self._need("exempt"), _EXEMPT_KEY.size)}

    def status(self) -> dict[str, Any]:
        """What `gpuguard gate status --json` shows. "attached" is the kernel's answer (the program
        is among those attached to the root), "problems" what verify() finds wrong."""
        health = self.verify()
        if not health.loaded:
            return {"name": self.name, "attached": False, "prog_id": None, "cgroup": health.cgroup,
                    "pinned": None, "managed": [str(r) for r in self._wanted_managed()],
                    "entries": 0, "users": {}, "exempt": [0], "problems": health.problems}
        users: dict[str, list[str]] = {}
        entries = sorted(self.entries())
        for uid, (major, minor) in entries:
            users.setdefault(str(uid), []).append(f"{major}:{minor}")
        return {"name": self.name, "attached": health.attached, "prog_id": self.prog_id(),
                "cgroup": health.cgroup,
                "pinned": str(self.pin_dir) if (self.pin_dir / "prog").exists() else None,
                "managed": [str(r) for r in self.managed],
                "entries": len(entries), "users": users, "exempt": sorted(self.exempt()),
                "problems": health.problems}

    # internals

    def _wanted_managed(self) -> tuple[DeviceRange, ...]:
        managed = tuple(self._managed_now())
        if not managed:
            raise ValueError("a gate must manage at least one device range")
        return managed

    def _need(self, what: str) -> int:
        if not self._fds and not self.find():
            raise GateError(f"gate {self.name!r} is not loaded (run `gpuguard gate attach`)")
        return self._fds[what]

    def _check_managed(self, dev: Device) -> None:
        if not any(r.covers(dev) for r in self.managed):
            raise ValueError(f"{dev[0]}:{dev[1]} is not managed by gate {self.name!r}")

    def _create(self) -> None:
        try:
            self._fds["grants"] = bpf.map_create(_GRANT_KEY.size, GRANTS_MAX, self.object_name + "_gr")
            self._fds["exempt"] = bpf.map_create(_EXEMPT_KEY.size, EXEMPT_MAX, self.object_name + "_ex")
        except OSError as exc:
            self.close()
            raise bpf.error("creating the gate's maps refused", exc) from None
        try:
            self._fds["prog"] = bpf.load_device_program(self._code(self._fds["grants"], self._fds["exempt"]),
                                                        self.object_name)
        except GateError:
            self.close()
            raise

    def _code(self, grants_fd: int, exempt_fd: int) -> bytes:
        return assemble(device_program(self.managed, grants_fd, exempt_fd))

    def _pin(self) -> None:
        """Pin whatever is not pinned yet (all of it when found by name, e.g. after bpffs was remounted)."""
        for what, fd in self._fds.items():
            path = self.pin_dir / what
            if not path.exists():
                try:
                    bpf.pin(fd, path)
                except OSError as exc:
                    raise bpf.error(f"pinning {path} failed", exc) from None

    def _pinned_prog_id(self) -> int | None:
        try:
            fd = bpf.open_pinned(self.pin_dir / "prog")
        except OSError:
            return None
        try:
            return int(bpf.prog_info(fd).id)
        finally:
            os.close(fd)

    def _open_pins(self) -> bool:
        fds = {}
        try:
            for what in PINS:
                fds[what] = bpf.open_pinned(self.pin_dir / what)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            return False
        self._fds = fds
        return True

    def _open_attached(self) -> bool:
        """Find our program by object name among those attached to the root, and its maps by name."""
        try:
            root = cgroup2_root()
        except GateError:
            return False  # no cgroup v2: nothing can be attached
        ours = [i for i, name in bpf.attached_programs(root).items() if name == self.object_name]
        for prog_id in ours:
            try:
                fd = bpf.prog_fd_by_id(prog_id)
            except OSError:
                continue  # detached meanwhile
            self._fds["prog"] = fd
            for map_id in bpf.prog_map_ids(fd):
                map_fd = bpf.map_fd_by_id(map_id)
                suffix = bpf.map_info(map_fd).name.decode().removeprefix(self.object_name)
                what = {"_gr": "grants", "_ex": "exempt"}.get(suffix)
                if what:
                    self._fds[what] = map_fd
                else:
                    os.close(map_fd)
            if len(self._fds) == 3:
                return True
            self.close()
        return False

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise attach() between processes, so two of them never attach two programs."""
        try:
            self.pin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.pin_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise GateError(f"cannot use {self.pin_dir}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
