"""Which GPUs a user gets: a pure function of the inventory, topology and current grants.

The inventory holds units (model.py): whole GPUs, and the MIG slices of GPUs in MIG mode. Whole
GPUs come first, when the quota allows them (whole_gpus); what is still wanted is then made up of
slices (at most quota.slices of the user's units), which are never shared (their point is
isolation in hardware): free slices of an allowed profile, in the quota's order of profiles
(smallest first when it names none), then the ones the user held last, least recently released,
lowest unit.

Order of preference among whole GPUs, most important first:
1. free GPUs before shared ones, and among shared ones the least crowded. Sharing only when the
   caller allows it, onto a GPU whose holders all share too, where one more sharer keeps its
   promises (room_to_share): at most the quota's `max_sharers` users on the GPU, and the memory
   quotas promised to them all (Grant.memory, the joiner's gpu_memory included) within the GPU's
   memory. A sharing grant without a known memory promise lets nobody join;
2. the GPUs this user held last (sticky: a returning user gets them back when they are free,
   so the CUDA_VISIBLE_DEVICES of their tmux and screen shells still names their GPUs), the
   most recently held first;
3. for several GPUs, the best-connected set: the smallest worst pairwise link, then the
   smallest sum of links (NVLink < PCIe switch < NUMA node < system), counting the GPUs
   the user already holds, so a top-up lands next to them;
4. fewest NUMA nodes;
5. least recently released (spreads wear; a just-released GPU may still be draining);
6. lowest units, so the answer is deterministic.

A fraction (quota.fraction: part of one GPU's memory, policy.fraction_terms) goes where
place_fraction says, on a GPU of its own or beside other fractions; see its docstring.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from heapq import nsmallest
from itertools import combinations, filterfalse, repeat
from math import comb
from operator import attrgetter, neg
from typing import Any

from gpuguard.core.model import Gpu, Grant, Link, Placement, Quota, is_slice, unit_parent

# Beyond this many candidate sets (e.g. 8 of 64 GPUs) a greedy search replaces the exhaustive one.
EXHAUSTIVE_LIMIT = 5000

Topology = Mapping[tuple[int, int], Link]
# The asks seen lately, by size: bytes of a fraction (None: a whole GPU) -> how many (Grants.demand)
Demand = Mapping["int | None", float]


def link(topology: Topology, a: int, b: int) -> Link:
    """The link between two GPUs; an undeclared pair counts as the worst, never the best."""
    return topology.get((a, b), topology.get((b, a), Link.SYSTEM))


def promised(others: Iterable[Grant]) -> int | None:
    """The memory promised to these grants on one GPU together; None when one of them is not a
    fraction (Grant.fraction: a grant of the GPU alone, or a promise unknown), so nobody joins."""
    total = 0
    for grant in others:
        if grant.fraction is None:
            return None
        total += grant.fraction
    return total


def room_to_share(gpu: Gpu, others: Sequence[Grant], quota: Quota) -> bool:
    """Whether a user on `quota` may join `others` (other users' grants on this GPU) as one more
    sharer: a whole GPU of known memory, every holder sharing with a known memory promise, fewer
    than max_sharers users on it, and all promises, the joiner's gpu_memory included, within
    the GPU's memory."""
    if quota.gpu_memory is None or gpu.slice is not None or gpu.memory_total <= 0:
        return False
    taken = promised(others)
    return (taken is not None and len({g.uid for g in others}) < quota.max_sharers
            and taken + quota.gpu_memory <= gpu.memory_total)


def blocking(grants: Iterable[Grant], uid: int, units: Collection[int], share: bool,
             gpus: Mapping[int, Gpu], quota: Quota) -> list[Grant]:
    """Other users' grants that keep `uid` off these units: all of them, unless `uid` may share
    (share) and room_to_share says the unit takes one more sharer on `quota`'s terms."""
    others: dict[int, list[Grant]] = {}
    for grant in grants:
        if grant.unit in units and grant.uid != uid:
            others.setdefault(grant.unit, []).append(grant)
    return [g for unit, held in others.items()
            if not (share and unit in gpus and room_to_share(gpus[unit], held, quota)) for g in held]


class Whole:
    """Whole GPUs as _choose_whole weighs them: in inventory order, by unit, with their NUMA nodes."""

    def __init__(self, gpus: Iterable[Gpu]):
        self.by_unit: dict[int, Gpu] = {gpu.unit: gpu for gpu in gpus}
        self.numa: dict[int, int | None] = {unit: gpu.numa_node for unit, gpu in self.by_unit.items()}
        self.one_node = len(set(self.numa.values())) <= 1  # so is every part of it


class Pool:
    """The units that may be handed out, sorted by kind once per change of the inventory rather
    than at every choice (Grants keeps one: a pool of hundreds of GPUs is asked at every grant)."""

    def __init__(self, gpus: Iterable[Gpu]):
        units = list(gpus)
        self.units = frozenset(gpu.unit for gpu in units)
        # whole GPUs not in MIG mode (those a quota with whole_gpus takes: suits) and the slices
        self.whole = Whole(gpu for gpu in units if gpu.slice is None and not gpu.mig_mode)
        self.slices = tuple(gpu for gpu in units if gpu.slice is not None)


_NO_GPUS = Whole(())
_unit = attrgetter("unit")


def choose(gpus: Pool | Sequence[Gpu], topology: Topology, grants: Iterable[Grant],
           last_released: Mapping[int, float], uid: int, count: int, share: bool = False,
           held_last: Mapping[int, float] | None = None, quota: Quota | None = None,
           placement: Placement = Placement.FGD, demand: Demand | None = None) -> tuple[int, ...]:
    """Up to `count` more units for `uid` (fewer when fewer are available; () when none), on the
    terms of `quota` (which units; None: the defaults). held_last: when `uid` last gave back each
    unit it held (Store.last_held). A fraction (quota.fraction) is one unit, placed by
    `placement` for the asks of `demand` (place_fraction)."""
    quota = quota or Quota()
    held_last = held_last or {}
    grants = list(grants)
    pool = gpus if isinstance(gpus, Pool) else Pool(gpus)
    whole = pool.whole if quota.whole_gpus else _NO_GPUS
    # Slices are numbered above every GPU (unit_numbers): the highest unit held says whether any is.
    sliced = [g for g in grants if is_slice(g.unit)] if grants and is_slice(max(map(_unit, grants))) else []
    if sliced:  # a GPU with a slice held is not free whole (its node is the slice holder's too)
        cut = {unit_parent(g.unit) for g in sliced}
        whole = Whole(gpu for unit, gpu in whole.by_unit.items() if unit not in cut)
    if quota.fraction is not None:
        return place_fraction(whole.by_unit.values(), grants, uid, quota, placement, demand)
    chosen = _choose_whole(whole, topology, grants, last_released, uid, count, share, held_last, quota)
    if not pool.slices:  # no MIG here: the common case stops here
        return chosen
    # Nor is a slice free on a GPU held whole (a grant the layout has ended, until its revoke is through).
    held_whole = {g.unit for g in grants if not is_slice(g.unit)}
    slices = [gpu for gpu in pool.slices if suits(gpu, quota) and gpu.slice is not None
              and gpu.slice.parent not in held_whole]
    room = count - len(chosen)
    if quota.slices is not None:
        room = min(room, quota.slices - sum(1 for g in sliced if g.uid == uid))
    return tuple(sorted(chosen + _choose_slices(slices, grants, last_released, uid, room, quota.slice_profiles,
                                                held_last)))


def suits(gpu: Gpu, quota: Quota) -> bool:
    """Whether a unit is of a kind the quota takes: a whole GPU (not in MIG mode) when whole_gpus;
    a slice when slices are allowed at all, of an allowed profile."""
    if gpu.slice is None:
        return quota.whole_gpus and not gpu.mig_mode
    return quota.slices != 0 and (not quota.slice_profiles or gpu.slice.profile in quota.slice_profiles)


def _choose_slices(slices: Sequence[Gpu], grants: list[Grant], last_released: Mapping[int, float], uid: int,
                   count: int, profiles: Sequence[str], held_last: Mapping[int, float]) -> tuple[int, ...]:
    """Up to `count` free slices (of allowed profiles already), best first (see the module's docstring)."""
    if count <= 0:
        return ()
    held = {g.unit for g in grants}
    rank = {profile: place for place, profile in enumerate(profiles)}
    free = [gpu for gpu in slices if gpu.unit not in held]
    free.sort(key=lambda gpu: (rank.get(_profile(gpu), 0), gpu.memory_total,
                               gpu.unit not in held_last, -held_last.get(gpu.unit, 0.0),
                               last_released.get(gpu.unit, 0.0), gpu.unit))
    return tuple(gpu.unit for gpu in free[:count])


def _profile(gpu: Gpu) -> str:
    return gpu.slice.profile if gpu.slice else ""


def _choose_whole(whole: Whole, topology: Topology, grants: list[Grant], last_released: Mapping[int, float],
                  uid: int, count: int, share: bool, held_last: Mapping[int, float], quota: Quota) -> tuple[int, ...]:
    """Up to `count` more whole GPUs (see the module's docstring)."""
    numa = whole.numa
    # A grant on a GPU missing from the inventory (NVML could not read it at start) still counts
    # as held, but has no NUMA node or links to weigh: only the GPUs known here are placed.
    own = {g.unit for g in grants if g.uid == uid and g.unit in numa}
    if share:
        holders = Counter[int](g.unit for g in grants if g.uid != uid)
        taken = own.union(g.unit for g in blocking(grants, uid, whole.by_unit.keys(), share, whole.by_unit, quota))
    else:  # every GPU held is taken (blocking's answer, without asking it), so no candidate has holders
        holders = Counter[int]()
        taken = set(map(_unit, grants))
    candidates = list(filterfalse(taken.__contains__, numa))  # filtered in C: hundreds of GPUs, every choice
    want = min(count, len(candidates))
    if want <= 0:
        return ()
    if not topology and (whole.one_node or len({numa[m] for m in (*candidates, *own)}) <= 1):
        # No links or NUMA nodes declared (a replay's pool): every set is linked alike, so the best
        # set is the best GPUs one by one, by the same preferences as below (fast on 100 GPUs).
        # Nobody's first, among them the ones this user held last, then least recently released
        # (keys built in C, and only the best `want` picked: a pool of hundreds is ranked at every
        # choice); then the shared ones, fewest holders first.
        unheld = candidates if not share else list(filterfalse(holders.__contains__, candidates))
        sticky = list(held_last.keys() & unheld)
        ranked = [m for *_, m in nsmallest(want, zip(map(neg, map(held_last.__getitem__, sticky)),
                                                     map(last_released.get, sticky, repeat(0.0)), sticky,
                                                     strict=True))]
        if len(ranked) < want:
            rest = list(filterfalse(held_last.__contains__, unheld)) if held_last else unheld
            ranked += [m for _, m in nsmallest(want - len(ranked),
                                               zip(map(last_released.get, rest, repeat(0.0)), rest, strict=True))]
        if len(ranked) < want:
            ranked += sorted((m for m in candidates if m in holders),
                             key=lambda m: (holders[m], m not in held_last, -held_last.get(m, 0.0),
                                            last_released.get(m, 0.0), m))
        return tuple(sorted(ranked[:want]))

    def key(chosen: tuple[int, ...]) -> tuple[Any, ...]:
        together = (*chosen, *sorted(own))
        links = [link(topology, a, b) for a, b in combinations(together, 2)]
        return (sum(1 for m in chosen if holders[m]),
                sum(holders[m] for m in chosen),
                -sum(1 for m in chosen if m in held_last),
                sorted(-held_last.get(m, 0.0) for m in chosen),
                max(links, default=Link.NVLINK),
                sum(links),
                len({numa[m] for m in together}),
                sorted((last_released.get(m, 0.0) for m in chosen), reverse=True),
                sorted(chosen))

    if comb(len(candidates), want) <= EXHAUSTIVE_LIMIT:
        best = min(combinations(candidates, want), key=key)
    else:
        best = min((_grow(start, candidates, want, key) for start in candidates), key=key)
    return tuple(sorted(best))


def _grow(start: int, candidates: list[int], want: int,
          key: Callable[[tuple[int, ...]], tuple[Any, ...]]) -> tuple[int, ...]:
    """Greedy: from one GPU, keep adding whichever candidate makes the best set so far."""
    chosen: tuple[int, ...] = (start,)
    while len(chosen) < want:
        chosen = min(((*chosen, c) for c in candidates if c not in chosen), key=key)
    return chosen


def place_fraction(gpus: Iterable[Gpu], grants: Iterable[Grant], uid: int, quota: Quota,
                   placement: Placement, demand: Demand | None) -> tuple[int, ...]:
    """The whole GPU for one fraction of quota.fraction bytes, as (unit,), or () when none has room.

    A GPU has room when nobody holds it, or when everyone on it holds a fraction and the memory
    promised to them all, this one included, fits it (room_to_share); never one `uid` holds.

    Where it goes decides what stays usable. Each GPU's memory not yet promised is fragmented for
    an ask when that ask could not use it: a whole-GPU ask can use a GPU only while nobody is on
    it; a fraction, only where at least its size is left. Fragmentation-aware placement (FGD,
    after Weng et al., "Beware of Fragmentation", USENIX ATC 2023) weighs that over the asks seen
    lately (`demand`, by how often each size was asked: fragmentation()) and puts the fraction
    where the expected fragmented memory grows least: among the GPUs with fractions on them, the
    one whose leftover the coming asks could least use anyway. It breaks into a free GPU only
    when none of those has room, whatever the mix: a free GPU serves every ask, a whole-GPU one
    included, and the mix of a quiet hour (fractions only, say) is no reason to spend one. Ties
    go to the best fit (least memory left), then to the NUMA node with the fewest free GPUs (so
    another node's stay whole together, for a multi-GPU job: FGD's point about servers of several
    GPUs, within one server), then the lowest unit.
    Baselines, for the replay to compare: best-fit (the least memory left after it, a free GPU
    counting as the most) and first-fit (the lowest unit with room)."""
    memory = quota.fraction
    assert memory is not None  # a fraction's terms (policy.fraction_terms)
    by_unit = {gpu.unit: gpu for gpu in gpus}
    others: dict[int, list[Grant]] = {}
    mine: set[int] = set()
    for grant in grants:
        if grant.uid == uid:
            mine.add(grant.unit)
        elif grant.unit in by_unit:
            others.setdefault(grant.unit, []).append(grant)
    # unit -> memory promised on it before this fraction
    room = {unit: promised(others.get(unit, ())) or 0 for unit, gpu in by_unit.items()
            if unit not in mine and room_to_share(gpu, others.get(unit, []), quota)}
    if not room:
        return ()
    if placement == Placement.FIRST_FIT:
        return (min(room),)

    def left(unit: int) -> int:
        return by_unit[unit].memory_total - room[unit] - memory

    if placement == Placement.BEST_FIT:
        return (min(room, key=lambda unit: (left(unit), unit)),)
    sizes = demand or {None: 1.0}

    def growth(unit: int) -> float:
        total = by_unit[unit].memory_total
        return (fragmentation(left(unit) / total, total, sizes)
                - fragmentation((total - room[unit]) / total, total, sizes))

    # A server's GPUs are not interchangeable for a multi-GPU job, which wants them on one NUMA node
    # (the whole GPUs' order above): a fraction that must break into a free GPU takes one where
    # the fewest stay free, keeping another node's GPUs whole together.
    held = mine.union(others)
    intact = Counter(gpu.numa_node for unit, gpu in by_unit.items() if unit not in held)
    # (growth rounded: equal growths differ in floating point, and equal ones go to the best fit)
    return (min(room, key=lambda unit: (room[unit] == 0, round(growth(unit), 9), left(unit),
                                         intact[by_unit[unit].numa_node], unit)),)


def fragmentation(free: float, total: int, demand: Demand) -> float:
    """The part of a GPU (of `total` bytes, `free` of it not promised) that the next ask could
    not use, expected over `demand`: all of the free part for an ask it cannot serve (a whole-GPU
    ask where anything is promised, a fraction larger than what is free), none for one it can."""
    asks = sum(demand.values())
    unusable = sum(count for size, count in demand.items()
                   if (free < 1.0 if size is None else free * total < size))
    return free * unusable / asks if asks else 0.0
