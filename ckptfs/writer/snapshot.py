"""Snapshot phase of a save: copy the tensors chunk by chunk into staging buffers and hand each
chunk to the persist workers. CPU tensors go through the native multi-threaded copy
(ckptfs.memcopy); GPU tensors through pinned buffers on side streams (ckptfs.writer.cuda).
"""
from __future__ import annotations

from typing import Callable

import torch

from ckptfs.chunks import Chunk
from ckptfs.memcopy import copy_spans, copy_spans_crc32, host_bytes
from ckptfs.writer.cuda import CallerMark, SideStreams, copy_chunk_pieces
from ckptfs.writer.job import Job
from ckptfs.writer.staging import StagingBuffer, StagingPool

# enqueue(job, chunk, filled buffer, its pool, CUDA events to wait for, piece CRCs or None)
Enqueue = Callable[[Job, Chunk, StagingBuffer, StagingPool, tuple, list | None], None]
# unpark(job): let go of the buffers held for the job's parked CRCs (PersistPipeline.unpark)
Unpark = Callable[[Job], None]


def byte_source(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without a copy when it is contiguous."""
    # Conjugate / negative views are lazy bits on top of the storage: materialize them, as the
    # bytes must hold the values the caller sees.
    # Each step only where it changes something: 1.9 us a tensor instead of 4.6 (the spans of
    # 40,000 tensors are made with it); on an H100 it left the stall of GPT-2 + AdamW unchanged.
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() != 1:
        t = t.reshape(-1)
    return t.view(torch.uint8)


def _is_own_bytes(t: torch.Tensor) -> bool:
    """Whether ``byte_source(t)`` is a view of the bytes at ``t.data_ptr()`` as they lie, in
    order: a contiguous tensor without lazy conjugate or negative bits. Else it makes a copy
    (on a GPU, a kernel)."""
    return t.is_contiguous() and not (t.is_conj() or t.is_neg())


class Snapshotter:
    """Takes the snapshots of one writer; returns once the tensors may change."""

    def __init__(self, enqueue: Enqueue, unpark: Unpark, copy_threads: int, timeout_s: float):
        self._enqueue = enqueue
        self._unpark = unpark
        self._copy_threads = copy_threads
        self._timeout_s = timeout_s
        self._side_streams = SideStreams()
        # The spans of the last host snapshot's layout, kept per tensor: a save of the same
        # tensors reuses those of each tensor copied from its own memory at the same address
        # (building a buffer over each of 40,000 tensors is most of such a save's stall, and the
        # spans' objects are most of the garbage collector's work of a save); it holds those
        # tensors' memory until the next host snapshot or the writer's end.
        self._host_spans: _HostSpans | None = None

    def take(self, job: Job, pool: StagingPool, mark: CallerMark | None) -> None:
        """Copy every chunk of ``job`` out of its tensors; ``mark``: where its CUDA copies start."""
        devices = job.plan.cuda_devices
        if devices:
            self._take_cuda(job, pool, devices, mark)
        else:
            try:
                self._take_host(job, self.host_spans(job.plan), pool)
            finally:
                if self._host_spans is not None:
                    self._host_spans.drop_copies()

    def host_spans(self, plan) -> list[list[tuple]]:
        """Per chunk of a plan of CPU tensors, the (buffer offset, source, source offset,
        length) spans of its copy (Writer.prepare makes them ahead of the first save).

        A tensor's spans are reused from the last snapshot of the same layout when it starts at
        the same address and is, now as then, copied from its own memory (the same parameter,
        updated in place; ``_is_own_bytes``): they are over exactly the bytes it holds now, as
        the memory they cover stays allocated while held. The others' (new tensors, views to
        make contiguous) are made again."""
        cached = self._host_spans
        if cached is None or cached.layout is not plan.layout:
            cached = self._host_spans = _HostSpans(plan.layout)
        cached.update(plan.flat.tensors)
        return cached.spans

    def _buffer(self, job: Job, pool: StagingPool) -> StagingBuffer:
        """A staging buffer for the next chunk. Before waiting for one, the buffers the job's
        parked CRCs hold are let go: they may be the ones it waits for."""
        buf = pool.try_acquire()
        if buf is None:
            self._unpark(job)
            buf = pool.acquire(self._timeout_s)
        return buf

    def _take_host(self, job: Job, spans: list[list[tuple]], pool: StagingPool) -> None:
        """CPU tensors: the native multi-threaded copy, chunk by chunk."""
        for chunk, chunk_spans in zip(job.chunks, spans, strict=True):
            buf = self._buffer(job, pool)
            try:
                if job.crc_in_snapshot:
                    # A background snapshot runs while the caller computes: checksumming here
                    # keeps that memory traffic out of the caller's next optimizer step, which
                    # the persist workers' checksums would otherwise overlap; taken in the copy's
                    # own pass, the tensors are read from memory once. A snapshot the caller
                    # waits for leaves them to the persist workers: in the copy they lengthened
                    # its stall by a quarter (bench_save, 2-core VM: flat 0.74 -> 0.94 of a
                    # memcpy, GPT-2 + AdamW 0.77 -> 0.98) for no durable time gained. (A tensor changed
                    # during the snapshot, against save()'s contract, is torn as before; changed
                    # inside a window between its CRC and its copy, it also fails its check on load.)
                    crcs = copy_spans_crc32(buf.mapping, chunk_spans, chunk.pieces, self._copy_threads)
                else:
                    copy_spans(buf.mapping, chunk_spans, self._copy_threads)
                    crcs = None
            except BaseException:
                pool.release(buf)
                raise
            self._enqueue(job, chunk, buf, pool, (), crcs)

    def _take_cuda(self, job: Job, pool: StagingPool, devices: set[int], mark: CallerMark | None) -> None:
        """Some tensors on GPUs: copies into pinned buffers on side streams; the persist workers
        wait for each chunk's events. Returns once every copy is done (the tensors may change)."""
        # A thread's current device starts as 0: without this, registering the pinned buffers
        # from the snapshot thread would make a context on GPU 0 in every rank of a job.
        with torch.cuda.device(min(devices)):
            streams = self._side_streams.ordered_after_caller(devices, mark)
            sources = _LazySources(job.plan.flat.tensors, streams)
            pending = []
            for chunk, runs in zip(job.chunks, job.plan.layout.copy_runs, strict=True):
                buf = self._buffer(job, pool)
                try:
                    events = copy_chunk_pieces(buf.tensor, runs, sources, streams)
                except BaseException:
                    _release_after_copies(pool, buf)
                    raise
                pending.extend(events)
                self._enqueue(job, chunk, buf, pool, events, None)
            for event in pending:
                event.synchronize()


class _LazySources:
    """The byte source of each tensor of a CUDA snapshot, made when a chunk first needs it, so
    that the first chunks' copies are queued while the later tensors' sources are still to be
    made: made all before the first copy, they kept the copy engine idle for ~3.5 ms of a 31 ms
    snapshot of GPT-2 + AdamW (592 tensors) on an H100, against a 28 ms device-to-host copy."""

    def __init__(self, tensors: list, streams: dict[int, "torch.cuda.Stream"]):
        self._tensors = tensors
        self._streams = streams
        self._made: list[torch.Tensor | None] = [None] * len(tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        source = self._made[i]
        if source is None:
            t = self._tensors[i]
            if t.is_cuda and not _is_own_bytes(t):
                # a view that must be made contiguous is copied on the side stream, after the
                # caller's work and before the copies that read it, like the rest of the snapshot
                with torch.cuda.stream(self._streams[t.device.index]):
                    source = byte_source(t)
            else:
                # only views of the tensor's own memory: no GPU work, no stream to enter
                # (entering one costs as much as queueing the tensor's copy)
                source = byte_source(t)
            self._made[i] = source
        return source


def _release_after_copies(pool: StagingPool, buf: StagingBuffer) -> None:
    """Give back a pinned buffer whose chunk failed to queue: once the copies already queued
    into it are done. A device in error keeps it out of the pool (a copy may still land)."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the save's own error is the one to report
        return
    pool.release(buf)


class _HostSpans:
    """The copy spans of one layout's chunks, with what each tensor's come from."""

    def __init__(self, layout) -> None:
        self.layout = layout
        n = len(layout.records)
        self.ptrs: list[int | None] = [None] * n  # the address each tensor's spans are over; None: make again
        self.hosts: list = [None] * n
        self.chunks_of: list[list[int]] = [[] for _ in range(n)]
        for c, chunk in enumerate(layout.chunks):
            for p in chunk.pieces:
                if not self.chunks_of[p.tensor] or self.chunks_of[p.tensor][-1] != c:
                    self.chunks_of[p.tensor].append(c)
        self.spans: list[list[tuple] | None] = [None] * len(layout.chunks)
        self._copies: list[int] = []

    def update(self, tensors) -> None:
        """Make the spans of every tensor not at its cached address, and of their chunks."""
        stale = set()
        for i, t in enumerate(tensors):
            ptr = t.data_ptr()
            # the address alone does not name the bytes: a transposed, strided or conjugate view
            # of the same memory starts there too (and was saved as the last snapshot's bytes)
            if self.ptrs[i] != ptr or self.hosts[i] is None or not _is_own_bytes(t):
                source = byte_source(t)
                self.hosts[i] = host_bytes(source)
                own = not source.numel() or source.data_ptr() == ptr
                self.ptrs[i] = ptr if own else None
                if not own:
                    self._copies.append(i)
                stale.update(self.chunks_of[i])
        for c in stale:
            self.spans[c] = [(p.buffer_start, self.hosts[p.tensor], p.tensor_start, p.length)
                             for p in self.layout.copy_runs[c]]

    def drop_copies(self) -> None:
        """After a snapshot: let go of the copies made for it (a non-contiguous tensor's), which
        are not over the tensor's memory; the next snapshot makes them again."""
        for i in self._copies:
            self.hosts[i] = None
            for c in self.chunks_of[i]:
                self.spans[c] = None
        self._copies.clear()
