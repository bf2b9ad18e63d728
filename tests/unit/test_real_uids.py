"""procfs.RealUids: a root-owned /proc entry seen before costs no read of its status."""
from __future__ import annotations

from gpuguard.backends.procfs import RealUids


def test_an_entry_seen_before_is_not_read_again_until_its_inode_changes():
    reads = []

    def reader(uid: int):
        return lambda: reads.append(uid) or uid

    cache = RealUids()
    assert cache.real_uid(10, inode=100, read=reader(0)) == 0
    assert cache.real_uid(11, inode=101, read=reader(1001)) == 1001  # a user's setuid program
    cache.walked()
    assert cache.real_uid(10, inode=100, read=reader(5)) == 0      # the same process: not read
    assert cache.real_uid(11, inode=999, read=reader(1002)) == 1002  # the pid reused: read again
    cache.walked()
    assert reads == [0, 1001, 1002]
    assert cache.real_uid(10, inode=100, read=reader(0)) == 0
    cache.walked()
    assert cache.real_uid(11, inode=999, read=reader(7)) == 7  # not seen by the last walk: forgotten
    assert reads == [0, 1001, 1002, 7]
