"""A small assembler for eBPF: the instructions the gate's device program uses, with jump labels.

Each helper returns one `Insn` (or two, for the 64-bit map load); `assemble()` resolves labels
and encodes struct bpf_insn as the kernel reads it.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

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
