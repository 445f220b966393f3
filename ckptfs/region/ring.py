"""The slot lifecycle of one model's ring: claim -> begin -> write -> commit -> publish, or abort.

This module is the only code that writes slot headers, takes claim locks, issues the barriers
of a commit and moves the latest pointer. The order it keeps (docs/FORMAT.md, PCcheck §3.1):

  1. ``Ring.claim``: a version counter larger than any handed out, and a slot that is neither
     latest, pinned nor claimed (an exclusive lock byte, re-checked against latest once held),
     the one holding the oldest version first. While every slot is busy it waits (backpressure)
     up to ``timeout_s``, then BusyError;
  2. ``Claim.begin``: a slot that holds a committed version is first marked WRITING, durably, so
     that a crash while it is rewritten never leaves the old header in front of half-new data;
  3. ``Claim.write``: bytes at offsets of the data area (O_DIRECT, page-aligned buffers);
  4. ``Claim.commit(index)``: the index, one barrier (data and index durable), then the header
     that vouches for them alone in its page, and a second barrier;
  5. publish (part of ``commit`` unless ``publish=False``; else ``Ring.publish`` later): the
     compare-and-swap of the latest pointer, only while it names an older counter (PCcheck
     Listing 1), and the pointer made durable;
  6. the claim is released; ``Claim.abort`` releases it without committing (a WRITING slot
     holds no version).
After a commit the region's subscribers hear of it (``Region.commits``), outside every lock.

A ring is opened by one writer; several rings (writers, processes) on one model exclude each
other through the lock bytes. Another kind of commit (a rank's part of a global version, a
batch of differential records, a version held until a tier has drained it) is a new caller of
``claim`` / ``commit`` / ``publish``, not a copy of this protocol. A SLOT_COMMITTED version newer
than latest counts as latest for readers and is published by the next ring that opens
(``SlotReader.newest_intact``): a commit that must not become latest on its own (a rank's part
of a global version) needs a header state of its own.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ckptfs.checksum import crc32
from ckptfs.errors import BusyError, CheckpointTooLargeError, CkptfsError, in_words
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.format import (SLOT_COMMITTED, SLOT_HEADER_BYTES, SLOT_WRITING, ModelEntry, SlotHeader,
                                  pack_latest, slot_layout, unpack_latest)
from ckptfs.region.locks import LockSpace, slot_lock_offset
from ckptfs.units import human_bytes

CLAIM_POLL_S = 0.005  # how often a claim waiting for a free slot looks again


@dataclass(frozen=True)
class SlotLayout:
    """Where a version's index and data go in a slot, and the slot size it needs."""

    index_offset: int
    data_offset: int
    slot_bytes: int

    @classmethod
    def of(cls, index_bytes: int, data_bytes: int) -> "SlotLayout":
        """The layout for an index of at most ``index_bytes`` and ``data_bytes`` of data."""
        return cls(*slot_layout(index_bytes, data_bytes))


@dataclass(frozen=True)
class Committed:
    """A version made durable by ``Claim.commit``; what subscribers of ``Region.commits`` get."""

    model: str
    step: int
    counter: int
    slot: int
    data_bytes: int
    published: bool  # False: not (yet) latest; a newer version was, or publish=False


class Ring:
    """The slot lifecycle of one model for one writer. Thread-safe; ``close`` when done."""

    def __init__(self, region, entry: ModelEntry, *, timeout_s: float):
        self.region = region
        self.entry = entry
        self.timeout_s = timeout_s
        # Claims are held on a description of their own, so that they exclude this process's own
        # pins (OFD locks of one description never conflict in the kernel).
        self._claims = LockSpace(region.path, writable=True)
        self._ages_lock = threading.Lock()
        self._ages: list[int] | None = None
        self._recover_counter()
        self._roll_forward()

    def close(self) -> None:
        self._claims.close()

    # ------------------------------------------------------------------ geometry
    def layout(self, index_bytes: int, data_bytes: int) -> SlotLayout:
        """The slot layout of a version; CheckpointTooLargeError if it does not fit a slot."""
        layout = SlotLayout.of(index_bytes, data_bytes)
        if layout.slot_bytes > self.entry.slot_bytes:
            name = self.entry.name
            raise CheckpointTooLargeError(
                f"this checkpoint of {name!r} needs {human_bytes(layout.slot_bytes)} but its slots hold "
                f"{human_bytes(self.entry.slot_bytes)} (slots are sized at the model's first save); "
                + in_words(python=f"remove the model (Store.remove_model({name!r})) and save again, or give "
                                  "slot_bytes= large enough when the model is first created",
                           cli=f"remove the model (`ckptfs rm --all {name}`) and save again"))
        return layout

    # ------------------------------------------------------------------ claim
    def claim(self, step: int, layout: SlotLayout) -> "Claim":
        """A new counter and a claimed slot for version ``step``; waits while every slot is busy
        (BusyError after ``timeout_s``)."""
        self.region.backend.check_present(for_write=True)
        counter = self.region.next_counter(self.entry)
        slot = self._claim_slot()
        return Claim(self, slot, counter, step, time.time_ns(), layout)

    def _claim_slot(self) -> int:
        entry = self.entry
        deadline = time.monotonic() + self.timeout_s
        while True:
            latest_slot = self._latest_slot()
            ages = self._slot_ages()
            for slot in sorted((s for s in range(entry.nslots) if s != latest_slot), key=ages.__getitem__):
                lock = slot_lock_offset(entry.index, slot)
                if not self._claims.try_exclusive(lock):
                    continue
                if self._latest_slot() == slot:  # became latest between the look and the lock
                    self._claims.release(lock)
                    continue
                return slot
            if time.monotonic() > deadline:
                raise BusyError(f"every slot of {entry.name!r} is latest, pinned by a reader or being written "
                                f"after waiting {self.timeout_s} s; close readers (open files in the mount, "
                                "loads) or create the model with more slots")
            with self._ages_lock:
                self._ages = None  # another process may have moved things: look again
            time.sleep(CLAIM_POLL_S)

    def _latest_slot(self) -> int:
        latest = unpack_latest(self.region.latest_word(self.entry))
        return latest[1] if latest else -1

    def _slot_ages(self) -> list[int]:
        """Counter of the committed version in each slot (-1: none), read from the headers once and
        then kept up to date by this ring's own commits. Only the choice among free slots depends
        on it (safety rests on the claim lock and the latest check), so a value made stale by
        another process costs at most a less old version, never a wrong overwrite; it spares
        every save a disk read per slot header."""
        with self._ages_lock:
            if self._ages is None:
                ages = []
                for slot in range(self.entry.nslots):
                    header = self.region.read_header(self.entry, slot)
                    ages.append(header.counter if header is not None and header.state == SLOT_COMMITTED else -1)
                self._ages = ages
            return list(self._ages)

    def _note_age(self, slot: int, counter: int) -> None:
        with self._ages_lock:
            if self._ages is not None:
                self._ages[slot] = counter

    def _recover_counter(self) -> None:
        """Make the next counter exceed every version on the media (a crash may have lost the
        counter's last update while a version it numbered reached the media)."""
        highest = max((v.header.counter for v in self.region.committed(self.entry)), default=0)
        latest = unpack_latest(self.region.latest_word(self.entry))
        self.region.raise_counter(self.entry, max(highest, latest[0] if latest else 0))

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
        finally:
            self._claims.release(lock)

    # ------------------------------------------------------------------ publish
    def publish(self, counter: int, slot: int) -> bool:
        """PCcheck Listing 1: CAS the latest pointer to (counter, slot) only while it names an
        older counter, then make the pointer durable. True if this version became latest."""
        region, entry = self.region, self.entry
        desired = pack_latest(counter, slot)
        while True:
            seen = region.latest_word(entry)
            current = unpack_latest(seen)
            if current is not None and current[0] >= counter:
                published = False
                break
            if region.cas_latest(entry, seen, desired)[0]:
                published = True
                break
        region.persist_words(entry)
        return published


class Claim:
    """One slot claimed for one version: ``begin``, ``write``s, then ``commit`` or ``abort``."""

    def __init__(self, ring: Ring, slot: int, counter: int, step: int, time_ns: int, layout: SlotLayout):
        self.ring = ring
        self.slot = slot
        self.counter = counter
        self.step = step
        self.time_ns = time_ns
        self.layout = layout
        self._lock = slot_lock_offset(ring.entry.index, slot)
        self._held = True

    @property
    def model(self) -> str:
        return self.ring.entry.name

    def begin(self) -> None:
        """Before the first write: a slot that holds a committed version is marked WRITING,
        durably (its old version is gone from here on)."""
        region, entry = self.ring.region, self.ring.entry
        header = region.read_header(entry, self.slot)
        if header is not None and header.state == SLOT_COMMITTED:
            self.ring._note_age(self.slot, -1)
            marker = SlotHeader(SLOT_WRITING, self.counter, self.step, self.time_ns, entry.index, self.slot)
            self._write_page(0, marker.pack())
            region.backend.barrier()

    def write(self, data_offset: int, buf) -> None:
        """Write page-aligned ``buf`` at ``data_offset`` of the version's data area."""
        self._check_held()
        self.ring.region.write_slot(self.ring.entry, self.slot, self.layout.data_offset + data_offset, buf)

    def commit(self, index: bytes, data_bytes: int, *, publish: bool = True) -> Committed:
        """Make the version durable behind ``index`` (its encoded manifest) and, with
        ``publish``, latest if it is the newest; release the claim; tell the subscribers."""
        self._check_held()
        ring, region, entry, layout = self.ring, self.ring.region, self.ring.entry, self.layout
        room = layout.data_offset - layout.index_offset
        if len(index) > room:
            raise CkptfsError(f"the index of {entry.name} step {self.step} outgrew its reserved space "
                              f"({len(index)} > {room} bytes); this is a bug in ckptfs, please report it")
        self._write_page(layout.index_offset, index, room)
        # One barrier makes the tensor bytes and the index durable; only then the header that
        # vouches for them is written, alone in its page: a torn commit leaves at worst an
        # invalid header (no version), never a valid header over a torn index.
        region.backend.barrier()
        header = SlotHeader(SLOT_COMMITTED, self.counter, self.step, self.time_ns, entry.index, self.slot,
                            layout.index_offset, len(index), crc32(index), layout.data_offset, data_bytes)
        self._write_page(0, header.pack())
        region.backend.barrier()  # header durable before the pointer moves
        published = ring.publish(self.counter, self.slot) if publish else False
        ring._note_age(self.slot, self.counter)
        self._release()
        committed = Committed(entry.name, self.step, self.counter, self.slot, data_bytes, published)
        region.commits.notify(committed)
        return committed

    def abort(self) -> None:
        """Give the slot back without a version (idempotent). What was written is no version:
        the slot's header is empty, WRITING, or the old version's if ``begin`` never ran."""
        if self._held:
            self.ring._note_age(self.slot, -1)
            self._release()

    def _release(self) -> None:
        self._held = False
        self.ring._claims.release(self._lock)

    def _check_held(self) -> None:
        if not self._held:
            raise CkptfsError(f"the claim of {self.model} step {self.step} was already committed or aborted")

    def _write_page(self, slot_offset: int, data: bytes, nbytes: int = SLOT_HEADER_BYTES) -> None:
        page = aligned_buffer(nbytes)
        page[:len(data)] = data
        self.ring.region.write_slot(self.ring.entry, self.slot, slot_offset, page)
