"""The slot lifecycle of one model's ring: claim -> begin -> write -> commit -> publish, or abort.

This module, with ``ckptfs.region.claim`` (one slot's claim: steps 2-6 below), is the only code
that writes slot headers, takes claim locks, issues the barriers of a commit and moves the
latest pointer (forward in ``publish``; back only in ``move_latest_back``, the removal of the
latest version). The order it keeps (docs/FORMAT.md, PCcheck §3.1):

  1. ``Ring.claim``: a slot large enough that is neither latest, kept, pinned nor claimed (an
     exclusive lock byte, re-checked against latest and kept once held), the one holding the
     oldest version first, then a version counter larger than any handed out. Where there is no
     such slot, the model takes more from the region's free space (region/extents.py: a reader
     or a kept version never blocks a save, and a model outgrows its first save's slots); only
     when the region is full does a claim wait, up to ``timeout_s``, then BusyError;
  2. ``Claim.begin``: a slot that holds a committed version is first marked WRITING, durably, so
     that a crash while it is rewritten never leaves the old header in front of half-new data;
  3. ``Claim.write``: bytes at offsets of the data area (O_DIRECT, page-aligned buffers);
  4. ``Claim.commit(index)``: the index, one barrier (data and index durable), then the header
     that vouches for them (both copies) alone in its pages, and a second barrier;
  5. publish (part of ``commit`` unless ``publish=False``; else ``Ring.publish`` later): the
     compare-and-swap of the latest pointer, only while it names an older counter (PCcheck
     Listing 1), and the pointer made durable;
  6. the claim is released; ``Claim.abort`` releases it without committing (a WRITING slot
     holds no version); slots taken beyond what the model keeps go back (region/extents.py).
After a commit the region's subscribers hear of it (``Region.commits``), outside every lock.
``mark_kept`` sets or clears a committed version's kept flag, the one other header write.

A ring is opened by one writer; several rings (writers, processes) on one model exclude each
other through the lock bytes. Another kind of commit (a rank's part of a global version, a
batch of differential records, a version held until a tier has drained it) is a new caller of
``claim`` / ``commit`` / ``publish``, not a copy of this protocol. A SLOT_COMMITTED version newer
than latest counts as latest for readers and is published by the next ring that opens
(``SlotReader.newest_intact``): a commit that must not become latest on its own (a rank's part
of a global version) needs a header state of its own.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ckptfs.errors import BusyError, CheckpointTooLargeError, CkptfsError, NotFoundError, RegionFullError, in_words
from ckptfs.region.backend import aligned_buffer, io_step
from ckptfs.region.claim import Claim, SlotLayout
from ckptfs.region.extents import KEPT, Extents
from ckptfs.region.format import (HEADER_COPY_OFFSETS, PAGE_BYTES, SLOT_COMMITTED, SLOT_KEPT, ModelEntry, SlotHeader,
                                  pack_latest, unpack_latest)
from ckptfs.region.holders import holders_in_words
from ckptfs.region.locks import model_lock_offset, slot_lock_offset
from ckptfs.region.slots import SlotVersion, hidden_by
from ckptfs.units import human_bytes

log = logging.getLogger("ckptfs")

CLAIM_POLL_S = 0.005  # how often a claim waiting for a free slot looks again
GROW_RETRY_S = 1.0  # how long a claim that found the region full waits before it asks again
MODEL_WAIT_S = 5.0  # the longest a ring opening waits for a removal of its model that holds its lock byte
PARTS_STUCK_S = 10.0  # how long a ring of parts (not sole) waits with every slot latest or kept, the region full
OWN_WAIT_S = 0.2  # ... where only this process holds it (a writer of its own, or a removal on another thread)


class Ring:
    """The slot lifecycle of one model for one writer. Thread-safe; ``close`` when done."""

    def __init__(self, region, entry: ModelEntry, *, timeout_s: float, sole: bool = True):
        """``sole``: this ring is its model's only writer (``_hold_model``); False for the writers
        ckptfs keeps for multi-rank (DCP) saves, whose global commit orders their versions and
        which a DCP background process opens beside the training process's."""
        self.region = region
        self.entry = entry
        self.timeout_s = timeout_s
        self.sole = sole
        self._short_said = False  # the warning that kept versions leave fewer than ring_slots was given
        # Claims are held on a description of their own, so that they exclude this process's own
        # pins (OFD locks of one description never conflict in the kernel).
        # (a writer's, not a forked child's: its claims and the model stay with the parent's threads)
        with io_step("open for a writer", region.path):  # a filesystem gone read-only: EROFS, worded
            self._claims = region.pins.another(pins_in_child=False)
        # Open, the ring keeps the model from being removed (Region.remove_model: a training
        # job's writer between two saves holds no slot, and its next save found no model) and
        # from a second writer (see _hold_model).
        try:
            self._hold_model(entry)
            self._open(entry)
        except BaseException:
            self.close()
            raise

    def _hold_model(self, entry: ModelEntry) -> None:
        """Take the model's lock byte: exclusively for a sole writer (one writer per model, in
        this process or any: two writers of one model took counters each in its own order, and
        the latest went back a step; a resumed job and its zombie, two writers in one script),
        shared for the writers of multi-rank saves; either way no removal while it is open. A
        removal holds the byte for as long as it looks at the slots (ms, then the model is gone
        or the removal refused): wait that out, then NotFoundError if the model went; BusyError
        naming the process whose writer holds it."""
        offset = model_lock_offset(entry.index)
        take = self._claims.try_exclusive if self.sole else self._claims.try_shared
        deadline, looked, waited_from, elsewhere = time.monotonic() + MODEL_WAIT_S, False, None, False
        while not take(offset):
            if not looked:
                waited_from = self._latest_now(entry)  # what a job resumed from just now loaded, perhaps
                if holders_in_words(self.region.path, offset)[1]:  # once: a scan of every process
                    deadline = time.monotonic() + OWN_WAIT_S  # a writer of this process: no removal elsewhere to wait out
                else:
                    elsewhere = True
            looked = True
            if time.monotonic() > deadline:
                who, here_only = holders_in_words(self.region.path, offset)
                if here_only:
                    raise BusyError(f"model {entry.name!r} has a writer open in this process: one writer per model; "
                                    "close that one first (the Store it came from closes it too, even once it is out "
                                    "of reach), or save under another name")
                raise BusyError(f"model {entry.name!r} has a writer open in {who}: one writer per "
                                "model; close it (or stop that job) first, or save under another name")
            time.sleep(CLAIM_POLL_S)
        now = self.region.reload(entry)  # NotFoundError if it was removed meanwhile
        if elsewhere and self.sole:
            self._check_not_overtaken(now, waited_from)

    def _latest_now(self, entry: ModelEntry):
        """The model's latest through its entry as it is now (None: none, or the model is gone)."""
        try:
            return self.region.latest(self.region.reload(entry))
        except NotFoundError:
            return None

    def _check_not_overtaken(self, entry: ModelEntry, waited_from) -> None:
        """BusyError where the writer this one waited for (another process's, closing: a job's
        old process still saving while its restart resumed) committed a newer version meanwhile:
        the job loaded an older state, and its saves would hide those steps with older data."""
        now = self.region.latest(entry)
        if now is None or (waited_from is not None and now.header.counter <= waited_from.header.counter):
            return
        was = "none" if waited_from is None else f"step {waited_from.header.step}"
        raise BusyError(f"while this writer of {entry.name!r} waited for another writer of it to close (a job's old "
                        f"process, still saving), that one committed step {now.header.step} (latest was {was}): "
                        "what this job loaded may be older. Open the writer before loading (then the old process is "
                        "waited for first), and load again")

    def _open(self, entry: ModelEntry) -> None:
        self._ages_lock = threading.Lock()
        self._flushing: list[int] = []  # slots the pointer on the media may still name (see publish)
        self._ages: dict[int, int] | None = None
        self.extents = Extents(self)
        if self.region.entry_problems_of(entry):
            self.entry = self.region.repair_entry(entry.name)
        self._recover_counter()
        self._repair_headers()
        self._roll_forward()

    def close(self) -> None:
        """Let go of the model (it may be removed from now on) and of the claims' description."""
        self._claims.close()

    # ------------------------------------------------------------------ geometry
    def layout(self, index_bytes: int, data_bytes: int) -> SlotLayout:
        """The slot layout of a version. A version larger than the model's slots gets larger ones
        at its claim; CheckpointTooLargeError only if it cannot fit the region at all."""
        layout = SlotLayout.of(index_bytes, data_bytes)
        if layout.slot_bytes > self.region.data_area_bytes():
            raise CheckpointTooLargeError(
                f"this checkpoint of {self.entry.name!r} needs {human_bytes(layout.slot_bytes)} but the region "
                f"{self.region.path} holds {human_bytes(self.region.data_area_bytes())} in all; " + in_words(
                    python="create a larger region (Store.create(path, size_bytes=...))",
                    cli="create a larger region (`ckptfs mkfs --size`)"))
        return layout

    def refresh(self) -> ModelEntry:
        """The model's entry as the table holds it now (another writer may have added or given
        back slots); NotFoundError if the model was removed."""
        entry = self.region.reload(self.entry)
        if entry.generation != self.entry.generation:
            with self._ages_lock:
                self.entry, self._ages = entry, None
        return entry

    # ------------------------------------------------------------------ claim
    def claim(self, step: int, layout: SlotLayout) -> "Claim":
        """A claimed slot and a new counter for version ``step``; waits while every slot is busy
        and the region has no room for more (BusyError after ``timeout_s``)."""
        self.region.backend.check_present(for_write=True)
        entry, slot, header = self._claim_slot(layout.slot_bytes)
        try:
            counter = self.region.next_counter(entry)
        except BaseException:
            self._claims.release(slot_lock_offset(entry.index, slot))
            raise
        return Claim(self, entry, slot, counter, step, time.time_ns(), layout, header)

    def _claim_slot(self, need: int) -> tuple[ModelEntry, int, SlotHeader | None]:
        deadline = time.monotonic() + self.timeout_s
        full_until = 0.0
        stuck_since = None  # since when every slot has been latest or kept, the region full
        while True:
            entry = self.refresh()
            now = time.monotonic()
            # kept versions left the ring: it takes slots in their place to keep ring_slots versions
            short = self.usable_slots(entry, need) < entry.ring_slots
            if short and now >= full_until:
                # before growing, the headers as they are: another process may have unkept a
                # version since this ring read them (a multi-rank job's leader unkeeps every
                # rank's older parts), and a growth costs a reservation and barriers
                self._forget_ages()
                short = self.usable_slots(entry, need) < entry.ring_slots
            found = None if short and now >= full_until else self._try_claim(entry, need)
            if found is not None:
                return found
            fits = any(x.slot_bytes >= need for x in entry.extents)
            if now >= full_until:
                try:
                    self.extents.add(need, outgrown=not fits)
                    continue
                except RegionFullError as e:
                    full, full_until = e, now + GROW_RETRY_S
                    if not fits:
                        raise CheckpointTooLargeError(
                            f"this checkpoint of {entry.name!r} needs slots of {human_bytes(need)}, larger than its "
                            f"{human_bytes(entry.slot_bytes)}, and {e}") from None
                    self._forget_ages()
                    stuck_since = None if self._candidates(entry, need) else (stuck_since or now)
                    # every slot latest or kept: only an unkeep or a removal changes that, not waiting
                    # (each save waited timeout_s for nothing). A multi-rank job's parts are kept
                    # until its leader, maybe in another process, gives the older ones back after
                    # each global commit: a ring of parts waits a while for that first
                    if stuck_since is not None and (self.sole or now - stuck_since >= PARTS_STUCK_S):
                        raise self._stuck(entry, need, e) from None
                    if short:  # no room for the ring's share: make do with its other slots
                        if not self._short_said:
                            self._short_said = True
                            # (not "its kept versions took them": a model that outgrew its slots, or
                            # asked for more, has none kept)
                            log.warning("ckptfs: %r keeps fewer than its %d recent versions for now: %d of its slots "
                                        "can take this save (the others hold kept versions, or are smaller), and %s",
                                        entry.name, entry.ring_slots, self.usable_slots(entry, need), e)
                        continue
            if now > deadline:
                raise BusyError(f"every slot of {entry.name!r} is latest, kept, pinned by a reader or being written "
                                f"after waiting {self.timeout_s} s, and {full}; close readers (open files in the "
                                "mount, loads) or make room")
            self._forget_ages()  # another process may have moved things: look again
            time.sleep(CLAIM_POLL_S)

    def _try_claim(self, entry: ModelEntry, need: int) -> tuple[ModelEntry, int, SlotHeader | None] | None:
        """Lock the free slot of at least ``need`` bytes holding the oldest version, or None;
        with the entry as of the lock and the slot's header (no other process writes it while
        the claim is held)."""
        ages = self._slot_ages(entry)
        for slot in sorted(self._candidates(entry, need), key=ages.__getitem__):
            lock = slot_lock_offset(entry.index, slot)
            if not self._claims.try_exclusive(lock):
                continue
            try:
                header = self.region.read_header(entry, slot)
                now = self.region.reload(entry)
            except BaseException:  # an I/O error, the model removed: the lock is not kept for good
                self._claims.release(lock)
                raise
            if (slot in self._not_claimable()  # became latest between the look and the lock
                    or (header is not None and header.kept)  # kept by another process meanwhile
                    or not now.same_slot(entry, slot)):
                if header is not None and header.kept:
                    self._note_age(slot, KEPT)
                self._claims.release(lock)
                continue
            return now, slot, header
        return None

    def _stuck(self, entry: ModelEntry, need: int, full: RegionFullError) -> RegionFullError:
        """The error of a save no slot of ``entry`` can ever take (``_candidates`` none) in a
        region too ``full`` for another: its slots large enough hold its latest or kept versions;
        where none is kept, the checkpoint grew past its other slots, and no unkeep helps."""
        ages = self._slot_ages(entry)
        if not any(ages[s] == KEPT for s in entry.slots() if entry.slot_size(s) >= need):
            return RegionFullError(
                f"this checkpoint of {entry.name!r} ({human_bytes(need)} a slot) grew past its older slots, and its "
                f"one slot large enough holds its latest; {full}")
        return RegionFullError(
            f"every slot of {entry.name!r} holds its latest or a kept version, and {full}" + (
                "" if "unkeep" in str(full) else "; unkeep or remove a version of it") + ": " + in_words(
                python="Store.unkeep / Store.remove", cli="`ckptfs unkeep` / `ckptfs rm`"))

    def _candidates(self, entry: ModelEntry, need: int) -> list[int]:
        """The slots of ``entry`` a version of ``need`` bytes may take once free: large enough,
        neither latest nor kept (pinned or being written, or not)."""
        busy, ages = self._not_claimable(), self._slot_ages(entry)
        return [s for s in entry.slots() if entry.slot_size(s) >= need and s not in busy and ages[s] != KEPT]

    def give_back_hidden(self, step: int, counter: int, every_step: bool = False) -> tuple[list[SlotVersion], int]:
        """After the commit of version ``counter`` of ``step``: the kept versions of the same step
        with older counters, which it hides (a listing shows the newer of a step saved twice), are
        given back to the ring (``mark_kept``), as nothing could list, unkeep or load them any
        more; ``every_step``: those of every step a newer save hides. Returns them, and the
        highest step of the model's committed versions (from the same read of the headers)."""
        committed = self.region.committed(self.entry)
        if every_step:
            newest = {v.header.step: v.header.counter for v in committed}  # committed is in counter order
            hidden = [v for v in committed if v.header.kept and v.header.counter < newest[v.header.step]]
        else:
            hidden = [v for v in hidden_by(committed, step, counter) if v.header.kept]
        for v in hidden:
            if mark_kept(self.region, v, False):
                self._note_age(v.slot, v.header.counter)
        return hidden, max((v.header.step for v in committed), default=step)

    def usable_slots(self, entry: ModelEntry, need: int) -> int:
        """How many slots of ``entry`` could take a version of ``need`` bytes: large enough and
        not kept (busy or not)."""
        ages = self._slot_ages(entry)
        return sum(1 for s in entry.slots() if entry.slot_size(s) >= need and ages[s] != KEPT)

    def _latest_slot(self) -> int:
        latest = unpack_latest(self.region.latest_word(self.entry))
        return latest[1] if latest else -1

    def _not_claimable(self) -> set[int]:
        """The slots no claim may take whatever their age: the latest, and a latest being
        replaced whose pointer is not on the media yet (``publish``)."""
        return {self._latest_slot(), *self._flushing}

    def _slot_ages(self, entry: ModelEntry) -> dict[int, int]:
        """Counter of the committed version in each slot of ``entry`` (-1: none, KEPT: a kept
        version), read from the headers once and then kept up to date by this ring's own commits.
        Only the choice among free slots depends on it (safety rests on the claim lock and the
        checks made once it is held), so a value made stale by another process costs at most a
        less old version, never a wrong overwrite; it spares every save a read per slot header."""
        with self._ages_lock:
            if self._ages is None or set(self._ages) != set(entry.slots()):
                ages = {}
                for slot in entry.slots():
                    header = self.region.read_header(entry, slot)
                    committed = header is not None and header.state == SLOT_COMMITTED
                    ages[slot] = (KEPT if header.kept else header.counter) if committed else -1
                self._ages = ages
            return dict(self._ages)

    def _forget_ages(self) -> None:
        """Read the slot headers again at the next ``_slot_ages``."""
        with self._ages_lock:
            self._ages = None

    def _note_age(self, slot: int, counter: int) -> None:
        with self._ages_lock:
            if self._ages is not None and slot in self._ages:
                self._ages[slot] = counter

    def _recover_counter(self) -> None:
        """Make the next counter exceed every version on the media (a crash may have lost the
        counter's last update while a version it numbered reached the media)."""
        highest = max((v.header.counter for v in self.region.committed(self.entry)), default=0)
        latest = unpack_latest(self.region.latest_word(self.entry))
        self.region.raise_counter(self.entry, max(highest, latest[0] if latest else 0))

    def _repair_headers(self) -> None:
        """Rewrite the header of every committed version one of whose two copies is damaged or
        stale (from the intact one, with a warning); a slot in use is left to the next open."""
        region, entry = self.region, self.entry
        for slot in entry.slots():
            if not region.header_copies_differ(entry, slot):
                continue
            lock = slot_lock_offset(entry.index, slot)
            if not self._claims.try_exclusive(lock):
                continue
            try:
                header = region.read_header(entry, slot)
                if header is None or not region.header_copies_differ(entry, slot):
                    continue
                rewrite_header(region, entry, slot, header)
                log.warning("model %r: one copy of the header of slot %d (step %d) was damaged; rewritten from the "
                            "intact copy", entry.name, slot, header.step)
            finally:
                self._claims.release(lock)

    def _roll_forward(self) -> None:
        """Publish the newest committed version if the latest pointer names an older one: a crash
        between a commit's header and its compare-and-swap leaves a complete, durable version
        that nothing points at. A version whose slot another writer holds is mid-commit and
        publishes itself; one pinned by a reader is left to the next open."""
        region, entry = self.region, self.entry
        latest = unpack_latest(region.latest_word(entry))
        version = region.newest_intact(entry, above_counter=latest[0] if latest else 0)
        if version is None:
            return
        lock = slot_lock_offset(entry.index, version.slot)
        if not self._claims.try_exclusive(lock):
            return
        try:
            if region.read_header(entry, version.slot) == version.header:
                self.publish(version.header.counter, version.slot)
        except NotFoundError:
            pass
        finally:
            self._claims.release(lock)

    # ------------------------------------------------------------------ publish
    def publish(self, counter: int, slot: int) -> bool:
        """PCcheck Listing 1: CAS the latest pointer to (counter, slot) only while it names an
        older counter, then make the pointer durable. True if this version became latest."""
        region, entry = self.region, self.entry
        desired = pack_latest(counter, slot)
        replaced = None
        while True:
            seen = region.latest_word(entry)
            current = unpack_latest(seen)
            if current is not None and current[0] >= counter:
                published = False
                break
            # Until the flush below, the pointer on the media names the latest replaced here:
            # its slot stays unclaimable (set before the swap, which makes it claimable). Claimed
            # meanwhile, a power loss left a pointer to a slot being overwritten, and `verify`
            # said a healthy region was damaged.
            replaced = current[1] if current is not None else None
            if replaced is not None:
                self._flushing.append(replaced)
            if region.cas_latest(entry, seen, desired)[0]:
                published = True
                break
            if replaced is not None:
                self._flushing.remove(replaced)
        try:
            region.persist_words(entry)
        except (CkptfsError, OSError) as e:
            # The version is durable already (its header, behind the commit's second barrier),
            # and a committed version newer than the pointer on the media counts as latest
            # (SlotReader.latest): the save stands. Failed here, it was reported failed while
            # readers (and the next writer) took it for the latest.
            log.warning("model %r: the latest pointer to its save %d was not made durable: %s; the version "
                        "is durable, and latest after a crash too", entry.name, counter, e)
        finally:
            if published and replaced is not None:
                self._flushing.remove(replaced)
        return published


def move_latest_back(region, version, seen: int) -> None:
    """The latest pointer, which names ``version`` (``seen``: its word as read, the version's
    slot locked exclusively by the caller), moved back to the newest committed version of
    another step below it whose index verifies, or to none, durably: the removal of the latest
    version (a rollback; the earlier saves of its step go with it, ``Store.remove``), whose
    header the caller invalidates only then. A crash between the two leaves the
    version latest (a committed version newer than the pointer's counts as latest:
    ``SlotReader.latest``), never a pointer to an invalid slot. The new latest is pinned
    meanwhile, as by a reader: a save that claimed its slot a moment before (a writer of the
    model still running) would rewrite the version the pointer then names. BusyError, nothing
    changed, if such a save holds it, or if a save published meanwhile (the pointer no longer
    reads ``seen``)."""
    entry = version.entry
    target = latest_after_removal(region, version)
    if target is not None and not region.pin(target):
        raise BusyError(f"step {target.header.step} of {entry.name!r}, which would become latest, is being "
                        f"rewritten by a save: stop the job's writers of {entry.name!r}, then remove step "
                        f"{version.header.step}")
    try:
        desired = pack_latest(target.header.counter, target.slot) if target is not None else 0
        if not region.cas_latest(entry, seen, desired)[0]:
            raise BusyError(f"a save of {entry.name!r} was committed while step {version.header.step} was being "
                            "removed; look at the versions again and remove it then")
        region.persist_words(entry)
    finally:
        if target is not None:
            region.unpin(target)


def latest_after_removal(region, version) -> SlotVersion | None:
    """The version that becomes latest when ``version``, the latest, is removed
    (``move_latest_back``): the newest committed version of another step below it whose index
    verifies, or None."""
    return region.newest_intact(version.entry, above_counter=0, below=version)


def rewrite_header(region, entry, slot: int, header: SlotHeader) -> None:
    """Rewrite the header of a committed version in place (its kept flag, a repaired copy): one
    copy, durable, then the other, durable. One write of both could tear both where a device
    tears below a sector (the crash images found it: a kept flag set on the latest version, torn
    in 8-byte pieces, lost that version); this way one intact copy, old or new, is always there."""
    pages = header.pack()
    for offset in HEADER_COPY_OFFSETS:
        page = aligned_buffer(PAGE_BYTES)
        page[:] = pages[offset:offset + PAGE_BYTES]
        region.write_slot(entry, slot, offset, page)
        region.backend.barrier()


def mark_kept(region, version, kept: bool) -> bool:
    """Set (or clear) the kept flag of a committed version's header, durably; False if the
    version is gone. The version is pinned meanwhile (no claim can take it), and the header's
    copies are rewritten one after the other (``rewrite_header``): a crash leaves a valid header
    of the same version, with either flag."""
    if not region.pin(version):
        return False
    try:
        with region.meta_locked():  # one flag change at a time per region
            header = region.read_header(version.entry, version.slot)
            if header is None or header.counter != version.header.counter or header.state != SLOT_COMMITTED:
                return False
            flags = (header.flags | SLOT_KEPT) if kept else (header.flags & ~SLOT_KEPT)
            if flags != header.flags:
                rewrite_header(region, version.entry, version.slot, dataclasses.replace(header, flags=flags))
            return True
    finally:
        region.unpin(version)


def room_after_keeping(region, version) -> bool:
    """Whether ``version``'s model can go on saving once ``version`` is kept: two other slots of
    its size that are not kept (the latest and the one the next save takes, which then is the
    latest: with one, the model saved once more and was stuck), or room in the region."""
    entry = region.reload(version.entry)
    unkept = 0
    for slot in entry.slots():
        if slot == version.slot or entry.slot_size(slot) < entry.slot_bytes:
            continue
        header = region.read_header(entry, slot)
        unkept += header is None or not header.kept
        if unkept >= 2:
            return True
    try:
        with region.meta_locked():
            region.find_gap(entry.slot_bytes)
        return True
    except RegionFullError:
        return False


