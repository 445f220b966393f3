"""The model table of a region: its entries (each a model's name and ring), created whole and
removed at once, read without a lock. A part of ``Region`` (``ckptfs.region.region``)."""
from __future__ import annotations

import contextlib
import logging
import time
import unicodedata

from ckptfs import _native
from ckptfs.errors import (BusyError, CorruptionError, InvalidNameError, in_words, no_model,
                           RegionFormatError, RegionFullError)
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.format import (COUNTER_WORD_OFFSET, ENTRY_BYTES, ENTRY_STATIC_OFFSET, LATEST_WORD_OFFSET,
                                  NAME_MAX_BYTES, SLOT_HEADER_BYTES, SUPERBLOCK_BYTES, ModelEntry,
                                  _align)
from ckptfs.region.locks import META_LOCK_OFFSET, slot_lock_offset
from ckptfs.units import human_bytes

log = logging.getLogger("ckptfs")


def validate_model_name(name) -> str:
    """Return ``name`` if it can name a model (a directory in the mount); else InvalidNameError."""
    if not isinstance(name, str):
        raise InvalidNameError(f"model name must be a str, got {type(name).__name__}")
    if not name or name in (".", ".."):
        raise InvalidNameError(f"model name {name!r} is not allowed; use letters, digits, '-', '_' or '.'")
    if "/" in name or "\0" in name:
        raise InvalidNameError(f"model name {name!r} contains '/' or NUL; use e.g. {name.replace('/', '-')!r}")
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in name):
        raise InvalidNameError(f"model name {name!r} contains control characters")
    if name != name.strip():
        raise InvalidNameError(f"model name {name!r} has leading or trailing whitespace")
    if len(name.encode()) > NAME_MAX_BYTES:
        raise InvalidNameError(f"model name is {len(name.encode())} bytes long; the limit is {NAME_MAX_BYTES}")
    return name



class ModelTable:
    """Region's model-table operations; needs ``path``, ``backend``, ``superblock``, ``pins`` and
    ``_meta_mutex`` from the Region it is part of."""

    def _entry_offset(self, index: int) -> int:
        return self.superblock.table_offset + index * ENTRY_BYTES

    def _read_entry(self, index: int) -> ModelEntry | None:
        off = self._entry_offset(index) + ENTRY_STATIC_OFFSET
        entry = ModelEntry.unpack_static(index, bytes(self.backend.view(off, ENTRY_BYTES - ENTRY_STATIC_OFFSET)))
        sb = self.superblock
        if entry is not None:
            try:
                validate_model_name(entry.name)
            except InvalidNameError as e:
                raise RegionFormatError(f"model table entry {index} holds an impossible name: {e}") from None
        if entry is not None and (entry.ring_offset % sb.block_bytes or entry.slot_bytes % sb.block_bytes
                                  or entry.ring_offset < sb.data_offset
                                  or entry.ring_offset + entry.ring_bytes > sb.region_bytes):
            raise RegionFormatError(f"model table entry {index} places its ring outside the region's data area")
        return entry

    def entries(self) -> list[ModelEntry]:
        """Every model of the region. A damaged entry is logged and left out (see damaged_entries)."""
        return self._scan_entries()[0]

    def damaged_entries(self) -> list[tuple[int, str | None, str]]:
        """(index, the name it seems to hold or None, what is wrong) of every damaged table entry."""
        return self._scan_entries()[1]

    def _scan_entries(self) -> tuple[list[ModelEntry], list[tuple[int, str | None, str]]]:
        out, damaged = [], []
        for index in range(self.superblock.table_entries):
            # No lock: an entry is created body first and magic last (one atomic store), and
            # removed by clearing the magic, so a concurrent creation never shows a torn entry.
            # (Taking the table lock here deadlocked create_model, which scans under it.)
            try:
                entry = self._read_entry(index)
            except RegionFormatError as e:
                name = self._salvage_entry_name(index)
                log.warning("skipping model table entry %d%s: %s", index,
                            f" (model {name!r}?)" if name else "", e)
                damaged.append((index, name, str(e)))
                entry = None
            if entry is not None:
                out.append(entry)
        # Two rings over the same bytes can only come from damage (or a crafted region); writing
        # one would corrupt the other, so neither is trusted.
        ordered = sorted(out, key=lambda e: e.ring_offset)
        clash = {e.index for a, b in zip(ordered, ordered[1:]) if a.ring_offset + a.ring_bytes > b.ring_offset
                 for e in (a, b)}
        for e in [e for e in out if e.index in clash]:
            log.warning("skipping model table entry %d (model %r): its ring overlaps another model's", e.index, e.name)
            damaged.append((e.index, e.name, f"model table entry {e.index} has a ring that overlaps another model's"))
        out = [e for e in out if e.index not in clash]
        return out, damaged

    def _salvage_entry_name(self, index: int) -> str | None:
        """The name a damaged entry seems to hold (for messages only; never trusted)."""
        off = self._entry_offset(index) + ENTRY_STATIC_OFFSET + ModelEntry.NAME_OFFSET
        raw = bytes(self.backend.view(off, NAME_MAX_BYTES)).split(b"\0", 1)[0]
        try:
            return validate_model_name(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, InvalidNameError):
            return None

    def find(self, name: str) -> ModelEntry | None:
        for entry in self.entries():
            if entry.name == name:
                return entry
        return None

    def get(self, name: str) -> ModelEntry:
        entry = self.find(validate_model_name(name))
        if entry is None:
            damaged = sorted(self.damaged_entries(), key=lambda d: d[1] != name)
            if damaged:
                index, guess, _ = damaged[0]
                seems = f", which seems to hold {guess!r}" if guess else ""
                raise CorruptionError(
                    f"model {name!r} is not readable in {self.path}: model table entry {index}{seems} is damaged "
                    "and may have been this model; run `ckptfs verify`")
            raise no_model(name, self.path)
        return entry

    @contextlib.contextmanager
    def meta_locked(self):
        """Exclusive access to the model table across threads and processes."""
        with self._meta_mutex:
            self.pins.try_exclusive(META_LOCK_OFFSET, wait=True)
            try:
                yield
            finally:
                self.pins.release(META_LOCK_OFFSET)

    def create_model(self, name: str, nslots: int, slot_bytes: int) -> ModelEntry:
        """Add a model with a ring of ``nslots`` slots; returns the existing entry if present."""
        validate_model_name(name)
        block = self.superblock.block_bytes
        slot_bytes = _align(slot_bytes, block)
        with self.meta_locked():
            entries, damaged = self._scan_entries()
            for entry in entries:
                if entry.name == name:
                    return entry
            # a damaged entry's index is not free: keep it (and what may be salvaged from it)
            used = {e.index for e in entries} | {index for index, _, _ in damaged}
            index = next((i for i in range(self.superblock.table_entries) if i not in used), None)
            if index is None:
                raise RegionFullError(f"the model table of {self.path} is full "
                                      f"({self.superblock.table_entries} models); remove a model first")
            ring_offset = self._find_gap(entries, nslots * slot_bytes)
            self.backend.reserve(ring_offset, nslots * slot_bytes)
            entry = ModelEntry(index, name, nslots, slot_bytes, ring_offset, time.time_ns())
            base = self._entry_offset(index)
            mapping = self.backend.mapping
            # Stale headers from a removed model that lived here must not look like versions.
            self._wipe_slot_headers(entry)
            _native.atomic_store_u64(mapping, base + LATEST_WORD_OFFSET, 0)
            _native.atomic_store_u64(mapping, base + COUNTER_WORD_OFFSET, 0)
            # Everything but the magic first, then the magic with one atomic 8-byte store: a crash
            # (or a reader) sees a free entry or a complete one, never a torn one, even though the
            # kernel may write the page back at any moment of the copy.
            static = entry.pack_static()
            start = base + ENTRY_STATIC_OFFSET
            mapping[start + 8:start + len(static)] = static[8:]
            self.backend.persist_mapped(base, ENTRY_BYTES)
            _native.atomic_store_u64(mapping, start, int.from_bytes(static[:8], "little"))
            self.backend.persist_mapped(start, 8)
            return entry

    def _find_gap(self, entries: list[ModelEntry], nbytes: int) -> int:
        sb = self.superblock
        cursor = sb.data_offset
        for e in sorted(entries, key=lambda e: e.ring_offset):
            if e.ring_offset - cursor >= nbytes:
                return cursor
            cursor = max(cursor, e.ring_offset + e.ring_bytes)
        end = (sb.region_bytes - SUPERBLOCK_BYTES) // sb.block_bytes * sb.block_bytes  # backup superblock
        if end - cursor >= nbytes:
            return cursor
        free = end - sb.data_offset - sum(e.ring_bytes for e in entries)
        raise RegionFullError(
            f"region {self.path} has no contiguous {human_bytes(nbytes)} free for a new model ring "
            f"({human_bytes(free)} free in all); " + in_words(
                python="remove models (Store.remove_model), or create a larger region (Store.create(path, size_bytes=...))",
                cli="remove models (`ckptfs rm --all MODEL`), or create a larger region (`ckptfs mkfs --size`)"))

    def _wipe_slot_headers(self, entry: ModelEntry) -> None:
        blank = aligned_buffer(SLOT_HEADER_BYTES)
        for slot in range(entry.nslots):
            self.backend.write(entry.slot_offset(slot), blank)
        self.backend.barrier()

    def remove_model(self, name: str) -> None:
        """Remove a model and free its ring; BusyError while any of its slots is pinned or claimed."""
        with self.meta_locked():
            entry = self.get(name)
            claimed = []
            try:
                for slot in range(entry.nslots):
                    off = slot_lock_offset(entry.index, slot)
                    if not self.pins.try_exclusive(off):
                        raise BusyError(f"model {name!r} is in use (a writer or a reader holds slot {slot}); "
                                        "close it first")
                    claimed.append(off)
                # Clearing the magic (one atomic 8-byte store) frees the entry; the rest is left
                # as it is, so a crash cannot leave a half-cleared entry that looks damaged.
                start = self._entry_offset(entry.index) + ENTRY_STATIC_OFFSET
                _native.atomic_store_u64(self.backend.mapping, start, 0)
                self.backend.persist_mapped(start, 8)
            finally:
                for off in claimed:
                    self.pins.release(off)

