"""The bpf() system call through ctypes, and the operations the gate needs on BPF objects:
hash maps (create, update, delete, walk), cgroup device programs (load, attach, detach, query),
pins in bpffs, and looking objects up by id. No compiler and no libbpf at run time.

Every function raises OSError with the kernel's errno; `error()` turns one into a GateError
whose message names the action and, for EPERM, what privilege is missing.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuguard.backends import GateError

_NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

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


class ProgInfo(ctypes.Structure):
    _fields_ = [("type", u32), ("id", u32), ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", u32),
                ("xlated_prog_len", u32), ("jited_prog_insns", u64), ("xlated_prog_insns", u64),
                ("load_time", u64), ("created_by_uid", u32), ("nr_map_ids", u32),
                ("map_ids", u64), ("name", ctypes.c_char * 16)]


class MapInfo(ctypes.Structure):
    _fields_ = [("type", u32), ("id", u32), ("key_size", u32), ("value_size", u32),
                ("max_entries", u32), ("map_flags", u32), ("name", ctypes.c_char * 16)]


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr); raises OSError with the kernel's errno."""
    if _NR_BPF is None:
        raise GateError(f"bpf() syscall number unknown for {platform.machine()}")
    ret = libc.syscall(_NR_BPF, ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def error(action: str, exc: OSError) -> GateError:
    """`action: <strerror>`, with what bpf() needs when the cause is a missing privilege."""
    hint = (" (bpf() needs root: CAP_BPF and CAP_SYS_ADMIN; before Linux 5.11 also RLIMIT_MEMLOCK)"
            if exc.errno == errno.EPERM else "")
    return GateError(f"{action}: {exc.strerror}{hint}")


def _addr(buf: ctypes.Array[Any] | ctypes.Structure) -> int:
    return ctypes.addressof(buf)


def raise_memlock() -> None:
    """Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK, whose default is tiny."""
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass  # not root: the bpf() call that follows names the real problem


@contextmanager
def opened(directory: Path) -> Iterator[int]:
    """A directory's fd (a cgroup's, for attach, detach and query), closed afterwards."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


# --- maps --------------------------------------------------------------------------------------

def map_create(key_size: int, max_entries: int, name: str) -> int:
    """A hash map with one-byte values (a set of keys); returns its fd."""
    return _bpf(MAP_CREATE, _MapCreateAttr(map_type=MAP_TYPE_HASH, key_size=key_size, value_size=1,
                                           max_entries=max_entries, map_name=name.encode()))


def map_update(map_fd: int, key: bytes, value: bytes) -> None:
    kbuf = ctypes.create_string_buffer(key, len(key))
    vbuf = ctypes.create_string_buffer(value, len(value))
    _bpf(MAP_UPDATE_ELEM, _MapElemAttr(map_fd=map_fd, key=_addr(kbuf), value=_addr(vbuf)))


def map_delete(map_fd: int, key: bytes) -> None:
    """Raises FileNotFoundError when the key is absent."""
    kbuf = ctypes.create_string_buffer(key, len(key))
    _bpf(MAP_DELETE_ELEM, _MapElemAttr(map_fd=map_fd, key=_addr(kbuf)))  # value 0: the kernel wants it so


def map_keys(map_fd: int, key_size: int) -> Iterator[bytes]:
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


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info)))
    return info


# --- programs ----------------------------------------------------------------------------------

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
                raise GateError(f"{error('loading the device program refused', exc)}\n"
                                f"verifier log:\n{verifier}") from None
    raise GateError("loading the device program failed: EAGAIN five times in a row")


def prog_info(fd: int) -> ProgInfo:
    info = ProgInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info)))
    return info


def prog_map_ids(fd: int) -> list[int]:
    """Ids of the maps a loaded program uses."""
    count = prog_info(fd).nr_map_ids
    ids = (u32 * count)()
    info = ProgInfo(nr_map_ids=count, map_ids=_addr(ids))
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=_addr(info)))
    return list(ids)


def prog_fd_by_id(prog_id: int) -> int:
    """Raises FileNotFoundError when no program has this id (any more)."""
    return _bpf(PROG_GET_FD_BY_ID, _GetFdByIdAttr(id=prog_id))


def map_fd_by_id(map_id: int) -> int:
    return _bpf(MAP_GET_FD_BY_ID, _GetFdByIdAttr(id=map_id))


# --- attaching to cgroups -------------------------------------------------------------------------

def attach_program(cgroup_fd: int, prog_fd: int, replace: int | None = None) -> None:
    """Attach a device program to a cgroup, alongside the programs already there,
    or in one step in the place of the attached program `replace` (BPF_F_REPLACE, Linux 5.6)."""
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
        with opened(cgroup) as cgroup_fd:
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
        raise error(f"querying device programs on {cgroup} failed", exc) from None


def attached_programs(cgroup: Path) -> dict[int, str]:
    """Device programs attached directly to a cgroup: id -> object name."""
    names = {}
    for prog_id in attached_ids(cgroup):
        try:
            fd = prog_fd_by_id(prog_id)
        except OSError:
            continue  # detached meanwhile
        try:
            names[prog_id] = prog_info(fd).name.decode()
        finally:
            os.close(fd)
    return names


# --- pins in bpffs -----------------------------------------------------------------------------

def pin(fd: int, path: Path) -> None:
    buf = ctypes.create_string_buffer(str(path).encode())
    _bpf(OBJ_PIN, _ObjPinAttr(pathname=_addr(buf), bpf_fd=fd))


def open_pinned(path: Path) -> int:
    """The fd of the object pinned at path; raises FileNotFoundError when nothing is."""
    buf = ctypes.create_string_buffer(str(path).encode())
    return _bpf(OBJ_GET, _ObjPinAttr(pathname=_addr(buf)))
