"""MIG profiles, placements and the driver's capability table: pure data and arithmetic."""
from __future__ import annotations

import re

import pytest

from gpuguard.backends import mig_caps
from gpuguard.backends.sim_mig import driver_mig_minors
from gpuguard.core.mig_profiles import place

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def placed(name: str, profiles: list[str]) -> list[tuple[str, int, int]]:
    return [(p.profile.name, p.start, p.gpu_instance) for p in place(name, profiles)]


def test_gi_ids_are_the_places_swizzle_ids() -> None:
    assert placed(H200, ["1g.18gb"] * 7) == [("1g.18gb", start, 7 + start) for start in range(7)]
    assert placed(H100, ["7g.80gb"]) == [("7g.80gb", 0, 0)]
    assert placed(H100, ["3g.40gb", "3g.40gb"]) == [("3g.40gb", 0, 1), ("3g.40gb", 4, 2)]
    assert placed(H200, ["1g.35gb"] * 4) == [("1g.35gb", s, 3 + s // 2) for s in (0, 2, 4, 6)]
    assert placed(H200, ["4g.71gb", "2g.35gb", "1g.18gb"]) == [("4g.71gb", 0, 1), ("2g.35gb", 4, 5),
                                                              ("1g.18gb", 6, 13)]


def test_a_layout_is_placed_so_that_all_of_it_fits() -> None:
    # Largest first at the lowest place leaves no room for the last 1g; moving the 3g makes it fit.
    assert placed(H100, ["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb"]) == [
        ("1g.10gb", 2, 9), ("3g.40gb", 4, 2), ("2g.20gb", 0, 3), ("1g.10gb", 3, 10)]


@pytest.mark.parametrize(("name", "profiles", "error"), [
    (H100, ["1g.18gb"], "no MIG profile '1g.18gb' on NVIDIA H100 80GB HBM3 (known: 1g.10gb, 1g.20gb,"),
    (H200, ["1g.18gb"] * 8, "8 x 1g.18gb do not fit: at most 7 on NVIDIA H200"),
    (H200, ["7g.141gb", "1g.18gb"], "take 8 compute slices: a GPU has 7"),
    (H200, ["1g.35gb"] * 4 + ["1g.18gb"], "do not fit in the 8 memory slices"),
    (H200, ["4g.71gb", "4g.71gb"], "2 x 4g.71gb do not fit: at most 1"),
    ("Tesla T4", [], "'Tesla T4' has no MIG"),
])
def test_what_does_not_fit_is_refused_in_one_line(name: str, profiles: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        place(name, profiles)


def test_the_driver_table_matches_the_documented_minors() -> None:
    minors = mig_caps.parse_mig_minors(driver_mig_minors())
    # NVIDIA's MIG user guide, "Device Nodes and Capabilities": the first entries of mig-minors.
    assert [minors[k] for k in ("config", "monitor", "gpu0/gi0/access", "gpu0/gi0/ci0/access")] == [1, 2, 3, 4]
    assert len(minors) == 2 + 32 * 15 * 9 and minors["gpu31/gi14/ci7/access"] == 2 + 32 * 15 * 9
    assert mig_caps.slice_caps(minors, 1, 7, 0) == (minors["gpu1/gi7/access"], minors["gpu1/gi7/ci0/access"])


def test_slice_caps_need_both_entries_and_never_give_config_or_monitor() -> None:
    minors = mig_caps.parse_mig_minors("config 1\nmonitor 2\ngpu0/gi7/access 66\nbad line here\ngpu0/gi7/ci0/access x\n")
    assert minors == {"config": 1, "monitor": 2, "gpu0/gi7/access": 66}
    assert mig_caps.slice_caps(minors, 0, 7, 0) is None
    assert mig_caps.slice_caps({**minors, "gpu0/gi7/ci0/access": 67}, 0, 7, 0) == (66, 67)
