"""The model table of a region: its entries (each a model's name and ring), created whole and
removed at once, read without a lock. A part of ``Region`` (``ckptfs.region.region``)."""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
import unicodedata

import numpy as np

from ckptfs import _native
from ckptfs.errors import (BusyError, CorruptionError, InvalidNameError, in_words, no_model,
                           RegionFormatError, RegionFullError, warn_once)
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.extents import SPREAD_EXTENTS
from ckptfs.region.format import (COUNTER_WORD_OFFSET, ENTRY_BYTES, ENTRY_COPY_BYTES, ENTRY_COPY_OFFSET,
                                  LATEST_WORD_OFFSET, NAME_MAX_BYTES, SLOT_HEADER_BYTES,
                                  Extent, ModelEntry)
from ckptfs.region.locks import META_LOCK_OFFSET, model_lock_offset, name_lock_offset, slot_lock_offset
from ckptfs.units import align_up, human_bytes

log = logging.getLogger("ckptfs")
ROOM_TO_GROW_RUNS = 4  # find_gap(room_to_grow=) places in the middle of a free run at least this many times the size


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

    def entry_copy_offsets(self, index: int) -> tuple[int, int]:
        """Where copy A (in the table) and copy B (in its mirror) of entry ``index`` start."""
        return (self._entry_offset(index) + ENTRY_COPY_OFFSET,
                self.superblock.mirror_offset + index * ENTRY_BYTES + ENTRY_COPY_OFFSET)

    def _read_entry(self, index: int) -> ModelEntry | None:
        """The entry at ``index`` (None: free), from the newest intact of its two copies; raises
        RegionFormatError when no copy is intact and the entry is not free."""
        return self._read_copies(index)[0]

    def _read_copies(self, index: int) -> tuple[ModelEntry | None, list[str]]:
        """(the entry, what is wrong with its copies). A copy that is damaged, missing or of an
        older generation than the other is repaired by the next change of the entry
        (``repair_entry``); reading never writes."""
        parsed, errors = [], []
        for which, off in zip("AB", self.entry_copy_offsets(index)):
            try:
                entry = ModelEntry.unpack_copy(index, bytes(self.backend.view(off, ENTRY_COPY_BYTES)))
                if entry is not None:
                    self._check_entry(entry)
                parsed.append(entry)
            except RegionFormatError as e:
                parsed.append(None)
                errors.append(f"copy {which}: {e}")
        self.backend.check_mapping()  # zeros read through a faulted mapping are not a free entry
        valid = [e for e in parsed if e is not None]
        if not valid:
            if errors:
                raise RegionFormatError("; ".join(errors))
            return None, []
        entry = max(valid, key=lambda e: e.generation)
        problems = list(errors)
        for which, copy in zip("AB", parsed):
            if copy is None and not errors:
                problems.append(f"copy {which} is missing")
            elif copy is not None and copy != entry:
                problems.append(f"copy {which} is older (generation {copy.generation} of {entry.generation})")
        return entry, problems

    def _check_entry(self, entry: ModelEntry) -> None:
        try:
            validate_model_name(entry.name)
        except InvalidNameError as e:
            raise RegionFormatError(f"model table entry {entry.index} holds an impossible name: {e}") from None
        sb = self.superblock
        end = sb.data_end
        ordered = sorted(entry.extents, key=lambda x: x.offset)
        for x in ordered:
            if x.offset % sb.block_bytes or x.slot_bytes % sb.block_bytes or x.offset < sb.data_offset or x.end > end:
                raise RegionFormatError(f"model table entry {entry.index} places its slots outside the region's data area")
        if any(a.end > b.offset for a, b in zip(ordered, ordered[1:])):
            raise RegionFormatError(f"model table entry {entry.index} has extents that overlap")

    def _maybe_used(self) -> list[int]:
        """The indices of the entries not free in at least one copy (a non-zero magic), in
        order: the others need no reading. One vectorized pass over the table and its mirror
        instead of 2 x table_entries small reads (~7 ms per model lookup at 1,024 entries)."""
        sb = self.superblock
        n = sb.table_entries
        used = np.zeros(n, dtype=bool)
        for start in (sb.table_offset, sb.mirror_offset):
            rows = np.frombuffer(self.backend.view(start, n * ENTRY_BYTES), dtype=np.uint8).reshape(n, ENTRY_BYTES)
            used |= ModelEntry.copies_in_use(rows)
            del rows  # the view over the mapping
        self.backend.check_mapping()  # zeros read through a faulted mapping are not free entries
        return np.flatnonzero(used).tolist()

    def entry_problems(self) -> list[tuple[ModelEntry, list[str]]]:
        """(entry, what is wrong) of every readable entry whose two copies are not both intact
        and equal (for verify). An entry that looks so is read again under the table lock: read
        between the copies of a change (a ring growing beside a reader, a model made or
        removed), it was reported damaged while all was well."""
        def problems_of(indices) -> list[tuple[ModelEntry, list[str]]]:
            out = []
            for index in indices:
                try:
                    entry, problems = self._read_copies(index)
                except RegionFormatError:
                    continue  # damaged_entries reports it
                if entry is not None and problems:
                    out.append((entry, problems))
            return out
        suspects = problems_of(self._maybe_used())  # no lock: the usual case, nothing to report
        if not suspects or not self.writable:  # open read-only: no write lock to take
            return suspects
        with self.meta_locked():
            return problems_of([entry.index for entry, _ in suspects])

    def entries(self) -> list[ModelEntry]:
        """Every model of the region. A damaged entry is logged and left out (see damaged_entries)."""
        return self._scan_entries()[0]

    def damaged_entries(self) -> list[tuple[int, str | None, str]]:
        """(index, the name it seems to hold or None, what is wrong) of every damaged table entry."""
        return self._scan_entries()[1]

    def _scan_entries(self) -> tuple[list[ModelEntry], list[tuple[int, str | None, str]]]:
        out, damaged = [], []
        for index in self._maybe_used():
            # No lock: an entry is created body first and magic last (one atomic store), and
            # removed by clearing the magic, so a concurrent creation never shows a torn entry.
            # (Taking the table lock here deadlocked create_model, which scans under it.)
            try:
                entry = self._read_entry(index)
            except RegionFormatError as e:
                name = self._salvage_entry_name(index)
                warn_once(log, self.path, f"skipping model table entry {index}"
                                          f"{f' (model {name!r}?)' if name else ''}: {e}")
                damaged.append((index, name, str(e)))
                entry = None
            if entry is not None:
                out.append(entry)
        # Two rings over the same bytes can only come from damage (or a crafted region); writing
        # one would corrupt the other, so neither is trusted.
        ordered = sorted(((x, e) for e in out for x in e.extents), key=lambda p: p[0].offset)
        clash = {e.index for (a, ea), (b, eb) in zip(ordered, ordered[1:]) if a.end > b.offset for e in (ea, eb)}
        for e in [e for e in out if e.index in clash]:
            warn_once(log, self.path,
                      f"skipping model table entry {e.index} (model {e.name!r}): its slots overlap another model's")
            damaged.append((e.index, e.name, f"model table entry {e.index} has slots that overlap another model's"))
        out = [e for e in out if e.index not in clash]
        return out, damaged

    def _salvage_entry_name(self, index: int) -> str | None:
        """The name a damaged entry seems to hold (for messages only; never trusted)."""
        for copy in self.entry_copy_offsets(index):
            off = copy + ModelEntry.NAME_OFFSET
            raw = bytes(self.backend.view(off, NAME_MAX_BYTES)).split(b"\0", 1)[0]
            try:
                if raw:
                    return validate_model_name(raw.decode("utf-8"))
            except (UnicodeDecodeError, InvalidNameError):
                pass
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

    def create_model(self, name: str, nslots: int, slot_bytes: int, min_slots: int | None = None) -> ModelEntry:
        """Add a model of ``nslots`` slots (``_place_ring``), keeping ``nslots`` versions; returns
        the existing entry if present. Where the region has no room for ``nslots`` slots, as few
        as ``min_slots`` (with a warning): the model takes the others when room is made."""
        validate_model_name(name)
        slot_bytes = align_up(slot_bytes, self.superblock.block_bytes)
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
            placed = self._place_ring(nslots, min_slots or nslots, slot_bytes, entries)
            have = sum(n for _, n in placed)
            if have < nslots:
                log.warning("region %s has room for %d slots of %s for model %r, not %d: it keeps fewer versions "
                            "until room is made", self.path, have, human_bytes(slot_bytes), name, nslots)
            firsts = itertools.accumulate((n for _, n in placed), initial=0)  # slot ids run on across extents
            entry = ModelEntry(index, name, nslots, time.time_ns(), tuple(
                Extent(offset, slot_bytes, n, first) for (offset, n), first in zip(placed, firsts)))
            for offset, n in placed:
                self.backend.reserve(offset, n * slot_bytes)
            # Stale headers from a removed model that lived here must not look like versions.
            self.wipe_slot_headers(entry, entry.slots())
            base = self._entry_offset(index)
            mapping = self.backend.mapping
            _native.atomic_store_u64(mapping, base + LATEST_WORD_OFFSET, 0)
            _native.atomic_store_u64(mapping, base + COUNTER_WORD_OFFSET, 0)
            # Both copies but their magics first, then each magic with one atomic 8-byte store: a
            # crash (or a reader) sees a free entry or a complete one, never a torn one, even
            # though the kernel may write the page back at any moment of the copy.
            copy = entry.pack_copy()
            offsets = self.entry_copy_offsets(index)
            for off in offsets:
                mapping[off + 8:off + len(copy)] = copy[8:]
                self.backend.persist_mapped(off, len(copy))
            self.backend.persist_mapped(base, 16)
            try:
                for off in offsets:
                    _native.atomic_store_u64(mapping, off, int.from_bytes(copy[:8], "little"))
                    self.backend.persist_mapped(off, 8)
            except BaseException:
                # Failed half way (an I/O error): no model, rather than one with a copy missing.
                for off in offsets:
                    _native.atomic_store_u64(mapping, off, 0)
                raise
            return entry

    def write_entry(self, entry: ModelEntry, previous: ModelEntry | None = None) -> None:
        """Replace an existing entry by ``entry`` (a later generation); the caller holds the table
        lock. Copy A, durable, then copy B, durable: a crash leaves one intact copy of either
        generation, and readers take the newest intact one. If a step fails (an I/O error), both
        copies are set back to ``previous`` before the error is raised: the change did not
        happen, and no copy is left behind the other."""
        copy = entry.pack_copy()
        try:
            for off in self.entry_copy_offsets(entry.index):
                self.backend.mapping[off:off + len(copy)] = copy
                self.backend.persist_mapped(off, len(copy))
        except BaseException:
            if previous is not None:
                old = previous.pack_copy()
                for off in self.entry_copy_offsets(entry.index):
                    self.backend.mapping[off:off + len(old)] = old
            raise

    def entry_problems_of(self, entry: ModelEntry) -> list[str]:
        """What is wrong with the copies of ``entry`` in the table (empty: both intact and equal)."""
        try:
            return self._read_copies(entry.index)[1]
        except RegionFormatError as e:
            return [str(e)]

    def repair_entry(self, name: str) -> ModelEntry:
        """Rewrite both copies of a model's entry if one is damaged, missing or old (with a
        warning); returns the entry."""
        with self.meta_locked():
            entry = self.get(name)
            _, problems = self._read_copies(entry.index)
            if problems:
                log.warning("model %r: model table entry %d: %s; repaired from the intact copy",
                            name, entry.index, "; ".join(problems))
                self.write_entry(entry)
            return entry

    def reload(self, entry: ModelEntry) -> ModelEntry:
        """The current generation of ``entry`` (same index, name and creation); NotFoundError if
        the model was removed (and perhaps replaced by another of the same name)."""
        try:
            now = self._read_entry(entry.index)
        except RegionFormatError as e:
            raise CorruptionError(f"model {entry.name!r} is not readable in {self.path}: {e}; "
                                  "run `ckptfs verify`") from None
        if now is None or now.name != entry.name or now.created_ns != entry.created_ns:
            raise no_model(entry.name, self.path)
        return now

    def data_area_bytes(self) -> int:
        """The bytes of the region that slots can use, all models together."""
        return self.superblock.data_end - self.superblock.data_offset

    def _place_ring(self, nslots: int, min_slots: int, slot_bytes: int, entries: list[ModelEntry]) -> list[tuple[int, int]]:
        """Where a new model's slots go, (offset, slots) of each extent: one free run that holds
        all ``nslots``, else as many as fit spread over the free runs, the largest first, at
        least ``min_slots`` (else RegionFullError), in at most SPREAD_EXTENTS extents (a region
        whose free space was in holes refused a new model although each hole held a slot)."""
        try:
            return [(self.find_gap(nslots * slot_bytes, entries=entries), nslots)]
        except RegionFullError:
            pass
        runs = self.free_runs(entries)
        placed, left = [], nslots
        for a, b in sorted(runs, key=lambda run: run[0] - run[1])[:SPREAD_EXTENTS]:
            count = min((b - a) // slot_bytes, left)
            if count:
                placed.append((a, count))
                left -= count
        if nslots - left < min_slots:
            raise self._no_room(min_slots * slot_bytes, f"{min_slots} slots of {human_bytes(slot_bytes)}", runs)
        return sorted(placed)

    def free_runs(self, entries: list[ModelEntry]) -> list[tuple[int, int]]:
        """[start, end) of each run of the data area that no model's extent holds, in order."""
        taken = sorted((x.offset, x.end) for e in entries for x in e.extents)
        runs, cursor = [], self.superblock.data_offset
        for a, b in taken:
            if a > cursor:
                runs.append((cursor, a))
            cursor = max(cursor, b)
        runs.append((cursor, self.superblock.data_end))
        return [(a, b) for a, b in runs if b > a]

    def find_gap(self, nbytes: int, *, prefer: int | None = None, what: str = "new slots",
                 entries: list[ModelEntry] | None = None, room_to_grow: bool = False) -> int:
        """The offset of ``nbytes`` of the data area that no model's extent holds (``prefer`` if
        that one is free); RegionFullError when there is none. The caller holds the table lock
        (and passes ``entries`` if it has just scanned them). First fit, or ``room_to_grow``:
        the middle of the largest free run, so that what is placed there can grow in place as
        far as whatever grows into the run from its start (two models that each take one slot
        at a time, a model and its EMA keeping milestones, each took a new extent per slot
        when first fit put them one after the other)."""
        sb = self.superblock
        entries = self._scan_entries()[0] if entries is None else entries
        runs = self.free_runs(entries)
        if prefer is not None and any(a <= prefer and prefer + nbytes <= b for a, b in runs):
            return prefer
        fits = [(a, b) for a, b in runs if b - a >= nbytes]
        if fits and room_to_grow:
            a, b = max(fits, key=lambda run: (run[1] - run[0], -run[0]))
            if b - a >= ROOM_TO_GROW_RUNS * nbytes:  # else first fit: halves too small to hold one were lost
                return a + (b - a - nbytes) // 2 // sb.block_bytes * sb.block_bytes
        if fits:
            return fits[0][0]
        raise self._no_room(nbytes, what, runs)

    def _no_room(self, nbytes: int, what: str, runs: list[tuple[int, int]]) -> RegionFullError:
        """The refusal of ``nbytes`` in one run for ``what``, the free ``runs`` being these."""
        free = sum(b - a for a, b in runs)
        need, have = human_bytes(nbytes), human_bytes(free)
        if need == have:  # "no contiguous 2.2 MiB free ... (2.2 MiB free in all)": say the bytes
            need, have = f"{nbytes:,} bytes", f"{free:,} bytes"
        return RegionFullError(
            f"region {self.path} has no contiguous {need} free for {what} ({have} free in all); " + in_words(
                python="remove models or versions (Store.remove_model, Store.remove), or create a larger region "
                       "(Store.create(path, size_bytes=...))",
                cli="remove models or versions (`ckptfs rm`), or create a larger region (`ckptfs mkfs --size`)"))

    def wipe_slot_headers(self, entry: ModelEntry, slots) -> None:
        """Zero the headers of ``slots``, durably: new slots (no stale header may look like a
        version), a removed version's (its slot holds no version from then on)."""
        blank = aligned_buffer(SLOT_HEADER_BYTES)
        for slot in slots:
            self.backend.write(entry.slot_offset(slot), blank)
        self.backend.barrier()

    def remove_model(self, name: str) -> None:
        """Remove a model and free its slots; BusyError while a writer has it open (a ring:
        ``ring.Ring``) or any of its slots is pinned or claimed."""
        with self.meta_locked():
            entry = self.get(name)
            claimed = []
            try:
                # the model's byte, and its name's: a writer opened before the model was made holds
                # that one until its ring holds the model's (rm --all between the two failed the
                # job's first save with "no model")
                for writers in (model_lock_offset(entry.index), name_lock_offset(name)):
                    if not self.pins.try_exclusive(writers):
                        from ckptfs.region.holders import holders_in_words

                        raise BusyError(f"model {name!r} has a writer open (a training job saving it: "
                                        f"{holders_in_words(self.path, writers, this_process=False)[0]}); " + in_words(
                                            python="close the writer (or stop the job) first",
                                            cli="stop the job that saves it first"))
                    claimed.append(writers)
                for slot in entry.slots():
                    off = slot_lock_offset(entry.index, slot)
                    if not self.pins.try_exclusive(off):
                        raise BusyError(f"model {name!r} is in use (a writer or a reader holds slot {slot}); "
                                        "close it first")
                    claimed.append(off)
                # Clearing the magics (atomic 8-byte stores) frees the entry; the rest is left as
                # it is, so a crash cannot leave a half-cleared entry that looks damaged. (A crash
                # between the two leaves the model in place: removed again, not half removed.)
                for off in self.entry_copy_offsets(entry.index):
                    _native.atomic_store_u64(self.backend.mapping, off, 0)
                    self.backend.persist_mapped(off, 8)
            finally:
                for off in claimed:
                    self.pins.release(off)
