"""`gpuguard sim burn`: a stand-in for a CUDA program on simulated GPUs; `gpuguard sim mig`:
what `nvidia-smi mig` does to them.

burn does what matters to gpuguard about a CUDA program: it opens its GPU's device node first
(so file modes, ACLs and the BPF gate decide, exactly as they do for CUDA), and on a MIG slice
also the slice's GPU-instance and compute-instance capability nodes (read-only, as CUDA does),
keeps them open while it runs (so revocation finds them in /proc/*/fd), and is listed by NVML
(on its slice) with its memory and utilization until it exits, however it exits.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuguard.backends.devnodes import caps_node, gpu_node
from gpuguard.cli import CommandError, load_config, summary
from gpuguard.core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpuguard.core.model import slice_unit, unit_label
from gpuguard.core.quantities import UnitError, format_size, parse_duration, parse_size

if TYPE_CHECKING:
    from gpuguard.config import Config


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("sim", help=summary("sim"))
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    burn = actions.add_parser("burn", help="act like a CUDA program using a GPU or a MIG slice",
                              description="A stand-in for a CUDA program on simulated GPUs: it opens the GPU's node "
                                          "(the gate decides) and shows in NVML with this memory and utilisation. "
                                          "Example: gpuguard sim burn --gpu 0 --mem 4GiB --seconds 10m")
    where = burn.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpu", type=int, metavar="MINOR", help="the GPU's minor number (the N of nvidiaN)")
    where.add_argument("--slice", metavar="MIG-UUID", help="a MIG slice, by its UUID (`gpuguard gpus` lists them)")
    burn.add_argument("--mem", type=_memory, required=True, metavar="SIZE",
                      help="GPU memory in use, e.g. 4GiB, or `unknown` (NVML cannot tell)")
    burn.add_argument("--util", type=_percent, default=100, metavar="PCT",
                      help="GPU utilization in percent (default 100)")
    burn.add_argument("--seconds", type=_duration, metavar="N",
                      help="exit after N seconds, or a duration like 2m (default: run until killed)")
    burn.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM: only SIGKILL ends it")
    burn.set_defaults(func=run_burn)

    mig = actions.add_parser("mig", help="change the MIG layout of a simulated GPU (root)",
                             description="Destroy the GPU's MIG instances and create PROFILEs in their place "
                                         "(new UUIDs; a place used before gets its GI id again). "
                                         "Examples: sudo gpuguard sim mig 0 3g.40gb 1g.10gb; sudo gpuguard sim mig 0 --off")
    mig.add_argument("gpu", type=int, metavar="MINOR", help="the GPU's minor number")
    mig.add_argument("profiles", nargs="*", metavar="PROFILE", help="e.g. 1g.10gb 3g.40gb")
    mode = mig.add_mutually_exclusive_group()
    mode.add_argument("--on", action="store_true", help="MIG mode (with no PROFILE: no slices yet)")
    mode.add_argument("--off", action="store_true", help="leave MIG mode")
    mig.set_defaults(func=run_mig)


def _memory(text: str) -> int | None:
    if text == "unknown":
        return None
    try:
        size = parse_size(text)
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size is None:
        raise argparse.ArgumentTypeError("a program cannot use unlimited memory (write a size or unknown)")
    return size


def _duration(text: str) -> float | None:
    try:
        return parse_duration(text, bare_unit="s")  # the option is --seconds
    except UnitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _percent(text: str) -> int:
    if not text.isdigit() or int(text) > 100:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got {text!r}")
    return int(text)


class _Terminated(BaseException):
    """SIGTERM arrived (a BaseException so that nothing on the way swallows it)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _simulated(args: argparse.Namespace, command: str) -> Config:
    config = load_config(args)
    if config.gpu.backend != "simulated":
        raise CommandError(f'sim {command} needs simulated GPUs (gpu.backend = "simulated")', EXIT_USAGE)
    return config


def run_mig(args: argparse.Namespace) -> int:
    from gpuguard.backends.sim_mig import change_layout  # imports pynvml: only when needed

    config = _simulated(args, "mig")
    if os.geteuid() != 0:
        raise CommandError("sim mig changes the simulated GPUs, as nvidia-smi mig does: run it as root", EXIT_USAGE)
    sim = config.gpu.simulated
    if not 0 <= args.gpu < sim.count:
        raise CommandError(f"no simulated GPU {args.gpu} (count = {sim.count})", EXIT_USAGE)
    if args.off and args.profiles:
        raise CommandError("--off takes no PROFILE: it leaves MIG mode", EXIT_USAGE)
    if not (args.profiles or args.on or args.off):
        raise CommandError("name the PROFILEs to create, or --on (MIG mode, no slices) or --off", EXIT_USAGE)
    try:
        slices = change_layout(sim, config.paths.device_dir, args.gpu, None if args.off else args.profiles)
    except ValueError as exc:
        raise CommandError(f"GPU {args.gpu}: {exc}", EXIT_USAGE) from None
    if slices is None:
        print(f"GPU {args.gpu}: MIG mode off")
    for each in slices or ():
        unit = unit_label(slice_unit(args.gpu, each.gpu_instance, each.compute_instance))
        print(f"GPU {args.gpu}: {each.profile} {unit} {each.uuid}")
    if slices == ():
        print(f"GPU {args.gpu}: MIG mode, no slices")
    return EXIT_OK


def _slice_of(device_dir: Path, mig_uuid: str) -> tuple[int, tuple[int, int], list[Path]]:
    """(GPU minor, (GI id, CI id), the capability nodes to open) of a simulated MIG slice."""
    from gpuguard.backends import mig_caps
    from gpuguard.backends.sim_mig import MIG_MINORS_FILE, read_layout
    from gpuguard.backends.sim_registry import REGISTRY_DIR

    try:
        layout = read_layout(device_dir)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    for minor, slices in layout.items():
        for each in slices:
            if each.uuid == mig_uuid:
                caps = mig_caps.slice_caps(mig_caps.read_mig_minors(device_dir / REGISTRY_DIR / MIG_MINORS_FILE),
                                           minor, each.gpu_instance, each.compute_instance)
                if caps is None:
                    raise CommandError(f"CUDA error: the driver lists no capabilities for MIG slice {mig_uuid}")
                return minor, (each.gpu_instance, each.compute_instance), [caps_node(device_dir, c) for c in caps]
    raise CommandError(f"no MIG slice {mig_uuid} on the simulated GPUs (`gpuguard gpus` lists them)", EXIT_USAGE)


def _open_like_cuda(node: Path, flags: int) -> str | None:
    """Open a node as CUDA does (then hold it, as CUDA holds its fd, for the /proc/*/fd scan that
    revocation relies on); the reason when it may not."""
    try:
        os.close(os.open(node, flags | os.O_CLOEXEC))  # a real driver would answer here
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: the kernel let us through to the absent driver
            return f"cannot open {node}: {exc.strerror}"
    os.open(node, os.O_PATH | os.O_CLOEXEC)  # O_PATH skips the driver's open, which cannot succeed without one
    return None


def run_burn(args: argparse.Namespace) -> int:
    device_dir = _simulated(args, "burn").paths.device_dir
    if args.slice is not None:
        minor, mig, caps = _slice_of(device_dir, args.slice)
    else:
        minor, mig, caps = args.gpu, None, []
        if _in_mig_mode(device_dir, minor):
            print(f"CUDA error: GPU {minor} is in MIG mode: run on one of its slices (--slice MIG-...)",
                  file=sys.stderr)
            return EXIT_FAILED
    # The GPU's node for reading and writing, a slice's capabilities read-only, as CUDA opens them.
    for node, flags in [(gpu_node(device_dir, minor), os.O_RDWR), *((cap, os.O_RDONLY) for cap in caps)]:
        if (refused := _open_like_cuda(node, flags)) is not None:
            print(f"CUDA error: no CUDA-capable device is detected ({refused})", file=sys.stderr)
            return EXIT_FAILED

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else _on_sigterm)
    try:
        _burn(args, device_dir, minor, mig)
    except _Terminated:
        # Die of SIGTERM like a CUDA program, so a parent sees the signal and not an exit code.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return EXIT_OK


def _in_mig_mode(device_dir: Path, minor: int) -> bool:
    from gpuguard.backends.sim_mig import read_layout

    try:
        return minor in read_layout(device_dir)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _burn(args: argparse.Namespace, device_dir: Path, minor: int, mig: tuple[int, int] | None) -> None:
    from gpuguard.backends.sim_registry import register_process  # imports pynvml: only when needed

    try:
        record = register_process(device_dir, os.getpid(), minor, args.mem, args.util, mig=mig)
    except FileNotFoundError:
        raise CommandError(f"no simulated GPUs in {device_dir} (run `gpuguard gpus` as root once)") from None
    try:
        using = "unknown memory" if args.mem is None else format_size(args.mem)
        where = f"GPU {minor}" if mig is None else f"MIG slice {unit_label(slice_unit(minor, *mig))} ({args.slice})"
        print(f"burn: pid {os.getpid()} on {where} using {using}", flush=True)
        if args.seconds is None:
            while True:
                signal.pause()
        time.sleep(args.seconds)
    finally:
        record.unlink(missing_ok=True)  # after SIGKILL readers drop the record by start time
