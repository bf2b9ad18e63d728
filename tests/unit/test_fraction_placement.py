"""Fractions of a GPU (gpuguard request --memory): their terms, their bounds, where the pure
allocator places them under each placement, and the memory the watcher holds them to."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gpuguard.core import allocator, policy, rules
from gpuguard.core.model import Gpu, Grant, Placement, Quota

GIB = 1 << 30


def gpu(unit: int, memory: int = 80 * GIB) -> Gpu:
    return Gpu(unit, unit, f"GPU-{unit}", "H100", f"0000:{unit:02x}:00.0", memory, 0, 0, 0)


def fraction(uid: int, unit: int, memory: int) -> Grant:
    return Grant(uid, f"u{uid}", unit, 0.0, None, 0.0, shared=True, memory=memory * GIB)


def whole(uid: int, unit: int) -> Grant:
    return Grant(uid, f"u{uid}", unit, 0.0, None, 0.0)


def place(gpus: list[Gpu], grants: list[Grant], memory: int, placement: Placement = Placement.FGD,
          demand: allocator.Demand | None = None, uid: int = 99) -> tuple[int, ...]:
    terms = policy.fraction_terms(Quota(gpus=4), memory * GIB)
    return allocator.choose(gpus, {}, grants, {}, uid, 1, True, quota=terms, placement=placement, demand=demand)


def test_two_fractions_share_a_gpu_and_a_third_that_does_not_fit_goes_elsewhere_or_nowhere():
    gpus = [gpu(0)]
    assert place(gpus, [], 30) == (0,)
    assert place(gpus, [fraction(1, 0, 30)], 40) == (0,)
    assert place(gpus, [fraction(1, 0, 30), fraction(2, 0, 40)], 20) == ()  # 90 GiB of 80
    assert place(gpus, [fraction(1, 0, 30), fraction(2, 0, 40)], 10) == (0,)  # exactly 80 fits


def test_a_fraction_never_joins_a_whole_grant_nor_the_askers_own_gpu():
    gpus = [gpu(0), gpu(1)]
    assert place(gpus, [whole(1, 0)], 20) == (1,)
    assert place(gpus, [whole(1, 0), fraction(99, 1, 20)], 20) == ()  # 1 is the asker's already


def test_a_whole_request_never_lands_on_a_gpu_with_fractions():
    gpus = [gpu(0), gpu(1)]
    grants = [fraction(1, 0, 20), whole(2, 1)]
    assert place(gpus, grants, 20) == (0,)  # room beside the fraction, for a fraction
    assert allocator.choose(gpus, {}, grants, {}, 5, 1, False, quota=Quota(gpus=2)) == ()  # none for a whole GPU
    assert allocator.choose(gpus, {}, grants[:1], {}, 5, 2, False, quota=Quota(gpus=2)) == (1,)


@pytest.mark.parametrize("placement", list(Placement))
def test_every_placement_packs_fractions_rather_than_breaking_into_a_free_gpu(placement):
    gpus = [gpu(0), gpu(1), gpu(2)]
    # GPU 1 has room for one more; 0 and 2 are free
    assert place(gpus, [fraction(1, 1, 40)], 20, placement) == ((0,) if placement == Placement.FIRST_FIT else (1,))


def test_best_fit_takes_the_tightest_gpu():
    gpus = [gpu(0), gpu(1)]
    grants = [fraction(1, 0, 40), fraction(2, 1, 60)]
    assert place(gpus, grants, 10, Placement.BEST_FIT) == (1,)  # 10 GiB left, not 30
    assert place(gpus, grants, 10, Placement.FIRST_FIT) == (0,)


def test_fgd_keeps_room_where_the_asks_seen_lately_fit():
    """Two GPUs with 40 and 30 GiB left; a 10 GiB fraction. Best-fit takes the 30 (20 left), but
    when the lab asks mostly for 30 GiB fractions, both 40 and 30 could serve the next ask; after
    best-fit's choice only one can, after FGD's (40 -> 30) both still can."""
    gpus = [gpu(0), gpu(1)]
    grants = [fraction(1, 0, 40), fraction(2, 1, 50)]
    assert place(gpus, grants, 10, Placement.BEST_FIT) == (1,)
    assert place(gpus, grants, 10, Placement.FGD, demand={30 * GIB: 9, None: 1}) == (0,)
    # With whole GPUs the only asks, every leftover is lost alike: the best fit, as a tie-break.
    assert place(gpus, grants, 10, Placement.FGD, demand={None: 1}) == (1,)


def test_fragmentation_counts_what_the_asks_cannot_use():
    demand = {None: 1, 40 * GIB: 1}
    total = 80 * GIB
    assert allocator.fragmentation(1.0, total, demand) == 0.0  # free: both asks fit
    assert allocator.fragmentation(0.5, total, demand) == pytest.approx(0.25)  # 40 GiB fits one of the two
    assert allocator.fragmentation(0.25, total, demand) == pytest.approx(0.25)  # 20 GiB fits neither
    assert allocator.fragmentation(0.0, total, demand) == 0.0


def test_a_fraction_needs_a_gpu_of_known_memory_and_no_mig():
    unknown = replace(gpu(0), memory_total=0)
    assert place([unknown], [], 10) == ()
    assert place([replace(gpu(0), mig_mode=True)], [], 10) == ()


def test_terms_bounds_and_limits():
    quota = Quota(gpus=2, gpu_memory=40 * GIB, max_sharers=2)
    terms = policy.fraction_terms(quota, 20 * GIB)
    assert (terms.fraction, terms.gpu_memory, terms.sharing, terms.slices) == (20 * GIB, 20 * GIB, True, 0)
    assert terms.max_sharers == policy.FRACTIONS_PER_GPU  # memory bounds them, not the users' max_sharers
    assert policy.fraction_bounds(quota, 80 * GIB) == (256 << 20, 40 * GIB)  # the gpu_memory quota caps it
    assert policy.fraction_bounds(replace(quota, gpu_memory=None, min_fraction_memory=8 * GIB), 80 * GIB) == \
        (8 * GIB, 80 * GIB)
    assert policy.fraction_bounds(replace(quota, max_fraction_memory=24 * GIB), 80 * GIB)[1] == 24 * GIB
    assert policy.fraction_limit(quota) == 2
    assert policy.fraction_limit(replace(quota, max_fractions=1)) == 1
    assert policy.fraction_limit(replace(quota, max_fractions=5)) == 2  # never more than gpus


def test_the_watcher_holds_a_fraction_to_its_promise_and_a_quota_to_the_smaller():
    grant = fraction(1, 0, 20)
    assert rules.memory_limit(grant, Quota()) == 20 * GIB
    assert rules.memory_limit(grant, Quota(gpu_memory=16 * GIB)) == 16 * GIB
    assert rules.memory_limit(whole(1, 0), Quota()) is None
    assert rules.memory_limit(whole(1, 0), Quota(gpu_memory=16 * GIB)) == 16 * GIB


def test_a_fraction_that_breaks_into_a_free_gpu_keeps_another_numa_nodes_gpus_whole():
    """8 GPUs on two NUMA nodes, GPU 5 held whole: a fraction takes a free GPU of node 1, where 3
    stay free, not of node 0, whose 4 GPUs stay free together for a 4-GPU job. The baselines
    know nothing of nodes."""
    gpus = [replace(gpu(unit), numa_node=unit // 4) for unit in range(8)]
    grants = [whole(1, 5)]
    assert place(gpus, grants, 20) == (4,)
    assert place(gpus, grants, 20, Placement.FIRST_FIT) == (0,)
    assert allocator.choose(gpus, {}, [*grants, fraction(2, 4, 20)], {}, 7, 4, False, quota=Quota(gpus=4)) == \
        (0, 1, 2, 3)


def test_equal_growths_go_to_the_best_fit_whatever_floating_point_says():
    """18 and 73 GiB promised, a 5 GiB ask, only whole-GPU asks seen: both GPUs lose the same
    (5/80 of a GPU), which floating point puts a hair apart; the best fit takes it."""
    gpus = [gpu(0), gpu(1)]
    grants = [fraction(1, 0, 18), fraction(2, 1, 73)]
    assert place(gpus, grants, 5, demand={None: 10}) == (1,)
    assert place(gpus, grants, 5) == (1,)


def test_config_check_warns_of_a_fraction_the_same_quota_refuses():
    from gpuguard.config import Config
    from gpuguard.core import config_warnings

    def warned(quota: Quota) -> list[str]:
        found = config_warnings.warnings(Config(defaults=quota), lambda name: True, lambda name: True,
                                         lambda path: True)
        return [line for line in found if "fraction_memory" in line]

    assert warned(Quota(fraction_memory=20 * GIB)) == []
    assert warned(Quota(fraction_memory=20 * GIB, gpu_memory=16 * GIB)) == [
        "defaults.fraction_memory: 20GiB is outside 256MiB to 16GiB (min_fraction_memory, max_fraction_memory, "
        "gpu_memory): their logins get no GPU"]
    assert warned(Quota(fraction_memory=20 * GIB, max_fractions=0)) == [
        "defaults.fraction_memory: asks for fractions the same quota allows none of (max_fractions, gpus or "
        "whole_gpus): their logins get no GPU"]
