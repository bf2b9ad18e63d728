import pytest

from gpuguard.units import UnitError, format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 << 20), ("20GiB", 20 << 30), ("1.5GiB", 3 << 29), ("80GB", 80 * 10**9),
    ("4096", 4096), (4096, 4096), ("0", 0), ("unlimited", None), (" 2 GiB ", 2 << 30),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "20G", "20gib", "-1GiB", "GiB", "1e3", "lots", "2PiB", True, 2**60])
def test_bad_sizes(text):
    with pytest.raises(UnitError):
        parse_size(text)


@pytest.mark.parametrize("text, expected", [
    ("90s", 90), ("30m", 1800), ("8h", 28800), ("2d", 172800), ("45", 45), (45, 45), (0.5, 0.5),
    ("none", None), ("1.5h", 5400),
])
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "8 hours", "1w", "-5s", "h", "unlimited", "400d", False])
def test_bad_durations(text):
    with pytest.raises(UnitError):
        parse_duration(text)


def test_formatting_round_trips():
    for size in (512 << 20, 20 << 30, 1 << 40):
        assert parse_size(format_size(size)) == size
    for seconds in (90.0, 1800.0, 28800.0, 172800.0):
        assert parse_duration(format_duration(seconds)) == seconds
    assert format_size(None) == "unlimited" and format_duration(None) == "none"


@pytest.mark.parametrize("value", [20.5, float("nan"), [1], {"a": 1}])
def test_sizes_of_the_wrong_kind_are_unit_errors(value):
    with pytest.raises(UnitError):
        parse_size(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1], {"a": 1}])
def test_durations_of_the_wrong_kind_are_unit_errors(value):
    with pytest.raises(UnitError):
        parse_duration(value)
