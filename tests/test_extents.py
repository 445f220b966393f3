"""Slots that grow and shrink, kept versions, and the format upgrade: a model outgrows its first
save, readers never stall a save while the region has room, milestones stay, an older region
is copied into the current format (ckptfs.region.extents, ring.mark_kept, region.upgrade)."""
import gzip
import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

import ckptfs
from ckptfs.errors import OldFormatError
from ckptfs.region.extents import GIVE_BACK_AFTER_COMMITS
from ckptfs.region.format import unpack_latest
from ckptfs.testing.crashcheck import same
from conftest import fill_region


def state(step: int, n: int = 1000):
    return {"w": torch.full((n,), float(step)), "step": step}


def test_an_optimizer_without_state_at_step_0_then_adam(store):
    """The new user's case: model + optimizer saved before the first opt.step(), then after."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    with store.writer("adam") as w:
        w.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=0).result()
        for step in range(1, 6):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            assert w.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=step).result().published
    back = store.load("adam")
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert [v.step for v in store.versions("adam")] == [2, 3, 4, 5] and store.verify() == []


def test_readers_pinning_every_slot_never_stall_the_writer(store):
    with store.writer("m", max_inflight=1, slots=3, timeout_s=60) as w:
        for step in (1, 2, 3):
            w.save(state(step), step).result()
        reader = ckptfs.Store(store.path)  # another reader (its own open file description)
        pins = [reader.open_version("m", s) for s in (1, 2)]  # with latest, every slot is busy
        for step in (4, 5, 6):
            result = w.save(state(step), step).result(timeout=10)
            assert result.published
        assert store.region.get("m").nslots == 4  # one slot more, not one per save
        assert [p.load()["step"] for p in pins] == [1, 2]
        status = {m["name"]: m for m in store.status()["models"]}["m"]
        assert sorted(p["step"] for p in status["pinned"]) == [1, 2]
        assert all(pid == os.getpid() for p in status["pinned"] for pid, _ in p["holders"])
        for p in pins:
            p.close()
        reader.close()
        last = 7 + GIVE_BACK_AFTER_COMMITS + 2  # the slot goes back once spare at that many commits
        for step in range(7, last):
            w.save(state(step), step).result()
    assert store.region.get("m").nslots == 3 and [v.step for v in store.versions("m")] == list(range(last - 3, last))


@pytest.mark.parametrize("unkept_by", ["this store", "another process's store"])
def test_a_ring_whose_kept_versions_come_and_go_settles(tmp_path, unkept_by):
    """A multi-rank job's parts: each save kept, the one before unkept once the next is saved
    (its step went global), by the job's leader: another process. The ring grows by what its
    kept versions take, and no more: a claim that finds it short looks at the headers again
    before growing (the leader unkept one meanwhile), and a slot spare at one commit is not
    given back to be taken again at the next claim. It grew by one slot per save, to 11."""
    path = str(tmp_path / "parts.region")
    with ckptfs.Store.create(path, size_bytes=256 << 20) as store:
        leader = store if unkept_by == "this store" else ckptfs.Store(path)
        sizes = []
        with store.writer("part", max_inflight=2) as w:
            for step in range(1, 40):
                w.save(state(step, n=1 << 16), step, keep=True).result()
                if step > 1:
                    leader.unkeep("part", step - 1)
                sizes.append(store.region.get("part").nslots)
        assert len(set(sizes[8:])) == 1 and sizes[-1] <= 4 + 2, sizes  # the ring's 4, 2 kept at a claim
        assert [v.step for v in store.versions("part") if v.kept] == [39]
        assert torch.equal(store.load("part", 39)["w"], state(39, n=1 << 16)["w"])


def test_kept_versions_are_never_reused(store):
    with store.writer("m", slots=3, keep_every=5) as w:
        for step in range(1, 21):
            w.save(state(step), step, keep=(step == 2) or None).result()
    versions = store.versions("m")
    assert [v.step for v in versions if v.kept] == [2, 5, 10, 15, 20]
    assert [v.step for v in versions if not v.kept] == [18, 19]  # the ring keeps 3: 18, 19, 20
    assert store.latest("m").step == 20
    for v in versions:
        assert store.load("m", v.step)["step"] == v.step
    store.unkeep("m", 5)
    store.unkeep("m", 10)
    store.keep("m", 18)
    with store.writer("m") as w:
        for step in range(21, 26):
            w.save(state(step), step).result()
    assert [v.step for v in store.versions("m") if v.kept] == [2, 15, 18, 20]
    assert [v.step for v in store.versions("m") if not v.kept] == [23, 24, 25]
    assert store.region.get("m").nslots <= 3 + 4 + 1  # the ring's share, the kept ones, one in rotation
    store.remove("m", 2)  # a kept version can be removed
    assert 2 not in [v.step for v in store.versions("m")]
    with pytest.raises(ckptfs.errors.NotFoundError):
        store.keep("m", 3)


def test_a_run_rolled_back_over_its_milestones_gives_the_hidden_ones_back(store, caplog):
    """A job with keep_every=4 saves steps 1-9, then resumes from step 3 (a loss spike) and saves
    4-9 again, in a new process's writer. Each step saved again hides the first run's version
    (listings show the newer); the first run's milestones 4 and 8, hidden, went back to the
    ring with a warning instead of holding their slots, unseen, for good."""
    with store.writer("m", keep_every=4) as w:
        for step in range(1, 10):
            w.save({**state(step), "run": 1}, step).result()
    first = {v.step: v.counter for v in store.versions("m") if v.kept}
    assert sorted(first) == [4, 8]
    with caplog.at_level("WARNING", logger="ckptfs"), store.writer("m", keep_every=4) as w:
        for step in range(4, 10):
            w.save({**state(step), "run": 2}, step).result()
    said = [r.getMessage() for r in caplog.records if "saved again" in r.getMessage()]
    assert len(said) == 2 and "step 4 of 'm'" in said[0] and "store.keep" not in said[0]  # the new 4 is kept
    every = store.versions("m", hidden=True)
    assert not [v for v in every if v.counter in first.values() and v.kept]  # given back (and reused, or not yet)
    assert [v.step for v in every if v.kept] == [4, 8]  # the second run's
    assert [v.step for v in store.versions("m")] == [4, 5, 6, 7, 8, 9]
    assert all(store.load("m", step)["run"] == 2 for step in (4, 8, 9))
    assert store.status()["models"][0]["kept_steps"] == [4, 8]
    # a step saved twice without being kept the first time: nothing to give back, nothing said
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckptfs"), store.writer("m") as w:
        w.save(state(9), 9).result()
    assert not [r for r in caplog.records if "saved again" in r.getMessage()]


def test_a_milestone_hidden_while_a_crash_cut_its_give_back_goes_back_at_the_next_run(store, monkeypatch):
    """Killed between a save that hid a kept version (its step saved again) and the give-back of
    that version: it stayed kept for good, listed nowhere, its slot never reused. A writer's
    first look sweeps every step."""
    from ckptfs.region.ring import Ring

    with store.writer("m", keep_every=3) as w:
        for step in range(1, 5):
            w.save({**state(step), "run": 1}, step).result()
    old = next(v for v in store.versions("m") if v.kept)
    real = Ring.give_back_hidden
    monkeypatch.setattr(Ring, "give_back_hidden", lambda self, step, counter, every_step=False: ([], 1 << 40))
    with store.writer("m") as w:  # the run resumed from 2, "killed" before its give-back
        w.save({**state(3), "run": 2}, 3).result()
    assert [v.counter for v in store.versions("m", hidden=True) if v.kept] == [old.counter]  # hidden, kept
    monkeypatch.setattr(Ring, "give_back_hidden", real)
    with store.writer("m") as w:  # the next run
        w.save({**state(10), "run": 3}, 10).result()
    assert not [v for v in store.versions("m", hidden=True) if v.kept]
    assert store.load("m", 3)["run"] == 2


def test_a_step_saved_again_beside_a_concurrent_commit_still_gives_its_milestone_back():
    """Two commits on two threads, the first writer's first: the first set the highest step
    known to its own before its look was done, so the other (a higher step, the one that hid a
    milestone) took itself to be past every step and did not look."""
    import threading

    from ckptfs.writer.hidden import HiddenKept
    from ckptfs.writer.job import SaveResult

    looked, first_in = [], threading.Event()
    release = threading.Event()

    class Ring:
        def give_back_hidden(self, step, counter, every_step=False):
            looked.append(step)
            if step == 4:
                first_in.set()
                release.wait(10)
            return [], 6  # the first run went up to step 6

    hidden = HiddenKept("m", enabled=True)
    result = lambda step: SaveResult("m", step, step + 10, 0, 0, True, 0.0, 0.0)
    first = threading.Thread(target=hidden.after_commit, args=(Ring(), result(4), False))
    first.start()
    assert first_in.wait(10)
    hidden.after_commit(Ring(), result(5), False)  # step 5 of the first run was kept: look
    release.set()
    first.join(10)
    assert sorted(looked) == [4, 5]
    hidden.after_commit(Ring(), result(6), False)  # not past step 6 either
    hidden.after_commit(Ring(), result(7), False)  # past every step: no look
    assert sorted(looked) == [4, 5, 6]


def test_a_failed_look_for_hidden_milestones_leaves_the_save_committed(store, caplog, monkeypatch):
    """The look at a first commit (reading the model's headers) failing with an I/O error: the
    save is durable and committed all the same, its future completes, the failure is logged."""
    from ckptfs.region.ring import Ring

    def unreadable(self, step, counter, every_step=False):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(Ring, "give_back_hidden", unreadable)
    with caplog.at_level("WARNING", logger="ckptfs"), store.writer("m") as w:
        assert w.save(state(1), 1).result(timeout=30).step == 1
    assert store.latest("m").step == 1
    assert any("could not be looked for" in r.getMessage() for r in caplog.records)


def test_rm_of_a_step_saved_twice_removes_both_saves(store, capsys):
    """`ckptfs rm m 3` of a step a rolled-back run saved again said 'removed', and step 3 was
    still listed: the first run's save of it, which the second had hidden, showed again."""
    from test_cli import run

    with store.writer("m", slots=8) as w:
        for step in range(1, 6):
            w.save(state(step), step).result()
    with store.writer("m") as w:
        for step in (3, 4):
            w.save({**state(step), "run": 2}, step).result()
    assert [v.step for v in store.versions("m", hidden=True)] == [1, 2, 3, 3, 4, 4, 5]
    code, out, _ = run(capsys, "rm", "--region", store.path, "m", "3")
    assert code == 0 and "removed m step 3" in out
    assert [v.step for v in store.versions("m", hidden=True)] == [1, 2, 4, 4, 5]
    with pytest.raises(ckptfs.errors.NotFoundError):
        store.load("m", 3)
    store.remove("m", 2)  # a step saved once: as before
    assert [v.step for v in store.versions("m")] == [1, 4, 5]
    # a reader (another Store: another process's) holds step 5 when a run saves it again: the
    # removal is refused before anything listed changes; the newer save went first, then the
    # refusal, and step 5 was the held save, an abandoned run's, latest for the next resume
    with ckptfs.Store(store.path) as other, other.open_version("m", 5):
        with store.writer("m") as w:
            w.save({**state(5), "run": 2}, 5).result()
        with pytest.raises(ckptfs.errors.BusyError, match="open or being written"):
            store.remove("m", 5, allow_latest=True)
        assert store.load("m")["run"] == 2 and store.latest("m").step == 5
    store.remove("m", 5, allow_latest=True)
    assert [v.step for v in store.versions("m", hidden=True)] == [1, 4, 4] and store.latest("m").step == 4


def test_the_latest_removed_on_request_rolls_the_model_back(store, capsys):
    """A job that wants to resume from an earlier step and drop the later ones (a loss spike):
    the latest is removed only on request, and latest moves back to the newest version left;
    the later saves go on from there. A crash between the pointer's move and the removal of the
    version leaves that version latest, complete, never a pointer to an invalid slot."""
    from test_cli import run

    with store.writer("m", slots=8) as w:
        for step in range(1, 6):
            w.save(state(step), step).result()
    with pytest.raises(ckptfs.errors.BusyError, match=r"allow_latest=True"):
        store.remove("m", 5)
    code, _, err = run(capsys, "rm", "--region", store.path, "m", "5")
    assert code != 0 and "--allow-latest" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "rm", "--region", store.path, "m", "4", "5")
    assert code != 0 and "--allow-latest" in err
    assert [v.step for v in store.versions("m")] == [1, 2, 3, 4, 5]  # refused before anything was removed
    code, out, _ = run(capsys, "rm", "--region", store.path, "--allow-latest", "m", "4", "5")
    # the latest last: it moves back once, to the newest version left
    assert code == 0 and out.splitlines() == ["removed m step 4", "removed m step 5", "latest of m: step 3"]
    assert [(v.step, v.latest) for v in store.versions("m", hidden=True)] == [(1, False), (2, False), (3, True)]
    # a save of the model still running that has claimed the slot of the version that would become
    # latest: refused, nothing changed (the pointer would name a slot being rewritten)
    from ckptfs.region.locks import LockSpace, slot_lock_offset

    entry, two = store.region.get("m"), next(v for v in store.versions("m") if v.step == 2)
    claims = LockSpace(store.path)
    assert claims.try_exclusive(slot_lock_offset(entry.index, two.slot))
    try:
        with pytest.raises(ckptfs.errors.BusyError, match="stop the job's writers"):
            store.remove("m", 3, allow_latest=True)
    finally:
        claims.close()
    assert store.latest("m").step == 3 and store.load("m", 3)["step"] == 3
    with store.writer("m") as w:
        w.save({**state(4), "run": 2}, 4).result()
    assert store.latest("m").step == 4 and store.load("m")["run"] == 2
    assert store.verify("m") == []

    # a crash once the pointer moved back, before the version's header went: it is latest again
    region = store.region
    entry = region.get("m")
    latest = region.latest(entry)
    real_write = region.backend.write

    def crash_at_the_header(offset, buf):
        if offset == entry.slot_offset(latest.slot):
            raise OSError(5, "the machine stopped here")
        return real_write(offset, buf)
    region.backend.write = crash_at_the_header
    try:
        with pytest.raises(OSError, match="stopped here"):
            store.remove("m", 4, allow_latest=True)
    finally:
        region.backend.write = real_write
    step3 = next(v for v in store.versions("m") if v.step == 3)
    assert unpack_latest(region.latest_word(entry)) == (step3.counter, step3.slot)  # the pointer moved back ...
    with ckptfs.Store(store.path) as again:  # ... and the complete step 4 still counts as latest
        assert again.latest("m").step == 4 and again.load("m")["run"] == 2
        with again.writer("m") as w:  # which the next writer publishes
            w.save(state(5), 5).result()
        assert [v.step for v in again.versions("m")] == [1, 2, 3, 4, 5]


def test_keep_and_unkeep_on_the_command_line(store, capsys):
    from test_cli import run

    with store.writer("m", slots=3) as w:
        for step in range(1, 4):
            w.save(state(step), step).result()
    code, out, _ = run(capsys, "keep", "--region", store.path, "m", "step-00000002")
    assert code == 0 and out.strip() == "kept m step 2"
    code, out, _ = run(capsys, "ls", "--region", store.path, "m")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[:2] for r in rows[1:]] == [["2", "kept"], ["3", "latest"]] and rows[0][0] == "1" and rows[0][1] != "kept"
    code, out, _ = run(capsys, "status", "--region", store.path)
    assert code == 0 and "KEPT" in out and "no versions pinned by readers" in out
    code, out, _ = run(capsys, "unkeep", "--region", store.path, "m", "2")
    assert code == 0 and not store.versions("m")[1].kept
    code, _, err = run(capsys, "keep", "--region", store.path, "m", "7")
    assert code != 0 and "step 7" in err and len(err.strip().splitlines()) == 1
    # several steps, one mistyped: nothing changes (the others were kept, unkept or removed
    # before the error, a milestone among them)
    code, out, err = run(capsys, "keep", "--region", store.path, "m", "1", "7")
    assert code == 1 and out == "" and "no step 7" in err and not store.versions("m")[0].kept
    store.keep("m", 1)
    for command in (["unkeep"], ["rm"]):
        code, out, err = run(capsys, *command, "--region", store.path, "m", "1", "98")
        assert code == 1 and out == "" and "no step 98" in err, (command, out, err)
        assert [(v.step, v.kept) for v in store.versions("m")][0] == (1, True)


def test_a_region_too_full_for_a_kept_versions_replacement_keeps_saving(store):
    with store.writer("m", slots=3) as w:
        for step in (1, 2, 3):
            w.save(state(step), step).result()
        fill_region(store)
        store.keep("m", 2)
        for step in (4, 5, 6):  # no room for a slot in the kept one's place: the ring makes do
            assert w.save(state(step), step).result().published
    assert [v.step for v in store.versions("m")] == [2, 5, 6]


def test_one_model_extends_its_extent_in_place(store):
    with store.writer("m", slots=2, max_inflight=1) as w:
        w.save(state(1), 1).result()
        for n in range(6):
            w.save(state(2 + n), 2 + n, keep=True).result()
    entry = store.region.get("m")
    assert len(entry.extents) == 1 and entry.nslots == 7  # grown where it lies: no entry runs out of extents


def test_milestones_kept_in_outgrown_slots_hold_only_their_own(store):
    """keep_every's milestones scattered over a model's first slots, then the model grows (an
    EMA copy added, the optimizer's state appears): every old slot but the milestones' goes
    back, the extent split around them."""
    with store.writer("m", slots=4, max_inflight=1, keep_every=3) as w:
        for step in range(1, 12):
            w.save(state(step), step).result()
        small = store.region.get("m").slot_bytes
        for step in range(12, 16):
            w.save(state(step, n=20000), step).result()
    entry = store.region.get("m")
    old = [s for s in entry.slots() if entry.slot_size(s) == small]
    assert sorted(v.slot for v in store.region.committed(entry) if v.header.step < 12) == old
    assert len(old) == 3 and len(entry.extents) >= 3  # steps 3, 6 and 9; the middle slots went back
    assert [v.step for v in store.versions("m")] == [3, 6, 9, 12, 13, 14, 15]
    for v in store.versions("m"):
        assert store.load("m", v.step)["step"] == v.step
    assert store.verify() == []


def test_an_unkeep_or_removal_by_another_reaches_a_writer_that_stays_open(store):
    """A milestone kept, then unkept (or removed) by another process (`ckptfs unkeep`, `rm`)
    while the writer saves on: its slot goes back to the ring and the spare one to the region.
    The writer's ring counted it kept from its own view for as long as it stayed open: the
    unkept version was listed for good and the ring held 5 slots for 3."""
    other = ckptfs.Store(store.path)  # the other process's own view of the region
    with store.writer("m", slots=3, max_inflight=1) as w:
        for step in range(1, 4):
            w.save(state(step), step).result()
        other.keep("m", 2)
        other.keep("m", 3)
        for step in range(4, 10):
            w.save(state(step), step).result()
        assert store.region.get("m").nslots == 5  # the ring's 3 and the 2 milestones
        other.unkeep("m", 2)
        other.remove("m", 3)
        for step in range(10, 10 + 2 * GIVE_BACK_AFTER_COMMITS + 2):
            w.save(state(step), step).result()
        assert [v.step for v in store.versions("m")] == list(range(step - 2, step + 1))
        assert store.region.get("m").nslots == 3
    other.close()
    assert store.verify() == []


def test_splitting_extents_leaves_an_entry_room_to_grow(store):
    """Milestones in every other slot of a large extent, then the model grows: the extent is
    split only as far as the entry keeps two extents free, and the model outgrows its slots
    once more afterwards."""
    from ckptfs.region.format import MAX_EXTENTS
    with store.writer("m", slots=40, max_inflight=1) as w:
        for step in range(1, 41):
            w.save(state(step), step, keep=step % 2 == 0).result()
        for step in range(41, 82):
            w.save(state(step, n=3000), step).result()
        entry = store.region.get("m")
        assert len(entry.extents) == MAX_EXTENTS - 2
        assert entry.nslots < 40 + 40 - 5  # most of the 20 unkept old slots went back
        for step in range(82, 86):
            assert w.save(state(step, n=6000), step).result().published  # outgrown once more: an extent was free
    assert [v.step for v in store.versions("m") if v.kept] == list(range(2, 41, 2))
    assert store.verify() == []


def test_a_model_and_its_ema_keeping_milestones_take_slots_not_extents(store):
    """Two models saving in turn, each keeping a milestone every few steps: each milestone takes
    a slot out of its ring, which takes one more in its place. First fit put each model's new
    slot right after the other's, a new extent per milestone, and after 16 the saves failed in
    a region 94 % free. A new slot is now placed where the next can extend it."""
    sd = {"w": torch.randn(64, 64)}
    with store.writer("model", keep_every=3, timeout_s=5) as a, store.writer("model-ema", keep_every=3,
                                                                               timeout_s=5) as b:
        for step in range(100):
            a.save(sd, step).result()
            b.save(sd, step).result()
    for name in ("model", "model-ema"):
        assert len(store.region.get(name).extents) <= 3
        assert [v.step for v in store.versions(name) if v.kept] == list(range(0, 100, 3))
        assert [v.step for v in store.versions(name) if not v.kept][-2:] == [97, 98] and store.latest(name).step == 99
    assert store.verify() == []


def test_a_kept_first_save_in_smaller_slots_costs_the_later_commits_nothing(store, monkeypatch):
    """Step 0 saved before the optimizer had state, kept by keep_every, in slots smaller than
    the model's since: each later commit took the table lock and read every slot header (209 a
    save with 200 milestones) to give back small slots that held only kept versions."""
    with store.writer("m", keep_every=1000) as w:
        w.save(state(0, n=10), 0).result()
        for step in range(1, 60):
            w.save(state(step, n=20000), step, keep=True).result()
        reads = []
        read_header = store.region.read_header
        monkeypatch.setattr(store.region, "read_header", lambda *a, **k: reads.append(a) or read_header(*a, **k))
        for step in range(60, 80):
            w.save(state(step, n=20000), step).result()
    assert len(reads) / 20 < 25, len(reads) / 20  # 71 before (every header at each commit); 5 + one look per 8
    assert [v.step for v in store.versions("m") if v.kept] == list(range(60))


def test_a_kept_first_save_unkept_by_another_process_goes_back(store):
    """The smaller slots are looked at again from the headers now and then: an unkeep by another
    process does not reach the writer's own view of its slots, and the slot stayed for good."""
    with store.writer("m", keep_every=1000) as w:
        w.save(state(0, n=10), 0).result()
        small = store.region.get("m").slot_bytes
        for step in range(1, 6):
            w.save(state(step, n=20000), step).result()
        assert any(x.slot_bytes == small for x in store.region.get("m").extents)
        other = ckptfs.Store(store.path)
        other.unkeep("m", 0)
        other.close()
        for step in range(6, 6 + 2 * GIVE_BACK_AFTER_COMMITS):
            w.save(state(step, n=20000), step).result()
        entry = store.region.get("m")
        assert all(x.slot_bytes > small for x in entry.extents), entry.extents
    assert 0 not in [v.step for v in store.versions("m")]


def test_status_free_bytes_is_what_slots_can_take(store):
    with store.writer("m") as w:
        w.save(state(1), 1).result()
    free = store.status()["free_bytes"]
    block = store.region.superblock.block_bytes
    with store.region.meta_locked():
        store.region.find_gap(free)  # one free run after the only ring: all of it can be had
        with pytest.raises(ckptfs.errors.RegionFullError):
            store.region.find_gap(free + block)


def test_an_open_of_a_model_with_many_kept_versions_reads_each_header_once(store, monkeypatch):
    """Each open of a version (each file opened in the mount) read every slot header two or
    three times: 14 ms an open at 600 kept versions, 115 ms at 2000."""
    with store.writer("m", keep_every=1) as w:
        for step in range(60):
            w.save(state(step, n=10), step).result()
    nslots = store.region.get("m").nslots
    reads = []
    read_bytes = store.region.backend.read_bytes
    monkeypatch.setattr(store.region.backend, "read_bytes", lambda *a: reads.append(a) or read_bytes(*a))
    for how in (lambda: store.open_version("m", 7).close(), lambda: store.versions("m")):
        reads.clear()
        how()
        assert nslots <= len(reads) <= nslots + 4, (len(reads), nslots)


def test_one_slot_more_does_not_halve_the_free_space_of_a_later_model(tmp_path):
    """A model that keeps two versions took its one slot more in the middle of the region's free
    space, and a model made next found no room for its ring (first fit, as before, until a model
    could not grow in place twice)."""
    with ckptfs.Store.create(str(tmp_path / "r"), size_bytes=64 << 20) as s:
        for name in ("a", "b"):
            with s.writer(name) as w:
                w.save({"x": torch.zeros(512 * 1024)}, step=1).result()
        with s.writer("a") as w:
            for step in (2, 3):
                w.save({"x": torch.zeros(512 * 1024)}, step=step, keep=True).result()
        with s.writer("c") as w:
            w.save({"x": torch.zeros(8 * 256 * 1024)}, step=1).result()
        assert s.region.get("c").nslots == 4


def test_extents_that_continue_one_another_are_one():
    from ckptfs.region.format import Extent, ModelEntry

    entry = ModelEntry.new(0, "m", 2, 4096, 1 << 20, 0)
    joined = entry.with_extents([Extent((1 << 20) + 2 * 4096, 4096, 3, 2), Extent(1 << 20, 4096, 2, 0),
                                 Extent(9 << 20, 4096, 1, 5), Extent(10 << 20, 8192, 1, 6)])
    assert joined.extents == (Extent(1 << 20, 4096, 5, 0), Extent(9 << 20, 4096, 1, 5), Extent(10 << 20, 8192, 1, 6))
    assert joined.generation == 2 and [joined.slot_offset(s) for s in (0, 4, 5)] == [1 << 20, (1 << 20) + 4 * 4096,
                                                                                       9 << 20]


def _format1_region(tmp_path) -> str:
    """The format-1 region of tests/data (made by ckptfs 3cc2de9: models gpt at 20, 30, 40, tiny at 7)."""
    path = str(tmp_path / "old.region")
    with gzip.open(os.path.join(os.path.dirname(__file__), "data", "format1.region.gz")) as f, open(path, "wb") as out:
        shutil.copyfileobj(f, out)
    return path


def _format1_state(step: int):
    g = torch.Generator().manual_seed(1)
    for s in (10, 20, 30, 40):
        obj = {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.arange(s, s + 8)}, "step": s,
               "lr": 0.5, "names": ["a", ("b", None)]}
        if s == step:
            return obj


def test_an_older_region_is_refused_with_the_way_out_then_upgraded(tmp_path):
    path = _format1_region(tmp_path)
    before = zlib.crc32(open(path, "rb").read())
    with pytest.raises(OldFormatError, match=r"format 1\.0.*ckptfs\.upgrade\("):
        ckptfs.Store(path)
    assert zlib.crc32(open(path, "rb").read()) == before  # never rewritten silently
    assert ckptfs.upgrade(path) == [("gpt", 3), ("tiny", 1)]
    assert zlib.crc32(open(path + ".format1", "rb").read()) == before
    with ckptfs.Store(path) as s:
        assert [(v.step, v.latest) for v in s.versions("gpt")] == [(20, False), (30, False), (40, True)]
        for step in (20, 30, 40):
            assert same(_format1_state(step), s.load("gpt", step)) is None
        assert torch.equal(s.load("tiny")["t"], torch.ones(3, dtype=torch.bfloat16))
        with s.open_version("gpt", 30) as v:
            assert dict(v.manifest.files) == {"config.json": '{"x": 30}'}
        assert s.verify() == []
        with s.writer("gpt") as w:  # and it takes new saves
            w.save(_format1_state(40), step=50).result()
        assert s.latest("gpt").step == 50


def test_upgrade_on_the_command_line(tmp_path):
    path = _format1_region(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    ls = subprocess.run([sys.executable, "-m", "ckptfs.cli", "ls", "--region", path], capture_output=True, text=True,
                        env=env)
    assert ls.returncode != 0 and f"`ckptfs upgrade --region {path}`" in ls.stderr and len(ls.stderr.splitlines()) == 1
    up = subprocess.run([sys.executable, "-m", "ckptfs.cli", "upgrade", "--region", path], capture_output=True,
                        text=True, env=env)
    assert up.returncode == 0, up.stderr
    assert "upgraded gpt: 3 version(s)" in up.stdout
    ls = subprocess.run([sys.executable, "-m", "ckptfs.cli", "ls", "--region", path], capture_output=True, text=True,
                        env=env)
    assert ls.returncode == 0 and [line.split()[:3] for line in ls.stdout.splitlines()[1:]] == [
        ["gpt", "3", "40"], ["tiny", "1", "7"]]


def test_a_region_too_small_for_the_whole_ring_starts_with_fewer_slots(tmp_path, caplog):
    """A first save of 15 MiB into a 64 MiB region: 4 slots of 16.5 MiB do not fit; the model
    starts with 3 (N+1 for N=2 in flight) and says so, instead of refusing the save."""
    with ckptfs.Store.create(str(tmp_path / "small.region"), size_bytes=64 << 20) as store:
        with caplog.at_level("WARNING", logger="ckptfs"):
            with store.writer("m") as w:
                for step in range(5):
                    assert w.save(state(step, n=15 << 18), step).result().published
        assert "room for 3 slots" in caplog.text
        entry = store.region.get("m")
        assert entry.nslots == 3 and entry.ring_slots == 4
        assert [v.step for v in store.versions("m")] == [2, 3, 4] and store.verify() == []


def test_a_job_resumed_with_more_saves_in_flight_gets_the_ring_they_need(store):
    """A model made by a writer of max_inflight=1 (a ring of 3) and resumed at max_inflight=4
    keeps 6 versions, as a new model at 4 does (it kept 3: fewer saves in flight and fewer
    versions than asked); one resumed at fewer in flight keeps the ring it had."""
    with store.writer("m", max_inflight=1) as w:
        w.save({"w": torch.ones(1000)}, step=1).result()
    assert store.region.get("m").ring_slots == 3
    with store.writer("m", max_inflight=4) as w:
        for step in range(2, 12):
            w.save({"w": torch.full((1000,), float(step))}, step=step)
        w.wait()
    assert store.region.get("m").ring_slots == 6 and [v.step for v in store.versions("m")] == list(range(6, 12))
    with store.writer("m", max_inflight=1) as w:
        w.save({"w": torch.ones(1000)}, step=12).result()
    assert store.region.get("m").ring_slots == 6


def test_a_writer_refused_more_slots_leaves_the_model_as_it_was(tmp_path):
    """`store.writer(model, slots=40)` in a region without room for them was refused, yet the
    model kept 40 as its ring: its saves then took slot after slot until the region was full,
    and another model's first save failed."""
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with store.writer("a") as w:
            w.save({"x": torch.zeros(1 << 20)}, 0).result()
        before = store.region.get("a")
        with pytest.raises(ckptfs.errors.RegionFullError):
            store.writer("a", slots=40)
        after = store.region.get("a")
        assert (after.ring_slots, after.nslots) == (before.ring_slots, before.nslots) == (4, 4)
        with store.writer("a") as w:
            for step in range(1, 20):
                w.save({"x": torch.zeros(1 << 20)}, step).result()
        assert store.region.get("a").nslots == 4
        with store.writer("b") as w:
            w.save({"x": torch.zeros(1 << 20)}, 0).result()


def test_a_writer_reopened_with_fewer_slots_keeps_the_older_versions_until_saves_replace_them(store):
    """`store.writer(model, slots=2)` on a model of 8 versions dropped 5 of them at its opening,
    before it saved anything, without a word: a restarted job lost its rollback points. They go
    now as the saves that follow replace them."""
    with store.writer("m", max_inflight=1, slots=8) as w:
        for step in range(10):
            w.save({"x": torch.full((1000,), float(step))}, step, keep=step == 3).result()
    before = [v.step for v in store.versions("m")]
    assert before == list(range(1, 10))  # a ring of 8, and the milestone
    store.writer("m", max_inflight=1, slots=2).close()
    assert [v.step for v in store.versions("m")] == before
    with store.writer("m", max_inflight=1, slots=2) as w:
        for step in range(10, 30):
            w.save({"x": torch.full((1000,), float(step))}, step).result()
    assert [v.step for v in store.versions("m")] == [3, 28, 29]  # the milestone, and the ring of 2


def test_slots_spare_from_before_a_restart_go_back_though_no_job_saves_8_times(store):
    """A model saved with slots=10, then jobs of 5 saves each with slots=3 (preempted before
    their 8th save): the spare slots were counted from 0 in every process and never went back.
    They go once each job's ring holds its own versions."""
    with store.writer("m", max_inflight=1, slots=10) as w:
        for step in range(10):
            w.save({"x": torch.full((1000,), float(step))}, step).result()
    assert store.region.get("m").nslots == 10
    step = 10
    for _ in range(2):
        with store.writer("m", max_inflight=1, slots=3) as w:
            for _ in range(5):
                w.save({"x": torch.full((1000,), float(step))}, step).result()
                step += 1
    assert [v.step for v in store.versions("m")] == [step - 3, step - 2, step - 1]
    assert store.region.get("m").nslots == 3
    assert torch.equal(store.load("m")["x"], torch.full((1000,), float(step - 1)))



def test_a_first_save_that_fails_gives_its_new_model_back_and_a_refusal_is_said_once(tmp_path, caplog):
    """A new model's first save that fails after its ring was made (staging memory refused)
    removes the model again at close: its ring held the region's space for good, and the next
    model found it full. A save outgrowing its slots in a full region is raised to save()'s
    caller once: it was logged as well ("save of m step 2 failed: ..." twice on the command
    line); a background snapshot's, which no caller hears of at once, is still logged."""
    from ckptfs.testing.anomaly import failing_staging

    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        free_bytes = store.status()["free_bytes"]
        with pytest.raises(ckptfs.errors.StagingMemoryError):
            with failing_staging(1), store.writer("n") as w:
                w.save({"w": torch.ones(1 << 20)}, 1)
        assert store.models() == [] and store.status()["free_bytes"] == free_bytes
        with store.writer("m") as w:
            w.save({"w": torch.ones(1 << 20)}, 1).result()
        with store.writer("big") as w:
            w.save({"w": torch.ones(2 << 20)}, 1).result()
        for background in (False, True):
            caplog.clear()
            with store.writer("m") as w:
                with pytest.raises(ckptfs.errors.CheckpointTooLargeError, match="needs slots of 32.0 MiB"):
                    w.save({"w": torch.ones(8 << 20)}, 2, async_snapshot=background).result()
            assert caplog.text.count("save of m step 2 failed") == background, caplog.text
        assert [v.step for v in store.versions("m")] == [1]


def test_versions_removed_after_the_run_give_their_space_back(tmp_path, capsys):
    """A finished run's milestones filled the region; `ckptfs rm` of them printed "removed" and
    freed nothing (slots went back only at a commit of their own model), so the advice of the
    next model's RegionFullError, to remove versions, did not help. The emptied slots go back
    at once where no writer of the model is open; an open writer's commits give them back."""
    from ckptfs.errors import RegionFullError
    from test_cli import run

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 64 << 20)
    with store.writer("a", max_inflight=1, keep_every=1) as w:
        step = 0
        while True:
            try:
                w.save({"w": torch.full((3 << 18,), float(step))}, step).result()  # 3 MiB
            except RegionFullError:
                break
            step += 1
    kept = [v.step for v in store.versions("a")]
    assert len(kept) >= 12
    big = {"w": torch.zeros(5 << 18)}  # 5 MiB: a ring of 4 such slots no longer fits
    with pytest.raises(RegionFullError):
        with store.writer("b", max_inflight=1) as w:
            w.save(big, 1).result()
    code, out, err = run(capsys, "rm", "--region", store.path, "a", *map(str, kept[:-2]))
    assert code == 0, err
    assert [v.step for v in store.versions("a")] == kept[-2:]
    with store.writer("b", max_inflight=1) as w:
        w.save(big, 1).result()
    assert torch.equal(store.load("a")["w"], torch.full((3 << 18,), float(kept[-1])))
    assert torch.equal(store.load("a", kept[-2])["w"], torch.full((3 << 18,), float(kept[-2])))
    # an open writer's slots stay its own until its commits give them back
    with store.writer("a", max_inflight=1) as w:
        before = store.region.get("a").nslots
        store.remove("a", kept[-2])
        assert store.region.get("a").nslots == before
    store.close()


def test_an_outgrown_model_refused_for_want_of_room_says_what_one_slot_needs(store):
    """A checkpoint that outgrew its slots in a region with room for none of the larger ones:
    the refusal said the room for a whole ring of them (3x what one slot needs), the first of
    the tries (3, 2, 1 slots) rather than the least."""
    from ckptfs.errors import CheckpointTooLargeError

    with store.writer("m", slots=3, max_inflight=1) as w:
        w.save(state(1, n=1000), 1).result()
        fill_region(store, leave_bytes=1 << 20)
        with pytest.raises(CheckpointTooLargeError) as e:
            w.save(state(2, n=1 << 20), 2).result()  # 4 MiB, in slots of 5 MiB
    assert "no contiguous 5.0 MiB free for more slots of 'm' (1.0 MiB free in all)" in str(e.value)


def test_a_new_model_takes_its_ring_from_holes_none_of_which_holds_it_whole(tmp_path):
    """Models removed left the free space in holes of ~1.5 slots each: a new model was refused
    ("no contiguous ... free", with several times that free in all) although each hole held a
    slot. Its ring is spread over the holes, each an extent of the entry."""
    from ckptfs.errors import RegionFullError

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 96 << 20)
    names = []
    while True:  # models of one 6 MiB slot each, side by side, until the region is full
        try:
            store.region.create_model(f"m{len(names)}", 1, 6 << 20)
        except RegionFullError:
            break
        names.append(f"m{len(names)}")
    for name in names[::2]:
        store.remove_model(name)
    free = store.space()["free_bytes"]
    assert free >= 4 * (5 << 20)  # room for a ring of 4 in all, in holes of one slot
    state = {"w": torch.arange(float(1 << 20))}
    with store.writer("new", max_inflight=2) as w:  # a ring of 4
        for step in range(6):
            w.save({"w": state["w"] + step}, step).result()
    entry = store.region.get("new")
    assert entry.nslots == 4 and len(entry.extents) > 1  # no free run held 4
    assert torch.equal(store.load("new")["w"], state["w"] + 5)
    assert [v.step for v in store.versions("new")] == [2, 3, 4, 5]
    assert store.verify() == []
    store.close()


def test_a_model_reopened_with_more_slots_takes_them_from_holes(tmp_path):
    """`store.writer(model, slots=8)` where the free space is in holes of one slot each was
    refused (all the slots wanted in one run); they are spread over the holes. Where the holes
    cannot hold them all, the model stays as it was."""
    from ckptfs.errors import RegionFullError

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 96 << 20)
    with store.writer("a", max_inflight=1) as w:
        w.save({"x": torch.zeros(1 << 18)}, 0).result()  # 1 MiB: slots of 1.3 MiB
    size = store.region.get("a").slot_bytes
    names = []
    while True:  # the rest in models of 1.5 slots each, side by side
        try:
            store.region.create_model(f"f{len(names)}", 1, size * 3 // 2)
        except RegionFullError:
            break
        names.append(f"f{len(names)}")
    for name in names[1::2][:6]:
        store.remove_model(name)  # 6 holes of one slot each
    with pytest.raises(RegionFullError):
        store.writer("a", max_inflight=1, slots=12)
    assert store.region.get("a").nslots == 3
    with store.writer("a", max_inflight=1, slots=8) as w:
        for step in range(1, 10):
            w.save({"x": torch.full((1 << 18,), float(step))}, step).result()
    assert store.region.get("a").nslots == 8 and [v.step for v in store.versions("a")] == list(range(2, 10))
    assert store.verify() == []
    store.close()


def test_a_failed_first_look_for_hidden_milestones_is_not_repeated_at_every_commit(caplog):
    """The first look failing (an I/O error reading the headers) left the highest step unknown:
    every later commit swept every header again and logged again."""
    from ckptfs.writer.hidden import HiddenKept
    from ckptfs.writer.job import SaveResult

    looks = []

    class Ring:
        def give_back_hidden(self, step, counter, every_step=False):
            looks.append(step)
            raise OSError(5, "Input/output error")

    hidden = HiddenKept("m", enabled=True)
    for step in range(1, 6):
        hidden.after_commit(Ring(), SaveResult("m", step, step, 0, 0, True, 0.0, 0.0), False)
    assert looks == [1]


def test_rm_of_several_steps_refused_at_one_gives_back_what_it_removed(tmp_path, capsys):
    """`ckptfs rm m 1 2 3` with step 3 held by a reader: 1 and 2 went, and their slots stayed
    the model's (only the last removal gave back)."""
    from test_cli import run

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 64 << 20)
    with store.writer("m", max_inflight=1, keep_every=1) as w:
        for step in range(1, 6):
            w.save({"w": torch.full((1 << 18,), float(step))}, step).result()
    free = store.space()["free_bytes"]
    with store.open_version("m", 3):
        code, out, err = run(capsys, "rm", "--region", store.path, "m", "1", "2", "3")
    assert code != 0 and "removed m step 2" in out
    assert [v.step for v in store.versions("m")] == [3, 4, 5]
    assert store.space()["free_bytes"] > free
    store.close()


def test_slots_spread_over_holes_leave_the_entry_extents_to_grow_with(tmp_path):
    """Slots spread over one-slot holes filled all 16 extents of the entry: a later outgrown
    save was refused for good. A spread that would leave fewer than 2 free is refused (the
    model as it was); a new model's spread takes the largest runs first."""
    from ckptfs.errors import RegionFullError

    store = ckptfs.Store.create(str(tmp_path / "r.region"), 128 << 20)
    with store.writer("a", max_inflight=1) as w:
        w.save({"x": torch.zeros(1 << 16)}, 0).result()  # 256 KiB
    size = store.region.get("a").slot_bytes
    names = []
    while len(names) < 60:
        store.region.create_model(f"f{len(names)}", 1, size)
        names.append(f"f{len(names)}")
    for name in names[1:41:2]:
        store.remove_model(name)  # 20 one-slot holes, then the rest of the region in one run
    a, b = max(store.region.free_runs(store.region.entries()), key=lambda run: run[1] - run[0])
    store.region.create_model("tail", 1, b - a - 8 * size)  # leaves a run of 8 slots
    new = store.region.create_model("new", 10, size, min_slots=2)
    assert new.nslots == 10 and len(new.extents) == 3  # the run of 8, then 2 holes
    store.remove_model("new")
    with pytest.raises(RegionFullError):
        store.writer("a", max_inflight=1, slots=3 + 8 + 14)  # would fill every extent
    assert store.region.get("a").nslots == 3
    with store.writer("a", max_inflight=1, slots=3 + 8 + 3) as w:  # the run of 8 first, then 3 holes
        w.save({"x": torch.ones(1 << 16)}, 1).result()
    assert len(store.region.get("a").extents) == 1 + 4
    store.close()
