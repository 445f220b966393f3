"""The slot lifecycle as one API (ckptfs.region.ring): claim, begin, write, commit, publish,
abort, roll-forward on open, and the subscribers of commits."""
import logging
import pathlib

import pytest
import torch

import ckptfs
from conftest import fill_region
from ckptfs.errors import CkptfsError
from ckptfs.region.format import unpack_latest
from ckptfs.region.claim import Claim, Committed


def state(step, n=1024):
    return {"w": torch.full((n,), float(step)), "step": step}


@pytest.fixture
def store(tmp_path):
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        yield s


def test_subscribers_hear_every_commit_and_cannot_fail_it(store, caplog):
    heard = []
    unsubscribe = store.region.commits.subscribe(heard.append)

    def broken(event):
        raise RuntimeError("subscriber bug")

    store.region.commits.subscribe(broken)
    with caplog.at_level(logging.ERROR, logger="ckptfs"), store.writer("m", max_inflight=2, slots=4) as w:
        results = [w.save(state(s), step=s).result() for s in (1, 2)]
    assert [r.published for r in results] == [True, True]
    assert heard == [Committed("m", r.step, r.counter, r.slot, r.nbytes, True) for r in results]
    assert "subscriber bug" in caplog.text
    unsubscribe()
    with store.writer("m") as w:
        w.save(state(3), step=3).result()
    assert len(heard) == 2
    assert store.load("m")["step"] == 3


def save_two_leaving_the_second_unpublished(store, monkeypatch) -> None:
    """Steps 1 and 2 of model "m", step 2 committed without its compare-and-swap (as a crash
    between the two leaves it)."""
    with store.writer("m") as w:
        w.save(state(1), step=1).result()
    original = Claim.commit
    monkeypatch.setattr(Claim, "commit", lambda self, index, nbytes, publish=True, keep=False:
                        original(self, index, nbytes, publish=False, keep=keep))
    with store.writer("m") as w:
        assert w.save(state(2), step=2).result().published is False
    monkeypatch.undo()


def test_a_commit_left_unpublished_is_rolled_forward_when_a_ring_opens(store, monkeypatch):
    """A crash between a commit's header and its compare-and-swap: the version is complete and
    durable but the pointer names the one before; the next writer publishes it."""
    save_two_leaving_the_second_unpublished(store, monkeypatch)

    entry = store.region.get("m")
    pointed = unpack_latest(store.region.latest_word(entry))[0]
    assert [v.step for v in store.versions("m")] == [1, 2] and pointed == store.versions("m")[0].counter
    with store.writer("m"):
        pass  # opening the ring rolls forward: the pointer itself moves
    assert unpack_latest(store.region.latest_word(entry))[0] == store.versions("m")[1].counter
    assert store.latest("m").step == 2 and store.load("m")["step"] == 2


def test_a_reader_sees_the_newest_complete_version_as_latest_without_writing(store, monkeypatch):
    """Issue 13 §2: after a crash between header and CAS, a reader (a load, `ckptfs ls`, the
    mount) sees the newest committed version as latest, never one listed beside a newer one, and
    reading writes nothing; the model's next writer publishes it."""
    save_two_leaving_the_second_unpublished(store, monkeypatch)
    entry = store.region.get("m")
    word = store.region.latest_word(entry)
    for reader in (ckptfs.Store(store.path), ckptfs.Store(store.path, writable=False)):
        with reader:
            listed = reader.versions("m")
            assert reader.latest("m") == max(listed, key=lambda v: v.counter) == listed[-1]
            assert reader.latest("m").step == 2 and reader.load("m")["step"] == 2
            assert [v.latest for v in listed] == [False, True]
    assert store.region.latest_word(entry) == word and unpack_latest(word)[0] == listed[0].counter
    assert sorted(listed, reverse=True) == listed[::-1]  # VersionInfo orders by (step, counter)
    with store.writer("m"):
        pass
    assert unpack_latest(store.region.latest_word(entry))[0] == listed[1].counter


def test_no_ring_opens_beside_a_writer_mid_commit(store, monkeypatch):
    """A ring opened while a writer's version has its header but not yet its CAS would find a
    version to roll forward that is that writer's: no second ring opens on a model while its
    writer is open (BusyError), and the writer then reports its version published."""
    import ckptfs.region.ring as ring_module
    from ckptfs.region.ring import Ring

    monkeypatch.setattr(ring_module, "MODEL_WAIT_S", 0.2)
    with store.writer("m") as w:
        w.save(state(1), step=1).result()
    refused = []
    original = Ring.publish

    def publish_after_another_ring_tried(self, counter, slot):
        entry = store.region.get("m")
        try:
            store.region.ring(entry, timeout_s=1).close()
        except ckptfs.errors.BusyError as e:
            refused.append(str(e))
        return original(self, counter, slot)

    monkeypatch.setattr(Ring, "publish", publish_after_another_ring_tried)
    with store.writer("m") as w:
        assert w.save(state(2), step=2).result().published is True
    assert len(refused) == 1 and "one writer per model" in refused[0]
    assert store.latest("m").step == 2


def test_abort_gives_the_slot_back(store):
    with store.writer("m", max_inflight=2, slots=4) as w:
        w.save(state(1), step=1).result()
    ring = store.region.ring(store.region.get("m"), timeout_s=0.2)
    try:
        layout = ring.layout(4096, 0)
        claims = [ring.claim(s, layout) for s in (2, 3, 4)]  # every slot but latest
        fill_region(store)  # and no room for more
        with pytest.raises(ckptfs.errors.BusyError):
            ring.claim(5, layout)
        claims[0].abort()
        claims[0].abort()  # idempotent
        with pytest.raises(CkptfsError, match="already committed or aborted"):
            claims[0].write(0, bytes(4096))
        again = ring.claim(5, layout)
        assert again.slot == claims[0].slot
        for c in (again, *claims[1:]):
            c.abort()
    finally:
        ring.close()
    assert store.load("m")["step"] == 1


def test_publish_keeps_the_newest(store):
    with store.writer("m", max_inflight=2, slots=4) as w:
        old = w.save(state(1), step=1).result()
        assert w.save(state(2), step=2).result().published
    ring = store.region.ring(store.region.get("m"), timeout_s=1)
    try:
        assert ring.publish(old.counter, old.slot) is False  # an older counter never wins
        assert store.latest("m").step == 2
    finally:
        ring.close()


def test_the_latest_a_publish_replaces_is_not_claimed_until_the_new_pointer_is_on_the_media(store, monkeypatch):
    """A publish swaps the pointer in memory, then flushes it. In between, the pointer on the
    media still names the latest it replaced: a save claiming that slot then (a reader held the
    older one) and a power loss left a pointer to a slot being overwritten (`verify`: "the latest
    pointer names slot 0 ... which does not hold it")."""
    from ckptfs.region.region import Region

    with store.writer("m", max_inflight=2, slots=3) as w:
        first = w.save(state(1), step=1).result()
        ring = w._ring
        seen = []
        real = Region.persist_words

        def look_then_persist(self, entry):
            on_media = unpack_latest(self.latest_word(entry))  # what the flush makes durable
            seen.append((on_media, ring._candidates(ring.entry, 1)))
            real(self, entry)
        monkeypatch.setattr(Region, "persist_words", look_then_persist)
        second = w.save(state(2), step=2).result()
        monkeypatch.setattr(Region, "persist_words", real)
        (on_media, candidates), = seen
        assert on_media[1] == second.slot and first.slot not in candidates and second.slot not in candidates
        assert first.slot in ring._candidates(ring.entry, 1)  # flushed: claimable again
        w.save(state(3), step=3).result()
    assert store.load("m")["w"].equal(state(3)["w"])


def test_the_writer_leaves_the_format_to_the_region():
    """Nothing under ckptfs/writer touches slot headers, barriers, claim lock bytes or the latest
    word: every commit goes through ckptfs.region.ring."""
    forbidden = ("SlotHeader", "SLOT_WRITING", "SLOT_COMMITTED", "slot_lock_offset", "LockSpace", ".barrier(",
                 "pack_latest", "unpack_latest", "cas_latest", "latest_word", "persist_words", "write_slot",
                 "next_counter", "data_base")
    writer_dir = pathlib.Path(ckptfs.__file__).parent / "writer"
    found = [(path.name, name) for path in sorted(writer_dir.glob("*.py"))
             for name in forbidden if name in path.read_text()]
    assert found == []
