"""Tier 4: a full and contended region -- clear errors or bounded waits, never corruption, never a
deadlock (every test runs under a pytest-timeout much shorter than the suite's).
"""
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch

import ckptfs
from ckptfs.errors import (BusyError, CheckpointTooLargeError, NotFoundError, RegionFullError)
from ckptfs.region.region import Region
from ckptfs.store import Store
from ckptfs.testing.crashcheck import same
from ckptfs.testing.recording import RecordingBackend
from conftest import fill_region, mp_context

pytestmark = pytest.mark.timeout(90)


def state(step, n=2000):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _intact(store, model, steps):
    for s in steps:
        assert same(state(s), store.load(model, s)) is None
    assert store.verify(model) == []


def test_region_without_room_for_another_model(store):
    with store.writer("big", max_inflight=1, slot_bytes=100 << 20, slots=2) as w:
        w.save(state(1), 1).result()
    t0 = time.monotonic()
    with pytest.raises(RegionFullError, match="remove models"):
        with store.writer("other", max_inflight=1, slot_bytes=100 << 20, slots=2) as w:
            w.save(state(2), 2)
    assert time.monotonic() - t0 < 5
    assert store.models() == ["big"]  # nothing half-created
    _intact(store, "big", [1])


def test_filesystem_without_room(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (to make the filesystem, not the region, run out of space)")
    try:
        path = str(mnt / "r.region")
        with Store.create(path, size_bytes=64 << 20) as s:  # sparse: larger than its filesystem
            with s.writer("a", max_inflight=1, slot_bytes=2 << 20, slots=2) as w:
                w.save(state(1), 1).result()
            with pytest.raises(RegionFullError, match="MiB free, and the new ring needs .* MiB; nothing was kept"):
                with s.writer("b", max_inflight=1, slot_bytes=8 << 20, slots=2) as w:
                    w.save(state(2), 2)
            assert s.models() == ["a"]
            _intact(s, "a", [1])
            with s.writer("a") as w:  # the existing model's ring was reserved: it goes on
                w.save(state(3), 3).result()
            _intact(s, "a", [1, 3])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_checkpoint_that_outgrew_its_slots_in_a_full_region_is_refused_before_writing(store):
    with store.writer("m", max_inflight=1, slots=2) as w:
        w.save(state(1), 1).result()
        fill_region(store, leave_bytes=1 << 20)  # room for a few more small slots, not for larger ones
        before = bytes(store.region.backend.view(0, store.region.superblock.data_offset))
        with pytest.raises(CheckpointTooLargeError, match="larger than its"):
            w.save(state(2, n=500_000), 2)
    assert bytes(store.region.backend.view(0, store.region.superblock.data_offset)) == before
    _intact(store, "m", [1])


def test_all_slots_pinned_in_a_full_region_gives_busy_in_bounded_time(store):
    with store.writer("m", max_inflight=1, slots=3) as w:
        for s in (1, 2, 3):
            w.save(state(s), s).result()
    fill_region(store)
    pins = [store.open_version("m", s) for s in (1, 2)]  # 3 is latest: nothing is free
    try:
        with store.writer("m", max_inflight=1, timeout_s=0.5) as w:
            t0 = time.monotonic()
            with pytest.raises(BusyError, match="pinned"):
                w.save(state(4), 4)
            assert time.monotonic() - t0 < 5
        _intact(store, "m", [1, 2, 3])
        assert store.latest("m").step == 3
    finally:
        pins.pop().close()
    with store.writer("m", max_inflight=1, timeout_s=5) as w:  # one slot free again
        w.save(state(4), 4).result()
    assert store.latest("m").step == 4
    pins[0].close()


def test_keeping_in_a_full_region_is_refused_where_it_leaves_no_slot_to_save_into(store):
    """In a full region, keeping versions until the model has no slot but its latest: the keep
    that would do so is refused, nothing kept (it said "kept", and the job's next save waited
    timeout_s, then BusyError). Where saves keep versions themselves (keep_every) until every
    slot is latest or kept, a save fails at once with RegionFullError saying what to unkeep,
    not after timeout_s."""
    with store.writer("m", max_inflight=1, slots=3) as w:
        for s in (1, 2, 3):
            w.save(state(s), s).result()
    fill_region(store)
    store.keep("m", 1)
    with pytest.raises(RegionFullError, match=r"keeping step 2 of 'm' would leave it no slot to save into.*unkeep"):
        store.keep("m", 2)
    assert [v.step for v in store.versions("m") if v.kept] == [1]
    store.keep("m", 1)  # kept already: nothing changes
    with store.writer("m", max_inflight=1, timeout_s=30) as w:
        w.save(state(4), 4).result()  # into 2's slot, the one keep left
        w.save(state(5), 5, keep=True).result()  # into 3's
        w.save(state(6), 6, keep=True).result()  # into 4's: every slot is latest or kept now
        t0 = time.monotonic()
        with pytest.raises(RegionFullError, match=r"every slot of 'm' holds its latest or a kept version.*unkeep"):
            w.save(state(7), 7)
        assert time.monotonic() - t0 < 10
    assert store.latest("m").step == 6 and [v.step for v in store.versions("m") if v.kept] == [1, 5, 6]
    _intact(store, "m", [1, 5, 6])
    # the latest kept where one other slot is left: the model would save once more, then be stuck
    store.region.remove_model("filler")
    with store.writer("two", max_inflight=1, slots=2) as w:
        for s in (1, 2):
            w.save(state(s), s).result()
    fill_region(store)
    with pytest.raises(RegionFullError, match=r"keeping step 2 of 'two' would leave it no slot"):
        store.keep("two", 2)


def test_a_refused_save_raises_once_even_while_its_failure_is_still_being_delivered(store, monkeypatch):
    """The claim runs beside the snapshot, and a refused claim fails the save on a persist thread
    too: ``save`` raises the refusal, and closing the writer afterwards does not raise it again,
    however late that thread delivers the failure."""
    from ckptfs.writer.writer import Writer

    with store.writer("m", max_inflight=1, slots=3) as w:
        for s in (1, 2, 3):
            w.save(state(s), s).result()
    fill_region(store)
    pins = [store.open_version("m", s) for s in (1, 2)]
    finish = Writer._finish

    def late_finish(self, *args):
        time.sleep(0.3)  # the persist thread's part of the failure comes after save has raised
        return finish(self, *args)

    monkeypatch.setattr(Writer, "_finish", late_finish)
    try:
        with store.writer("m", max_inflight=1, timeout_s=0.3) as w:
            with pytest.raises(BusyError, match="pinned"):
                w.save(state(4), 4)
    finally:
        for pin in pins:
            pin.close()
    assert store.latest("m").step == 3


def test_removing_pinned_or_latest_is_busy(store):
    with store.writer("m", max_inflight=1, slots=3) as w:
        for s in (1, 2):
            w.save(state(s), s).result()
    with store.open_version("m", 1):
        with pytest.raises(BusyError):
            store.remove("m", 1)
        with pytest.raises(BusyError):
            store.remove_model("m")
    with pytest.raises(BusyError, match="latest"):
        store.remove("m", 2)
    store.remove("m", 1)
    with pytest.raises(NotFoundError):
        store.load("m", 1)
    _intact(store, "m", [2])


def _comm() -> str:
    with open("/proc/self/comm") as f:
        return f.read().strip()


def test_a_model_with_a_writer_open_is_not_removed(store, region_path):
    """A training job's writer between two saves holds no slot: a removal of its model (``ckptfs
    rm --all`` from another process, or this one) is refused while the writer is open, and the
    job's next save goes on; once the writer is closed the model goes."""
    with store.writer("m", max_inflight=1) as w:
        w.save(state(1), 1).result()
        with ckptfs.Store(region_path) as other:  # another open of the region: another process's locks
            with pytest.raises(BusyError, match=rf"has a writer open \(a training job saving it: .*\(pid {os.getpid()}\)\)"):
                other.remove_model("m")
        with pytest.raises(BusyError, match="has a writer open"):
            store.remove_model("m")
        assert [m["writers"] for m in store.status()["models"]] == [[(os.getpid(), _comm())]]  # who holds it
        assert w.save(state(2), 2).result().published
    _intact(store, "m", [1, 2])
    store.remove_model("m")
    assert "m" not in store.models()


def _hold_pin_forever(region_path, step, ready_path):
    s = ckptfs.Store(region_path)
    v = s.open_version("m", step)
    with open(ready_path, "w") as f:
        f.write(str(v.info.slot))
    while True:
        time.sleep(1)


def test_reader_holding_a_pin_forever(region_path, store):
    with store.writer("m", max_inflight=2, slots=4) as w:
        for s in (1, 2):
            w.save(state(s), s).result()
    ready = region_path + ".ready"
    child = mp_context().Process(target=_hold_pin_forever, args=(region_path, 1, ready), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ready) or not open(ready).read():
            assert child.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        pinned_slot = int(open(ready).read())
        # the writer keeps going around the pinned slot, N in flight, and never waits long
        t0 = time.monotonic()
        with store.writer("m", max_inflight=2, timeout_s=10) as w:
            futures = [w.save(state(s), s) for s in range(3, 40)]
            results = [f.result() for f in futures]
        assert all(r.slot != pinned_slot for r in results)
        assert time.monotonic() - t0 < 60
        _intact(store, "m", [1, 39])  # the pinned version is untouched
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    # its pin died with it: the slot is reused by the next saves
    with store.writer("m", max_inflight=1) as w:
        slots = {w.save(state(s), s).result().slot for s in range(40, 46)}
    assert pinned_slot in slots


def test_all_inflight_permits_busy_on_a_slow_device(region_path, store):
    with store.writer("m", max_inflight=2, slots=4) as w:
        w.save(state(0), 0).result()
    store.close()
    gate = threading.Event()

    def slow(offset, length):
        gate.wait(20)  # the device completes nothing until the test says so

    region = Region(region_path, backend=RecordingBackend(region_path, write_hook=slow))
    try:
        w = ckptfs.Writer(region, "m", max_inflight=2, slots=4, timeout_s=0.5)
        f1, f2 = w.save(state(1), 1), w.save(state(2), 2)
        t0 = time.monotonic()
        with pytest.raises(BusyError, match="in flight"):
            w.save(state(3), 3)
        assert time.monotonic() - t0 < 5
        gate.set()
        assert f1.result(20).step == 1 and f2.result(20).step == 2
        w.close()
    finally:
        gate.set()
        region.close()
    with Store(region_path) as s:
        _intact(s, "m", [0, 1, 2])
        assert s.latest("m").step == 2


@pytest.mark.slow
def test_mixed_contention_never_deadlocks_or_corrupts(store):
    """A writer, readers pinning random versions, verify and removals, all at once."""
    with store.writer("m", max_inflight=2, slots=5) as w:
        w.save(state(0), 0).result()
    stop = time.monotonic() + 4
    errors, checked = [], [0]
    latest_step = [0]

    def writer():
        with store.writer("m", max_inflight=2, slots=5, timeout_s=20) as w:
            s = 1
            while time.monotonic() < stop:
                w.save(state(s), s).add_done_callback(lambda f, s=s: latest_step.__setitem__(0, max(latest_step[0], s)))
                s += 1

    def reader(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            try:
                steps = [v.step for v in store.versions("m")]
                s = rng.choice(steps)
                got = store.load("m", s)
                diff = same(state(s), got)
                if diff:
                    errors.append(f"step {s}: {diff}")
                checked[0] += 1
            except NotFoundError:
                pass  # the documented "version gone" case: reused between listing and pinning

    def verifier():
        while time.monotonic() < stop:
            problems = store.verify("m")
            if problems:
                errors.append(f"verify: {problems}")

    def remover(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            try:
                versions = store.versions("m")
                store.remove("m", rng.choice(versions).step)
            except (BusyError, NotFoundError):
                pass
            time.sleep(0.01)

    threads = [threading.Thread(target=t, args=a) for t, a in
               [(writer, ()), (reader, (1,)), (reader, (2,)), (verifier, ()), (remover, (3,))]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "deadlock: a thread did not finish"
    assert errors == []
    assert checked[0] > 10
    assert store.latest("m").step == latest_step[0]
    assert store.verify() == []


def test_pin_and_remove_race_within_one_process(store):
    # Threads of one process share one lock description, in which the kernel never sees a
    # conflict: a pin taken while a removal was acquiring its exclusive lock used to be silently
    # converted into it, and the version was removed under the reader's feet.
    w = store.writer("m", max_inflight=1, slots=4)
    w.save(state(0), 0).result()
    entry = store.region.get("m")
    try:
        for step in range(1, 31):
            w.save(state(step), step).result()  # step-1 is now a removable, non-latest version
            errors, removed = [], threading.Event()

            def pinner(target=step - 1):
                while not removed.is_set():
                    try:
                        with store.open_version("m", target) as v:
                            for _ in range(5):
                                h = store.region.read_header(entry, v.info.slot)
                                if h is None or h.counter != v.info.counter:
                                    errors.append(f"step {target} was removed while pinned")
                                    return
                    except NotFoundError:
                        return

            def remover(target=step - 1):
                while True:
                    try:
                        store.remove("m", target)
                        removed.set()
                        return
                    except BusyError:
                        pass
                    except Exception as e:  # noqa: BLE001
                        errors.append(repr(e))
                        removed.set()
                        return

            threads = [threading.Thread(target=pinner), threading.Thread(target=pinner),
                       threading.Thread(target=remover)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert errors == [], f"round {step}: {errors}"
            assert removed.is_set()
    finally:
        w.close()
    _intact(store, "m", [30])
