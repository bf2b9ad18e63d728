"""The gate: a cgroup v2 device program that lets a user open only the GPUs granted to them.

One BPF_PROG_TYPE_CGROUP_DEVICE program is attached with BPF_F_ALLOW_MULTI to the root of the
cgroup v2 hierarchy, so it judges every open() of a device node on the machine: login sessions,
cron and at jobs, nohup'd work after logout, containers, user namespaces. It reads two hash maps:
grants {(uid, major<<20|minor)} and exempt {uid}; a grant or a revoke is one map write.

The program and maps are pinned in bpffs under /sys/fs/bpf/gpuguard/<name>/, so the attachment
outlives the process that made it and a later process finds it; when the pins are gone the
program is found by its object name among those attached to the root. Everything is built with
raw bpf() syscalls through ctypes: no compiler and no libbpf at run time.

The kernel checks access only at open(): revoking must also end processes that hold the node
(see procfs.holders).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import platform
import re
import resource
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpuguard.backends import GateError
from gpuguard.backends.procfs import char_major
from gpuguard.model import NVIDIA_MAJOR


# --- the bpf() system call -------------------------------------------------------------------

_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# Commands (enum bpf_cmd).
MAP_CREATE, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 2, 3, 4
PROG_LOAD, OBJ_PIN, OBJ_GET, PROG_ATTACH, PROG_DETACH = 5, 6, 7, 8, 9
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 14, 15, 16

MAP_TYPE_HASH = 1
PROG_TYPE_CGROUP_DEVICE = 15
ATTACH_CGROUP_DEVICE = 6
F_ALLOW_MULTI, F_REPLACE = 2, 4

u32, u64 = ctypes.c_uint32, ctypes.c_uint64


class _MapCreateAttr(ctypes.Structure):
    _fields_ = [("map_type", u32), ("key_size", u32), ("value_size", u32), ("max_entries", u32),
                ("map_flags", u32), ("inner_map_fd", u32), ("numa_node", u32),
                ("map_name", ctypes.c_char * 16)]


class _MapElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", u32), ("pad", u32), ("key", u64), ("value", u64), ("flags", u64)]


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", u32), ("insn_cnt", u32), ("insns", u64), ("license", u64),
                ("log_level", u32), ("log_size", u32), ("log_buf", u64), ("kern_version", u32),
                ("prog_flags", u32), ("prog_name", ctypes.c_char * 16), ("prog_ifindex", u32),
                ("expected_attach_type", u32)]


class _ObjPinAttr(ctypes.Structure):
    _fields_ = [("pathname", u64), ("bpf_fd", u32), ("file_flags", u32)]


class _AttachAttr(ctypes.Structure):
    _fields_ = [("target_fd", u32), ("attach_bpf_fd", u32), ("attach_type", u32),
                ("attach_flags", u32), ("replace_bpf_fd", u32)]


class _GetFdByIdAttr(ctypes.Structure):
    _fields_ = [("id", u32), ("next_id", u32), ("open_flags", u32)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", u32), ("info_len", u32), ("info", u64)]


class _QueryAttr(ctypes.Structure):
    _fields_ = [("target_fd", u32), ("attach_type", u32), ("query_flags", u32),
                ("attach_flags", u32), ("prog_ids", u64), ("prog_cnt", u32)]


class _ProgInfo(ctypes.Structure):
    _fields_ = [("type", u32), ("id", u32), ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", u32),
                ("xlated_prog_len", u32), ("jited_prog_insns", u64), ("xlated_prog_insns", u64),
                ("load_time", u64), ("created_by_uid", u32), ("nr_map_ids", u32),
                ("map_ids", u64), ("name", ctypes.c_char * 16)]


class _MapInfo(ctypes.Structure):
    _fields_ = [("type", u32), ("id", u32), ("key_size", u32), ("value_size", u32),
                ("max_entries", u32), ("map_flags", u32), ("name", ctypes.c_char * 16)]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr); raises OSError with the kernel's errno."""
    if _NR_BPF is None:
        raise GateError(f"bpf() syscall number unknown for {platform.machine()}")
    ret = _libc.syscall(_NR_BPF, ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _fail(action: str, exc: OSError) -> GateError:
    hint = (" (bpf() needs root: CAP_BPF and CAP_SYS_ADMIN; before Linux 5.11 also RLIMIT_MEMLOCK)"
            if exc.errno == errno.EPERM else "")
    return GateError(f"{action}: {exc.strerror}{hint}")


def _addr(buf: ctypes.Array) -> int:
    return ctypes.addressof(buf)


# --- a small assembler -------------------------------------------------------------------------

R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)  # R10: read-only frame pointer

# Instruction classes, sizes, modes and operations (linux/bpf_common.h, linux/bpf.h).
LD, LDX, STX, ALU, JMP, ALU64 = 0x00, 0x01, 0x03, 0x04, 0x05, 0x07
W, DW = 0x00, 0x18
IMM, MEM = 0x00, 0x60
K, X = 0x00, 0x08
ADD, OR, AND, LSH, MOV = 0x00, 0x40, 0x50, 0x60, 0xB0
JA, JEQ, JGT, JNE, JLT, CALL, EXIT = 0x00, 0x10, 0x20, 0x50, 0xA0, 0x80, 0x90
PSEUDO_MAP_FD = 1

# Helpers.
MAP_LOOKUP_ELEM_HELPER = 1
GET_CURRENT_UID_GID = 15


@dataclass(frozen=True)
class Insn:
    code: int
    dst: int = 0
    src: int = 0
    off: int | str = 0  # a label name on jumps, resolved by assemble()
    imm: int = 0


@dataclass(frozen=True)
class Label:
    name: str


def mov(dst: int, src: int) -> Insn:
    return Insn(ALU64 | MOV | X, dst, src)


def mov_imm(dst: int, imm: int) -> Insn:
    return Insn(ALU64 | MOV | K, dst, imm=imm)


def mov32(dst: int, src: int) -> Insn:
    """32-bit move: keeps the low half and zeroes the high half."""
    return Insn(ALU | MOV | X, dst, src)


def alu(op: int, dst: int, src: int) -> Insn:
    return Insn(ALU64 | op | X, dst, src)


def alu_imm(op: int, dst: int, imm: int) -> Insn:
    return Insn(ALU64 | op | K, dst, imm=imm)


def load32(dst: int, src: int, off: int) -> Insn:
    """dst = *(u32 *)(src + off)"""
    return Insn(LDX | MEM | W, dst, src, off)


def store32(dst: int, off: int, src: int) -> Insn:
    """*(u32 *)(dst + off) = src"""
    return Insn(STX | MEM | W, dst, src, off)


def jump_imm(op: int, dst: int, imm: int, label: str) -> Insn:
    """if (dst <op> imm) goto label; comparisons other than JEQ/JNE are unsigned"""
    return Insn(JMP | op | K, dst, off=label, imm=imm)


def goto(label: str) -> Insn:
    return Insn(JMP | JA, off=label)


def call(helper: int) -> Insn:
    return Insn(JMP | CALL, imm=helper)


def exit_() -> Insn:
    return Insn(JMP | EXIT)


def load_map(dst: int, map_fd: int) -> list[Insn]:
    """dst = the map behind map_fd (a two-slot 64-bit load the verifier rewrites)."""
    return [Insn(LD | IMM | DW, dst, PSEUDO_MAP_FD, imm=map_fd), Insn(0)]


def assemble(program: Sequence[Insn | Label]) -> bytes:
    """Encode struct bpf_insn {u8 code; u8 dst:4, src:4; s16 off; s32 imm} with labels resolved."""
    where: dict[str, int] = {}
    insns: list[Insn] = []
    for item in program:
        if isinstance(item, Label):
            where[item.name] = len(insns)
        else:
            insns.append(item)
    code = bytearray()
    for pc, insn in enumerate(insns):
        off = where[insn.off] - pc - 1 if isinstance(insn.off, str) else insn.off
        code += struct.pack("<BBhi", insn.code, insn.dst | insn.src << 4, off, insn.imm)
    return bytes(code)


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

    def covers(self, dev: tuple[int, int]) -> bool:
        return dev[0] == self.major and self.first <= dev[1] <= self.last

    def __str__(self) -> str:
        return f"{self.major}:{self.first}-{self.last}"


def default_managed() -> tuple[DeviceRange, ...]:
    """/dev/nvidia0..253 (254 and 255 are nvidia-modeset and nvidiactl, open to all),
    plus every nvidia-caps node (MIG instances) when that driver is loaded."""
    ranges = [DeviceRange(NVIDIA_MAJOR, 0, 253)]
    caps = char_major("nvidia-caps")
    if caps is not None:
        ranges.append(DeviceRange(caps))
    return tuple(ranges)


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


def load_device_program(code: bytes, name: str) -> int:
    """PROG_LOAD a cgroup device program; returns its fd. The verifier log comes with a refusal."""
    insns = ctypes.create_string_buffer(code, len(code))
    license = ctypes.create_string_buffer(b"Dual MIT/GPL")
    log = ctypes.create_string_buffer(1 << 16)
    attr = _ProgLoadAttr(prog_type=PROG_TYPE_CGROUP_DEVICE, insn_cnt=len(code) // 8,
                         insns=_addr(insns), license=_addr(license),
                         log_level=1, log_size=len(log), log_buf=_addr(log),
                         prog_name=name.encode(), expected_attach_type=ATTACH_CGROUP_DEVICE)
    for _ in range(5):  # the verifier answers EAGAIN when interrupted by a signal: retry, as libbpf does
        try:
            return _bpf(PROG_LOAD, attr)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                verifier = log.value.decode(errors="replace").strip()
                raise GateError(f"{_fail('loading the device program refused', exc)}\n"
                                f"verifier log:\n{verifier}") from None
    raise GateError("loading the device program failed: EAGAIN five times in a row")


def attach_program(cgroup_fd: int, prog_fd: int, replace: int | None = None) -> None:
    """Attach a device program to a cgroup, alongside the programs already there,
    or in one step in the place of the attached program `replace`."""
    flags = F_ALLOW_MULTI | (F_REPLACE if replace is not None else 0)
    _bpf(PROG_ATTACH, _AttachAttr(target_fd=cgroup_fd, attach_bpf_fd=prog_fd, attach_type=ATTACH_CGROUP_DEVICE,
                                  attach_flags=flags, replace_bpf_fd=replace or 0))


def detach_program(cgroup_fd: int, prog_fd: int) -> None:
    _bpf(PROG_DETACH, _AttachAttr(target_fd=cgroup_fd, attach_bpf_fd=prog_fd,
                                  attach_type=ATTACH_CGROUP_DEVICE))


def attached_ids(cgroup: Path) -> list[int]:
    """Ids of the device programs attached directly to a cgroup."""
    count = 64  # BPF_CGROUP_MAX_PROGS; grown if a future kernel allows more
    try:
        with _opened(cgroup) as cgroup_fd:
            while True:
                ids = (u32 * count)()
                attr = _QueryAttr(target_fd=cgroup_fd, attach_type=ATTACH_CGROUP_DEVICE,
                                  prog_ids=_addr(ids), prog_cnt=count)
                try:
                    _bpf(PROG_QUERY, attr)
                    return list(ids[:attr.prog_cnt])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    count = attr.prog_cnt
    except OSError as exc:
        raise _fail(f"querying device programs on {cgroup} failed", exc) from None


def attached_programs(cgroup: Path) -> dict[int, str]:
    """Device programs attached directly to a cgroup: id -> object name."""
    names = {}
    for prog_id in attached_ids(cgroup):
        try:
            fd = _bpf(PROG_GET_FD_BY_ID, _GetFdByIdAttr(id=prog_id))
        except OSError:
            continue  # detached meanwhile
        try:
            names[prog_id] = prog_info(fd).name.decode()
        finally:
            os.close(fd)
    return names


def prog_info(fd: int) -> _ProgInfo:
    info = _ProgInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return info


def _map_info(fd: int) -> _MapInfo:
    info = _MapInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return info


def _map_create(key_size: int, max_entries: int, name: str) -> int:
    return _bpf(MAP_CREATE, _MapCreateAttr(map_type=MAP_TYPE_HASH, key_size=key_size, value_size=1,
                                           max_entries=max_entries, map_name=name.encode()))


def _map_elem(cmd: int, map_fd: int, key: bytes, value: bytes | None = None) -> None:
    """Update (with a value) or delete (without: the kernel wants the unused fields zero)."""
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(value, len(value)) if value is not None else None
    _bpf(cmd, _MapElemAttr(map_fd=map_fd, key=_addr(kbuf), value=_addr(vbuf) if vbuf is not None else 0))


def _map_keys(map_fd: int, key_size: int) -> Iterator[bytes]:
    key = ctypes.create_string_buffer(key_size)
    following = ctypes.create_string_buffer(key_size)
    attr = _MapElemAttr(map_fd=map_fd, key=0, value=_addr(following))  # key NULL: the first key
    while True:
        try:
            _bpf(MAP_GET_NEXT_KEY, attr)
        except FileNotFoundError:
            return
        yield following.raw
        ctypes.memmove(key, following, key_size)
        attr.key = _addr(key)


def _raise_memlock() -> None:
    """Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK, whose default is tiny."""
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass  # not root: the bpf() call that follows names the real problem


# --- where things live ---------------------------------------------------------------------

BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "gpuguard"
GRANTS_MAX = 16384  # (uid, device) pairs: 100 users x 8 GPUs x MIG slices fit many times over
EXEMPT_MAX = 1024
_GRANT_KEY = struct.Struct("<II")  # {u32 uid; u32 major<<20|minor}
_EXEMPT_KEY = struct.Struct("<I")


def _mounts() -> Iterator[tuple[str, str]]:
    """(mount point, fs type) from /proc/self/mountinfo, octal escapes decoded."""
    with open("/proc/self/mountinfo") as lines:
        for line in lines:
            left, _, right = line.partition(" - ")
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), left.split()[4])
            yield point, right.split()[0]


def cgroup2_root() -> Path:
    """The root of the cgroup v2 hierarchy: /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts."""
    for point, fstype in _mounts():
        if fstype == "cgroup2":
            return Path(point)
    raise GateError("no cgroup v2 mount in /proc/self/mountinfo: the gate needs the unified hierarchy "
                    "(systemd.unified_cgroup_hierarchy, or mount -t cgroup2 none /sys/fs/cgroup/unified)")


def _bpffs_mounted() -> bool:
    return (str(BPFFS), "bpf") in _mounts()


def _ensure_bpffs() -> None:
    if _bpffs_mounted():
        return
    if _libc.mount(b"bpf", str(BPFFS).encode(), b"bpf", 0, b"mode=0700") != 0:
        err = ctypes.get_errno()
        raise GateError(f"cannot mount bpffs at {BPFFS}: {os.strerror(err)}")


@contextmanager
def bpffs_restored() -> Iterator[None]:
    """For the tests, the demo and the bench: a bpffs that gates mounted inside is unmounted again
    if nothing is pinned there any more. (The daemon keeps its mount, as systemd would.)"""
    mounted_before = _bpffs_mounted()
    try:
        yield
    finally:
        if not mounted_before and _bpffs_mounted():
            if PIN_ROOT.is_dir() and not any(PIN_ROOT.iterdir()):
                PIN_ROOT.rmdir()
            # maps.debug and progs.debug are the kernel's own (bpf_preload), in every new bpffs.
            if not {entry.name for entry in BPFFS.iterdir()} - {"maps.debug", "progs.debug"}:
                _libc.umount(str(BPFFS).encode())


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
    tag = bytes(prog_info(prog_fd).tag)
    return tag in (hashlib.sha256(code).digest()[:8], hashlib.sha1(code).digest()[:8])


def _dev_code(dev: tuple[int, int]) -> int:
    major, minor = dev
    return major << MINOR_BITS | minor


# --- the gate ---------------------------------------------------------------------------------

class Gate:
    """One gate instance: program + grants map + exempt map, attached to the cgroup v2 root.

    Methods find the pinned (or attached) objects on first use, so a new process can
    grant, revoke or detach a gate that another process attached.
    """

    def __init__(self, name: str = "gpuguard", managed: Sequence[DeviceRange] | None = None):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("."):
            raise ValueError(f"bad gate name {name!r}: use letters, digits, '_', '.', '-'")
        self.name = name
        self.managed = tuple(managed) if managed is not None else default_managed()
        if not self.managed:
            raise ValueError("a gate must manage at least one device range")
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
        _ensure_bpffs()
        _raise_memlock()  # before any map or program is made, here or swapped in below
        with self._locked():
            if not self._fds and not self.find():
                self._create()
            self.set_exempt(exempt_uids)
            old = self._fds["prog"]
            current = self.is_current()
            new = old if current else load_device_program(self._code(self._fds["grants"], self._fds["exempt"]),
                                                          self.object_name)
            attached = prog_info(old).id in attached_ids(root)
            try:
                with _opened(root) as cgroup_fd:
                    if not attached:
                        attach_program(cgroup_fd, new)
                    elif not current:
                        attach_program(cgroup_fd, new, replace=old)
            except OSError as exc:
                if not current:
                    os.close(new)
                raise _fail(f"attaching the gate to {root} refused", exc) from None
            if not current:
                (self.pin_dir / "prog").unlink(missing_ok=True)
                os.close(old)
                self._fds["prog"] = new
            self._pin()

    def detach(self) -> None:
        """Detach and unpin this gate; programs that are not this gate's are never touched."""
        if self._fds or self.find():
            root = cgroup2_root()
            if self.prog_id() in attached_ids(root):
                try:
                    with _opened(root) as cgroup_fd:
                        detach_program(cgroup_fd, self._fds["prog"])
                except OSError as exc:
                    raise _fail(f"detaching the gate from {root} refused", exc) from None
            self.close()
        for pin in ("prog", "grants", "exempt"):
            (self.pin_dir / pin).unlink(missing_ok=True)
        for directory in (self.pin_dir, PIN_ROOT):
            try:
                directory.rmdir()
            except OSError:
                pass  # absent, or another instance still lives there

    def is_attached(self) -> bool:
        if not self._fds and not self.find():
            return False
        return self.prog_id() in attached_ids(cgroup2_root())

    def prog_id(self) -> int:
        return prog_info(self._need("prog")).id

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

    # grants and exemptions

    def grant(self, uid: int, dev: tuple[int, int]) -> None:
        self._check_managed(dev)
        try:
            _map_elem(MAP_UPDATE_ELEM, self._need("grants"), _GRANT_KEY.pack(uid, _dev_code(dev)), b"\1")
        except OSError as exc:
            raise _fail(f"granting {dev[0]}:{dev[1]} to uid {uid} failed", exc) from None

    def revoke(self, uid: int, dev: tuple[int, int]) -> None:
        """Remove a grant (no error when absent). Processes that hold the node keep it open."""
        try:
            _map_elem(MAP_DELETE_ELEM, self._need("grants"), _GRANT_KEY.pack(uid, _dev_code(dev)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _fail(f"revoking {dev[0]}:{dev[1]} from uid {uid} failed", exc) from None

    def entries(self) -> set[tuple[int, tuple[int, int]]]:
        """Every grant as (uid, (major, minor))."""
        found = set()
        for key in _map_keys(self._need("grants"), _GRANT_KEY.size):
            uid, code = _GRANT_KEY.unpack(key)
            found.add((uid, (code >> MINOR_BITS, code & MINOR_MAX)))
        return found

    def set_exempt(self, uids: Iterable[int]) -> None:
        """Make exactly these uids exempt (root always is); takes effect without a reload."""
        fd = self._need("exempt")
        wanted = set(uids) - {0}
        current = self.exempt() - {0}
        try:
            for uid in current - wanted:
                _map_elem(MAP_DELETE_ELEM, fd, _EXEMPT_KEY.pack(uid))
            for uid in wanted - current:
                _map_elem(MAP_UPDATE_ELEM, fd, _EXEMPT_KEY.pack(uid), b"\1")
        except OSError as exc:
            raise _fail("updating exempt uids failed", exc) from None

    def exempt(self) -> set[int]:
        return {0} | {_EXEMPT_KEY.unpack(key)[0] for key in _map_keys(self._need("exempt"), _EXEMPT_KEY.size)}

    def status(self) -> dict:
        """What `gpuguard gate status --json` shows."""
        root = cgroup2_root()
        if not self._fds and not self.find():
            return {"name": self.name, "attached": False, "prog_id": None, "cgroup": str(root),
                    "pinned": None, "managed": [str(r) for r in self.managed],
                    "entries": 0, "users": {}, "exempt": [0]}
        users: dict[str, list[str]] = {}
        entries = sorted(self.entries())
        for uid, (major, minor) in entries:
            users.setdefault(str(uid), []).append(f"{major}:{minor}")
        prog_id = self.prog_id()
        return {"name": self.name, "attached": prog_id in attached_ids(root), "prog_id": prog_id,
                "cgroup": str(root),
                "pinned": str(self.pin_dir) if (self.pin_dir / "prog").exists() else None,
                "managed": [str(r) for r in self.managed],
                "entries": len(entries), "users": users, "exempt": sorted(self.exempt())}

    # internals

    def _need(self, what: str) -> int:
        if not self._fds and not self.find():
            raise GateError(f"gate {self.name!r} is not loaded (run `gpuguard gate attach`)")
        return self._fds[what]

    def _check_managed(self, dev: tuple[int, int]) -> None:
        if not any(r.covers(dev) for r in self.managed):
            raise ValueError(f"{dev[0]}:{dev[1]} is not managed by gate {self.name!r}")

    def _create(self) -> None:
        try:
            self._fds["grants"] = _map_create(_GRANT_KEY.size, GRANTS_MAX, self.object_name + "_gr")
            self._fds["exempt"] = _map_create(_EXEMPT_KEY.size, EXEMPT_MAX, self.object_name + "_ex")
        except OSError as exc:
            self.close()
            raise _fail("creating the gate's maps refused", exc) from None
        try:
            self._fds["prog"] = load_device_program(self._code(self._fds["grants"], self._fds["exempt"]),
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
                buf = ctypes.create_string_buffer(str(path).encode())
                try:
                    _bpf(OBJ_PIN, _ObjPinAttr(pathname=_addr(buf), bpf_fd=fd))
                except OSError as exc:
                    raise _fail(f"pinning {path} failed", exc) from None

    def _open_pins(self) -> bool:
        fds = {}
        try:
            for what in ("prog", "grants", "exempt"):
                buf = ctypes.create_string_buffer(str(self.pin_dir / what).encode())
                fds[what] = _bpf(OBJ_GET, _ObjPinAttr(pathname=_addr(buf)))
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
        ours = [i for i, name in attached_programs(root).items() if name == self.object_name]
        for prog_id in ours:
            try:
                fd = _bpf(PROG_GET_FD_BY_ID, _GetFdByIdAttr(id=prog_id))
            except OSError:
                continue  # detached meanwhile
            self._fds["prog"] = fd
            count = prog_info(fd).nr_map_ids
            map_ids = (u32 * count)()
            info = _ProgInfo(nr_map_ids=count, map_ids=_addr(map_ids))
            _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info)))
            for map_id in map_ids:
                map_fd = _bpf(MAP_GET_FD_BY_ID, _GetFdByIdAttr(id=map_id))
                suffix = _map_info(map_fd).name.decode().removeprefix(self.object_name)
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


@contextmanager
def _opened(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)
