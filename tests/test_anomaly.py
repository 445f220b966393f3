"""Anomaly tests (issue 22): every I/O step of a save fails in turn, with EIO, ENOSPC and EROFS,
and the staging allocation fails; after each, the contract of ckptfs.testing.anomaly holds."""
import errno
import logging

import pytest

import ckptfs
from ckptfs import _native
from ckptfs.errors import RegionIOError
from ckptfs.testing import anomaly


@pytest.fixture
def region_with_a_version(tmp_path):
    path = str(tmp_path / "anomaly.region")
    with ckptfs.Store.create(path, size_bytes=64 << 20) as store:
        with store.writer("m", max_inflight=2, slots=4, chunk_bytes=8192) as w:
            w.save(anomaly.state(1), step=1).result()
    return path


@pytest.mark.crash
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EROFS], ids=errno.errorcode.get)
@pytest.mark.parametrize("model", ["m", "n", "g"], ids=["existing model", "new model", "outgrown slots"])
def test_every_io_step_of_a_save_failing(region_with_a_version, code, model, caplog):
    with caplog.at_level(logging.CRITICAL, logger="ckptfs"):
        runs = anomaly.sweep(region_with_a_version, code, model)
    assert runs[-1].operation is None, "the sweep stopped before a save met no fault"
    failed = {r.operation for r in runs if r.operation}
    # every kind of call of the save path was failed at least once
    assert {"pwrite", "fdatasync", "msync", "pread"} <= failed
    if model != "m":  # a new model's slots, and the larger slots of an outgrown one, are reserved
        assert "fallocate" in failed
    assert len(runs) > 20
    assert [p for r in runs for p in r.problems] == []


@pytest.mark.crash
def test_the_staging_allocation_failing(region_with_a_version, caplog):
    with caplog.at_level(logging.CRITICAL, logger="ckptfs"):
        runs = [anomaly.staging_run(region_with_a_version, k, 100 * k) for k in (1, 2)]
    assert [p for r in runs for p in r.problems] == []
    assert all("StagingMemoryError" in r.error and "staging_budget_bytes" in r.error for r in runs)


def test_an_io_error_names_the_operation_where_and_what_to_do(region_with_a_version):
    from ckptfs.region.backend import io_step

    with pytest.raises(RegionIOError) as e:
        with io_step("write", "/x.region", 8192, 4096):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.errno == errno.ENOSPC and e.value.operation == "write"
    assert str(e.value) == ("write of /x.region at offset 8192 (4.0 KiB) failed: No space left on device; "
                            "the filesystem is full: free space on it")


def test_the_mount_answers_a_region_io_error_with_its_errno():
    from ckptfs.fs.errors import errno_for

    assert errno_for(RegionIOError("x", errno.EROFS, "write")) == errno.EROFS
    assert errno_for(RegionIOError("x", errno.EIO, "read")) == errno.EIO


@pytest.mark.crash
@pytest.mark.skipif(not _native.pmem_available(), reason="libpmem1 is not installed")
@pytest.mark.parametrize("model", ["m", "n", "g"], ids=["existing model", "new model", "outgrown slots"])
def test_every_mapped_step_of_a_devdax_save_failing(region_with_a_version, model, caplog):
    """The devdax backend writes and flushes through the mapping: each of those steps meets a
    page that cannot be read or written in turn (a bus error, caught by the bus guard)."""
    with caplog.at_level(logging.CRITICAL, logger="ckptfs"):
        runs = anomaly.sweep(region_with_a_version, errno.EIO, model, devdax=True)
    assert runs[-1].operation is None, "the sweep stopped before a save met no fault"
    assert {r.operation for r in runs if r.operation} == set(anomaly.DEVDAX_OPERATIONS)
    assert len(runs) > 20
    assert all("RegionIOError" in r.error for r in runs if r.operation and r.error)
    assert [p for r in runs for p in r.problems] == []


def test_a_save_whose_slot_cannot_be_given_back_still_ends_and_the_writer_goes_on(tmp_path, monkeypatch, caplog):
    """A write fails, then so does the give-back of its claim: the save's future fails with the
    write's error and the persist worker lives on. An exception out of that give-back killed
    the worker: the failed save's future and every later save waited forever."""
    import torch

    from ckptfs.region.claim import Claim

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 64 << 20)
    state = {"w": torch.arange(4096.0)}
    real_write, real_abort = Claim.write, Claim.abort

    def write_fails(self, *args):
        raise RegionIOError("pwrite failed (EIO) at the test's request", errno.EIO, "pwrite")

    def abort_fails(self):
        raise RuntimeError("unlock failed at the test's request")

    with store.writer("m", max_inflight=1, persist_threads=1, timeout_s=20) as w:
        w.save(state, step=1).result()
        monkeypatch.setattr(Claim, "write", write_fails)
        monkeypatch.setattr(Claim, "abort", abort_fails)
        with caplog.at_level(logging.ERROR, logger="ckptfs"):
            with pytest.raises(RegionIOError, match="at the test's request"):
                w.save(state, step=2).result(timeout=20)
        assert "could not be given back (unlock failed" in caplog.text
        monkeypatch.setattr(Claim, "write", real_write)
        monkeypatch.setattr(Claim, "abort", real_abort)
        state["w"] += 1
        w.save(state, step=3).result(timeout=20)
    assert [v.step for v in store.versions("m")] == [1, 3]
    assert store.load("m")["w"].equal(state["w"])


def test_a_claim_that_lands_after_its_save_failed_and_cannot_be_given_back(tmp_path, monkeypatch, caplog):
    """The snapshot fails while the slot is still being claimed; the claim then lands and its
    give-back raises: the claim thread died with it, and every later save waited forever."""
    import time

    import torch

    from ckptfs.region.claim import Claim
    from ckptfs.region.ring import Ring

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 64 << 20)
    state = {"w": torch.arange(4096.0)}
    real_claim, real_abort = Ring.claim, Claim.abort

    def slow_claim(self, *args, **kwargs):
        time.sleep(0.3)  # lands after the snapshot failed
        return real_claim(self, *args, **kwargs)

    def abort_fails(self):
        real_abort(self)
        raise RuntimeError("unlock failed at the test's request")

    with store.writer("m", max_inflight=1, timeout_s=20) as w:
        w.save(state, step=1).result()
        real_take = w._snapshotter.take

        def take_fails(*args):
            raise RuntimeError("snapshot failed at the test's request")
        monkeypatch.setattr(Ring, "claim", slow_claim)
        monkeypatch.setattr(Claim, "abort", abort_fails)
        monkeypatch.setattr(w._snapshotter, "take", take_fails)
        with caplog.at_level(logging.ERROR, logger="ckptfs"):
            with pytest.raises(RuntimeError, match="snapshot failed"):
                w.save(state, step=2)
            time.sleep(0.5)  # the claim lands, its give-back fails
        monkeypatch.setattr(w._snapshotter, "take", real_take)
        monkeypatch.setattr(Ring, "claim", real_claim)
        monkeypatch.setattr(Claim, "abort", real_abort)
        assert w._claimer._thread.is_alive()
        w.save(state, step=3).result(timeout=20)
    assert [v.step for v in store.versions("m")] == [1, 3]
