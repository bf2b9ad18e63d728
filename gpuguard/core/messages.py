"""Text people read: the login line and the times and lists in it (shared by daemon and CLI)."""
from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence

from gpuguard.core.quantities import format_duration, format_size
from gpuguard.core.unit_numbers import is_slice, slice_place, unit_label

TYPE_CHECKING = False  # not typing's: the users' commands import this module, and start fast
if TYPE_CHECKING:
    from typing import Any

    from gpuguard.core.model import Gpu, Grant
    from gpuguard.core.rules import Action

WHOAMI_HINT = " - run gpuguard whoami for details"


def grant_message(gpus: list[Gpu], expires_at: float | None, shared: bool, wanted: int | None = None,
                  ending: str = WHOAMI_HINT, fraction: int | None = None) -> str:
    """`gpuguard: GPU 3 (NVIDIA H100 80GB HBM3) is yours until 20:00 - run gpuguard whoami for details`
    (`ending` replaces the part after "yours ..."); fraction: the memory of the one GPU promised
    (`GPU 3 (NVIDIA H100 80GB HBM3, 20GiB of it, shared)`)."""
    names = ", ".join(sorted({gpu.name for gpu in gpus}))
    if any(smi_differs(gpu.unit, gpu.index) for gpu in gpus):
        names += f", nvidia-smi {','.join(str(gpu.index) for gpu in sorted(gpus, key=lambda g: g.unit))}"
    names += f", {format_size(fraction)} of it" if fraction is not None else ""
    names += ", shared" if shared else ""
    several = len(gpus) > 1
    subject = f"GPU{'s' if several else ''} {unit_list(gpu.unit for gpu in gpus)} ({names})"
    until = f" until {clock(expires_at)}" if expires_at is not None else ""
    short = f" ({len(gpus)} of {wanted}: no more free)" if wanted and len(gpus) < wanted else ""
    return f"gpuguard: {subject} {'are' if several else 'is'} yours{until}{short}{ending}"


def grant_reply(gpus: Mapping[int, Gpu], held: Sequence[Grant], wanted: int | None = None, ending: str = WHOAMI_HINT,
                new: Collection[int] | None = None) -> dict[str, Any]:
    """gpus, cuda_visible_devices and the one-line message (grant_message) for what a user holds
    (`held`, of the units in `gpus`): what a login, a request and a grant from the queue reply or
    tell. new: the units just granted, which the message is about (with their own end, not an
    older grant's); wanted: the total asked for, of which those held before count too."""
    mine = [gpus[g.unit] for g in held if g.unit in gpus]
    if not mine:
        return {"gpus": [], "cuda_visible_devices": "", "message": ""}
    told = [g for g in held if new is None or g.unit in new] or list(held)
    expiries = [g.expires_at for g in told if g.expires_at is not None]
    told_units = {g.unit for g in told}
    told_gpus = [gpu for gpu in mine if gpu.unit in told_units]
    if wanted is not None:
        wanted -= len(mine) - len(told_gpus)  # the ones held before count towards it
    return {"gpus": [gpu.unit for gpu in mine],
            "cuda_visible_devices": ",".join(gpu.uuid for gpu in mine),
            "message": grant_message(told_gpus, min(expiries, default=None), any(g.shared for g in told), wanted,
                                     ending, told[0].fraction if len(told) == 1 else None)}


def smi_differs(unit: int, index: int | None) -> bool:
    """Whether NVML's index of a unit's GPU (what nvidia-smi, nvitop, gpustat and DCGM number GPUs
    by) differs from its minor (what gpuguard and /dev/nvidiaN use): then both are shown."""
    return index is not None and index != (slice_place(unit)[0] if is_slice(unit) else unit)


def gpu_label(unit: int, index: int | None) -> str:
    """`3`, or `0 (nvidia-smi 2)` where the numbers differ."""
    return unit_label(unit) + (f" (nvidia-smi {index})" if smi_differs(unit, index) else "")


def cuda_export(uuids: Iterable[str]) -> str:
    """The line a shell evaluates to see exactly the user's GPUs (`gpuguard env`, `whoami`)."""
    return f"export CUDA_VISIBLE_DEVICES={','.join(uuids)}"


def stale_devices(shell_value: str | None, uuids: Iterable[str]) -> str | None:
    """What to tell a user whose shell's CUDA_VISIBLE_DEVICES (a tmux or screen shell older than
    their grant) no longer names their GPUs; None when it does, or is unset."""
    current = ",".join(uuids)
    if shell_value is None or shell_value == current:
        return None
    return (f"your shell's CUDA_VISIBLE_DEVICES={shell_value} is stale: your GPUs are {current or 'none'}; "
            'run eval "$(gpuguard env)"')


def clock(timestamp: float) -> str:
    """`20:00` today, `Tue 20:00` within six days either way, else `2025-03-04 20:00` (local time)."""
    moment = time.localtime(timestamp)
    if moment[:3] == time.localtime()[:3]:
        return time.strftime("%H:%M", moment)
    if abs(timestamp - time.time()) < 6 * 86400:
        return time.strftime("%a %H:%M", moment)
    return time.strftime("%Y-%m-%d %H:%M", moment)


def number_list(numbers: Iterable[int]) -> str:
    """`1,3,4`: pids as people type them."""
    return ",".join(str(n) for n in sorted(numbers))


def unit_list(units: Iterable[int]) -> str:
    """`1,3/gi1/ci0`: GPUs and MIG slices as people type them (model.unit_label)."""
    return ",".join(unit_label(unit) for unit in sorted(units))


def in_use_message(units: Collection[int], pids: Collection[int]) -> str:
    """Why release keeps a GPU and what to do: `still in use by your process 11606: end it (kill
    11606) or let it finish, then gpuguard release --gpu 1` (after "GPU 1 is" or "GPU 1 stays,")."""
    them = "them" if len(set(pids)) > 1 else "it"
    return (f"still in use by your process{'es' if them == 'them' else ''} {number_list(pids)}: end {them} "
            f"(kill {' '.join(str(pid) for pid in sorted(set(pids)))}) or let {them} finish, then gpuguard release "
            + " ".join(f"--gpu {unit_label(unit)}" for unit in sorted(units)))


def layout_message(whys: Iterable[str]) -> str:
    """What a user whose grant a MIG layout change ended is told."""
    return (f"gpuguard: {'; '.join(whys)}: your grant of it ended and its processes are stopped; "
            "gpuguard request gets you another - gpuguard whoami for details")


def queue_message(position: int, waiting: int, gpus: int, estimate: float | None, then: str) -> str:
    """`gpuguard: no GPU is free right now; you are number 2 of 3 in the queue for 1 GPU ...`
    (`then`: what happens next; a client that blocks until its turn says "waiting")."""
    when = f" (expected by {clock(estimate)})" if estimate is not None else ""
    return (f"gpuguard: no GPU is free right now; you are number {position} of {waiting} in the queue for "
            f"{gpus} GPU{'s' if gpus != 1 else ''}{when}; {then} - gpuguard whoami shows the queue")


def fleet_quota_message(fleet_quota: int, elsewhere: int, position: int, waiting: int, then: str) -> str:
    """`gpuguard: you hold your fleet quota of 2 GPUs (2 on other servers); ...`: a login that
    queues although GPUs may be free here, because the user's GPUs elsewhere use up their fleet quota."""
    return (f"gpuguard: you hold your fleet quota of {fleet_quota} GPU{'s' if fleet_quota != 1 else ''} "
            f"({elsewhere} on other servers); you are number {position} of {waiting} in the queue here, served once "
            f"you release one there; {then} - gpuguard whoami shows the queue")


IDLE_SHOWN = 120.0  # idle shorter than this is "in use": the store's last-active time is up to a minute old


def queue_why(queue: dict[str, Any], now: float) -> list[str]:
    """Why a queued user waits and what they can do, in words (`gpuguard whoami`): who holds the
    GPUs, which are idle and for how long, whether reclaim would free them, the first expiry."""
    holders = queue.get("holders") or []
    lines = ["root holds your request: it keeps its place but is not served until released - ask your admin"] \
        if queue.get("held") else []
    if queue.get("fleet_quota") is not None:
        lines.append(f"you hold all of your fleet quota ({queue['fleet_quota']} GPUs on all servers together, "
                     f"{queue['fleet_elsewhere']} of them on other servers): you are served here once you release "
                     "one there")
    elif queue.get("free"):
        lines.append(f"{queue['free']} GPU{'s are' if queue['free'] != 1 else ' is'} free but held for requests "
                     "ahead of yours")
    busy = [h for h in holders if h["idle"] < IDLE_SHOWN]
    idle = sorted((h for h in holders if h["idle"] >= IDLE_SHOWN), key=lambda h: -h["idle"])
    if busy:
        lines.append("held: " + ", ".join(f"GPU {unit_label(h['minor'])} by {h['user']}" for h in busy))
    for h in idle:
        reclaim = ("reclaim is off for them" if h["reclaim_after"] is None else
                   f"reclaim takes it back after {format_duration(h['reclaim_after'])} idle while someone waits")
        lines.append(f"idle: GPU {unit_label(h['minor'])} of {h['user']}, unused for {_minutes(h['idle'])}; {reclaim}")
    expiries = [h["expires_at"] for h in holders if h["expires_at"] is not None]
    if expiries:
        first = min(expiries)
        lines.append(f"the first grant to end runs until {clock(first)} (in {_minutes(first - now)})")
    elif holders:
        lines.append("no grant has a time limit: a GPU comes free when its holder releases it or logs out")
    lines.append("you can: wait here (you are told on your terminals), see gpuguard status, ask a holder to run "
                 "gpuguard release, ask your admin, or leave with gpuguard cancel")
    return lines


def _minutes(seconds: float) -> str:
    """`2h04m` as `2h4m`: whole minutes, since store times are up to a minute old anyway."""
    return format_duration(max(1, int(seconds // 60)) * 60)


HINT = "see gpuguard whoami"


def action_message(action: Action, command: str = "") -> str:
    """What the watcher tells the user about an action (rules.decide), on their terminals and in
    `gpuguard whoami`: one line that says what happened, why, and what to do."""
    from gpuguard.core import rules  # the daemon's, loaded already there; the users' commands never need it

    n = action.numbers
    gpu = f"GPU {unit_label(action.unit)}"
    proc = action.proc
    who = f"process {proc.pid}" + (f" ({command})" if command else "") if proc else ""
    if action.rule == rules.MEMORY and action.kind == rules.WARN:
        over = f"over your {format_size(n['quota'])} quota"
        if proc is None:  # only processes of unknown memory: nothing can be chosen to stop
            return f"gpuguard: your processes on {gpu} use {format_size(n['used'])}, {over}; reduce usage - {HINT}"
        stop_in = format_duration(round(n["grace"]))
        if n.get("processes", 1) == 1:
            return (f"gpuguard: your {who} on {gpu} uses {format_size(n['used'])}, {over}; "
                    f"it will be stopped in {stop_in} unless usage drops - {HINT}")
        return (f"gpuguard: your {n['processes']} processes on {gpu} use {format_size(n['used'])} together, "
                f"{over}; the largest, {who}, will be stopped in {stop_in} unless usage drops - {HINT}")
    if action.kind == rules.TERM:
        reasons: dict[str, str] = {
            rules.MEMORY: f"your processes on {gpu} used {format_size(n.get('used'))}, over your "
                    f"{format_size(n.get('quota'))} quota, for {format_duration(round(n.get('grace', 0)))}",
            rules.TIME: f"your time on {gpu} is over",
            rules.STRAY: f"{gpu} is not granted to you",
        }
        why = reasons.get(action.rule, action.rule)
        return (f"gpuguard: stopping your {who} on {gpu} with SIGTERM: {why}; it will be killed if still "
                f"running in {format_duration(round(n.get('kill_wait', 0)))} - {HINT}")
    if action.kind == rules.KILL:
        return (f"gpuguard: killed your {who} on {gpu} with SIGKILL: it was still running "
                f"{format_duration(round(n.get('kill_wait', 0)))} after SIGTERM ({action.rule} rule) - {HINT}")
    if action.kind == rules.UNKILLABLE:
        return (f"gpuguard: your {who} on {gpu} survives SIGKILL (stuck in the kernel); an administrator "
                f"must look at it - {HINT}")
    if action.kind == rules.WARN and action.rule == rules.TIME and n["threshold"] == 0:
        return (f"gpuguard: your time on {gpu} is over; you keep it while nobody waits for a GPU, and it "
                f"will be taken (processes on it stopped) as soon as someone does - {HINT}")
    if action.kind == rules.WARN and action.rule == rules.TIME:
        at = time.strftime("%H:%M:%S", time.localtime(n["expires_at"]))
        return (f"gpuguard: your grant of {gpu} ends in {format_duration(max(0, round(n['left'])))} (at {at}); "
                f"save your work: processes still on it then will be stopped - {HINT}")
    if action.kind == rules.REVOKE:
        count = int(n.get("processes") or 0)
        ending = f"; your {count} process{'es' if count != 1 else ''} on it will be stopped" if count else ""
        return (f"gpuguard: your time on {gpu} is over (limit {format_duration(round(n['max_time']))}); access is "
                f"revoked{ending} - run gpuguard request for a new grant")
    if action.kind == rules.RELEASE and action.rule == rules.RECLAIM:
        return (f"gpuguard: released {gpu} for someone waiting: none of your processes used it for "
                f"{format_duration(round(n['reclaim_after']))}; your sessions are untouched - run gpuguard "
                f"request to get a GPU again")
    if action.kind == rules.RELEASE:
        return (f"gpuguard: released {gpu}: none of your processes used it for "
                f"{format_duration(round(n['idle_timeout']))}; your sessions are untouched - run gpuguard request "
                f"to get a GPU again")
    if action.rule == rules.STRAY and action.kind == rules.WARN:
        others = int(n.get("processes") or 1) - 1
        also = f" (and {others} more of yours)" if others > 0 else ""
        return (f"gpuguard: your {who}{also} uses {gpu}, which is not granted to you; your processes on it "
                f"will be stopped in {format_duration(round(n['grace']))} - {HINT} or gpuguard request")
    if action.kind == rules.REPORT:
        return f"gpuguard: {who} of an exempt user uses {gpu} without a grant (left alone)"
    return f"gpuguard: {action.kind} {action.rule} on {gpu}"
