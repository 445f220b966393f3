"""The one read path of a version's tensor bytes: every consumer (load, verify, export, the mount,
later a tier drain) reads through :class:`VersionData`, which owns the address arithmetic (a data
offset to a region offset) and checks each tensor's CRC32 before any of its bytes is trusted.

Two ways in, one rule:
  * ``read(offset, length)``: a range of the data area, zero-copy from the shared mapping. Every
    tensor the range touches is checksummed whole on first touch (then remembered: a committed
    version cannot change while pinned), so damaged bytes never leave as if they were data;
  * ``scan(on_chunk)``: the whole data area in chunks (the write path's chunking): reader
    threads read them into a small pool of page-aligned bounce buffers, bypassing the page
    cache, and checker threads copy each out and take its CRCs as the chunks stream by, at no
    extra pass over the data. Load and verify use it.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from ckptfs.checksum import crc32, crc32_pieces
from ckptfs.chunks import IO_ALIGN_BYTES, Chunk, plan_chunks, tensor_crcs
from ckptfs.errors import CorruptionError
from ckptfs.manifest import Manifest, TensorRecord, align_up
from ckptfs.writer.staging import StagingBuffer, StagingPool

if TYPE_CHECKING:
    import torch

READ_CHUNK_BYTES = 32 << 20
SKIP_GAP_BYTES = 1 << 20  # a scan of some tensors reads across a gap this size between two of them
READ_THREADS = 3  # a scan's threads that only read,
CHECK_THREADS = 2  # those that copy out and checksum what they read,
READ_BUFFERS = 6  # and the buffers between them
CHECK_BLOCK_BYTES = 8 << 20  # a tensor checked through the mapping is read in blocks this size,
PREFETCH_AHEAD_BYTES = 16 << 20  # with this much asked for ahead of the block being checksummed
CHECK_AHEAD_BYTES = 64 << 20  # the tensors this far past a read are checked in the background
CHECK_AHEAD_THREADS = 2
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


class VersionData:
    """The data area of one version, which the caller keeps pinned while it reads.

    ``checked`` (indices of tensors already found intact) may be shared by several opens of the
    same version (the mount shares one per version), so a version is checksummed once, not once
    per open. Thread-safe."""

    def __init__(self, region, data_base: int, manifest: Manifest, checked: set[int] | None = None):
        self._region = region
        self._data_base = data_base
        self.manifest = manifest
        self._checked: set[int] = set() if checked is None else checked
        self._placed: tuple[list[int], list[int]] | None = None  # see _placement
        self._ahead: dict[int, object] = {}  # tensor index -> the Future of its check ahead
        self._ahead_end = 0  # the data offset up to which checks ahead were started

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
        if offset + length + CHECK_AHEAD_BYTES // 2 > self._ahead_end:
            self._check_ahead(offset + length)
        return self._region.backend.view(self._data_base + offset, length)

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
        removes it on error). A tensor read from its first byte to its last, in order, is
        checksummed on the way, at no extra pass over the device, and CorruptionError comes
        before its last block is handed out; a block may span several tensors (a view's extent
        covers tensors stored one after another). Any other access is checked first, as by
        ``read``."""
        stream = {}  # while a tensor streams by: its index, running CRC and next offset
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
            for index, lo, hi, crc in pieces:
                crc = crc32(view[lo - offset:hi - offset], crc)
                record = self.manifest.tensors[index]
                if hi == record.offset + record.nbytes:
                    stream.clear()
                    self._expect(index, crc)
                else:
                    stream.update(index=index, crc=crc, next=hi)
            return view

        return read

    def _stream_pieces(self, offset: int, length: int, stream: dict) -> list[tuple[int, int, int, int]] | None:
        """For a sequential read of ``[offset, offset + length)``: (tensor index, start, end,
        CRC so far) of each piece of a not yet checked tensor it holds, or None when one of them
        is neither the tensor's first bytes nor the continuation of ``stream``."""
        if offset < 0 or length < 0 or offset + length > self.manifest.data_bytes:
            return None
        end, pieces = offset + length, []
        for index, record in self._unchecked_in(offset, end):
            lo, hi = max(offset, record.offset), min(end, record.offset + record.nbytes)
            if lo == record.offset:
                pieces.append((index, lo, hi, 0))
            elif stream.get("index") == index and stream["next"] == lo:
                pieces.append((index, lo, hi, stream["crc"]))
            else:
                return None
        return pieces

    def _check_range(self, offset: int, length: int) -> None:
        todo = []
        for index, record in self._unchecked_in(offset, offset + length):
            ahead = self._ahead.get(index)
            crc = ahead.result().get(index) if ahead is not None and not ahead.cancelled() else None
            if crc is None:
                todo.append((index, record))
            else:
                self._expect(index, crc)
        if todo:
            for (index, _), crc in zip(todo, self._crcs([r for _, r in todo])):
                self._expect(index, crc)

    def _check_ahead(self, offset: int) -> None:
        """Start checking, on background threads, the tensors of the data area from ``offset`` to
        ``CHECK_AHEAD_BYTES`` past it: a reader going front to back (``cp``, a load through the
        mount) then finds them checked, their bytes in memory, while the device was busy with
        them during its reads of the ones before, instead of waiting for each tensor's check at
        its first touch. Small tensors go in batches of about ``CHECK_BLOCK_BYTES``, one read
        each. A check ahead only computes: a tensor whose CRC it finds matching is marked
        checked; any other outcome is left to the reader's own check, which reports it."""
        start = max(offset, self._ahead_end)
        end = min(offset + CHECK_AHEAD_BYTES, self.manifest.data_bytes)
        if start >= end:
            return
        self._ahead_end = end
        pool = _ahead_pool()
        batch: list[tuple[int, TensorRecord]] = []

        def submit() -> None:
            future = pool.submit(self._check_quietly, list(batch))
            for index, _ in batch:
                self._ahead[index] = future
            batch.clear()

        for index, record in self._unchecked_in(start, end):
            if index in self._ahead:
                continue
            if batch and record.offset + record.nbytes - batch[0][1].offset > CHECK_BLOCK_BYTES:
                submit()
            batch.append((index, record))
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

    def _check_quietly(self, batch: list[tuple[int, TensorRecord]]) -> dict[int, int]:
        """A check ahead (see _check_ahead): {index: CRC} of the batch's tensors ({} if they
        could not be read)."""
        try:
            crcs = self._crcs([record for _, record in batch])
        except Exception:  # noqa: BLE001 - the reader's own check reads them again and says why
            return {}
        for (index, record), crc in zip(batch, crcs):
            if crc == record.crc32:
                self._checked.add(index)
        return {index: crc for (index, _), crc in zip(batch, crcs)}

    def _unchecked_in(self, start: int, end: int) -> Iterator[tuple[int, TensorRecord]]:
        """(index, record) of each tensor not yet found intact that holds bytes of data range
        ``[start, end)``, in data order."""
        starts, order = self._placement()
        tensors = self.manifest.tensors
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(order) and starts[i] < end:
            index = order[i]
            record = tensors[index]
            if index not in self._checked and start < record.offset + record.nbytes:
                yield index, record
            i += 1

    def _crcs(self, records: list[TensorRecord]) -> list[int]:
        """CRC32 of the stored bytes of ``records`` (in data order, near each other), in one pass
        with the next blocks read ahead; the bytes are then in memory for the reads of the
        mapping that follow (Backend.checksums)."""
        return self._region.backend.checksums([(self._data_base + r.offset, r.nbytes) for r in records],
                                              CHECK_BLOCK_BYTES, PREFETCH_AHEAD_BYTES)

    def _prefetch(self, offset: int, length: int) -> int:
        """Ask for data range ``[offset, offset + length)`` in the background (clipped to the data
        area); returns where it ends."""
        end = min(offset + length, self.manifest.data_bytes)
        self._region.backend.prefetch(self._data_base + offset, end - offset)
        return end

    def _expect(self, index: int, crc: int) -> None:
        record = self.manifest.tensors[index]
        if crc != record.crc32:
            self.confirm()  # zeros from a faulted mapping: say so, not "damaged bytes"
            raise CorruptionError(self.damage_message(record))
        self._checked.add(index)

    def damage_message(self, record: TensorRecord) -> str:
        m = self.manifest
        return (f"tensor {record.name!r} of {m.model} step {m.step} fails its checksum; the stored bytes are "
                "damaged: use another version (`ckptfs ls`) and run `ckptfs verify`")

    # ------------------------------------------------------------------ streaming
    def scan(self, on_chunk: Callable[[StagingBuffer, Chunk], None] | None = None,
             progress: Callable[[int], None] | None = None,
             only: set[int] | None = None,
             buffers: "ReadBuffers | None" = None) -> list[tuple[TensorRecord, int]]:
        """Read the whole data area chunk by chunk, calling ``on_chunk(buffer, chunk)`` for each;
        return (record, CRC as read) of every tensor whose bytes fail their checksum (the intact
        ones are remembered as checked). ``only``: the indices of the tensors wanted; just the
        pages that hold their bytes are read (``on_chunk`` sees only their pieces), and only
        they are checked. ``buffers``: the read buffers to use (``ReadBuffers``: a load of several
        versions, as a resharded load's parts, faults in one set, not one per version)."""
        scan = self.scanner(on_chunk, progress, only)
        with contextlib.nullcontext(buffers) if buffers is not None else ReadBuffers() as pool:
            scan_together([scan], pool)
        return scan.bad()

    def scanner(self, on_chunk: Callable[[StagingBuffer, Chunk], None] | None = None,
                progress: Callable[[int], None] | None = None,
                only: set[int] | None = None) -> "Scan":
        """``scan``'s work, to run with other versions' in one pipeline (``scan_together``)."""
        return Scan(self, on_chunk, progress, only)

    def restore(self, map_location="cpu", verify: bool = True, into=None):
        """The saved object (see ckptfs.restore.restore, which needs torch: this module does
        not, so that the mount and the CLI's listings load without it)."""
        from ckptfs.restore import restore

        return restore(self, map_location, verify, into)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
        """Recompute every tensor's CRC from the region; one problem per mismatching tensor."""
        return [VerifyProblem(self.manifest.model, self.manifest.step, r.name,
                              f"checksum mismatch (stored {r.crc32:08x}, computed {crc:08x})")
                for r, crc in self.scan(None, progress)]


def _wanted_runs(chunk: Chunk, only: set[int]) -> list[Chunk]:
    """The parts of ``chunk`` that hold the pieces of the tensors in ``only``, page-aligned, as
    chunks of their own (a gap of more than SKIP_GAP_BYTES between two wanted pieces is not
    read): a load that wants a few small tensors of a part (a replicated optimizer scalar, one
    row of a shard) reads those pages, not the 32 MiB chunks around them."""
    runs, wanted = [], [p for p in chunk.pieces if p.tensor in only]
    i = 0
    while i < len(wanted):
        j = i + 1
        while j < len(wanted) and wanted[j].buffer_start - (wanted[j - 1].buffer_start + wanted[j - 1].length) \
                <= SKIP_GAP_BYTES:
            j += 1
        lo = wanted[i].buffer_start // IO_ALIGN_BYTES * IO_ALIGN_BYTES
        hi = min(align_up(wanted[j - 1].buffer_start + wanted[j - 1].length, IO_ALIGN_BYTES), chunk.length)
        runs.append(Chunk(chunk.start + lo, hi - lo,
                          tuple(p._replace(buffer_start=p.buffer_start - lo) for p in wanted[i:j])))
        i = j
    return runs


class Scan:
    """The scan of one version (``VersionData.scan``): its chunks (of the wanted tensors' pages
    where ``only``), ``check`` of each chunk read (``on_chunk``, then its CRCs), and ``bad``
    once every chunk is checked."""

    def __init__(self, data: VersionData, on_chunk, progress, only: set[int] | None):
        self.data = data
        self.on_chunk = on_chunk  # may be set after a ReadAhead started, before the checks
        self._progress = progress
        self.only = only
        manifest = data.manifest
        chunks = plan_chunks(manifest.tensors, manifest.data_bytes, READ_CHUNK_BYTES)
        if only is not None:
            chunks = [run for c in chunks for run in _wanted_runs(c, only)]
        self.chunks = chunks
        self._crcs_of: dict[int, list[int]] = {}  # chunk.start -> the CRCs of its pieces
        self._mutex = threading.Lock()

    def read(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """Read ``chunk`` into ``buf``, bypassing the page cache."""
        data = self.data
        data._region.backend.read_direct(data._data_base + chunk.start, memoryview(buf.mapping)[:chunk.length])

    def check(self, buf: StagingBuffer, chunk: Chunk) -> None:
        """A chunk read: copied out, its CRCs taken."""
        if self.on_chunk is not None:
            self.on_chunk(buf, chunk)
        crcs = crc32_pieces(buf.mapping, chunk.pieces)
        with self._mutex:
            self._crcs_of[chunk.start] = crcs
        if self._progress:
            self._progress(chunk.length)

    def bad(self) -> list[tuple[TensorRecord, int]]:
        """(record, CRC as read) of each scanned tensor that fails its checksum; the intact ones
        are remembered as checked."""
        data, only = self.data, self.only
        crcs = tensor_crcs(self.chunks, self._crcs_of, len(data.manifest.tensors))
        bad = []
        for index, (record, crc) in enumerate(zip(data.manifest.tensors, crcs, strict=True)):
            if only is not None and index not in only:
                continue
            if crc == record.crc32:
                data._checked.add(index)
            else:
                bad.append((record, crc))
        return bad


def _ordered(scans: list[Scan]) -> list[tuple[Chunk, Scan]]:
    """Every chunk of ``scans`` in the order they are read: the small ones first, while the
    device's queue is short (a resharded load's few wanted tensors of a part)."""
    return sorted(((chunk, scan) for scan in scans for chunk in scan.chunks), key=lambda w: w[0].length)


class ReadAhead:
    """The first chunks of ``scans`` (up to READ_BUFFERS, into ``buffers``), read on threads of
    their own from now on, before their checks are known (a resharded load's planning, which
    waits for the slowest rank, runs meanwhile); ``scan_together(scans, buffers, ahead)`` checks
    them first. ``cancel`` where it never comes."""

    def __init__(self, scans: list[Scan], buffers: "ReadBuffers"):
        work = _ordered(scans)
        self.items: list[tuple[Chunk, Scan, object]] = []  # (chunk, scan, future of the buffer read into)
        if not work:
            return
        buffers.fit(work[-1][0].length)
        self._buffers = buffers
        first = work[:READ_BUFFERS]
        # each buffer is taken (made and faulted in, the first time: milliseconds each) on the
        # thread that reads into it, so that the first read starts before the last buffer exists
        pool = ThreadPoolExecutor(min(READ_THREADS, len(first)), thread_name_prefix="ckptfs-read-ahead")
        self.items = [(chunk, scan, pool.submit(_read_into, scan, chunk, buffers)) for chunk, scan in first]
        pool.shutdown(wait=False)

    def cancel(self) -> None:
        """The reads end, their buffers go back (idempotent)."""
        items, self.items = self.items, []
        for _, _, done in items:
            if done.exception() is None:
                self._buffers.release(done.result())


def _read_into(scan: Scan, chunk: Chunk, buffers: "ReadBuffers") -> StagingBuffer:
    """``chunk`` read into a buffer taken from ``buffers`` (given back if the read fails)."""
    buf = buffers.acquire()
    try:
        scan.read(chunk, buf)
    except BaseException:
        buffers.release(buf)
        raise
    return buf


def scan_together(scans: list[Scan], buffers: "ReadBuffers", ahead: ReadAhead | None = None) -> None:
    """Run ``scans`` (of versions kept open meanwhile) in one pipeline: reader threads only read,
    each chunk into a free buffer of ``buffers``, and hand it to checker threads that ``check``
    it and give the buffer back. A reader that copied and checksummed each chunk itself before
    its next read left the device waiting meanwhile (as the persist workers' CRCs did on the
    write path); versions scanned one after the other left it waiting at each one's end, and
    behind each of many small reads (a resharded load's parts). ``ahead``: a ReadAhead of these
    same scans, whose chunks are checked first. Raises the first error of a read or a check."""
    work = _ordered(scans)
    if not work:
        return
    buffers.fit(work[-1][0].length)
    pre = []
    if ahead is not None:
        pre, ahead.items = ahead.items, []
        if [(c, s) for c, s, _ in pre] != work[:len(pre)]:
            raise ValueError("a ReadAhead of other scans")  # a bug of the caller: nothing was read for it
    rest = work[len(pre):]
    checks = []
    failed = threading.Event()  # a check failed: the reads not started are not made

    def check(scan: Scan, read, chunk: Chunk) -> None:
        """``read``: the buffer ``chunk`` was read into, or the future of a read ahead's."""
        try:
            buf = read if isinstance(read, StagingBuffer) else read.result()  # a failed read gave its back
            try:
                scan.check(buf, chunk)
            finally:
                buffers.release(buf)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(min(CHECK_THREADS, len(work)), thread_name_prefix="ckptfs-check") as checkers:
        for chunk, scan, read in pre:
            checks.append(checkers.submit(check, scan, read, chunk))

        def read(chunk: Chunk, scan: Scan) -> None:
            if not failed.is_set():
                checks.append(checkers.submit(check, scan, _read_into(scan, chunk, buffers), chunk))

        readers = ThreadPoolExecutor(max(1, min(READ_THREADS, len(rest))), thread_name_prefix="ckptfs-read")
        try:
            for done in [readers.submit(read, chunk, scan) for chunk, scan in rest]:
                done.result()
        finally:
            readers.shutdown(wait=True, cancel_futures=True)  # after an error: no more reads
            for done in checks:  # every check ends (and gives its buffer back) before the pool closes
                done.exception()
    for done in checks:
        done.result()


class ReadBuffers:
    """The bounce buffers of scans, one scan at a time: a pool (writer.staging.StagingPool) of
    up to READ_BUFFERS, page-aligned, of the largest chunk a scan asked for (``fit``), made on
    first need and freed on ``close`` (a context manager). Fresh memory is faulted in at a cost
    (30-300 ms for a set on the VM measured): a load of several versions shares one set."""

    def __init__(self):
        self._pool: StagingPool | None = None

    def fit(self, nbytes: int) -> None:
        """Before a scan whose chunks are up to ``nbytes``: smaller buffers are let go."""
        if self._pool is None or nbytes > self._pool.chunk_bytes:
            if self._pool is not None:
                self._pool.close()
            nbytes = max(align_up(nbytes, IO_ALIGN_BYTES), IO_ALIGN_BYTES)
            self._pool = StagingPool(nbytes, nbytes * READ_BUFFERS,
                                     advice="free memory, or read this version where more memory is free")

    def acquire(self) -> StagingBuffer:
        return self._pool.acquire()

    def release(self, buf: StagingBuffer) -> None:
        self._pool.release(buf)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "ReadBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
