"""Slots as read: headers, committed versions, the version latest names (with its fallbacks),
damage diagnostics, and indexes. A part of ``Region`` (``ckptfs.region.region``); the writing side
of a slot's life is ``ckptfs.region.ring``."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from ckptfs.checksum import crc32
from ckptfs.errors import CorruptionError, MalformedInputError, warn_once
from ckptfs.manifest import Manifest
from ckptfs.region.format import PAGE_BYTES, SLOT_COMMITTED, SLOT_HEADER_BYTES, ModelEntry, SlotHeader, unpack_latest
from ckptfs.region.locks import slot_lock_offset

log = logging.getLogger("ckptfs")


@dataclass(frozen=True)
class SlotVersion:
    """A committed checkpoint in a slot."""

    entry: ModelEntry
    slot: int
    header: SlotHeader

    @property
    def data_base(self) -> int:
        return self.entry.slot_offset(self.slot) + self.header.data_offset

    def is_save(self, other: "SlotVersion | None") -> bool:
        """Whether ``other`` is this very save (its slot and its save counter): a step saved
        again is another save, and a slot reused holds another."""
        return other is not None and other.slot == self.slot and other.header.counter == self.header.counter


def hidden_by(committed: list[SlotVersion], step: int, counter: int) -> list[SlotVersion]:
    """Those of ``committed`` that the save ``counter`` of ``step`` hides: the earlier saves of
    its step (a listing shows the newest save of a step)."""
    return [v for v in committed if v.header.step == step and v.header.counter < counter]


class SlotReader:
    """Region's slot-reading operations; needs ``backend``, ``pins`` and ``latest_word`` from the
    Region it is part of."""

    def read_header(self, entry: ModelEntry, slot: int) -> SlotHeader | None:
        """The slot's header if it is valid and belongs to this model and slot (from either copy)."""
        if not entry.has_slot(slot):
            return None
        return self._parse_header(entry, slot, self.backend.read_bytes(entry.slot_offset(slot), SLOT_HEADER_BYTES))[0]

    @staticmethod
    def _parse_header(entry: ModelEntry, slot: int, raw: bytes) -> tuple[SlotHeader | None, bool]:
        """(the header of the page ``raw``, whether its copies disagree). Of two valid copies the
        committed one wins: a committed header is only ever written after its version is durable,
        and a slot's data is only overwritten after both copies say WRITING durably, so a copy
        that is committed vouches for a complete version even when the other was torn."""
        best, differ = _parsed(entry.index, slot, entry.slot_size(slot), SlotHeader.copy_bytes(raw))
        return best, differ if best is not None else raw.count(0) != len(raw)

    @staticmethod
    def _valid_copy(entry: ModelEntry, slot: int, header: SlotHeader | None) -> SlotHeader | None:
        return _valid_copy(entry.index, slot, entry.slot_size(slot), header)

    def header_copies_differ(self, entry: ModelEntry, slot: int) -> bool:
        """Whether one copy of the slot's header is damaged or stale while the other is valid
        (what the model's next writer rewrites)."""
        raw = self.backend.read_bytes(entry.slot_offset(slot), SLOT_HEADER_BYTES)
        header, differ = self._parse_header(entry, slot, raw)
        return header is not None and differ

    def header_copy_lost(self, entry: ModelEntry, slot: int) -> bool:
        """Whether one copy of the slot's header is not a valid header (damaged, or torn by a
        crash) while the other is (what verify reports). Two valid copies that differ only in
        the kept flag are a flag change a crash interrupted: the first copy holds the new flag."""
        if not entry.has_slot(slot):
            return False
        raw = self.backend.read_bytes(entry.slot_offset(slot), SLOT_HEADER_BYTES)
        copies = [self._valid_copy(entry, slot, h) for h in SlotHeader.unpack_copies(raw)]
        return (copies[0] is None) != (copies[1] is None)

    def committed(self, entry: ModelEntry) -> list[SlotVersion]:
        """Every slot holding a committed checkpoint, oldest counter first."""
        out = []
        for slot in entry.slots():
            header = self.read_header(entry, slot)
            if header is not None and header.state == SLOT_COMMITTED:
                out.append(SlotVersion(entry, slot, header))
        return sorted(out, key=lambda v: v.header.counter)

    def latest(self, entry: ModelEntry, committed: list[SlotVersion] | None = None) -> SlotVersion | None:
        """The version the latest pointer names, or a newer one: the newest committed version
        whose index verifies, when its counter is above the pointer's (a commit cut between its
        header and its publish; the next writer of the model publishes it, ``Ring``). So latest
        is always the newest version listed, and reading never writes. ``committed``: the
        model's committed versions as ``committed`` just read them (not read again).

        If the pointer names a slot that does not hold that version, or one whose index fails its
        checksum (a damaged region), falls back to the newest committed version whose index
        verifies, with a warning. (Tensor bytes are checked by ``load``, which falls back too.)
        """
        version, problem = self._resolve_latest(entry, committed)
        if problem is None:
            return version
        for version in reversed(self.committed(entry)):
            if self.index_ok(version):
                warn_once(log, self.path, f"model {entry.name!r}: {problem}; falling back to step "
                                          f"{version.header.step}, the newest intact version")
                return version
        warn_once(log, self.path, f"model {entry.name!r}: {problem}; no intact version is left")
        return None

    def latest_problem(self, entry: ModelEntry) -> str | None:
        """None if the latest pointer is empty or names an intact version, else what is wrong."""
        return self._resolve_latest(entry)[1]

    def _resolve_latest(self, entry: ModelEntry, committed: list[SlotVersion] | None = None
                        ) -> tuple[SlotVersion | None, str | None]:
        for _ in range(100):
            word = self.latest_word(entry)
            target = unpack_latest(word)
            if target is None:
                # Nothing published yet. A committed version can still be there: its save's commit
                # was cut before the pointer reached the media (never reported durable, but
                # complete), or the pointer word itself was zeroed. Take the newest intact one.
                return self.newest_intact(entry, above_counter=0, committed=committed), None
            counter, slot = target
            header = self.read_header(entry, slot)
            version = None
            if header is not None and header.state == SLOT_COMMITTED and header.counter == counter:
                version = SlotVersion(entry, slot, header)
                if self.index_ok(version):
                    return self.newest_intact(entry, above_counter=counter, committed=committed) or version, None
            if self.latest_word(entry) == word:
                break
            # The pointer moved on while we looked (a newer save published and the old slot is
            # already being rewritten): that is not damage; look again.
        if version is None:
            return None, f"the latest pointer names slot {slot} counter {counter}, which does not hold it"
        return None, f"the index of the latest version (step {version.header.step}, slot {slot}) fails its checksum"

    def newest_intact(self, entry: ModelEntry, above_counter: int, *, below: SlotVersion | None = None,
                      committed: list[SlotVersion] | None = None) -> SlotVersion | None:
        """The committed version with the highest counter above ``above_counter`` whose index
        verifies, or None: the one rule of which complete version is newer than the pointer.
        ``below``: only versions older than it, of another step (the latest once ``below``, the
        latest, is removed: ``ring.move_latest_back``). ``committed``: as ``latest``'s."""
        for version in reversed(self.committed(entry) if committed is None else committed):
            if version.header.counter <= above_counter:
                return None
            if below is not None and (version.header.counter >= below.header.counter
                                      or version.header.step == below.header.step):
                continue
            if self.index_ok(version):
                return version
        return None

    def index_ok(self, version: SlotVersion) -> bool:
        """Whether the version's index matches the CRC its header holds."""
        h = version.header
        start = version.entry.slot_offset(version.slot) + h.manifest_offset
        ok = crc32(self.backend.view(start, h.manifest_bytes)) == h.manifest_crc
        self.backend.check_mapping()
        return ok

    def unreadable_slots(self, entry: ModelEntry) -> list[tuple[int, int, Manifest | None]]:
        """(slot, region offset, the index behind it if readable) of every slot whose header is
        neither empty nor valid: damaged by the media, or torn by a crash in the middle of
        rewriting it (only where a write can tear below a 512-byte sector, e.g. devdax). The
        version it held, if any, is lost. (A header zeroed as a whole looks like an empty slot:
        that is what removal leaves, and a fresh slot's index is written before its header.)"""
        out = []
        for slot in entry.slots():
            offset = entry.slot_offset(slot)
            if self._header_readable(entry, slot):
                continue
            # Confirm with the slot pinned: a writer or a removal holding it rewrites the header
            # right now, and what was read may be half old, half new. Such a slot is in flux,
            # not lost.
            lock = slot_lock_offset(entry.index, slot)
            if not self.pins.try_shared(lock):
                continue
            try:
                if not self._header_readable(entry, slot):
                    out.append((slot, offset, self._salvage_index(entry, slot)))
            finally:
                self.pins.release(lock)
        return out

    def _header_readable(self, entry: ModelEntry, slot: int) -> bool:
        """Empty (never written, or removed) or valid, from one read of the header."""
        raw = self.backend.read_bytes(entry.slot_offset(slot), SLOT_HEADER_BYTES)
        return not any(raw) or self._parse_header(entry, slot, raw)[0] is not None

    def _salvage_index(self, entry: ModelEntry, slot: int) -> Manifest | None:
        start = entry.slot_offset(slot) + SLOT_HEADER_BYTES
        room = entry.slot_size(slot) - SLOT_HEADER_BYTES
        if room <= 0 or self.backend.view(start, 1)[0] != ord("{"):
            return None
        raw = bytes(self.backend.view(start, min(room, 1 << 20)))
        self.backend.check_mapping()
        try:
            return Manifest.decode(raw.split(b"\0", 1)[0])
        except (MalformedInputError, RecursionError):
            return None

    def read_manifest(self, version: SlotVersion) -> Manifest:
        h = version.header
        start = version.entry.slot_offset(version.slot) + h.manifest_offset
        raw = bytes(self.backend.view(start, h.manifest_bytes))
        self.backend.check_mapping()
        if crc32(raw) != h.manifest_crc:
            raise CorruptionError(f"the index of {version.entry.name} step {h.step} (slot {version.slot}) "
                                  "fails its checksum; run `ckptfs verify` and use another version")
        try:
            manifest = Manifest.decode(raw)
        except MalformedInputError as e:
            raise CorruptionError(f"the index of {version.entry.name} step {h.step} is damaged: {e}") from None
        if manifest.counter != h.counter or manifest.data_bytes != h.data_bytes:
            raise CorruptionError(f"the index of {version.entry.name} step {h.step} does not match its header")
        return manifest

    def write_slot(self, entry: ModelEntry, slot: int, offset: int, buf) -> None:
        """Write aligned ``buf`` at ``offset`` within a slot the caller has claimed."""
        size = entry.slot_size(slot)
        if offset < 0 or offset + len(buf) > size:
            raise ValueError(f"write of {len(buf)} bytes at {offset} overflows slot of {size}")
        self.backend.write(entry.slot_offset(slot) + offset, buf)



def _valid_copy(model_index: int, slot: int, slot_bytes: int, header: SlotHeader | None) -> SlotHeader | None:
    """``header`` if it is a valid header of slot ``slot`` (of ``slot_bytes``) of the model
    ``model_index``: its index and data inside the slot, in that order; else None."""
    if header is None or header.model_index != model_index or header.slot != slot:
        return None
    if header.state == SLOT_COMMITTED:
        end = header.data_offset + header.data_bytes
        if (header.manifest_offset < SLOT_HEADER_BYTES or header.data_offset % PAGE_BYTES
                or header.manifest_offset + header.manifest_bytes > header.data_offset or end > slot_bytes):
            return None
    return header


@functools.lru_cache(maxsize=1 << 14)
def _parsed(model_index: int, slot: int, slot_bytes: int, copies: tuple[bytes, ...]) -> tuple[SlotHeader | None, bool]:
    """(the valid header of ``copies``, the committed one first; whether they disagree) for a
    slot of ``slot_bytes``: a header page read again unchanged is not parsed again (listing a
    model of hundreds of kept versions read each of their headers at every open)."""
    valid_copies = [_valid_copy(model_index, slot, slot_bytes, SlotHeader.unpack(c)) for c in copies]
    valid = [h for h in valid_copies if h is not None]
    if not valid:
        return None, False
    best = next((h for h in valid if h.state == SLOT_COMMITTED), valid[0])
    return best, valid_copies[0] != valid_copies[1]
