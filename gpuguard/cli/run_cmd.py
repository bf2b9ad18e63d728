"""`gpuguard run -- CMD ARGS`: a command on GPUs taken for it and given back when it ends (like srun).

What it takes is what the request's reply says it granted (the part granted at once while the
rest was waited for included): only that goes back at the end, never a GPU the user held before.
CMD sees every GPU the user holds then, as `gpuguard env` would print them."""
from __future__ import annotations

import os
import sys

from gpuguard.cli import CommandError, fraction_size, gpu_count, summary
from gpuguard.cli.calls import ask
from gpuguard.cli.child import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, Blocked
from gpuguard.cli.requesting import give_back, take, timeout_of
from gpuguard.core.errors import EXIT_USAGE

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

DEFAULT_GPUS = 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import argparse
    run = subparsers.add_parser(
        "run", help=summary("run"),
        description="Take GPUs (up to --gpus in all, the ones you hold counted), run the command with "
                    "CUDA_VISIBLE_DEVICES set to your GPUs, pass signals sent to gpuguard run on to it, and "
                    "when it ends give back what was taken for it (GPUs you held before stay yours). The exit "
                    "code is the command's (128 + N when signal N ended it). Examples: gpuguard run -- python "
                    "train.py; gpuguard run --gpus 2 --wait --timeout 1h -- ./job.sh")
    amount = run.add_mutually_exclusive_group()
    amount.add_argument("--gpus", type=gpu_count, metavar="N",
                        help=f"how many GPUs in all, the ones you hold included (default: {DEFAULT_GPUS}, or your "
                             "quota's fraction_memory)")
    amount.add_argument("--memory", type=fraction_size, metavar="SIZE",
                        help="a fraction of one GPU instead: this much of its memory, e.g. 20GiB")
    run.add_argument("--wait", action="store_true", help="when they are not free, wait in the queue until they are")
    run.add_argument("--timeout", metavar="DURATION",
                     help="with --wait: give up after this long, e.g. 30m (exit 1, the command not run)")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS]", help="the command to run")
    run.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise CommandError("run: name the command to run, e.g. gpuguard run -- python train.py", EXIT_USAGE)
    timeout = timeout_of(args)
    env = dict(os.environ)
    granted = take_into(args, env, args.gpus, args.wait, timeout, give_back=True, memory=args.memory)
    return run_then_give_back(args, argv, env, granted, "run")


def take_into(args: argparse.Namespace, env: dict[str, str], gpus: int | None, wait: bool, timeout: float | None,
              give_back: bool, memory: int | None = None) -> list[int]:
    """Take GPUs (`gpus` in all, or one fraction of `memory` bytes; neither: the quota's
    fraction_memory, else DEFAULT_GPUS) and set env's CUDA_VISIBLE_DEVICES to every GPU the user
    then holds (an exempt user's left unset: every GPU is open to them, as `gpuguard env` says);
    the units this call took, which are all that may be given back (requesting.take's give_back)."""
    me = ask(args, "whoami")
    if me["exempt"]:
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return []
    if gpus is None and memory is None:
        memory = me["quota"].get("fraction_memory")
        gpus = DEFAULT_GPUS if memory is None else None
    reply = take(args, gpus, wait, timeout, give_back=give_back, memory=memory)
    env["CUDA_VISIBLE_DEVICES"] = reply["cuda_visible_devices"]
    if reply["message"]:
        print(reply["message"], file=sys.stderr, flush=True)
    return list(reply["granted"])


def run_then_give_back(args: argparse.Namespace, argv: list[str], env: dict[str, str], granted: list[int],
                       what: str, forward: bool = True) -> int:
    """Run argv as a child (child.Blocked.run, `forward` passed on), then give back `granted`:
    the child's exit code, or a shell's 127 or 126 when it cannot start (said on stderr, as `what`)."""
    with Blocked() as signals:  # from here to the release, a signal is the command's, not ours
        try:
            code = signals.run(argv, env, forward)
        except FileNotFoundError:
            code = EXIT_NOT_FOUND
            print(f"gpuguard: {what}: {argv[0]}: command not found", file=sys.stderr)
        except PermissionError:
            code = EXIT_NOT_EXECUTABLE
            print(f"gpuguard: {what}: {argv[0]}: permission denied", file=sys.stderr)
        if granted:
            give_back(args, granted)
    return code
