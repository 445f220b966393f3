"""Tier 2: several checkpoints in flight, out-of-order completion, pins, several processes."""
import os
import threading
import time

import pytest
import torch

import ckptfs
from ckptfs.errors import BusyError
from ckptfs.region.extents import GIVE_BACK_AFTER_COMMITS
from ckptfs.region.claim import Claim
from ckptfs.writer.progress import progress_dir
from conftest import fill_region, mp_context


@pytest.fixture
def held_commits(monkeypatch):
    """Every commit waits until the returned event is set (saves stay in flight)."""
    gate = threading.Event()
    original = Claim.commit

    def held_commit(self, *args, **kwargs):
        gate.wait(10)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Claim, "commit", held_commit)
    yield gate
    gate.set()


def state(step, n=4096):
    return {"w": torch.full((n,), float(step)), "step": step}


def test_n_in_flight_and_backpressure(store, held_commits):
    gate = held_commits
    with store.writer("bp", max_inflight=2, slots=4) as w:
        f1, f2 = w.save(state(1), step=1), w.save(state(2), step=2)
        blocked = threading.Event()
        third = []

        def save_third():
            third.append(w.save(state(3), step=3))
            blocked.set()

        t = threading.Thread(target=save_third)
        t.start()
        assert not blocked.wait(0.3), "a third save must wait while two are in flight"
        gate.set()
        t.join(10)
        assert blocked.is_set()
        assert [f.result().step for f in (f1, f2, third[0])] == [1, 2, 3]
    assert store.latest("bp").step == 3


def test_older_commit_never_replaces_newer(store, monkeypatch):
    release_old = threading.Event()
    original = Claim.commit

    def ordered_commit(self, *args, **kwargs):
        if self.step == 1:
            release_old.wait(10)  # the older checkpoint finishes last
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Claim, "commit", ordered_commit)
    with store.writer("ooo", max_inflight=2, slots=4) as w:
        old, new = w.save(state(1), step=1), w.save(state(2), step=2)
        assert new.result().published
        assert store.latest("ooo").step == 2
        release_old.set()
        assert old.result().published is False
    assert store.latest("ooo").step == 2
    assert store.load("ooo")["step"] == 2
    # the late older version is still a complete, listed version
    assert [v.step for v in store.versions("ooo")] == [1, 2]
    assert store.load("ooo", step=1)["step"] == 1


def test_a_synchronous_save_after_an_async_one_is_latest(store):
    """A periodic async save, then at once the job's final (or preemption) save, synchronous:
    it claimed its slot on the caller's thread while the async one still waited in the queue,
    took the smaller counter, and the older step stayed latest."""
    model = torch.nn.Linear(256, 256)
    with store.writer("m") as w:
        for step in range(0, 10, 2):
            w.save({"model": model.state_dict(), "step": step}, step=step, async_snapshot=True)
            w.save({"model": model.state_dict(), "step": step + 1}, step=step + 1).result()
            assert store.latest("m").step == step + 1
    counters = {v.step: v.counter for v in store.versions("m")}
    assert sorted(counters, key=counters.get) == sorted(counters)


def test_latest_and_pinned_slots_are_never_reused(store):
    with store.writer("pin", max_inflight=1, slots=3, timeout_s=0.5) as w:
        w.save(state(1), step=1).result()
        w.save(state(2), step=2).result()
        with store.open_version("pin", 1) as v1:  # pin the oldest version
            w.save(state(3), step=3).result()  # must take the free slot, not step 1's
            w.save(state(4), step=4).result()  # must reuse step 2's slot, not step 1's
            assert [v.step for v in store.versions("pin")] == [1, 3, 4]
            assert v1.load()["w"][0].item() == 1.0
            with store.open_version("pin", 3):
                # step 1 and 3 pinned, step 4 latest: the save takes one more slot from free space
                # instead of stalling training
                assert w.save(state(5), step=5).result().published
                assert store.region.get("pin").nslots == 4
            assert [v.step for v in store.versions("pin")] == [1, 3, 4, 5]
            assert v1.load()["w"][0].item() == 1.0
        # pins released: the extra slot goes back once it was spare at that many commits in a row
        last = 6 + GIVE_BACK_AFTER_COMMITS + 2
        for step in range(6, last):
            w.save(state(step), step=step).result()
    assert store.region.get("pin").nslots == 3
    assert [v.step for v in store.versions("pin")] == list(range(last - 3, last))
    assert store.latest("pin").step == last - 1


def test_a_version_can_be_opened_from_the_moment_it_is_listed(region_path, store, monkeypatch):
    """A version is listed once its header is committed (newer than the pointer it already
    counts as latest): from then on a reader of another open of the region can pin it. Until
    the writer's claim became a pin before that header, a path through the mount's ``latest``
    that named a version just committed could not open it (ENOENT)."""
    from ckptfs.region.ring import Ring

    opened = []
    publish = Ring.publish

    def publish_after_a_reader_opened_it(self, counter, slot):
        newest = max(other.versions("m"), key=lambda v: v.counter)
        assert newest.counter == counter and newest.latest
        with other.open_version("m", newest.step, counter=counter) as v:
            opened.append(int(v.load()["w"][0]))
        return publish(self, counter, slot)

    monkeypatch.setattr(Ring, "publish", publish_after_a_reader_opened_it)
    with ckptfs.Store(region_path) as other, store.writer("m", max_inflight=1) as w:
        for step in (1, 2, 3):
            w.save(state(step), step=step).result()
    assert opened == [1, 2, 3]


def _held(store, version):
    """Hold ``version``'s slot exclusively from another open description, as a save's commit
    (or a claim reusing the slot) does; returns the LockSpace to close to let go."""
    from ckptfs.region.locks import LockSpace, slot_lock_offset

    claims = LockSpace(store.path)
    assert claims.try_exclusive(slot_lock_offset(version.entry.index, version.slot))
    return claims


def test_a_version_held_by_its_commit_is_waited_for_and_one_being_reused_is_gone(region_path, store):
    """An older step committed after a newer one (max_inflight 2) is listed from the moment its
    header is written, and held exclusively through the commit's barrier: an open of it by step
    waits (it said "no step"). A version whose slot a claim holds (the version is being
    overwritten) is "no step" once the wait is over; the latest held is HeldError, at once with
    ``wait_s=0`` (the mount waits on its own loop)."""
    with store.writer("m", max_inflight=1) as w:
        for step in (1, 2, 3):
            w.save(state(step), step=step).result()
    one, three = (next(v for v in store.region.committed(store.region.get("m")) if v.header.step == s) for s in (1, 3))
    claims = _held(store, one)
    threading.Timer(0.2, claims.close).start()  # the commit's barrier ends
    t0 = time.monotonic()
    with store.open_version("m", 1) as v:
        assert 0.1 < time.monotonic() - t0 < 0.9 and int(v.load()["w"][0]) == 1
    claims = _held(store, one)
    try:
        t0 = time.monotonic()
        with pytest.raises(ckptfs.errors.NotFoundError, match="no step 1"):
            store.open_version("m", 1, wait_s=0.3)
        assert time.monotonic() - t0 >= 0.3
        with pytest.raises(ckptfs.errors.NotFoundError):
            store.open_version("m", 1, wait_s=0)
    finally:
        claims.close()
    claims = _held(store, three)
    try:
        for step in (None, 3):
            with pytest.raises(ckptfs.errors.HeldError, match="try again"):
                store.open_version("m", step, wait_s=0)
    finally:
        claims.close()
    with store.open_version("m", 3, wait_s=0) as v:
        assert v.info.step == 3


def test_pin_of_dead_process_is_released(region_path, store):
    with store.writer("dead", max_inflight=1, slots=2, timeout_s=2) as w:
        w.save(state(1), step=1).result()
        w.save(state(2), step=2).result()
    ctx = mp_context()
    ready = ctx.Event()
    p = ctx.Process(target=_pin_and_hang, args=(region_path, ready))
    p.start()
    assert ready.wait(20)
    entry = store.region.get("dead")
    slot = next(v.slot for v in store.versions("dead") if v.step == 1)
    assert store.region.is_busy(entry, slot)
    p.kill()
    p.join()
    assert not store.region.is_busy(entry, slot)
    with store.writer("dead", max_inflight=1, timeout_s=5) as w:
        assert w.save(state(3), step=3).result().slot == slot  # the dead reader's slot, not a new one
    assert store.region.get("dead").nslots == 2


def test_close_while_another_thread_saves(store):
    """close() (of the writer, or of its store) from one thread while another saves in a loop:
    close waits for the save under way and returns; the saver's next save is refused as closed;
    no worker thread is left. (It hung in the claimer's close, or left its threads behind, and
    the saver met closed descriptors and released buffers.)"""
    import random

    def writer_threads() -> list[str]:
        names = ("ckptfs-claim", "ckptfs-snapshot", "ckptfs-crc", "ckptfs-persist")
        return sorted(t.name for t in threading.enumerate() if t.name.startswith(names))

    rnd = random.Random(0)
    state_ = {"x": torch.ones(1 << 14)}
    before = writer_threads()
    for round_ in range(12):
        w = store.writer(f"c{round_}", max_inflight=2)
        failed = []

        def saver():
            try:
                for i in range(10 ** 6):
                    w.save(state_, step=i, async_snapshot=i % 2 == 0)
                    if i % 2 == 0:
                        w.wait_snapshot()
            except Exception as e:  # noqa: BLE001 - what the saver met, checked below
                failed.append(e)

        t = threading.Thread(target=saver)
        t.start()
        time.sleep(rnd.uniform(0.005, 0.05))
        w.close()
        t.join(15)
        assert not t.is_alive(), "the saver hung"
        assert [type(e).__name__ for e in failed] == ["CkptfsError"] and "closed" in str(failed[0])
    assert writer_threads() == before


_FORKS = r"""
import os, sys, time, signal, torch, ckptfs
from ckptfs.errors import BusyError
store = ckptfs.Store(sys.argv[1])
w = store.writer("m", max_inflight=1, slots=2)
w.save({"w": torch.zeros(1000)}, step=0).result()
v = store.open_version("m")  # the parent's pin
f = w.save({"w": torch.ones(1 << 22)}, step=1, async_snapshot=True)  # in flight at the fork
child = os.fork()
if child == 0:  # loads the pinned version itself, lets go of the one it inherited, exits (atexit runs)
    signal.alarm(30)  # a child that cannot exit is killed, not left behind
    with store.open_version("m", 0) as mine:
        mine.load()
    v.close()
    sys.exit(0)
start = time.monotonic()
while os.waitpid(child, os.WNOHANG)[0] == 0:
    assert time.monotonic() - start < 20, "the child's exit waits for the parent's save"
    time.sleep(0.01)
f.result()
def still_pinned(why):
    with ckptfs.Store(sys.argv[1]) as other:
        try:
            other.remove("m", 0)
            raise AssertionError(why)
        except BusyError:
            pass
still_pinned("the parent's pin went with its child")
for step in range(2, 6):
    w.save({"w": torch.full((1000,), float(step))}, step=step).result()
assert torch.equal(v.load()["w"], torch.zeros(1000)), "the pinned version was overwritten"
ready_r, ready_w = os.pipe()
reader = os.fork()
if reader == 0:  # its own pin of the version, then lets go of the one it inherited, and reads on
    signal.alarm(30)
    mine = store.open_version("m", 0)
    v.close()
    os.write(ready_w, b"x")
    time.sleep(60)
    os._exit(0)
os.read(ready_r, 1)
v.close()
still_pinned("the child's own pin went with the one it inherited")
os.kill(reader, signal.SIGKILL)
os.waitpid(reader, 0)
lives_on = os.fork()  # a persistent DataLoader worker, say
if lives_on == 0:
    time.sleep(60)
    os._exit(0)
w.close()
store.remove_model("m")  # the writer is closed: its ring's lock went with it, the child's copy too
os.kill(lives_on, signal.SIGKILL)
os.waitpid(lives_on, 0)
print("ok")
"""


def test_a_forked_child_leaves_its_parents_pins_saves_and_model_alone(region_path, store):
    """A child forked while the parent holds a pin and a save is in flight (a DataLoader
    worker): its own load and its letting go of what it inherited must not drop the parent's
    pin (the parent's version was overwritten under its reads), its exit must not wait for the
    parent's save (it waited forever), and once the parent closes its writer the model may be
    removed while the child lives on (the child's copy of the ring's lock description kept it)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORKS, region_path], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _pin_and_hang(region_path, ready):
    s = ckptfs.Store(region_path)
    pinned = s.open_version("dead", 1)  # noqa: F841 - held until the process dies
    ready.set()
    time.sleep(60)


def _write_model(region_path, model, steps, barrier):
    s = ckptfs.Store(region_path)
    barrier.wait(30)
    with s.writer(model, max_inflight=2) as w:
        for step in range(steps):
            w.save({"w": torch.full((20000,), float(step)), "m": model}, step=step)
    s.close()


def test_several_processes_write_different_models(region_path, store):
    ctx = mp_context()
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_write_model, args=(region_path, f"m{i}", 12, barrier)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert store.models() == ["m0", "m1", "m2"]
    for i in range(3):
        back = store.load(f"m{i}")
        assert back["m"] == f"m{i}" and torch.equal(back["w"], torch.full((20000,), 11.0))
    assert store.verify() == []
    # the rings do not overlap
    extents = sorted((x for e in store.region.entries() for x in e.extents), key=lambda x: x.offset)
    for a, b in zip(extents, extents[1:]):
        assert a.end <= b.offset


def test_one_writer_per_model_in_this_process_or_another(store, region_path, monkeypatch):
    """A second writer of a model, in this process or another, is refused while the first is
    open, naming the process that holds it (two writers took counters each in its own order:
    with async saves the latest went back a step, and a resumed job beside its zombie interleaved
    their versions); once the first closes, the second saves and is latest."""
    import os
    import subprocess
    import sys

    import ckptfs.region.ring as ring_module

    monkeypatch.setattr(ring_module, "MODEL_WAIT_S", 0.2)
    with store.writer("shared", max_inflight=2) as w1:
        w1.save(state(1), step=1).result()
        with pytest.raises(ckptfs.errors.BusyError, match=r"'shared' has a writer open in this process: one writer "
                                                          r"per model; close that one first \(the Store it came from"):
            store.writer("shared")
        other = subprocess.run(
            [sys.executable, "-c", "import sys, ckptfs, ckptfs.region.ring as r\nr.MODEL_WAIT_S = 0.2\n"
             "try:\n    ckptfs.Store(sys.argv[1]).writer('shared')\nexcept ckptfs.errors.BusyError as e:\n"
             "    print(e)", region_path], capture_output=True, text=True, timeout=60)
        assert f"pid {os.getpid()}" in other.stdout and "one writer per model" in other.stdout, other.stderr
        # a model not made yet (made at the first save): its name is held from the first writer's
        # opening (the second opened, and the first of the two to save refused the other's saves)
        store.writer("never").close()  # closed unsaved: the name is free again
        fresh = store.writer("fresh")
        with pytest.raises(ckptfs.errors.BusyError, match=r"'fresh' has a writer open in this process that has "
                                                          r"not saved yet: one writer per model"):
            store.writer("fresh")
        other = subprocess.run(
            [sys.executable, "-c", "import sys, ckptfs\ntry:\n    ckptfs.Store(sys.argv[1]).writer('fresh')\n"
             "except ckptfs.errors.BusyError as e:\n    print(e)", region_path], capture_output=True, text=True,
            timeout=60)
        assert f"pid {os.getpid()}" in other.stdout and "not saved yet" in other.stdout, other.stderr
        fresh.save(state(1), step=1).result()  # the model is made: its own lock byte from here
        with pytest.raises(ckptfs.errors.BusyError, match="one writer per model"):
            store.writer("fresh")
        fresh.close()
        with store.writer("fresh") as again:
            again.save(state(2), step=2).result()
        assert [v.step for v in store.versions("fresh")] == [1, 2]
    with store.writer("shared") as w2:
        assert w2.save(state(2), step=2).result().published
    assert store.latest("shared").step == 2


def test_the_writers_of_multi_rank_saves_share_a_model_and_exclude_a_sole_writer(store, monkeypatch):
    """The writers ckptfs keeps for DCP saves (sole=False: the training process's and DCP's
    background process's, of the same part models) share the model's lock byte; a sole writer
    (store.writer) and they exclude each other. Such a writer whose every slot is latest or kept
    waits for the leader to give parts back (BusyError after timeout_s), where a sole writer
    fails at once."""
    import ckptfs.region.ring as ring_module
    from ckptfs.writer.writer import Writer

    monkeypatch.setattr(ring_module, "MODEL_WAIT_S", 0.2)
    with store.writer("m") as sole:
        sole.save(state(1), step=1).result()
        with pytest.raises(ckptfs.errors.BusyError, match="this process: one writer per model"):
            Writer(store.region, "m", sole=False)
    a = Writer(store.region, "m", sole=False, max_inflight=1, timeout_s=0.5)
    b = Writer(store.region, "m", sole=False, max_inflight=1, timeout_s=0.5)
    try:
        a.save(state(2), step=2).result()
        b.save(state(3), step=3).result()
        with pytest.raises(ckptfs.errors.BusyError, match="one writer per model"):
            store.writer("m")
        fill_region(store)
        for step in range(4, 4 + store.region.get("m").nslots):
            a.save(state(step), step=step, keep=True).result()  # every slot latest or kept
        with pytest.raises(ckptfs.errors.BusyError, match="after waiting 0.5 s"):
            a.save(state(99), step=99)
    finally:
        a.close()
        b.close()


def test_load_while_saving_sees_complete_versions(store):
    stop = threading.Event()
    errors = []

    def reader():
        while not stop.is_set():
            try:
                obj = store.load("live")
            except ckptfs.errors.NotFoundError:
                continue
            w = obj["w"]
            if not torch.equal(w, torch.full_like(w, float(obj["step"]))):
                errors.append(obj["step"])

    with store.writer("live", max_inflight=2) as w:
        w.save(state(0), step=0).result()
        t = threading.Thread(target=reader)
        t.start()
        for step in range(1, 40):
            w.save(state(step), step=step)
        w.wait()
        stop.set()
        t.join()
    assert errors == []


def test_async_snapshot_overlaps_and_captures_state_before_mutation(store):
    w_tensor = torch.zeros(50000)
    with store.writer("async", max_inflight=2, chunk_bytes=65536) as w:
        futs = []
        for step in range(1, 8):
            w_tensor.fill_(float(step))
            futs.append(w.save({"w": w_tensor, "step": step}, step=step, async_snapshot=True))
            w.wait_snapshot()  # as a training loop does before optimizer.step()
            w_tensor.fill_(-1.0)  # the "update": must not leak into the checkpoint
        for f in futs:
            assert f.snapshotted.result() >= 0
            assert f.result().step in range(1, 8)
    for step in range(1, 8):
        try:
            back = store.load("async", step=step)
        except ckptfs.errors.NotFoundError:
            continue  # slot reused by a later step
        assert torch.equal(back["w"], torch.full((50000,), float(step)))
    assert store.latest("async").step == 7


def test_async_snapshot_failure_reaches_both_futures(store):
    with store.writer("asyncfail", max_inflight=1, slots=2, timeout_s=0.2) as w:
        w.save(state(1), step=1).result()
        w.save(state(2), step=2).result()
        fill_region(store)  # no room for another slot
        with store.open_version("asyncfail", 1):  # the only free slot is pinned
            fut = w.save(state(3), step=3, async_snapshot=True)
            with pytest.raises(BusyError):
                fut.snapshotted.result(5)
            with pytest.raises(BusyError):
                fut.result(5)
    assert store.latest("asyncfail").step == 2


@pytest.fixture
def step_2_fails(monkeypatch):
    """The commit of step 2 fails in the background (as a full disk fails it)."""
    commit = Claim.commit

    def failing(self, *args, **kwargs):
        if self.step == 2:
            raise ckptfs.errors.CkptfsError("step 2 could not be written (injected)")
        return commit(self, *args, **kwargs)
    monkeypatch.setattr(Claim, "commit", failing)


def test_a_save_that_failed_unseen_is_raised_by_wait_and_close(store, step_2_fails):
    """A job that does not keep its futures (``w.save(state, step)`` each step) lost the saves
    that failed in the background without a word: wait(), close() and the end of the ``with``
    block returned as if every save had committed, and the job exited 0."""
    w = store.writer("m", max_inflight=2)
    for step in (1, 2, 3):
        w.save(state(step), step=step)
    with pytest.raises(ckptfs.errors.CkptfsError, match="step 2 could not be written"):
        w.wait()
    assert w.wait() == []  # reported once
    w.close()
    with pytest.raises(ckptfs.errors.CkptfsError, match="step 2 could not be written"):
        with store.writer("m", max_inflight=2) as w:
            for step in (1, 2, 3):
                w.save(state(step), step=step, async_snapshot=True)
    assert [v.step for v in store.versions("m")] == [1, 3]
    with pytest.raises(TypeError, match="set"):  # an async save refused in the background, its future dropped
        with store.writer("m", max_inflight=2) as w:
            w.save({"w": torch.ones(4), "odd": {1, 2}}, step=4, async_snapshot=True)
            time.sleep(0.5)
    with pytest.raises(TypeError, match="set"):  # a synchronous refusal is raised by save(), once
        with store.writer("m", max_inflight=2) as w:
            w.save({"w": torch.ones(4), "odd": {1, 2}}, step=5)
    with store.writer("m", max_inflight=2) as w:  # seen through its future: not raised again
        futures = [w.save(state(step), step=step) for step in (1, 2, 3)]
        with pytest.raises(ckptfs.errors.CkptfsError):
            futures[1].result()
        w.wait()


def test_the_slot_is_claimed_beside_the_snapshot(store, monkeypatch):
    """The claim (slot headers read from the disk) runs while the tensors are copied: here a
    claim that can only end once the snapshot has begun, and a snapshot that waits for nothing."""
    from ckptfs.region.ring import Ring
    from ckptfs.writer.snapshot import Snapshotter

    took = threading.Event()
    claim, take = Ring.claim, Snapshotter.take
    waited = []

    def late_claim(self, *args, **kwargs):
        waited.append(took.wait(10))  # were the claim made first, this wait would time out
        return claim(self, *args, **kwargs)

    def take_noting(self, *args, **kwargs):
        took.set()
        return take(self, *args, **kwargs)

    monkeypatch.setattr(Ring, "claim", late_claim)
    monkeypatch.setattr(Snapshotter, "take", take_noting)
    with store.writer("beside", max_inflight=2) as w:
        for step in (1, 2, 3):
            took.clear()
            w.save(state(step), step=step, async_snapshot=step % 2 == 1).result(20)
    assert waited == [True, True, True]
    assert store.latest("beside").step == 3
    assert [store.load("beside", step=s)["step"] for s in (1, 2, 3)] == [1, 2, 3]


def test_a_failed_snapshot_gives_back_the_slot_claimed_beside_it(store, monkeypatch):
    """A snapshot that fails before its claim ends: the claim, once made, is aborted (its slot
    lock let go, nothing written); later saves take every slot of the ring again."""
    from ckptfs.region.ring import Ring
    from ckptfs.writer.snapshot import Snapshotter

    failed = threading.Event()
    claim, take, abort = Ring.claim, Snapshotter.take, Claim.abort
    aborted = []

    def late_claim(self, *args, **kwargs):
        failed.wait(10)
        return claim(self, *args, **kwargs)

    def failing_take(self, job, *args, **kwargs):
        if job.step == 2:
            raise RuntimeError("the copy failed")
        return take(self, job, *args, **kwargs)

    def noting_abort(self):
        aborted.append(self.step)
        return abort(self)

    monkeypatch.setattr(Snapshotter, "take", failing_take)
    monkeypatch.setattr(Claim, "abort", noting_abort)
    with store.writer("gone", max_inflight=1, slots=3, timeout_s=2) as w:
        w.save(state(1), step=1).result()
        monkeypatch.setattr(Ring, "claim", late_claim)
        fut = w.save(state(2), step=2, async_snapshot=True)
        with pytest.raises(RuntimeError, match="the copy failed"):
            fut.snapshotted.result(10)
        failed.set()
        with pytest.raises(RuntimeError, match="the copy failed"):
            fut.result(10)
        monkeypatch.setattr(Ring, "claim", claim)
        for step in range(3, 9):  # twice round the ring of 3: a slot held by step 2 would be missed
            w.save(state(step), step=step).result(10)
        deadline = time.monotonic() + 10
        while aborted != [2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted == [2]
        slots = {v.step: v.slot for v in store.versions("gone")}
    assert store.latest("gone").step == 8
    assert sorted(slots) == [6, 7, 8] and len(set(slots.values())) == 3
    assert store.load("gone")["step"] == 8


def test_status_reports_saves_in_flight_with_progress(store, held_commits):
    gate = held_commits
    with store.writer("prog", chunk_bytes=65536) as w:
        fut = w.save({"w": torch.zeros(100000)}, step=7)
        deadline = time.monotonic() + 5
        while True:
            inflight = [s for s in store.status()["saves_in_flight"] if s["model"] == "prog"]
            if inflight and inflight[0]["persisted_bytes"] == inflight[0]["total_bytes"]:
                break
            assert time.monotonic() < deadline, inflight
            time.sleep(0.05)
        assert inflight[0]["step"] == 7 and inflight[0]["total_bytes"] == 401408  # 400000, page padded
        gate.set()
        fut.result()
    assert [s for s in store.status()["saves_in_flight"] if s["model"] == "prog"] == []
    # the last writer of the region gone, nothing of it is left in /dev/shm (a directory per
    # region per run of the tests piled up by the ten thousand)
    assert not os.path.exists(progress_dir(store.region.superblock.uuid))


def test_a_killed_writers_progress_file_is_swept_away(store):
    """A writer SIGKILLed never removes its file from the progress board: the next reader of the
    board (``status``) removes it, and the region's directory with it; a live writer's stays."""
    import json
    import subprocess
    import sys

    directory = progress_dir(store.region.superblock.uuid)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.makedirs(directory, exist_ok=True)
    for pid, name in ((dead.pid, "gone"), (os.getpid(), "here")):
        with open(os.path.join(directory, f"{'0' * 40}.{pid}.json"), "w") as f:
            json.dump({"model": name, "pid": pid, "saves": [{"step": 1, "persisted_bytes": 0, "total_bytes": 1}]}, f)
    assert [s["model"] for s in store.status()["saves_in_flight"]] == ["here"]
    assert os.listdir(directory) == [f"{'0' * 40}.{os.getpid()}.json"]
    os.unlink(os.path.join(directory, f"{'0' * 40}.{os.getpid()}.json"))
    open(os.path.join(directory, f"{'0' * 40}.{dead.pid}.json.tmp"), "w").close()  # killed mid-publish
    assert store.status()["saves_in_flight"] == []
    assert not os.path.exists(directory)
    # a job that is always preempted (SIGKILLed) never closes, and nobody runs status: its next
    # writer sweeps them (they piled up in /dev/shm, one per run)
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, f"{'0' * 40}.{dead.pid}.json"), "w").close()
    other = progress_dir(b"\x01" * 16)  # a region deleted after its writer was killed: nobody else sweeps it
    os.makedirs(other, exist_ok=True)
    open(os.path.join(other, f"{'0' * 40}.{dead.pid}.json"), "w").close()
    from ckptfs.writer import progress

    progress._swept_all[0] = False  # as in a process whose first writer this is
    with store.writer("swept") as w:
        assert not os.path.exists(other)
        assert f"{'0' * 40}.{dead.pid}.json" not in os.listdir(directory) if os.path.exists(directory) else True
        w.save({"w": torch.ones(4)}, step=1).result()


_OLD_INSTANCE = r'''
import sys, time, torch, ckptfs
store = ckptfs.Store(sys.argv[1])
w = store.writer("job")
w.save({"w": torch.zeros(4)}, step=1).result()
open(sys.argv[2], "w").close()
time.sleep(1.0)  # its preemption notice: it finishes the step, saves it, and exits
w.save({"w": torch.ones(4)}, step=2).result()
w.close()
'''


def test_a_restart_beside_its_old_process_still_saving_is_told(store, tmp_path):
    """A job restarted while its old process still finishes its preemption save: the new one
    loaded step 1, its writer waited for the old one to close, meanwhile the old one committed
    step 2, and the new job's saves of step 2 on hid it with older data, without a word."""
    import subprocess
    import sys

    ready = tmp_path / "ready"
    old = subprocess.Popen([sys.executable, "-c", _OLD_INSTANCE, store.path, str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and old.poll() is None
            time.sleep(0.01)
        assert store.latest("job").step == 1  # what the restarted job loads
        with pytest.raises(BusyError, match="that one committed step 2 \\(latest was step 1\\).*Open the writer "
                                            "before loading"):
            store.writer("job")
    finally:
        assert old.wait(30) == 0
    with store.writer("job") as w:  # opened first: nothing to wait for, and the load sees step 2
        assert torch.equal(store.load("job")["w"], torch.ones(4))
        w.save({"w": torch.full((4,), 3.0)}, step=3).result()


def test_closing_a_store_commits_and_stops_the_writers_left_open_on_it(region_path):
    """A writer its user never closed (a notebook, DCP's writers kept across steps) ends with
    its store: the save in flight is committed, and no worker thread is left behind."""
    def writer_threads():
        return sum(1 for t in threading.enumerate() if t.name.startswith(("ckptfs-persist", "ckptfs-progress")))
    before = writer_threads()
    store = ckptfs.Store.create(region_path, size_bytes=64 << 20)
    w = store.writer("m")
    future = w.save({"w": torch.ones(100_000)}, step=1, async_snapshot=True)
    store.close()
    assert future.done() and future.result().step == 1
    assert writer_threads() == before
    with ckptfs.Store(region_path) as again:
        assert again.latest("m").step == 1 and torch.equal(again.load("m")["w"], torch.ones(100_000))


_FORK_WITHOUT_DESCRIPTORS = r'''
import os, resource, sys, torch, ckptfs
from ckptfs.region.holders import lock_holders
path = sys.argv[1]
store = ckptfs.Store(path)
with store.writer("m", max_inflight=1, slots=2) as w:
    w.save({"a": torch.arange(1000.)}, step=1).result()
v = store.open_version("m")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
fill = []
try:
    while True:
        fill.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
pid = os.fork()
if pid == 0:  # its at-fork reopen failed: no descriptor was left
    for fd in fill[:16]:
        os.close(fd)
    v.close()  # lets go of the Version it inherited: must not unlock the parent's pin
    try:
        store.load("m")
        os._exit(3)
    except ckptfs.errors.CkptfsError as e:
        os._exit(0 if "could not reopen the region" in str(e) and "new ckptfs.Store" in str(e) else 4)
    except BaseException:
        os._exit(5)
_, status = os.waitpid(pid, 0)
for fd in fill:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
assert [mode for holders in lock_holders(path).values() for _, _, mode in holders] == ["READ"], lock_holders(path)
try:
    ckptfs.Store(path).remove_model("m")
    raise SystemExit("removed under the parent's open version")
except ckptfs.errors.BusyError:
    pass
assert v.load()["a"].tolist() == torch.arange(1000.).tolist()
print("ok")
'''


def test_a_forked_child_that_cannot_reopen_the_region_never_unlocks_its_parents_pins(region_path, store):
    """The child's at-fork reopen of its region fails (a process at its descriptor limit): it
    lets go of the parent's description without unlocking anything, says so in a warning, and a
    read there fails in one line; the parent's pin stands (the child's unlock dropped it, and
    the model could be removed under the parent's open version)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_WITHOUT_DESCRIPTORS, region_path], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "a forked child could not reopen its region's descriptor" in done.stderr


_FORK_DURING_A_TABLE_UPDATE = r'''
import os, sys, threading, torch, ckptfs
store = ckptfs.Store(sys.argv[1])
held, go = threading.Event(), threading.Event()

def update():  # a thread of the parent inside a table update (a ring growing) at the fork
    with store.region._meta_mutex:
        held.set()
        go.wait()
t = threading.Thread(target=update)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    __import__("signal").alarm(20)  # a hang ends the child, and the test fails
    with store.writer("made_in_the_child") as w:  # a new model: a table update
        w.save({"a": torch.ones(3)}, step=1).result()
    store.keep("made_in_the_child", 1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
go.set()
t.join()
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
assert [v.step for v in store.versions("made_in_the_child")] == [1]
print("ok")
'''


def test_a_child_forked_during_a_table_update_makes_models_of_its_own(region_path, store):
    """A thread of the parent inside a table update at the fork (the region's metadata mutex
    held): the child, which has no such thread, makes and keeps models of its own (it waited
    forever)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_DURING_A_TABLE_UPDATE, region_path], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


_SAVE_IN_A_FORKED_CHILD = r'''
import os, sys, torch, ckptfs
store = ckptfs.Store(sys.argv[1])
w = store.writer("m")
w.save({"a": torch.ones(3)}, step=1).result()
pid = os.fork()
if pid == 0:
    __import__("signal").alarm(20)  # a hang ends the child, and the test fails
    try:
        w.save({"a": torch.ones(3)}, step=2)
        os._exit(3)
    except ckptfs.errors.CkptfsError as e:
        os._exit(0 if "belongs to the process that opened it" in str(e) else 4)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
w.save({"a": torch.ones(3)}, step=2).result()
w.close()
print("ok")
'''


def test_a_forked_childs_copy_of_a_writer_refuses_to_save(region_path, store):
    """A save through the copy of its parent's writer in a forked child (whose claim and
    persist threads stayed with the parent) waited forever; it is refused in one line, and the
    parent's writer goes on saving."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SAVE_IN_A_FORKED_CHILD, region_path], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_writer_whose_look_for_its_model_fails_leaves_its_name_free(store, monkeypatch):
    """Region.hold_name took the name's lock byte, then the look for the model failed (an I/O
    error reading the table): the byte stayed held, and every later writer of the model in this
    Store was refused as if one had not saved yet."""
    from ckptfs.errors import RegionIOError

    real_find, calls = type(store.region).find, []

    def find_then_fail(self, name):  # the writer's own look finds none; hold_name's fails
        calls.append(name)
        if len(calls) > 1:
            raise RegionIOError("injected media error", 5, "read")
        return real_find(self, name)
    monkeypatch.setattr(type(store.region), "find", find_then_fail)
    with pytest.raises(RegionIOError, match="injected"):
        store.writer("lost")
    monkeypatch.setattr(type(store.region), "find", real_find)
    with store.writer("lost") as w:
        w.save(state(1), step=1).result()
