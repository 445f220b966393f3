"""A formatted region: the model table, the latest pointers and counters, slot headers as read,
pins, and removal. The slot lifecycle of a save (claim, commit, publish) is ckptfs.region.ring.

Concurrency model (several processes may open one region):
  * the model table changes rarely (a new model, a removed model) under an exclusive OFD lock;
  * each model's latest pointer and counter are 64-bit words updated with atomics on the shared
    mapping (PCcheck Listing 1): the hot path takes no lock;
  * a slot being written is claimed with an exclusive lock byte, a slot being read is pinned
    with a shared one (see locks.py). A claim is only ever taken on a slot that is not latest,
    and is re-checked after the lock is held, so latest and pinned slots are never handed out.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
import unicodedata
from dataclasses import dataclass

from ckptfs import _native
from ckptfs.errors import (CorruptionError, InvalidNameError, MalformedInputError, NotFoundError,
                           RegionFormatError, RegionFullError, BusyError)
from ckptfs.manifest import Manifest
from ckptfs.checksum import crc32
from ckptfs.region.backend import Backend, aligned_buffer, open_backend
from ckptfs.region.format import (COUNTER_MAX, COUNTER_WORD_OFFSET, ENTRY_BYTES, ENTRY_STATIC_OFFSET,
                                  LATEST_WORD_OFFSET, NAME_MAX_BYTES, SLOT_COMMITTED,
                                  SLOT_HEADER_BYTES, SUPERBLOCK_BYTES, ModelEntry, SlotHeader,
                                  Superblock, unpack_latest, _align)
from ckptfs.region.events import Subscribers
from ckptfs.region.locks import META_LOCK_OFFSET, LockSpace, slot_lock_offset
from ckptfs.region.mkfs import format_in_place, format_new_file, make_sparse_file, refuse_to_overwrite
from ckptfs.region.ring import Committed, Ring

log = logging.getLogger("ckptfs")

DEFAULT_REGION_BYTES = 64 << 30  # a region file is sparse: only the rings of saved models take disk space


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


@dataclass(frozen=True)
class SlotVersion:
    """A committed checkpoint in a slot."""

    entry: ModelEntry
    slot: int
    header: SlotHeader

    @property
    def data_base(self) -> int:
        return self.entry.slot_offset(self.slot) + self.header.data_offset


class Region:
    """An open region. Thread-safe; share one per process per path."""

    def __init__(self, path: str, writable: bool = True, backend: Backend | None = None):
        """Open the region at ``path``; ``backend`` replaces the device backend (fault-injection
        harnesses pass an instrumented one)."""
        self.path = path
        self.writable = writable
        self.backend: Backend = backend if backend is not None else open_backend(path, writable)
        try:
            self.superblock = self._read_superblock()
            if self.superblock.region_bytes > self.backend.size_bytes:
                raise RegionFormatError(
                    f"{path} is {self.backend.size_bytes} bytes but its superblock says "
                    f"{self.superblock.region_bytes}; the region was truncated")
            self.pins = LockSpace(path, writable)
        except BaseException:
            self.backend.close()
            raise
        self._meta_mutex = threading.Lock()
        self.commits: Subscribers[Committed] = Subscribers("the commits of " + path)

    def _backup_superblock_offset(self) -> int:
        return self.backend.size_bytes - SUPERBLOCK_BYTES

    def _read_superblock(self) -> Superblock:
        """The superblock; if it is damaged, the backup mkfs wrote in the region's last 4 KiB."""
        if self.backend.size_bytes < SUPERBLOCK_BYTES:
            raise RegionFormatError(f"{self.path} is {self.backend.size_bytes} bytes, too small to be a ckptfs region; "
                                    f"format it with `ckptfs mkfs {self.path}`")
        try:
            return Superblock.unpack(bytes(self.backend.view(0, SUPERBLOCK_BYTES)), self.path)
        except RegionFormatError as primary_error:
            backup = self.backup_superblock()
            if backup is None:
                raise
            log.warning("the superblock of %s is damaged (%s); using its backup copy from the end of the "
                        "region. Copy your checkpoints out (`ckptfs export`) and re-create the region",
                        self.path, primary_error)
            return backup

    def backup_superblock(self) -> Superblock | None:
        """The backup superblock if it is intact and matches this device's size, else None."""
        offset = self._backup_superblock_offset()
        if offset < SUPERBLOCK_BYTES:
            return None
        try:
            sb = Superblock.unpack(bytes(self.backend.view(offset, SUPERBLOCK_BYTES)), self.path)
        except RegionFormatError:
            return None
        return sb if sb.region_bytes == self.backend.size_bytes else None

    # ---------------------------------------------------------------- creation
    @classmethod
    def format(cls, path: str, size_bytes: int | None = None, *, force: bool = False) -> "Region":
        """Write a fresh superblock and empty model table; return the open region.

        A new regular file is created sparse with ``size_bytes`` (default 64 GiB), under a
        temporary name first and linked into place, so a concurrent ``format`` of the same path
        or a reader never sees a half-formatted region (the loser gets RegionFormatError). A block or devdax
        device keeps its own size (``size_bytes``, if given, must equal it).

        Nothing is overwritten unless ``force``: not a region, not a non-empty file, not a
        device whose first MiB holds data (a filesystem, a partition table) - RegionFormatError
        says which and how to proceed.
        """
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        exists = mode is not None
        special = exists and not stat.S_ISREG(mode)
        if exists and stat.S_ISDIR(mode):
            raise RegionFormatError(f"{path} is a directory; a region is a file or a device: give a file path "
                                    f"such as {os.path.join(path, 'ckptfs.region')}")
        if exists and not force:
            refuse_to_overwrite(path, special)
        if special:
            format_in_place(path, size_bytes)
            return cls(path)
        size_bytes = DEFAULT_REGION_BYTES if size_bytes is None else size_bytes
        if size_bytes < 64 << 20:
            raise ValueError(f"size_bytes={size_bytes} is too small; a region needs at least 64 MiB")
        if exists:
            make_sparse_file(path, size_bytes, truncate=True)
            format_in_place(path, None)
        else:
            format_new_file(path, size_bytes)
        return cls(path)

    def close(self) -> None:
        self.pins.close()
        self.backend.close()

    def ring(self, entry: ModelEntry, *, timeout_s: float) -> Ring:
        """The slot lifecycle of ``entry``'s ring for one writer (ckptfs.region.ring); close it
        when done. ``timeout_s``: the longest a claim waits for a free slot."""
        return Ring(self, entry, timeout_s=timeout_s)

    # ---------------------------------------------------------------- model table
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
            raise NotFoundError(f"model {name!r} does not exist in {self.path} (see `ckptfs ls`)")
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
            f"region {self.path} has no contiguous {nbytes} bytes free for a new model ring "
            f"({free} bytes free in all); remove models with `ckptfs rm MODEL`, or create a larger "
            "region with `ckptfs mkfs --size`")

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

    # ---------------------------------------------------------------- latest pointer and counter
    def _word(self, entry: ModelEntry, which: int) -> int:
        return self._entry_offset(entry.index) + which

    def latest_word(self, entry: ModelEntry) -> int:
        return _native.atomic_load_u64(self.backend.mapping, self._word(entry, LATEST_WORD_OFFSET))

    def cas_latest(self, entry: ModelEntry, expected: int, desired: int) -> tuple[bool, int]:
        return _native.atomic_cas_u64(self.backend.mapping, self._word(entry, LATEST_WORD_OFFSET),
                                      expected, desired)

    def counter_word(self, entry: ModelEntry) -> int:
        return _native.atomic_load_u64(self.backend.mapping, self._word(entry, COUNTER_WORD_OFFSET))

    def next_counter(self, entry: ModelEntry) -> int:
        """A counter larger than any handed out before for this model (PCcheck's global counter)."""
        counter = _native.atomic_fetch_add_u64(self.backend.mapping, self._word(entry, COUNTER_WORD_OFFSET), 1) + 1
        if counter > COUNTER_MAX:
            raise CorruptionError(f"the version counter of model {entry.name!r} holds {counter - 1:#x}, more than a "
                                  f"latest pointer can name ({COUNTER_MAX:#x}): the model table is damaged; "
                                  "export the model's versions and re-create it")
        return counter

    def raise_counter(self, entry: ModelEntry, at_least: int) -> None:
        """Make the next counter exceed ``at_least`` (after a crash lost the counter's last update)."""
        off = self._word(entry, COUNTER_WORD_OFFSET)
        while True:
            seen = _native.atomic_load_u64(self.backend.mapping, off)
            if seen >= at_least or _native.atomic_cas_u64(self.backend.mapping, off, seen, at_least)[0]:
                return

    def persist_words(self, entry: ModelEntry) -> None:
        self.backend.persist_mapped(self._entry_offset(entry.index), 16)

    # ---------------------------------------------------------------- slots
    def read_header(self, entry: ModelEntry, slot: int) -> SlotHeader | None:
        """The slot's header if it is valid and belongs to this model and slot."""
        return self._parse_header(entry, slot, self.backend.read_bytes(entry.slot_offset(slot), SLOT_HEADER_BYTES))

    @staticmethod
    def _parse_header(entry: ModelEntry, slot: int, raw: bytes) -> SlotHeader | None:
        header = SlotHeader.unpack(raw)
        if header is None or header.model_index != entry.index or header.slot != slot:
            return None
        if header.state == SLOT_COMMITTED:
            end = header.data_offset + header.data_bytes
            if (header.manifest_offset < SLOT_HEADER_BYTES or header.data_offset % SLOT_HEADER_BYTES
                    or header.manifest_offset + header.manifest_bytes > header.data_offset
                    or end > entry.slot_bytes):
                return None
        return header

    def committed(self, entry: ModelEntry) -> list[SlotVersion]:
        """Every slot holding a committed checkpoint, oldest counter first."""
        out = []
        for slot in range(entry.nslots):
            header = self.read_header(entry, slot)
            if header is not None and header.state == SLOT_COMMITTED:
                out.append(SlotVersion(entry, slot, header))
        return sorted(out, key=lambda v: v.header.counter)

    def latest(self, entry: ModelEntry) -> SlotVersion | None:
        """The version the latest pointer names.

        If the pointer names a slot that does not hold that version, or one whose index fails its
        checksum (a damaged region), falls back to the newest committed version whose index
        verifies, with a warning. (Tensor bytes are checked by ``load``, which falls back too.)
        """
        version, problem = self._resolve_latest(entry)
        if problem is None:
            return version
        for version in reversed(self.committed(entry)):
            if self.index_ok(version):
                log.warning("model %r: %s; falling back to step %d, the newest intact version",
                            entry.name, problem, version.header.step)
                return version
        log.warning("model %r: %s; no intact version is left", entry.name, problem)
        return None

    def latest_problem(self, entry: ModelEntry) -> str | None:
        """None if the latest pointer is empty or names an intact version, else what is wrong."""
        return self._resolve_latest(entry)[1]

    def _resolve_latest(self, entry: ModelEntry) -> tuple[SlotVersion | None, str | None]:
        for _ in range(100):
            word = self.latest_word(entry)
            target = unpack_latest(word)
            if target is None:
                # Nothing published yet. A committed version can still be there: its save's commit
                # was cut before the pointer reached the media (never reported durable, but
                # complete), or the pointer word itself was zeroed. Take the newest intact one.
                for version in reversed(self.committed(entry)):
                    if self.index_ok(version):
                        return version, None
                return None, None
            counter, slot = target
            header = self.read_header(entry, slot) if slot < entry.nslots else None
            version = None
            if header is not None and header.state == SLOT_COMMITTED and header.counter == counter:
                version = SlotVersion(entry, slot, header)
                if self.index_ok(version):
                    return version, None
            if self.latest_word(entry) == word:
                break
            # The pointer moved on while we looked (a newer save published and the old slot is
            # already being rewritten): that is not damage; look again.
        if version is None:
            return None, f"the latest pointer names slot {slot} counter {counter}, which does not hold it"
        return None, f"the index of the latest version (step {version.header.step}, slot {slot}) fails its checksum"

    def index_ok(self, version: SlotVersion) -> bool:
        """Whether the version's index matches the CRC its header holds."""
        h = version.header
        start = version.entry.slot_offset(version.slot) + h.manifest_offset
        return crc32(self.backend.view(start, h.manifest_bytes)) == h.manifest_crc

    def unreadable_slots(self, entry: ModelEntry) -> list[tuple[int, int, Manifest | None]]:
        """(slot, region offset, the index behind it if readable) of every slot whose header is
        neither empty nor valid: damaged by the media, or torn by a crash in the middle of
        rewriting it (only where a write can tear below a 512-byte sector, e.g. devdax). The
        version it held, if any, is lost. (A header zeroed as a whole looks like an empty slot:
        that is what removal leaves, and a fresh slot's index is written before its header.)"""
        out = []
        for slot in range(entry.nslots):
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
        return not any(raw) or self._parse_header(entry, slot, raw) is not None

    def _salvage_index(self, entry: ModelEntry, slot: int) -> Manifest | None:
        start = entry.slot_offset(slot) + SLOT_HEADER_BYTES
        room = entry.slot_bytes - SLOT_HEADER_BYTES
        if room <= 0 or self.backend.view(start, 1)[0] != ord("{"):
            return None
        raw = bytes(self.backend.view(start, min(room, 1 << 20)))
        try:
            return Manifest.decode(raw.split(b"\0", 1)[0])
        except (MalformedInputError, RecursionError):
            return None

    def read_manifest(self, version: SlotVersion) -> Manifest:
        h = version.header
        start = version.entry.slot_offset(version.slot) + h.manifest_offset
        raw = bytes(self.backend.view(start, h.manifest_bytes))
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
        if offset < 0 or offset + len(buf) > entry.slot_bytes:
            raise ValueError(f"write of {len(buf)} bytes at {offset} overflows slot of {entry.slot_bytes}")
        self.backend.write(entry.slot_offset(slot) + offset, buf)

    # ---------------------------------------------------------------- pins
    def pin(self, version: SlotVersion) -> bool:
        """Pin a version against reuse. False if it is gone (its slot was claimed or rewritten)."""
        off = slot_lock_offset(version.entry.index, version.slot)
        if not self.pins.try_shared(off):
            return False
        header = self.read_header(version.entry, version.slot)
        if header is None or header.state != SLOT_COMMITTED or header.counter != version.header.counter:
            self.pins.release(off)
            return False
        return True

    def unpin(self, version: SlotVersion) -> None:
        self.pins.release(slot_lock_offset(version.entry.index, version.slot))

    def is_busy(self, entry: ModelEntry, slot: int) -> bool:
        """Whether another open description pins or claims the slot (for status and rm)."""
        return self.pins.is_locked_by_others(slot_lock_offset(entry.index, slot))

    def remove_version(self, version: SlotVersion) -> None:
        """Invalidate a committed version that is neither latest, pinned nor being written."""
        entry = version.entry
        latest = unpack_latest(self.latest_word(entry))
        if latest is not None and latest[1] == version.slot:
            raise BusyError(f"step {version.header.step} is the latest version of {entry.name!r}; "
                            "it cannot be removed (save a newer one first)")
        off = slot_lock_offset(entry.index, version.slot)
        if not self.pins.try_exclusive(off):
            raise BusyError(f"step {version.header.step} of {entry.name!r} is open or being written; "
                            "close readers and try again")
        try:
            header = self.read_header(entry, version.slot)
            latest = unpack_latest(self.latest_word(entry))
            if header is None or header.counter != version.header.counter:
                raise NotFoundError(f"step {version.header.step} of {entry.name!r} is already gone")
            if latest is not None and latest[1] == version.slot:
                raise BusyError(f"step {version.header.step} became the latest version of {entry.name!r}")
            self.backend.write(entry.slot_offset(version.slot), aligned_buffer(SLOT_HEADER_BYTES))
            self.backend.barrier()
        finally:
            self.pins.release(off)
