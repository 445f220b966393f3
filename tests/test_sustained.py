"""Tier 4: sustained load and mount-daemon kills (ckptfs.testing.load), through a real FUSE mount.

One writer checkpoints every iteration with N in flight while 4 reader processes read random
versions through the mount and through Store.load and compare them with what was saved, and a
verify process runs: zero mismatches, zero errors other than the documented "version gone", and
the memory of the writer and the daemon flat. Then the daemon is SIGKILLed while readers hold
files open and a writer saves. CKPTFS_LOAD_SECONDS sets the load's duration (CI: 30 s).
"""
import os

import pytest

from ckptfs.testing.load import mount_kill_rounds, sustained_load
from ckptfs.testing.mounts import fuse_available

pytestmark = [pytest.mark.slow, pytest.mark.crash]

SECONDS = float(os.environ.get("CKPTFS_LOAD_SECONDS", "30"))
MiB = 1 << 20

needs_fuse = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")


def _flat(pair, name):
    start, end = pair
    assert start > 0 and end > 0, f"no memory samples of the {name}"
    assert end - start < max(64 * MiB, start // 4), f"the {name} grew from {start >> 20} to {end >> 20} MiB"


@pytest.mark.fuse
@needs_fuse
@pytest.mark.timeout(SECONDS * 4 + 120)
def test_sustained_load_through_mount_and_load(tmp_path):
    r = sustained_load(str(tmp_path), SECONDS)
    assert r.mismatches == [], r.mismatches[:5]
    assert r.errors == [], r.errors[:5]
    assert r.saves >= SECONDS * 3, f"only {r.saves} saves in {r.seconds:.0f} s"
    assert r.mount_reads >= SECONDS and r.store_reads >= SECONDS, (r.mount_reads, r.store_reads)
    assert r.verifies >= 3
    assert r.gone < r.reads  # "gone" is the exception, not the rule
    _flat(r.writer_rss, "writer")
    _flat(r.daemon_rss, "mount daemon")


@pytest.mark.timeout(SECONDS * 4 + 120)
def test_sustained_load_through_store_load_only(tmp_path):
    # the same without a mount, so that machines without FUSE still run the Store half
    r = sustained_load(str(tmp_path), min(SECONDS, 10), mount=False)
    assert r.mismatches == [] and r.errors == [], (r.mismatches[:5], r.errors[:5])
    assert r.store_reads >= 10 and r.saves >= 10


@pytest.mark.fuse
@needs_fuse
@pytest.mark.timeout(300)
def test_mount_daemon_killed_while_files_are_open(tmp_path):
    r = mount_kill_rounds(str(tmp_path), int(os.environ.get("CKPTFS_MOUNT_KILLS", "3")), seed=5)
    assert r.failures == [], r.failures
    assert r.survived == r.rounds
