"""Slurm's gres.conf and `scontrol show node`, read for the GPUs Slurm owns on one node. Pure: text in.

gres.conf (gres.conf(5)) is lines of `Key=Value` pairs separated by blanks; keys are case-insensitive,
`#` starts a comment, a trailing backslash continues a line, and `Include PATH` reads another file
in its place. A line with `NodeName=` applies to those nodes (a Slurm hostlist: `gpu[01-04]`,
`tux[0-15],big1`, `rack[0-1]-n[1-2]`); one without applies to every node. `File=` and `MultipleFiles=`
name device files, also as hostlist expressions (`/dev/nvidia[0-3]`, `/dev/nvidia0,/dev/nvidia2`).
`AutoDetect=nvml` (or `nvidia`) makes slurmd find every NVIDIA GPU by itself: on a line of its own
for all nodes, on a NodeName line for those (`AutoDetect=off` there overrides the global one).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

MAX_NAMES = 65536      # one hostlist expression expands to at most this many names (a typo, else)
MAX_INCLUDE_DEPTH = 8  # Include inside Include ...: a loop, else
NVIDIA_AUTODETECT = frozenset({"nvml", "nvidia"})  # the mechanisms that find NVIDIA GPUs (rsmi, oneapi, nrt: others')
_GPU_NODE = re.compile(r"nvidia(\d+)")
_CAP_NODE = re.compile(r"nvidia-cap(\d+)")


class GresError(ValueError):
    """A gres.conf or scontrol text gpuguard cannot read with certainty: one line, with where."""


# --- hostlists

def expand_hostlist(expression: str, limit: int = MAX_NAMES) -> list[str]:
    """`gpu[01-03],big1` -> gpu01, gpu02, gpu03, big1: Slurm's hostlist syntax (commas between
    names, and bracketed lists of numbers and ranges, zero padding kept, several brackets in one
    name multiplied out). Raises GresError for a malformed one or one of more than `limit` names."""
    names: list[str] = []
    for part in _split_top_level(expression):
        if not part:
            raise GresError(f"empty name in hostlist {expression!r}")
        names += _expand_one(part, expression, limit)
        if len(names) > limit:
            raise GresError(f"hostlist {expression!r} names more than {limit} entries")
    return names


def _split_top_level(text: str, brackets: str = "[]") -> list[str]:
    """Split at commas outside the pair of brackets given (a hostlist's [], scontrol's Gres= ())."""
    opening, closing = brackets[0], brackets[1]
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {opening: 1, closing: -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _expand_one(name: str, expression: str, limit: int) -> list[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]*)\](.*)", name)
    if match is None:
        if "[" in name or "]" in name:
            raise GresError(f"unbalanced brackets in hostlist {expression!r}")
        return [name]
    prefix, body, rest = match.groups()
    numbers: list[str] = []
    for item in body.split(","):
        numbers += _range(item, expression, limit)
        if len(numbers) > limit:
            raise GresError(f"hostlist {expression!r} names more than {limit} entries")
    tails = _expand_one(rest, expression, limit)
    if len(numbers) * len(tails) > limit:
        raise GresError(f"hostlist {expression!r} names more than {limit} entries")
    return [prefix + number + tail for number in numbers for tail in tails]


def _range(item: str, expression: str, limit: int) -> list[str]:
    first, dash, last = item.partition("-")
    if not first.isdigit() or (dash and not last.isdigit()):
        raise GresError(f"not a number or a range of numbers: {item!r} in {expression!r}")
    width = len(first) if first.startswith("0") and len(first) > 1 else 0
    low, high = int(first), int(last) if dash else int(first)
    if high < low:
        raise GresError(f"range {item!r} goes down in {expression!r}")
    if high - low >= limit:
        raise GresError(f"hostlist {expression!r} names more than {limit} entries")
    return [str(number).zfill(width) for number in range(low, high + 1)]


# --- gres.conf

@dataclass(frozen=True)
class GresLine:
    where: str                        # "path:line", for messages
    values: dict[str, str]            # lower-case key -> value, as written


@dataclass(frozen=True)
class NodeGpus:
    """What gres.conf says Slurm owns on one node."""

    autodetect: bool                                 # slurmd finds every NVIDIA GPU itself: all are Slurm's
    minors: frozenset[int] = frozenset()             # /dev/nvidia<N> named in File= or MultipleFiles=
    caps: frozenset[int] = frozenset()               # /dev/nvidia-caps/nvidia-cap<N> named there (MIG)
    counted: tuple[str, ...] = field(default=())     # "where" of gpu lines with a Count but no file


def parse_gres_conf(text: str, source: str, read: Callable[[str], str], depth: int = 0) -> list[GresLine]:
    """The lines of a gres.conf with their Include files read in place (read(path) -> text; it
    raises OSError). Raises GresError for a line that is not Key=Value pairs."""
    if depth > MAX_INCLUDE_DEPTH:
        raise GresError(f"{source}: Include nested more than {MAX_INCLUDE_DEPTH} deep")
    lines: list[GresLine] = []
    for number, line in _logical_lines(text):
        where = f"{source}:{number}"
        words = line.split()
        if words[0].lower() == "include":
            if len(words) != 2:
                raise GresError(f"{where}: expected Include PATH, got {line!r}")
            try:
                included = read(words[1])
            except OSError as exc:
                raise GresError(f"{where}: cannot read {words[1]}: {exc.strerror or exc}") from None
            lines += parse_gres_conf(included, words[1], read, depth + 1)
            continue
        values: dict[str, str] = {}
        for word in words:
            key, equals, value = word.partition("=")
            if not equals or not key:
                raise GresError(f"{where}: expected Key=Value, got {word!r}")
            values[key.lower()] = value.strip('"')
        lines.append(GresLine(where, values))
    return lines


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each non-empty line, comments cut and continuations joined."""
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            yield start, line
    if pending.strip():
        yield start, pending.strip()


def node_gpus(lines: Iterable[GresLine], node: str) -> NodeGpus:
    """What Slurm owns on `node` according to these gres.conf lines. Raises GresError for a
    NodeName hostlist that cannot be read (a node might be in it)."""
    autodetect_all: str | None = None
    autodetect_node: str | None = None
    minors: set[int] = set()
    caps: set[int] = set()
    counted: list[str] = []
    for line in lines:
        values = line.values
        names = values.get("nodename")
        if names is not None:
            try:
                if node not in expand_hostlist(names):
                    continue
            except GresError as exc:
                raise GresError(f"{line.where}: NodeName: {exc}") from None
        if "autodetect" in values:
            if names is None:
                autodetect_all = values["autodetect"].lower()
            else:
                autodetect_node = values["autodetect"].lower()
        files = [path for key in ("file", "multiplefiles") if key in values
                 for path in _expand_files(values[key], line.where)]
        for path in files:
            base = path.rsplit("/", 1)[-1]
            if gpu := _GPU_NODE.fullmatch(base):
                minors.add(int(gpu[1]))
            elif cap := _CAP_NODE.fullmatch(base):
                caps.add(int(cap[1]))
        if values.get("name", "").lower() == "gpu" and not files:
            counted.append(line.where)
    detect = autodetect_node if autodetect_node is not None else autodetect_all
    return NodeGpus(autodetect=detect in NVIDIA_AUTODETECT, minors=frozenset(minors), caps=frozenset(caps),
                    counted=tuple(counted))


def _expand_files(expression: str, where: str) -> list[str]:
    try:
        return expand_hostlist(expression)
    except GresError as exc:
        raise GresError(f"{where}: File: {exc}") from None


# --- scontrol show node

def scontrol_gpu_count(text: str) -> int:
    """How many GPUs `scontrol show node NAME` gives the node: the gpu entries of its Gres=
    (`gpu:4`, `gpu:a100:2(S:0-1),gpu:v100:2`, `(null)` for none). Raises GresError when the text
    has no Gres= field (not a node's description)."""
    fields = dict(word.partition("=")[::2] for word in text.split() if "=" in word)
    if "Gres" not in fields:
        raise GresError("scontrol show node: no Gres= field in its answer")
    total = 0
    for entry in filter(None, _split_top_level(fields["Gres"], "()")):
        parts = re.sub(r"\(.*\)$", "", entry).split(":")
        if parts[0] != "gpu":
            continue
        counts = [part for part in parts[1:] if part.isdigit()]
        total += int(counts[-1]) if counts else 1
    return total

