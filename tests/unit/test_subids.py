"""subids: the owners of /etc/subuid's ranges, read from a real file as it changes."""
from __future__ import annotations

import os
import random
from pathlib import Path

from gpuguard.backends.subids import CHECK_EVERY, Range, Ranges, SubuidOwners, parse


def test_a_subuid_file_gives_its_well_formed_ranges():
    text = ("1002:165536:10\nalice:100000:65536\nbroken line\nbob:x:5\n:5:5\ncarol:300000:65536:extra\n"
            "dave:\u00b2:5\nerin:12345678901:5\n")  # digits Python's int() reads but newuidmap does not
    assert parse(text) == (Range("alice", 100000, 65536), Range("1002", 165536, 10))  # ordered by start


def test_ranges_found_by_bisection_agree_with_a_scan_of_them_all():
    generator = random.Random(5)
    # 1,000 users' ranges with gaps, and overlaps the admin may have made: some long, some nested
    ranges = parse("".join(f"u{n}:{generator.randrange(100000, 10**8)}:{generator.choice((1, 10, 65536, 10**6))}\n"
                           for n in range(1000)))
    found = Ranges(ranges)
    for uid in [generator.randrange(0, 10**8 + 10**6) for _ in range(2000)] + [r.start for r in ranges[::7]]:
        holders = {r.owner for r in ranges if uid in r}
        owner = found.owner(uid)
        assert (owner in holders) if holders else owner is None, uid


def test_overlapping_ranges_give_a_uid_to_one_that_holds_it():
    found = Ranges(parse("wide:100000:1000000\nnarrow:200000:10\n"))
    assert found.owner(200005) == "narrow" and found.owner(300000) == "wide" and found.owner(1100000) is None


def test_the_owner_of_a_uid_is_the_range_holding_it(tmp_path: Path):
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nbob:165536:65536\n")
    owners = SubuidOwners(subuid)
    assert owners.owner(100000) == "alice" and owners.owner(165535) == "alice"
    assert owners.owner(165536) == "bob" and owners.owner(231071) == "bob"
    assert owners.owner(231072) is None and owners.owner(1000) is None and owners.owner(99999) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def alice_owns(tmp_path: Path) -> tuple[SubuidOwners, Path, Clock]:
    """Owners read from a file that gives alice one range, asked once; with the file and the clock."""
    clock, subuid = Clock(), tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\n")
    owners = SubuidOwners(subuid, clock=clock)
    assert owners.owner(100001) == "alice"
    return owners, subuid, clock


def test_a_changed_file_is_read_again_once_looked_at(tmp_path: Path):
    owners, subuid, clock = alice_owns(tmp_path)
    subuid.write_text("carol:100000:65536\n")  # usermod --add-subuids, --del-subuids
    os.utime(subuid, ns=(0, 10**9))  # a new mtime, whatever the file system's granularity
    assert owners.owner(100001) == "alice"  # not looked at again within CHECK_EVERY
    clock.now += CHECK_EVERY
    assert owners.owner(100001) == "carol"
    subuid.unlink()
    clock.now += CHECK_EVERY
    assert owners.owner(100001) is None  # no file: no ranges


def test_a_file_that_cannot_be_read_for_a_moment_keeps_the_ranges_read(tmp_path: Path):
    owners, subuid, clock = alice_owns(tmp_path)
    subuid.unlink()
    subuid.mkdir()  # there, changed, and its read fails (as one would with the descriptors run out)
    clock.now += CHECK_EVERY
    assert owners.owner(100001) == "alice"
