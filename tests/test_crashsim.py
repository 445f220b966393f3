"""Tier 4: lost-write crash emulation (ckptfs.testing.crashsim), a bounded CI sample.

A scripted run (two models with N in flight and out-of-order commits, a removed version, a removed
model and a new one in its ring) is recorded write by write; at crash points along it, images
with every durable write kept and the pending ones dropped / kept / torn (8 B, 512 B, 4 KiB), and
the mapped model-table words at any value they held since their last msync, are opened with the
real code. `python tools/reliability.py` runs the long version.
"""
import logging
import os

import pytest

import ckptfs
from ckptfs.region.format import COUNTER_WORD_OFFSET

from ckptfs.region.region import Region
from ckptfs.testing.crashsim import CrashSim, record_scenario
from ckptfs.testing.recording import (BarrierEnd, BarrierStart, MapChange, Mark, Persist,
                                      RecordingBackend, Write, WriteDone)
from ckptfs.region.backend import aligned_buffer

pytestmark = [pytest.mark.crash]

POINTS = int(os.environ.get("CKPTFS_CRASHSIM_POINTS", "110"))


@pytest.fixture(autouse=True)
def quiet_fallback_warnings():
    logging.getLogger("ckptfs").setLevel(logging.ERROR)
    yield
    logging.getLogger("ckptfs").setLevel(logging.NOTSET)


def test_recording_sees_writes_barriers_and_mapped_updates(tmp_path):
    path = str(tmp_path / "r.region")
    Region.format(path, 64 << 20).close()
    backend = RecordingBackend(path)
    region = Region(path, backend=backend)
    try:
        entry = region.create_model("m", nslots=2, slot_bytes=1 << 20)
        buf = aligned_buffer(4096)
        buf[:4] = b"abcd"
        region.write_slot(entry, 0, 8192, buf)
        region.backend.barrier()
        region.next_counter(entry)
        region.persist_words(entry)
    finally:
        region.close()
    kinds = [type(e) for e in backend.events]
    writes = [e for e in backend.events if isinstance(e, Write)]
    assert writes[-1].offset == entry.slot_offset(0) + 8192 and writes[-1].data[:4] == b"abcd"
    # the write returned before the barrier began, so that barrier covers it
    start = next(e for e in backend.events if isinstance(e, BarrierStart) and writes[-1].id in e.covers)
    assert kinds.index(WriteDone) < backend.events.index(start)
    assert BarrierEnd in kinds and Persist in kinds
    # the counter's fetch-add on the mapping was seen before the persist that made it durable
    counter_word = region._word(entry, COUNTER_WORD_OFFSET) // 8
    changes = [e for e in backend.events if isinstance(e, MapChange) and any(w == counter_word for w, _ in e.changes)]
    assert changes and backend.events.index(changes[-1]) < max(i for i, e in enumerate(backend.events) if isinstance(e, Persist))


@pytest.mark.slow
def test_crash_images_of_the_scripted_run(tmp_path):
    rec = record_scenario(str(tmp_path), seed=11)
    assert rec.stats["saves"] == 34 and rec.stats["Write"] > 80
    assert sum(1 for e in rec.events if isinstance(e, Mark) and e.kind == "remove_model_done") == 1
    # the new records are in it: extents taken and given back (entry rewrites), a kept header
    with ckptfs.Store(str(tmp_path / "recorded.region")) as s:
        assert s.region.get("epsilon").slot_bytes >= 96 << 10 and s.region.get("epsilon").generation >= 2
        assert any(v.kept for v in s.versions("beta")) and s.region.get("beta").generation >= 2
    sim = CrashSim(rec, str(tmp_path), seed=11, exhaustive_limit=16, samples=6, tears=2,
                   max_points=POINTS, continue_every=40)
    report = sim.run()
    assert report.failures == [], "\n".join(report.failures[:5])
    # the sample is not vacuous
    assert report.crash_points_tested >= min(POINTS, report.crash_points)
    assert report.images >= 5 * report.crash_points_tested
    assert report.exhaustive_points > 0 and report.sampled_points > 0
    assert report.torn_images > 100 and report.continued >= 5
    assert report.max_pending_writes >= 3 and report.max_pending_words >= 2


@pytest.mark.slow
def test_out_of_order_commits_happen_in_the_scripted_run(tmp_path):
    # Invariant 3 is only exercised if an older save does finish after a newer one.
    seen = 0
    for seed in range(3):
        rec = record_scenario(str(tmp_path / str(seed)), seed=seed)
        seen += rec.stats["out_of_order_commits"]
        if seen:
            break
    assert seen > 0


class _NoBarrier(RecordingBackend):
    """A device whose fdatasync does nothing: no write is ever known durable."""

    def barrier(self):
        pass


class _NoMsync(RecordingBackend):
    """msync of the model table does nothing: pointers and new entries are never durable."""

    def persist_mapped(self, offset, length):
        pass


@pytest.mark.parametrize("broken", [_NoBarrier, _NoMsync])
def test_the_emulator_catches_a_missing_barrier(tmp_path, broken):
    rec = record_scenario(str(tmp_path), seed=3, backend_cls=broken)
    report = CrashSim(rec, str(tmp_path), seed=3, max_points=60, samples=6, tears=1, continue_every=0,
                      max_failures=3).run()
    assert report.failures, "a protocol without durability barriers passed the crash emulation"
    assert any("reported durable" in f or "missing" in f or "checksum" in f or "fails" in f
               for f in report.failures), report.failures
