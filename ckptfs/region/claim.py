"""One slot claimed for one version (the slot lifecycle's steps 2-6, ckptfs.region.ring): ``begin``
marks a slot that holds a version WRITING, ``write`` fills the data area, ``commit`` makes the
index durable, then the header that vouches for it, then publishes; ``abort`` gives the slot
back without a version. Claims are made by ``Ring.claim``. Slot headers are written here (a
claim's, both copies in one write: torn, they are a version not there yet, never a lost one),
by ``ring.rewrite_header`` (a committed version's: one copy at a time, each durable, so that one
intact copy is always there) and by ``ModelTable.wipe_slot_headers`` (zeros, where a slot holds no
version from then on)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.checksum import crc32
from ckptfs.errors import CkptfsError
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.extents import KEPT
from ckptfs.region.format import (SLOT_COMMITTED, SLOT_HEADER_BYTES, SLOT_KEPT, SLOT_WRITING, ModelEntry, SlotHeader,
                                  slot_layout)
from ckptfs.region.locks import slot_lock_offset

if TYPE_CHECKING:
    from ckptfs.region.ring import Ring


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
    kept: bool = False



class Claim:
    """One slot claimed for one version: ``begin``, ``write``s, then ``commit`` or ``abort``."""

    def __init__(self, ring: Ring, entry: ModelEntry, slot: int, counter: int, step: int, time_ns: int,
                 layout: SlotLayout, header: SlotHeader | None):
        self.ring = ring
        self._header = header  # the slot's header as read once the claim was held
        self.entry = entry  # the model's entry as of the claim: it holds this slot until released
        self.slot = slot
        self.counter = counter
        self.step = step
        self.time_ns = time_ns
        self.layout = layout
        self._lock = slot_lock_offset(entry.index, slot)
        self._held = True

    @property
    def model(self) -> str:
        return self.entry.name

    def begin(self) -> None:
        """Before the first write: a slot that holds a committed version is marked WRITING,
        durably (its old version is gone from here on)."""
        region, entry, header = self.ring.region, self.entry, self._header
        if header is not None and header.state == SLOT_COMMITTED:
            self.ring._note_age(self.slot, -1)
            marker = SlotHeader(SLOT_WRITING, self.counter, self.step, self.time_ns, entry.index, self.slot)
            self._write_page(0, marker.pack())
            region.backend.barrier()

    def write(self, data_offset: int, buf) -> None:
        """Write page-aligned ``buf`` at ``data_offset`` of the version's data area."""
        self._check_held()
        self.ring.region.write_slot(self.entry, self.slot, self.layout.data_offset + data_offset, buf)

    def commit(self, index: bytes, data_bytes: int, *, publish: bool = True, keep: bool = False) -> Committed:
        """Make the version durable behind ``index`` (its encoded manifest) and, with
        ``publish``, latest if it is the newest (``keep``: kept, never reused by the ring);
        release the claim; give back slots the model no longer needs; tell the subscribers."""
        self._check_held()
        ring, region, entry, layout = self.ring, self.ring.region, self.entry, self.layout
        room = layout.data_offset - layout.index_offset
        if len(index) > room:
            raise CkptfsError(f"the index of {entry.name} step {self.step} outgrew its reserved space "
                              f"({len(index)} > {room} bytes); this is a bug in ckptfs, please report it")
        self._write_page(layout.index_offset, index, room)
        # One barrier makes the tensor bytes and the index durable; only then the header that
        # vouches for them is written, alone in its page: a torn commit leaves at worst an
        # invalid header (no version), never a valid header over a torn index.
        region.backend.barrier()
        # the region truncated (or removed) since the claim: its data may be gone, and the
        # direct writes re-extended the file, so that the save would be reported committed
        region.backend.check_present(for_write=True)
        header = SlotHeader(SLOT_COMMITTED, self.counter, self.step, self.time_ns, entry.index, self.slot,
                            layout.index_offset, len(index), crc32(index), layout.data_offset, data_bytes,
                            SLOT_KEPT if keep else 0)
        self._write_page(0, header.pack())
        region.backend.barrier()  # header durable before the pointer moves
        # The claim becomes a pin once the header is durable: from then a reader that listed
        # the version (a committed header newer than the pointer already counts as latest) can
        # pin it, and no claim can take the slot until the release below. Held exclusively up to
        # the publish, a version just made latest could not be opened: a quarter of the mount's
        # opens of ``latest/...`` failed with ENOENT under saves every 50 ms. (Readers wait out
        # the header's barrier: Store.open_version.) Not earlier: a pin must find the header whole
        # and durable (Region.unreadable_slots, move_latest_back).
        ring._claims.downgrade(self._lock)
        published = ring.publish(self.counter, self.slot) if publish else False
        ring._note_age(self.slot, KEPT if keep else self.counter)
        self._release()
        committed = Committed(entry.name, self.step, self.counter, self.slot, data_bytes, published, keep)
        region.commits.notify(committed)
        ring.extents.give_back()
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
        self.ring.region.write_slot(self.entry, self.slot, slot_offset, page)
