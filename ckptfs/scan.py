"""Scans: a version's data area read in chunks (the write path's chunking) or just the pages of
the tensors wanted, bypassing the page cache: reader threads read them into a small pool of
page-aligned bounce buffers, checker threads copy each out and take its CRCs as the chunks stream
by, at no extra pass over the data. ``VersionData.scan`` runs one; a resharded load runs the scans
of several parts in one pipeline (``scan_together``). Each tensor read is checked against its
CRC32, or a tensor read in part against the CRCs of the blocks read (FORMAT.md, block CRCs).
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Mapping

from ckptfs.checksum import crc32_pieces
from ckptfs.chunks import IO_ALIGN_BYTES, Chunk, Piece, block_crcs, block_pieces, plan_chunks, tensor_crcs
from ckptfs.manifest import Manifest, TensorRecord
from ckptfs.units import align_up
from ckptfs.writer.staging import StagingBuffer, StagingPool

if TYPE_CHECKING:
    from ckptfs.reader import VersionData

READ_CHUNK_BYTES = 32 << 20
SKIP_GAP_BYTES = 1 << 20  # a scan of some tensors reads across a gap this size between two of them
READ_THREADS = 3  # a scan's threads that only read,
CHECK_THREADS = 2  # those that copy out and checksum what they read,
READ_BUFFERS = 6  # and the buffers between them
Wanted = set[int] | Mapping[int, tuple[int, int] | None]  # a scan's ``only`` (see VersionData.scan)


def _wanted_runs(chunk: Chunk, wanted_piece: Callable[[Piece], bool]) -> list[Chunk]:
    """The parts of ``chunk`` that hold the pieces for which ``wanted_piece`` is true,
    page-aligned, as chunks of their own (a gap of more than SKIP_GAP_BYTES between two wanted
    pieces is not read): a load that wants a few small tensors of a part (a replicated optimizer
    scalar, one row of a shard) reads those pages, not the 32 MiB chunks around them."""
    runs, wanted = [], [p for p in chunk.pieces if wanted_piece(p)]
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

    def __init__(self, data: VersionData, on_chunk, progress, only: Wanted | None):
        self.data = data
        self.on_chunk = on_chunk  # may be set after a ReadAhead started, before the checks
        self._progress = progress
        manifest = data.manifest
        block = manifest.crc_block_bytes
        chunks = plan_chunks(manifest.tensors, manifest.data_bytes, READ_CHUNK_BYTES, block)
        # only: {index: None (the whole tensor) or the range of its blocks wanted}
        self.only: dict[int, range | None] | None = None
        if only is not None:
            self.only = wanted = _wanted_blocks(manifest, only)
            chunks = [run for c in chunks for run in _wanted_runs(c, lambda p: p.tensor in wanted and (
                wanted[p.tensor] is None or p.tensor_start // block in wanted[p.tensor]))]
        self.chunks = chunks
        self._crcs_of: dict[int, list[int]] = {}  # chunk.start -> the CRCs of its pieces
        self._mutex = threading.Lock()

    def read(self, chunk: Chunk, buf: StagingBuffer) -> None:
        """Read ``chunk`` into ``buf``, bypassing the page cache."""
        data = self.data
        data._region.backend.read_direct(data._data_base + chunk.start, memoryview(buf.mapping)[:chunk.length])

    def check(self, buf: StagingBuffer, chunk: Chunk) -> None:
        """A chunk read: copied out, its CRCs taken (by an ``on_chunk`` marked ``gives_crcs``,
        ckptfs.restore.copy_out's: the CRCs of ``chunk.pieces`` it returns were taken in its
        copy's pass over the buffer; any other callback's return value is not looked at)."""
        crcs = self.on_chunk(buf, chunk) if self.on_chunk is not None else None
        if not getattr(self.on_chunk, "gives_crcs", False):
            crcs = crc32_pieces(buf.mapping, chunk.pieces)
        elif len(crcs) != len(chunk.pieces):  # a bug of the callback: never a verdict from it
            raise RuntimeError(f"on_chunk gave {len(crcs)} CRCs for a chunk of {len(chunk.pieces)} pieces")
        with self._mutex:
            self._crcs_of[chunk.start] = crcs
        if self._progress:
            self._progress(chunk.length)

    def bad(self) -> list[tuple[TensorRecord, int | None]]:
        """(record, CRC as read) of each scanned tensor that fails its checksum (of one scanned
        in part: of its first failing block); the intact ones (blocks) are remembered as
        checked."""
        data, only, records = self.data, self.only, self.data.manifest.tensors
        crcs = tensor_crcs(self.chunks, self._crcs_of, len(records))
        bad = []
        for index, (record, crc) in enumerate(zip(records, crcs, strict=True)):
            if only is not None and index not in only:
                continue
            if only is None or only[index] is None:
                if crc == record.crc32:
                    data._checked.add(index)
                else:
                    bad.append((record, crc))
        if only is not None and any(blocks is not None for blocks in only.values()):
            bad += self._bad_blocks()
        return bad

    def _bad_blocks(self) -> list[tuple[TensorRecord, int | None]]:
        """``bad`` of the tensors scanned in part: their blocks read are checked one by one."""
        data, records = self.data, self.data.manifest.tensors
        block = data.manifest.crc_block_bytes
        read = block_crcs(block_pieces(self.chunks, records, block), self._crcs_of)
        bad = []
        for index, blocks in self.only.items():
            for b in blocks or ():
                crc = read.get(index, {}).get(b)
                if crc == records[index].block_crcs[b]:
                    data._checked.add((index, b))
                else:
                    bad.append((records[index], crc))
                    break
        return bad


def _wanted_blocks(manifest: Manifest, only: Wanted) -> dict[int, range | None]:
    """A scan's ``only`` as {index: None (the whole tensor) or the range of the numbers of its
    blocks that hold the bytes wanted}; a range that covers every block is None."""
    if not isinstance(only, Mapping):
        return dict.fromkeys(only)
    out = {}
    for index, span in only.items():
        record = manifest.tensors[index]
        blocks = record.block_span(manifest.crc_block_bytes, *span) if span is not None else None
        out[index] = None if blocks is None or len(blocks) == len(record.block_crcs) or not record.block_crcs \
            else blocks
    return out


def _ordered(scans: list[Scan]) -> list[tuple[Chunk, Scan]]:
    """Every chunk of ``scans`` in the order they are read: the READ_BUFFERS largest first (in
    data order), then the small ones, while the device's queue is short (a resharded load's few
    wanted tensors of a part), then the rest by size (of one size, in data order). The first
    ones are what a ReadAhead reads while DCP plans the load: the smallest there (a part's
    wanted scalars, a few pages each) left the device idle through the planning (a W=4 -> 2
    load of GPT-2 + AdamW on the VM, rounds alternating: 0.754-0.790 s with the largest first,
    0.813-0.960 s without)."""
    work = [(chunk, scan) for scan in scans for chunk in scan.chunks]
    largest = sorted(range(len(work)), key=lambda i: -work[i][0].length)[:READ_BUFFERS]  # stable: data order
    head = sorted(largest)
    taken = set(head)
    rest = sorted((i for i in range(len(work)) if i not in taken), key=lambda i: work[i][0].length)
    return [work[i] for i in head + rest]


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
        buffers.fit(max(chunk.length for chunk, _ in work))
        self._buffers = buffers
        first = work[:READ_BUFFERS]
        # each buffer is taken (made and faulted in, the first time: milliseconds each) on the
        # thread that reads into it, so that the first read starts before the last buffer exists
        pool = ThreadPoolExecutor(min(READ_THREADS, len(first)), thread_name_prefix="ckptfs-read-ahead")
        self.items = [(chunk, scan, pool.submit(_read_into, scan, chunk, buffers)) for chunk, scan in first]
        pool.shutdown(wait=False)

    def cancel(self) -> None:
        """The reads not started are not made; those under way end and give their buffers back
        (idempotent)."""
        items, self.items = self.items, []
        for _, _, done in items:
            done.cancel()  # waiting for READ_THREADS reads, not for every read queued behind them
        for _, _, done in items:
            if not done.cancelled() and done.exception() is None:
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
    buffers.fit(max(chunk.length for chunk, _ in work))
    pre = []
    if ahead is not None:
        if [(c, s) for c, s, _ in ahead.items] != work[:len(ahead.items)]:
            # a bug of the caller: nothing was read for it (the reads stay the ahead's, to cancel)
            raise ValueError("a ReadAhead of other scans")
        pre, ahead.items = ahead.items, []
    rest = work[len(pre):]
    checks = []
    failed = threading.Event()  # a read or a check failed: the reads not started are not made

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
        # the reads ahead end before this scan's readers start: started meanwhile, they took the
        # buffers the reads ahead were still waiting for, while the checkers waited for those
        # reads in order, and nothing moved again
        for _, _, read in pre:
            read.exception()

        def read(chunk: Chunk, scan: Scan) -> None:
            if failed.is_set():
                return
            try:
                buf = _read_into(scan, chunk, buffers)
            except BaseException:
                failed.set()  # at once: the other readers start no more reads while this one's error travels
                raise
            checks.append(checkers.submit(check, scan, buf, chunk))

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


def current_cuda_device() -> int | None:
    """The calling thread's current GPU where this process has started CUDA (torch imported
    and its CUDA initialized), else None; never starts it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


class ReadBuffers:
    """The bounce buffers of scans, one scan at a time: a pool (writer.staging.StagingPool) of
    up to READ_BUFFERS, page-aligned, of the largest chunk a scan asked for (``fit``), made on
    first need and freed on ``close`` (a context manager). Fresh memory is faulted in at a cost
    (30-300 ms for a set on the VM measured): a load of several versions shares one set.

    In a process that already uses CUDA the buffers are registered with it where they can be
    (``current_cuda_device``): a load's copies into GPU tensors then go from them by DMA at the bus's
    speed, not through the driver's staging of pageable memory (a W=1 DCP load of GPT-2 +
    AdamW on an H200: the checkers' time 0.19 s instead of 0.52 s, the load 5 % faster). A
    process that does not (the mount, the CLI) is never made to start CUDA."""

    def __init__(self):
        self._pool: StagingPool | None = None
        # registered by the reader threads, in the context of the GPU current here (see StagingBuffer)
        self._pin_device = current_cuda_device()

    def fit(self, nbytes: int) -> None:
        """Before a scan whose chunks are up to ``nbytes``: smaller buffers are let go."""
        if self._pool is None or nbytes > self._pool.chunk_bytes:
            if self._pool is not None:
                self._pool.close()
            nbytes = max(align_up(nbytes, IO_ALIGN_BYTES), IO_ALIGN_BYTES)
            self._pool = StagingPool(nbytes, nbytes * READ_BUFFERS, pinned=self._pin_device is not None,
                                     pin_optional=True, pin_device=self._pin_device,
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
