import pytest

from gpuguard.core.quantities import UnitError, format_duration, format_size, parse_duration, parse_size

GiB = 1 << 30


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 << 20), ("20GiB", 20 * GiB), ("1.5GiB", 3 << 29), ("unlimited", None), (" 2 GiB ", 2 * GiB),
    # GB and G are binary, as GPU vendors count: an "80GB" H100 holds 80GiB
    ("80GB", 80 * GiB), ("40G", 40 * GiB), ("40gb", 40 * GiB), ("40gib", 40 * GiB), ("512M", 512 << 20),
    ("1TB", 1 << 40), ("0GiB", 0), ("UNLIMITED", None),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1GiB", "GiB", "1e3", "lots", "2PiB", "20 gigs", True, "20GiB x"])
def test_bad_sizes(text):
    with pytest.raises(UnitError):
        parse_size(text)


@pytest.mark.parametrize("value, guess", [
    ("20", "did you mean 20GiB?"), (20, "did you mean 20GiB?"), (21474836480, "did you mean 20GiB?"),
    ("0", "did you mean 0GiB?"), (8192, "did you mean 8192MiB?"),
])
def test_a_size_without_a_unit_is_refused_with_a_guess(value, guess):
    with pytest.raises(UnitError, match="has no unit") as refused:
        parse_size(value)
    assert guess in str(refused.value)


@pytest.mark.parametrize("text, expected", [
    ("90s", 90), ("30m", 1800), ("8h", 28800), ("2d", 172800), ("none", None), ("1.5h", 5400),
    ("1h30m", 5400), ("1h 30m", 5400), ("90min", 5400), ("1w", 604800), ("8hours", 28800), ("8 hours", 28800),
    ("8 h", 28800), ("2 days", 172800), ("1d12h", 129600), ("45 sec", 45), ("2H", 7200), ("None", None),
])
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "-5s", "h", "unlimited", "400d", False, "30m1h", "1h1h", "8 fortnights",
                                  "1h30", "1x"])
def test_bad_durations(text):
    with pytest.raises(UnitError):
        parse_duration(text)


@pytest.mark.parametrize("value, guess", [
    ("8", "did you mean 8h?"), (3600, "did you mean 3600s (1h)?"), ("45", "did you mean 45h?"),
    (5400.0, "did you mean 5400s (1h30m)?"), ("0", "did you mean none (no limit) or 0s?"),
])
def test_a_duration_without_a_unit_is_refused_with_a_guess(value, guess):
    with pytest.raises(UnitError, match="has no unit") as refused:
        parse_duration(value)
    assert guess in str(refused.value)


def test_a_caller_may_name_the_unit_of_a_bare_number():
    assert parse_duration("30", bare_unit="s") == 30
    assert parse_duration("2m", bare_unit="s") == 120


def test_formatting_round_trips():
    for size in (512 << 20, 20 * GiB, 1 << 40):
        assert parse_size(format_size(size)) == size
    for seconds in (90.0, 1800.0, 5400.0, 28800.0, 90061.0, 172800.0, 0.5):
        assert parse_duration(format_duration(seconds)) == seconds
    assert format_size(None) == "unlimited" and format_duration(None) == "none"


@pytest.mark.parametrize("seconds, shown", [
    (9.98768, "10s"), (59.6, "1m"), (5400, "1h30m"), (90061, "1d1h1m1s"), (0, "0s"), (0.5, "0.5s"), (3600, "1h"),
])
def test_durations_are_printed_as_people_write_them(seconds, shown):
    assert format_duration(seconds) == shown


@pytest.mark.parametrize("value", [20.5, float("nan"), [1], {"a": 1}])
def test_sizes_of_the_wrong_kind_are_unit_errors(value):
    with pytest.raises(UnitError):
        parse_size(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1], {"a": 1}])
def test_durations_of_the_wrong_kind_are_unit_errors(value):
    with pytest.raises(UnitError):
        parse_duration(value)
