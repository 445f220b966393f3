"""A formatted region: opening it (superblock and its backup), the latest pointers and counters,
pins, and removal of versions. Its model table is table.py, its slots as read are slots.py; the
slot lifecycle of a save (claim, commit, publish) is ring.py.

Concurrency model (several processes may open one region):
  * the model table changes rarely (a new model, a removed model) under an exclusive OFD lock;
  * each model's latest pointer and counter are 64-bit words updated with atomics on the shared
    mapping (PCcheck Listing 1): the hot path takes no lock;
  * a slot being written is claimed with an exclusive lock byte, a slot being read is pinned
    with a shared one (see locks.py). A claim is only ever taken on a slot that is not latest,
    and is re-checked after the lock is held, so latest and pinned slots are never handed out.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import weakref

from ckptfs import _native
from ckptfs.errors import (BusyError, CkptfsError, CorruptionError, NotFoundError, RegionFormatError, in_words,
                           not_a_region)
from ckptfs.region.backend import Backend, is_devdax, open_backend
from ckptfs.region.claim import Committed
from ckptfs.region.format import (COUNTER_MAX, COUNTER_WORD_OFFSET, LATEST_WORD_OFFSET, SLOT_COMMITTED,
                                  SUPERBLOCK_BYTES, ModelEntry, Superblock, backup_superblock_offset,
                                  unpack_latest)
from ckptfs.region.events import Subscribers
from ckptfs.region.locks import LockSpace, name_lock_offset, slot_lock_offset
from ckptfs.region.mkfs import (check_region_size, format_in_place, format_new_file, make_sparse_file,
                                refuse_if_in_use, refuse_to_overwrite)
from ckptfs.region.ring import Ring, move_latest_back
from ckptfs.region.slots import SlotReader, SlotVersion
from ckptfs.region.table import ModelTable, validate_model_name  # noqa: F401 - part of this module's API
from ckptfs.units import human_bytes

log = logging.getLogger("ckptfs")

DEFAULT_REGION_BYTES = 64 << 30  # a region file is sparse: only the rings of saved models take disk space


class Region(ModelTable, SlotReader):
    """An open region. Thread-safe; share one per process per path."""

    def __init__(self, path: str, writable: bool = True, backend: Backend | None = None):
        """Open the region at ``path``; ``backend`` replaces the device backend (fault-injection
        harnesses pass an instrumented one)."""
        self.path = path
        self.writable = writable
        self.read_only_reason: OSError | None = None  # why a region asked for writable opened read-only
        self.backend: Backend = backend if backend is not None else open_backend(path, writable)
        try:
            self.superblock = self._read_superblock()
            if self.superblock.region_bytes > self.backend.size_bytes:
                raise RegionFormatError(
                    f"{path} is {human_bytes(self.backend.size_bytes)} but its superblock says "
                    f"{human_bytes(self.superblock.region_bytes)}: the region was truncated; restore it from a copy")
            self.pins = LockSpace(path, writable)
        except BaseException:
            self.backend.close()
            raise
        self._meta_mutex = threading.Lock()
        _regions.add(self)
        self.commits: Subscribers[Committed] = Subscribers("the commits of " + path)

    def check_writable(self, what: str) -> None:
        """CkptfsError, in one line, where the region is open read-only: it cannot be ``what``
        ("saved to", "changed")."""
        if self.writable:
            return
        why = self.read_only_reason
        if why is None:
            raise CkptfsError(f"{self.path} is open read-only: it can be read, not {what}; open the store writable")
        again = in_words(python="open the store again", cli="run the command again")
        fix = (f"make its filesystem writable and {again}" if why.errno == errno.EROFS
               else f"give this user write access to it (its owner may: chmod, chown), or run as its owner, and {again}")
        raise CkptfsError(f"{self.path} is open read-only ({why.strerror or 'no write access'}): it can be read, "
                          f"not {what}; {fix}")

    def _read_superblock(self) -> Superblock:
        """The superblock; if it is damaged, the backup mkfs wrote in the region's last 4 KiB."""
        if self.backend.size_bytes < SUPERBLOCK_BYTES:
            raise not_a_region(self.path, f"{self.backend.size_bytes} bytes, too small to be one")
        try:
            return self.primary_superblock()
        except RegionFormatError as primary_error:
            backup = self.backup_superblock()
            if backup is None:
                raise
            log.warning("the superblock of %s is damaged (%s); using its backup copy from the end of the "
                        "region. Copy your checkpoints out (`ckptfs export`) and re-create the region",
                        self.path, primary_error)
            return backup

    def primary_superblock(self) -> Superblock:
        """The superblock at offset 0, checked (RegionFormatError where it is damaged)."""
        return Superblock.unpack(bytes(self.backend.view(0, SUPERBLOCK_BYTES)), self.path)

    def backup_superblock(self) -> Superblock | None:
        """The backup superblock if it is intact and matches this device's size, else None."""
        offset = backup_superblock_offset(self.backend.size_bytes)
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
        if size_bytes is not None and (isinstance(size_bytes, bool) or not isinstance(size_bytes, int)):
            raise ValueError(f"size_bytes must be an int (a number of bytes, e.g. 64 << 30), got {size_bytes!r}")
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        exists = mode is not None
        special = exists and not stat.S_ISREG(mode)
        if exists and stat.S_ISDIR(mode):
            raise RegionFormatError(f"{path} is a directory; a region is a file or a device: give a file path "
                                    f"such as {os.path.join(path, 'ckptfs.region')}")
        if special and not stat.S_ISBLK(mode) and not is_devdax(path):
            raise RegionFormatError(f"{path} is neither a file, a block device nor a devdax device (/dev/daxX.Y): "
                                    "a region cannot be made there; give a file path or such a device")
        if exists and not force:
            refuse_to_overwrite(path, special)
        if exists:
            refuse_if_in_use(path)
        if special:
            format_in_place(path, size_bytes)
            return cls(path)
        size_bytes = DEFAULT_REGION_BYTES if size_bytes is None else size_bytes
        check_region_size(size_bytes)
        if exists:
            make_sparse_file(path, size_bytes, truncate=True)
            format_in_place(path, None)
        else:
            format_new_file(path, size_bytes)
        return cls(path)

    def close(self) -> None:
        self.pins.close()
        self.backend.close()
        self.closed = True

    closed = False

    def check_open(self, what: str) -> None:
        """CkptfsError if the region was closed (its Store's ``close``): ``what`` (a version
        opened from it, say) cannot be used any more."""
        if self.closed:
            raise CkptfsError(f"{what} was opened from a Store that is closed since: open the Store again "
                              f"(ckptfs.Store({self.path!r})) and the version from it")

    def ring(self, entry: ModelEntry, *, timeout_s: float, sole: bool = True) -> Ring:
        """The slot lifecycle of ``entry``'s ring for one writer (ckptfs.region.ring); close it
        when done. ``timeout_s``: the longest a claim waits for a free slot; ``sole``: see Ring."""
        return Ring(self, entry, timeout_s=timeout_s, sole=sole)

    def hold_name(self, model: str) -> tuple[ModelEntry | None, int | None]:
        """For a writer of ``model``, no model of that name being made yet: (None, the name's
        lock byte, held exclusively until ``pins.release`` of it, once the first save made the
        model: a second writer of it is refused at its opening, ``locks.name_lock_offset``); or
        (the model's entry, None) where it was made meanwhile: its ring's lock decides. BusyError
        naming who holds the byte."""
        offset = name_lock_offset(model)
        if not self.pins.try_exclusive(offset):
            from ckptfs.region.holders import holders_in_words

            who, here_only = holders_in_words(self.path, offset)
            raise BusyError(f"model {model!r} has a writer open in {'this process' if here_only else who} that has "
                            "not saved yet: one writer per model; close that one first, or save under another name")
        try:
            entry = self.find(model)
        except BaseException:  # an I/O error reading the table: no writer holds the name
            self.pins.release(offset)
            raise
        if entry is not None:
            self.pins.release(offset)
            return entry, None
        return None, offset


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


    # ---------------------------------------------------------------- pins
    def pin(self, version: SlotVersion) -> bool:
        """Pin a version against reuse. False if it is gone (its slot was claimed or rewritten,
        given back by its model, or its model removed); nothing held when it raises."""
        off = slot_lock_offset(version.entry.index, version.slot)
        if not self.pins.try_shared(off):
            return False
        try:
            if self._still_there(version) is not None:
                return True
        except BaseException:
            self.pins.release(off)
            raise
        self.pins.release(off)
        return False

    def _still_there(self, version: SlotVersion) -> ModelEntry | None:
        """The model's entry as it is now if ``version`` is still in its slot, the slot's lock
        byte held: the slot is still its model's, where it was (a slot given back keeps its
        header, its bytes another model's from then on), and its header still the version's;
        else None."""
        try:
            now = self.reload(version.entry)
        except NotFoundError:
            return None  # the model was removed
        if not now.same_slot(version.entry, version.slot):
            return None
        header = self.read_header(version.entry, version.slot)
        ok = header is not None and header.state == SLOT_COMMITTED and header.counter == version.header.counter
        return now if ok else None

    def unpin(self, version: SlotVersion) -> None:
        self.pins.release(slot_lock_offset(version.entry.index, version.slot))

    def is_busy(self, entry: ModelEntry, slot: int) -> bool:
        """Whether another open description pins or claims the slot (for status and rm)."""
        return self.pins.is_locked_by_others(slot_lock_offset(entry.index, slot))

    def remove_version(self, version: SlotVersion, *, allow_latest: bool = False) -> None:
        """Invalidate a committed version that is neither pinned nor being written, nor latest
        unless ``allow_latest`` (a rollback: the latest pointer moves back first, see
        ``ring.move_latest_back``). Latest as listed (``SlotReader.latest``): a version committed
        newer than the pointer (a commit cut before its publish) is latest too."""
        entry = version.entry
        if not allow_latest and self._is_latest(SlotVersion(self.reload(entry), version.slot, version.header)):
            raise BusyError(f"step {version.header.step} is the latest version of {entry.name!r}; it is removed only "
                            "on request, to roll the model back to its newest older version: " + in_words(
                                python="store.remove(model, step, allow_latest=True)",
                                cli="`ckptfs rm --allow-latest`"))
        off = slot_lock_offset(entry.index, version.slot)
        if not self.pins.try_exclusive(off):
            raise BusyError(f"step {version.header.step} of {entry.name!r} is open or being written; "
                            "close readers and try again")
        try:
            now = self._still_there(version)
            if now is None:
                raise NotFoundError(f"step {version.header.step} of {entry.name!r} is already gone")
            # the model's entry as it is now (the caller's may predate slots it took since): what
            # is latest, and where the pointer moves back to, are read through it
            version, entry = SlotVersion(now, version.slot, version.header), now
            word = self.latest_word(entry)
            latest, is_latest = unpack_latest(word), self._is_latest(version)
            if is_latest and not allow_latest:
                raise BusyError(f"step {version.header.step} became the latest version of {entry.name!r}")
            if is_latest or (latest is not None and latest[1] == version.slot):
                # the pointer may name it (a newer unpublished version stays latest) or an older one
                move_latest_back(self, version, word)
            self.wipe_slot_headers(entry, [version.slot])
        finally:
            self.pins.release(off)

    def _is_latest(self, version: SlotVersion) -> bool:
        """Whether ``version`` is its model's latest as listed (``SlotReader.latest``); its entry
        read as it is now by the caller."""
        return version.is_save(self.latest(version.entry))


_regions: "weakref.WeakSet[Region]" = weakref.WeakSet()  # every Region opened in this process


def _after_fork_in_child() -> None:
    # a thread of the parent inside a table update (a ring growing its slots) held the mutex at
    # the fork, and is not in the child: the child's own updates (create, keep, remove) waited forever
    for region in list(_regions):
        region._meta_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
