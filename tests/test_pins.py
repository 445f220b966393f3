"""A pin or a claim holds exactly what it names, and nothing once it fails: a version looked up
before its slot was given back (or its model removed) cannot be pinned; an I/O error while a
pin or a claim checks its slot leaves no lock byte held; a save committed and published is not
failed by what follows its publish. (Found by a review; each confirmed by a reproducer first.)"""
import os

import pytest
import torch

import ckptfs
from ckptfs.region.locks import slot_lock_offset
from ckptfs.region.region import Region
from ckptfs.testing.anomaly import FaultyBackend
from ckptfs.writer.writer import Writer


def _saved(store, model, steps, **options):
    with store.writer(model, max_inflight=1, **options) as w:
        for s in steps:
            w.save({"w": torch.full((1024,), float(s))}, s).result()


def _held(lockspace, entry) -> set[int]:
    return {s for s in entry.slots() if lockspace._counts.get(slot_lock_offset(entry.index, s))}


def test_a_version_whose_slot_was_given_back_cannot_be_pinned(store):
    """A reader looked step 1 up; the model then outgrew its slots and gave the small ones
    back, and another model took their bytes. The pin said yes (the given-back slot keeps its
    header), and the reader read the other model's bytes: a CRC failure where verified, the
    other model's values where not (the mount checks a tensor once)."""
    _saved(store, "m", [1, 2], slots=2)
    stale, _ = store._find("m", 1)
    with store.writer("m", max_inflight=1, slots=2) as w:
        for s in (3, 4):
            w.save({"w": torch.ones(300_000)}, s).result()
    assert not store.region.get("m").same_slot(stale.entry, stale.slot)  # given back
    _saved(store, "other", [1], slots=2)
    assert not store.region.pin(stale)
    with pytest.raises(ckptfs.errors.NotFoundError):
        store.region.remove_version(stale)  # it wrote a zero header into the other model's bytes
    assert torch.equal(store.load("other")["w"], torch.full((1024,), 1.0))


def test_a_version_of_a_removed_model_cannot_be_pinned(store):
    _saved(store, "m", [1, 2])
    stale, _ = store._find("m", 1)
    store.remove_model("m")
    assert not store.region.pin(stale)


def test_an_io_error_inside_a_pin_holds_nothing(store):
    """The mount daemon's disk failing once while it pins a version: the pin stayed held for the
    daemon's life, and the version could never be removed or reused."""
    _saved(store, "m", [1, 2, 3], slots=3)
    with ckptfs.Store(store.path) as reader:
        faulty = FaultyBackend(store.path)
        reader.region.backend.close()
        reader.region.backend = faulty
        version, _ = reader._find("m", 1)
        faulty.fail_at = len(faulty.calls) + 1
        with pytest.raises(ckptfs.errors.RegionIOError):
            reader.region.pin(version)
        assert not _held(reader.region.pins, version.entry)
        store.remove("m", 1)


def test_an_io_error_while_a_save_claims_its_slot_gives_the_claim_back(store):
    """The header read after a claim's lock byte was taken failing: the save fails, and the
    writer's ring held the lock for good (the version in that slot could be neither read, kept
    nor removed, and the ring was a slot short)."""
    store.close()
    faulty = FaultyBackend(store.path)
    region = Region(store.path, backend=faulty)
    w = Writer(region, "m", max_inflight=1, slots=3, timeout_s=3)
    try:
        for s in range(1, 5):
            w.save({"t": torch.full((1024,), float(s))}, s).result()
        faulty.fail_at = len(faulty.calls) + 1  # the next call: the claim's header read
        with pytest.raises(ckptfs.errors.RegionIOError):
            w.save({"t": torch.full((1024,), 5.0)}, 5).result()
        assert faulty.failed == "pread"
        assert not _held(w._ring._claims, region.get("m"))
        for s in range(5, 9):  # every slot is claimed again
            w.save({"t": torch.full((1024,), float(s))}, s).result()
    finally:
        w.close()
        region.close()
    with ckptfs.Store(store.path) as again:
        assert [v.step for v in again.versions("m")] == [6, 7, 8]


def test_a_published_save_is_not_failed_by_giving_back_spare_slots(store, monkeypatch):
    """Giving back spare slots after a commit reads the slots' headers where the ring's cached
    ages were dropped (a claim waiting meanwhile does that): an I/O error there failed the save
    that was already latest."""
    from ckptfs.region import ring as ring_module

    store.close()
    faulty = FaultyBackend(store.path)
    region = Region(store.path, backend=faulty)
    publish = ring_module.Ring.publish

    def publish_then_fail(self, counter, slot):
        done = publish(self, counter, slot)
        self._forget_ages()
        faulty.fail_at = len(faulty.calls) + 1
        return done

    w = Writer(region, "m", max_inflight=1, slots=3)
    try:
        for s in (1, 2):
            w.save({"t": torch.full((1024,), float(s))}, s).result()
        monkeypatch.setattr(ring_module.Ring, "publish", publish_then_fail)
        assert w.save({"t": torch.full((1024,), 3.0)}, 3).result().published
    finally:
        monkeypatch.undo()
        w.close()
        region.close()
    with ckptfs.Store(store.path) as again:
        assert again.latest("m").step == 3


def test_a_version_committed_but_not_yet_published_is_latest_for_rm_too(store):
    """A commit cut between its header and its publish: every reader calls it latest (``ls``,
    the mount), and ``rm`` removed it without ``allow_latest``, rolling the model back."""
    _saved(store, "m", [1, 2], slots=3)
    cut = _commit_without_publish(store, "m", 3)
    assert store.latest("m").step == 3 and store.latest("m").counter == cut
    with pytest.raises(ckptfs.errors.BusyError, match="allow_latest=True"):
        store.remove("m", 3)
    store.remove("m", 2)  # the pointer names it: it moves back, step 3 stays latest
    assert [(v.step, v.latest) for v in store.versions("m")] == [(1, False), (3, True)]
    store.remove("m", 3, allow_latest=True)
    assert [(v.step, v.latest) for v in store.versions("m")] == [(1, True)]


def _commit_without_publish(store, model, step) -> int:
    """What a crash between a commit's header barrier and its publish leaves: step ``step``
    committed (a copy of the latest's index, no tensors), the pointer naming the one before.
    Its counter."""
    import json

    from ckptfs.region.claim import SlotLayout

    latest = store.region.latest(store.region.get(model))
    ring = store.region.ring(store.region.get(model), timeout_s=5)
    try:
        claim = ring.claim(step, SlotLayout.of(4096, 0))
        claim.begin()
        h = latest.header
        raw = json.loads(bytes(store.region.backend.view(latest.entry.slot_offset(latest.slot) + h.manifest_offset,
                                                         h.manifest_bytes)))
        raw.update(step=step, counter=claim.counter, time_ns=claim.time_ns, data_bytes=0, tensors=[],
                   skeleton={"dict": []})
        claim.commit(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode(), 0, publish=False)
        return claim.counter
    finally:
        ring.close()


def test_an_opened_version_says_whether_it_is_kept(store):
    """``Version.info`` is what ``versions()`` lists (its kept flag was always False)."""
    _saved(store, "m", [1, 2])
    store.keep("m", 1)
    with store.open_version("m", 1) as one, store.open_version("m", 2) as two:
        assert one.info == next(v for v in store.versions("m") if v.step == 1) and one.info.kept
        assert not two.info.kept


def test_a_region_renamed_under_an_open_store_is_still_the_one_its_writers_lock(tmp_path):
    """A writer's claims and its model's lock byte were taken on the region reopened by path:
    once the file was renamed (an operator moving it), ``writer()`` failed with a bare
    FileNotFoundError, and where another file had taken the name, its locks were on that one
    while its writes went to the region. They are taken through the store's own descriptor."""
    import os

    first, moved = str(tmp_path / "r.region"), str(tmp_path / "moved.region")
    with ckptfs.Store.create(first, size_bytes=64 << 20) as store:
        _saved(store, "m", [1])
        os.rename(first, moved)
        ckptfs.Store.create(first, size_bytes=64 << 20).close()  # another region takes the name
        with store.writer("m") as w, ckptfs.Store(moved) as other:
            w.save({"w": torch.full((1024,), 2.0)}, 2).result()
            with pytest.raises(ckptfs.errors.BusyError, match="one writer per model"):
                other.writer("m").save({"w": torch.zeros(1024)}, 3)
            assert other.latest("m").step == 2
        with ckptfs.Store(first) as new:
            assert new.models() == []


def test_a_save_whose_pointer_could_not_be_made_durable_stands(store, caplog):
    """The msync of the latest pointer failing once (a transient writeback error): the save
    was reported failed, while every reader took it for the latest (it is durable: its header
    is, and a committed version newer than the pointer on the media is latest after a crash)."""
    import errno

    _saved(store, "m", [1, 2, 3], slots=3)
    backend, msync, failed = store.region.backend, store.region.backend._msync, []

    def flaky(mapping, offset, length):
        if not failed and length == 16:
            failed.append(offset)
            raise OSError(errno.EIO, "injected writeback error")
        return msync(mapping, offset, length)
    backend._msync = flaky
    try:
        with store.writer("m", max_inflight=1) as w:
            assert w.save({"w": torch.full((1024,), 4.0)}, 4).result().published
            assert failed
            w.save({"w": torch.full((1024,), 5.0)}, 5).result()
    finally:
        del backend._msync
    assert "the latest pointer to its save 4 was not made durable: msync of" in caplog.text
    assert [(v.step, v.latest) for v in store.versions("m")] == [(3, False), (4, False), (5, True)]


def test_a_version_listed_before_its_model_took_larger_slots_is_removed_as_it_is(store):
    """The caller's entry predates the slots a save took since (a writer outgrowing them between
    Store.remove's look and its removal): the removal decided "latest" through that entry, found
    the pointer naming a slot it lacked, refused a version that was not latest, and with
    allow_latest moved the pointer back below the two newer steps."""
    from ckptfs.region.format import unpack_latest

    with store.writer("m", max_inflight=1, slots=3) as w:
        for s in (1, 2, 3):
            w.save({"t": torch.ones(1000) * s}, step=s).result()
        three = next(v for v in store.region.committed(store.region.get("m")) if v.header.step == 3)
        for s in (4, 5):
            w.save({"t": torch.ones(200_000) * s}, step=s).result()
    pointer = unpack_latest(store.region.latest_word(store.region.get("m")))
    store.region.remove_version(three)
    # steps 1 and 2 went back with their outgrown slots (older than the ring's newest 3)
    assert [(v.step, v.latest) for v in store.versions("m")] == [(4, False), (5, True)]
    assert unpack_latest(store.region.latest_word(store.region.get("m"))) == pointer


def test_a_version_or_store_used_after_the_store_closed_says_so(region_path):
    """Store.close lets go of the versions open from it: closing one afterwards raised 'lock
    byte ... is not held', loading it 'Bad file descriptor', and the store's own methods a
    released memoryview's ValueError."""
    store = ckptfs.Store.create(region_path, size_bytes=64 << 20)
    with store.writer("m") as w:
        w.save({"t": torch.ones(10)}, step=1).result()
    v = store.open_version("m")
    store.close()
    store.close()  # nothing to do twice
    for use in (v.load, lambda: v.read(0, 4)):
        with pytest.raises(ckptfs.errors.CkptfsError, match="opened from a Store that is closed since"):
            use()
    v.close()
    for use in (lambda: store.load("m"), lambda: store.versions("m"), lambda: store.writer("m")):
        with pytest.raises(ckptfs.errors.CkptfsError, match="this Store of .* is closed: open it again"):
            use()
    with ckptfs.Store(region_path) as again:
        v = again.open_version("m")
        v.close()
        with pytest.raises(ckptfs.errors.CkptfsError, match="m step 1 was closed"):
            v.load()
        assert again.load("m")["t"].sum() == 10  # its pin went, the slot is free: nothing held twice


def test_a_region_in_use_is_not_formatted_over(region_path):
    """mkfs --force under a reader holding a version open: the reader, whose CRCs were checked
    already, then read the new region's bytes as that version's, without an error."""
    import subprocess
    import sys

    with ckptfs.Store.create(region_path, size_bytes=64 << 20) as store:
        with store.writer("m") as w:
            w.save({"t": torch.ones(10)}, step=1).result()
        with store.open_version("m") as v:
            with pytest.raises(ckptfs.errors.BusyError, match=rf"is in use by .*pid {os.getpid()}"):
                ckptfs.Store.create(region_path, size_bytes=64 << 20, force=True)
            r = subprocess.run([sys.executable, "-m", "ckptfs.cli", "mkfs", "--force", "--size", "64M", region_path],
                               capture_output=True, text=True)
            assert r.returncode == 1 and "is in use by" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
            assert v.load()["t"].sum() == 10
        with store.writer("m") as w:  # an open writer is a use too
            with pytest.raises(ckptfs.errors.BusyError, match="is in use by"):
                ckptfs.Store.create(region_path, size_bytes=64 << 20, force=True)
    ckptfs.Store.create(region_path, size_bytes=64 << 20, force=True).close()  # nobody holds it now

