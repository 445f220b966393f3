"""The one read path of a version's tensor bytes: every consumer (load, verify, export, the mount,
later a tier drain) reads through :class:`VersionData`, which owns the address arithmetic (a data
offset to a region offset) and checks each tensor's CRC32 before any of its bytes is trusted.

Two ways in, one rule:
  * ``read(offset, length)``: a range of the data area, zero-copy from the shared mapping. Every
    tensor the range touches is checksummed on first touch, whole or, for a tensor with block
    CRCs, the blocks under the range (then remembered: a committed version cannot change while
    pinned), so damaged bytes never leave as if they were data;
  * ``scan(on_chunk)``: the whole data area, or the tensors wanted, in chunks read past the page
    cache and checked as they stream by (``ckptfs.scan``). Load and verify use it.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

from ckptfs.checksum import crc32
from ckptfs.chunks import Chunk
from ckptfs.errors import CorruptionError
from ckptfs.manifest import Manifest, TensorRecord
from ckptfs.scan import ReadBuffers, Scan, Wanted, scan_together
from ckptfs.writer.staging import StagingBuffer

if TYPE_CHECKING:
    import torch

CHECK_BLOCK_BYTES = 8 << 20  # a tensor checked through the mapping is read in blocks this size,
PREFETCH_AHEAD_BYTES = 16 << 20  # with this much asked for ahead of the block being checksummed
CHECK_AHEAD_BYTES = 64 << 20  # the tensors this far past a read are checked in the background
CHECK_AHEAD_THREADS = 2
READ_ENDS_KEPT = 16  # where the last reads ended: a read starting at one continues a front-to-back pass
_check_ahead_pool: ThreadPoolExecutor | None = None
_check_ahead_lock = threading.Lock()


def _ahead_pool() -> ThreadPoolExecutor:
    global _check_ahead_pool
    with _check_ahead_lock:
        if _check_ahead_pool is None:
            _check_ahead_pool = ThreadPoolExecutor(CHECK_AHEAD_THREADS, thread_name_prefix="ckptfs-check-ahead")
        return _check_ahead_pool


@dataclass(frozen=True)
class VerifyProblem:
    """One failed check: the version, the tensor (None for the index) and what is wrong;
    ``repairable``: one of two copies is lost, the other is used, and the model's next writer
    rewrites the lost one (nothing of the version is lost)."""

    model: str
    step: int
    tensor: str | None
    message: str
    repairable: bool = False

    def __str__(self) -> str:
        where = (self.model + (f" step {self.step}" if self.step >= 0 else "")
                 + (f" tensor {self.tensor}" if self.tensor else ""))
        return f"{where}: {self.message}"


class _Unit(NamedTuple):
    """What one check of a range covers: a whole tensor, or one block of a tensor that has
    block CRCs."""

    key: int | tuple[int, int]  # in VersionData's ``checked``: the tensor's index, or (index, block)
    index: int  # the tensor's
    offset: int  # the data offset of its first byte
    nbytes: int
    crc32: int


# a unit from its fields without NamedTuple's __new__, a Python call: a pass over 40,000 small
# tensors makes as many units (19 -> 8 ms a pass measured)
_new_unit = functools.partial(tuple.__new__, _Unit)


class VersionData:
    """The data area of one version, which the caller keeps pinned while it reads.

    ``checked`` (indices of tensors already found intact, and (index, block number) of blocks
    found intact in tensors not checked whole) may be shared by several opens of the same
    version (the mount shares one per version), so a version is checksummed once, not once per
    open. Thread-safe."""

    def __init__(self, region, data_base: int, manifest: Manifest, checked: set | None = None):
        self._region = region
        self._data_base = data_base
        self.manifest = manifest
        self._checked: set = set() if checked is None else checked
        self.shown_names: dict[str, str] = {}  # {a record's name: the name errors say} (a part's items.3)
        self._placed: tuple[list[int], list[int]] | None = None  # see _placement
        self._ahead: dict = {}  # _Unit.key -> the Future of its check ahead
        self._ahead_end = 0  # the data offset up to which checks ahead were started
        self._read_ends: collections.deque[int] = collections.deque(maxlen=READ_ENDS_KEPT)
        self._ends_lock = threading.Lock()

    def _placement(self) -> tuple[list[int], list[int]]:
        """(data offsets in ascending order, the index of the tensor at each), sorted on the first
        range read: an open that only lists a version's files (the mount's first stat) reads none."""
        placed = self._placed
        if placed is None:
            # ints and a sort by key, no (offset, index) pairs: 40,000 tuples would start the
            # cyclic GC over every object of the process
            tensors = self.manifest.tensors
            indices = [i for i, r in enumerate(tensors) if r.nbytes]
            offsets = [tensors[i].offset for i in indices]
            order = sorted(range(len(indices)), key=offsets.__getitem__)  # stable: ties by index
            placed = self._placed = ([offsets[j] for j in order], [indices[j] for j in order])
        return placed

    # ------------------------------------------------------------------ ranges
    def read(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of the data area, zero-copy; CorruptionError
        naming the tensor if a tensor the range touches fails its checksum."""
        if offset < 0 or length < 0 or offset + length > self.manifest.data_bytes:
            raise ValueError(f"read of {length} bytes at data offset {offset} is outside the "
                             f"{self.manifest.data_bytes} bytes of {self.manifest.model} step {self.manifest.step}")
        self._check_range(offset, length)
        end = offset + length
        if self._continues_a_pass(offset, end) and end + CHECK_AHEAD_BYTES // 2 > self._ahead_end:
            self._check_ahead(end)
        return self._region.backend.view(self._data_base + offset, length)

    def _continues_a_pass(self, offset: int, end: int) -> bool:
        """Whether a read of ``[offset, end)`` continues a front-to-back pass (it starts where one
        of the last READ_ENDS_KEPT reads ended), whose bytes past it are then checked ahead. A
        read anywhere else (a pass's first, a tool sampling rows, ``torch.load(mmap=True)``
        touching a few tensors, a file's header) checks only what it reads: checks ahead of
        random reads kept the device from the reads that waited (a random 3 KiB read of a 154 MB
        tensor through the mount, cold: median 4 ms without them, 12-18 ms with)."""
        with self._ends_lock:
            continues = offset in self._read_ends
            self._read_ends.append(end)
        return continues

    def tensor(self, index: int) -> torch.Tensor:
        """Stored tensor ``index`` as a read-only tensor over the region's mapping (zero-copy,
        checked against its CRC first): for callers that copy pieces of it elsewhere, as a
        resharded load does. Copy before the version is closed."""
        import torch

        record = self.manifest.tensors[index]
        if not record.nbytes:
            return torch.empty(record.shape, dtype=record.torch_dtype)
        raw = self.read(record.offset, record.nbytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is only read
            return torch.frombuffer(raw, dtype=record.torch_dtype).view(record.shape)

    def confirm(self) -> None:
        """RegionIOError if an access to the region's mapping has faulted since it was opened
        (the file cut short under it, a media error): bytes handed out by ``read`` are zero-copy
        views, so a consumer calls this after it has copied them and before it trusts the copy
        (the mount before it replies, export before it keeps its file)."""
        self._region.backend.check_mapping()

    def sequential_reader(self) -> Callable[[int, int], memoryview]:
        """A ``read`` for one front-to-back pass over a file (``View.iter_blocks``) whose consumer
        keeps nothing until the pass completes (``ckptfs export`` writes a temporary file and
        removes it on error). A tensor (or a block of one that has blocks) read from its first
        byte to its last, in order, is checksummed on the way, at no extra pass over the device,
        and CorruptionError comes before its last byte is handed out; a read may span several
        tensors (a view's extent covers tensors stored one after another). Any other access is
        checked first, as by ``read``."""
        stream = {}  # while a unit streams by: its key, running CRC and next offset
        ahead = [0]  # the data offset up to which the bytes were asked for in the background

        def read(offset: int, length: int) -> memoryview:
            pieces = self._stream_pieces(offset, length, stream)
            if pieces is None:  # not a front-to-back pass: check first, as read() does
                stream.clear()
                return self.read(offset, length)
            if min(offset + length + PREFETCH_AHEAD_BYTES // 2, self.manifest.data_bytes) > ahead[0]:
                # asked again once half of what was asked for is read: an advice costs a walk of
                # the range's pages (~0.1 ms per 16 MiB), too much for each of 40,000 small tensors
                ahead[0] = self._prefetch(offset, length + PREFETCH_AHEAD_BYTES)
            view = self._region.backend.view(self._data_base + offset, length)
            for unit, lo, hi, crc in pieces:
                crc = crc32(view[lo - offset:hi - offset], crc)
                if hi == unit.offset + unit.nbytes:
                    stream.clear()
                    self._expect(unit, crc)
                else:
                    stream.update(key=unit.key, crc=crc, next=hi)
            return view

        return read

    def _stream_pieces(self, offset: int, length: int, stream: dict) -> list[tuple[_Unit, int, int, int]] | None:
        """For a sequential read of ``[offset, offset + length)``: (unit, start, end, CRC so
        far) of each piece of a not yet checked unit it holds, or None when one of them is
        neither the unit's first bytes nor the continuation of ``stream``."""
        if offset < 0 or length < 0 or offset + length > self.manifest.data_bytes:
            return None
        end, pieces = offset + length, []
        for unit in self._unchecked_in(offset, end):
            lo, hi = max(offset, unit.offset), min(end, unit.offset + unit.nbytes)
            if lo == unit.offset:
                pieces.append((unit, lo, hi, 0))
            elif stream.get("key") == unit.key and stream["next"] == lo:
                pieces.append((unit, lo, hi, stream["crc"]))
            else:
                return None
        return pieces

    def _check_range(self, offset: int, length: int) -> None:
        todo = []
        for unit in self._unchecked_in(offset, offset + length):
            ahead = self._ahead.get(unit.key)
            crc = ahead.result().get(unit.key) if ahead is not None and not ahead.cancelled() else None
            if crc is None:
                todo.append(unit)
            else:
                self._expect(unit, crc)
        if todo:
            for unit, crc in zip(todo, self._crcs(todo)):
                self._expect(unit, crc)

    def _check_ahead(self, offset: int) -> None:
        """Start checking, on background threads, the tensors of the data area from ``offset`` to
        ``CHECK_AHEAD_BYTES`` past it: a reader going front to back (``cp``, a load through the
        mount) then finds them checked, their bytes in memory, while the device was busy with
        them during its reads of the ones before, instead of waiting for each tensor's check at
        its first touch (of a tensor with blocks, only the blocks in that span). Small tensors
        go in batches of about ``CHECK_BLOCK_BYTES``, one read each. A check ahead only
        computes: a unit whose CRC it finds matching is marked checked; any other outcome is
        left to the reader's own check, which reports it."""
        start = max(offset, self._ahead_end)
        end = min(offset + CHECK_AHEAD_BYTES, self.manifest.data_bytes)
        if start >= end:
            return
        self._ahead_end = end
        pool = _ahead_pool()
        batch: list[_Unit] = []

        def submit() -> None:
            future = pool.submit(self._check_quietly, list(batch))
            for unit in batch:
                self._ahead[unit.key] = future
            batch.clear()

        for unit in self._unchecked_in(start, end):
            if unit.key in self._ahead:
                continue
            if batch and unit.offset + unit.nbytes - batch[0].offset > CHECK_BLOCK_BYTES:
                submit()
            batch.append(unit)
        if batch:
            submit()

    def close(self) -> None:
        """Stop the checks ahead (those not started are dropped, the running ones waited for):
        called before the version is unpinned, so that none reads a slot being reused, or the
        region after its store closed."""
        self._ahead_end = self.manifest.data_bytes  # no more
        for future in set(self._ahead.values()):
            if not future.cancel():
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - a check ahead never raises; nothing to report
                    pass

    def _check_quietly(self, batch: list[_Unit]) -> dict:
        """A check ahead (see _check_ahead): {unit key: CRC} of the batch's units ({} if they
        could not be read)."""
        try:
            crcs = self._crcs(batch)
        except Exception:  # noqa: BLE001 - the reader's own check reads them again and says why
            return {}
        for unit, crc in zip(batch, crcs):
            if crc == unit.crc32:
                self._checked.add(unit.key)
        return {unit.key: crc for unit, crc in zip(batch, crcs)}

    def _unchecked_in(self, start: int, end: int) -> Iterator[_Unit]:
        """The units not yet found intact that hold bytes of data range ``[start, end)``, in
        data order: each such tensor, or where it has block CRCs, each such block of it."""
        starts, order = self._placement()
        tensors, checked, block = self.manifest.tensors, self._checked, self.manifest.crc_block_bytes
        i, n = max(bisect.bisect_right(starts, start) - 1, 0), len(order)
        while i < n and starts[i] < end:
            index = order[i]
            i += 1
            if index in checked:
                continue
            record = tensors[index]
            _, _, _, offset, nbytes, crc, blocks = record  # one unpacking: 40,000 records a pass
            if start >= offset + nbytes:
                continue
            if not blocks:
                yield _new_unit((index, index, offset, nbytes, crc))
                continue
            for b in record.block_span(block, start - offset, end - offset):
                if (index, b) not in checked:
                    lo = b * block
                    yield _Unit((index, b), index, offset + lo, min(block, nbytes - lo), blocks[b])

    def _crcs(self, units: list[_Unit]) -> list[int]:
        """CRC32 of the stored bytes of ``units`` (in data order, near each other), in one pass
        with the next blocks read ahead; the bytes are then in memory for the reads of the
        mapping that follow (Backend.checksums)."""
        return self._region.backend.checksums([(self._data_base + u.offset, u.nbytes) for u in units],
                                              CHECK_BLOCK_BYTES, PREFETCH_AHEAD_BYTES)

    def _prefetch(self, offset: int, length: int) -> int:
        """Ask for data range ``[offset, offset + length)`` in the background (clipped to the data
        area); returns where it ends."""
        end = min(offset + length, self.manifest.data_bytes)
        self._region.backend.prefetch(self._data_base + offset, end - offset)
        return end

    def _expect(self, unit: _Unit, crc: int) -> None:
        if crc != unit.crc32:
            self.confirm()  # zeros from a faulted mapping: say so, not "damaged bytes"
            raise CorruptionError(self.damage_message(self.manifest.tensors[unit.index]))
        self._checked.add(unit.key)

    def damage_message(self, record: TensorRecord) -> str:
        m = self.manifest
        name = self.shown_names.get(record.name, record.name)
        return (f"tensor {name!r} of {m.model} step {m.step} fails its checksum; the stored bytes are "
                "damaged: use another version (`ckptfs ls`) and run `ckptfs verify`")

    # ------------------------------------------------------------------ streaming
    def scan(self, on_chunk: Callable[[StagingBuffer, Chunk], object] | None = None,
             progress: Callable[[int], None] | None = None,
             only: Wanted | None = None,
             buffers: "ReadBuffers | None" = None) -> list[tuple[TensorRecord, int]]:
        """Read the whole data area chunk by chunk, calling ``on_chunk(buffer, chunk)`` for each
        (its return value is not used, unless it is marked ``gives_crcs``: see Scan.check);
        return (record, CRC as read) of every tensor whose bytes fail their checksum (the intact
        ones are remembered as checked). ``only``: the tensors wanted, as indices (whole) or
        {index: (start, end) of the bytes wanted, or None for all}; just the pages that hold
        their bytes are read (``on_chunk`` sees only their pieces), of a tensor with block CRCs
        only the blocks that hold the bytes wanted, and only those are checked. ``buffers``: the
        read buffers to use (``ReadBuffers``: a load of several versions, as a resharded load's
        parts, faults in one set, not one per version)."""
        scan = self.scanner(on_chunk, progress, only)
        with contextlib.nullcontext(buffers) if buffers is not None else ReadBuffers() as pool:
            scan_together([scan], pool)
        return scan.bad()

    def scanner(self, on_chunk: Callable[[StagingBuffer, Chunk], object] | None = None,
                progress: Callable[[int], None] | None = None,
                only: Wanted | None = None) -> "Scan":
        """``scan``'s work, to run with other versions' in one pipeline (``scan_together``)."""
        return Scan(self, on_chunk, progress, only)

    def restore(self, map_location="cpu", verify: bool = True, into=None, keys=None):
        """The saved object (see ckptfs.restore.restore, which needs torch: this module does
        not, so that the mount and the CLI's listings load without it)."""
        from ckptfs.restore import restore

        return restore(self, map_location, verify, into, keys=keys)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
        """Recompute every tensor's CRC from the region; one problem per mismatching tensor."""
        return [VerifyProblem(self.manifest.model, self.manifest.step, self.shown_names.get(r.name, r.name),
                              f"checksum mismatch (stored {r.crc32:08x}, computed {crc:08x})")
                for r, crc in self.scan(None, progress)]
