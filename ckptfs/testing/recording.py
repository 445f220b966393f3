"""An instrumented region backend that records what reaches the device, and when it is durable.

``RecordingBackend`` is a :class:`~ckptfs.region.backend.FileBackend` (the real O_DIRECT writes,
fdatasync barriers and msync persists still happen) that also appends, in one total order taken
under a lock, every event the crash emulator (:mod:`ckptfs.testing.crashsim`) needs:

``Write(id, offset, data)``      a slot write was issued; ``data`` is a copy of the buffer;
``WriteDone(id)``                 ... and ``pwrite`` returned;
``BarrierStart(id, covers)``      ``barrier()`` began; ``covers`` = the writes that had returned
                                  by then and were not yet durable (fdatasync makes those
                                  durable, whatever other barriers run at the same time; a
                                  write still in progress when it began is not covered);
``BarrierEnd(id)``                ... and returned: the covered writes are now durable;
``MapChange(changes)``            8-byte words of the watched metadata (superblock + the first
                                  ``watch_entries`` model table entries) changed in the shared
                                  mapping since the previous event: ``[(word_index, new_value)]``.
                                  Atomics and in-place stores on the mapping do not go through the
                                  backend, so the mapping is compared at every event;
``Persist(offset, length)``       ``persist_mapped`` returned: the watched words in the range hold,
                                  durably, the values they had when it was called;
``Mark(kind, info)``              a harness annotation (a save started / completed, an operation
                                  began / ended), so the checker knows what had been promised.

Use it with ``Region(path, backend=RecordingBackend(path))``.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ckptfs.region.backend import FileBackend
from ckptfs.region.format import ENTRY_BYTES, SUPERBLOCK_BYTES, Superblock


@dataclass(frozen=True)
class Write:
    id: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class WriteDone:
    id: int


@dataclass(frozen=True)
class BarrierStart:
    id: int
    covers: frozenset


@dataclass(frozen=True)
class BarrierEnd:
    id: int


@dataclass(frozen=True)
class MapChange:
    changes: tuple  # ((word_index, new_value), ...)


@dataclass(frozen=True)
class Persist:
    offset: int
    length: int


@dataclass(frozen=True)
class Mark:
    kind: str
    info: dict = field(default_factory=dict)


class RecordingBackend(FileBackend):
    """A file backend that records every write, barrier and metadata persist (see module doc).

    ``write_hook(offset, length)`` is called (outside the recording lock) before each write: a
    scenario uses it to inject delays and so reorder the commits of concurrent saves.
    """

    def __init__(self, path: str, writable: bool = True, *, watch_entries: int = 16,
                 write_hook: Callable[[int, int], None] | None = None):
        super().__init__(path, writable)
        sb = Superblock.unpack(bytes(self.view(0, SUPERBLOCK_BYTES)), path)
        # the first entries of the table and of its mirror (and what lies between: never written)
        self.watch_bytes = min(sb.mirror_offset + watch_entries * ENTRY_BYTES, sb.data_offset)
        self.data_offset = sb.data_offset
        self.events: list = []
        self.write_hook = write_hook
        self._lock = threading.Lock()
        self._next_write = 0
        self._next_barrier = 0
        self._done_not_durable: set[int] = set()
        self._last_words = self._words()
        self.initial_words = self._last_words.copy()

    # ---- recording helpers (call with self._lock held) ---------------------------------------
    def _words(self) -> np.ndarray:
        return np.frombuffer(self._map, dtype="<u8", count=self.watch_bytes // 8).copy()

    def _note_map(self) -> None:
        now = self._words()
        changed = np.flatnonzero(now != self._last_words)
        if changed.size:
            self.events.append(MapChange(tuple((int(i), int(now[i])) for i in changed)))
            self._last_words = now

    # ---- the backend interface ----------------------------------------------------------------
    def write(self, offset: int, buf) -> None:
        if offset < self.watch_bytes:
            raise AssertionError(f"write at {offset} into the mapped metadata: the two write paths "
                                 "must never share a range")
        if self.write_hook is not None:
            self.write_hook(offset, len(buf))
        data = bytes(memoryview(buf).cast("B"))
        with self._lock:
            self._note_map()
            wid = self._next_write
            self._next_write += 1
            self.events.append(Write(wid, offset, data))
        super().write(offset, buf)
        with self._lock:
            self._note_map()
            self._done_not_durable.add(wid)
            self.events.append(WriteDone(wid))

    def barrier(self) -> None:
        with self._lock:
            self._note_map()
            bid = self._next_barrier
            self._next_barrier += 1
            covers = frozenset(self._done_not_durable)
            self.events.append(BarrierStart(bid, covers))
        super().barrier()
        with self._lock:
            self._note_map()
            # Concurrent barriers may cover the same writes; whichever ends first makes them durable.
            self._done_not_durable -= covers
            self.events.append(BarrierEnd(bid))

    def persist_mapped(self, offset: int, length: int) -> None:
        # The words are captured before msync starts, so the recorded durable values are ones
        # msync is certain to write (a concurrent later update may or may not be included; the
        # crash emulator treats it as pending).
        with self._lock:
            self._note_map()
        super().persist_mapped(offset, length)
        with self._lock:
            self.events.append(Persist(offset, length))
            self._note_map()

    # ---- annotations -------------------------------------------------------------------------
    def mark(self, kind: str, **info) -> None:
        with self._lock:
            self._note_map()
            self.events.append(Mark(kind, info))

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for e in self.events:
            counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
        return counts


def copy_sparse(src: str, dst: str) -> None:
    """Copy a (sparse) region file, keeping its holes: only the data extents are copied."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size = os.fstat(fi.fileno()).st_size
        os.ftruncate(fo.fileno(), size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fi.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = os.lseek(fi.fileno(), start, os.SEEK_HOLE)
            off = start
            while off < end:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), end - off, off, off)
                if n <= 0:
                    raise OSError(f"copy_file_range stalled at {off} copying {src}")
                off += n
            pos = end
