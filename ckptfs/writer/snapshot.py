"""Snapshot phase of a save: copy the tensors chunk by chunk into staging buffers and hand each
chunk to the persist workers. CPU tensors go through the native multi-threaded copy
(ckptfs.memcopy); GPU tensors through pinned buffers on side streams (ckptfs.writer.cuda).
"""
from __future__ import annotations

from typing import Callable

import torch

from ckptfs.checksum import crc32
from ckptfs.chunks import Chunk
from ckptfs.memcopy import copy_spans, host_bytes
from ckptfs.writer.cuda import CallerMark, SideStreams, copy_chunk_pieces
from ckptfs.writer.job import Job
from ckptfs.writer.staging import StagingBuffer, StagingPool

# enqueue(job, chunk, filled buffer, its pool, CUDA events to wait for, piece CRCs or None)
Enqueue = Callable[[Job, Chunk, StagingBuffer, StagingPool, tuple, list | None], None]


def byte_source(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without a copy when it is contiguous."""
    # Conjugate / negative views are lazy bits on top of the storage: materialize them, as the
    # bytes must hold the values the caller sees.
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def piece_crcs(buf: StagingBuffer, chunk: Chunk) -> list[tuple[int, int, int, int]]:
    """(tensor, tensor_start, length, crc32) of every tensor piece in a filled staging buffer."""
    with memoryview(buf.mapping) as view:
        return [(p.tensor, p.tensor_start, p.length, crc32(view[p.buffer_start:p.buffer_start + p.length]))
                for p in chunk.pieces]


class Snapshotter:
    """Takes the snapshots of one writer; returns once the tensors may change."""

    def __init__(self, enqueue: Enqueue, copy_threads: int, timeout_s: float):
        self._enqueue = enqueue
        self._copy_threads = copy_threads
        self._timeout_s = timeout_s
        self._side_streams = SideStreams()
        # (layout, data pointers, spans of each chunk) of the last host snapshot whose tensors
        # were all copied from their own memory: a save of the same tensors reuses the spans
        # (building a buffer over each of 40,000 tensors is most of such a save's stall). It
        # holds those tensors' memory until the next host snapshot or the writer's end.
        self._host_spans: tuple | None = None

    def take(self, job: Job, pool: StagingPool, mark: CallerMark | None) -> None:
        """Copy every chunk of ``job`` out of its tensors; ``mark``: where its CUDA copies start."""
        devices = job.plan.cuda_devices
        if devices:
            self._take_cuda(job, pool, devices, mark)
        else:
            self._take_host(job, self.host_spans(job.plan), pool)

    def host_spans(self, plan) -> list[list[tuple]]:
        """Per chunk of a plan of CPU tensors, the (buffer offset, source, source offset,
        length) spans of its copy (Writer.prepare makes them ahead of the first save).

        Reused from the last snapshot when it had the same layout and its tensors started at the
        same addresses (the same parameters, updated in place): those buffers are over exactly
        the bytes these tensors hold now, as the memory they cover stays allocated while held."""
        tensors = plan.flat.tensors
        ptrs = [t.data_ptr() for t in tensors]
        cached = self._host_spans
        if cached is not None and cached[0] is plan.layout and cached[1] == ptrs:
            return cached[2]
        sources = [byte_source(t) for t in tensors]
        host = [host_bytes(s) for s in sources]
        spans = [[(p.buffer_start, host[p.tensor], p.tensor_start, p.length) for p in chunk.pieces]
                 for chunk in plan.layout.chunks]
        # only where every source is the tensor's own memory (not a contiguous or resolved copy)
        own = all(s.data_ptr() == p for s, p in zip(sources, ptrs) if s.numel())
        self._host_spans = (plan.layout, ptrs, spans) if own else None
        return spans

    def _take_host(self, job: Job, spans: list[list[tuple]], pool: StagingPool) -> None:
        """CPU tensors: the native multi-threaded copy, chunk by chunk."""
        for chunk, chunk_spans in zip(job.chunks, spans, strict=True):
            buf = pool.acquire(self._timeout_s)
            copy_spans(buf.mapping, chunk_spans, self._copy_threads)
            # A background snapshot runs while the caller computes: checksumming here keeps that
            # memory traffic out of the caller's next optimizer step, which the persist workers'
            # checksums would otherwise overlap.
            crcs = piece_crcs(buf, chunk) if job.crc_in_snapshot else None
            self._enqueue(job, chunk, buf, pool, (), crcs)

    def _take_cuda(self, job: Job, pool: StagingPool, devices: set[int], mark: CallerMark | None) -> None:
        """Some tensors on GPUs: copies into pinned buffers on side streams; the persist workers
        wait for each chunk's events. Returns once every copy is done (the tensors may change)."""
        # A thread's current device starts as 0: without this, registering the pinned buffers
        # from the snapshot thread would make a context on GPU 0 in every rank of a job.
        with torch.cuda.device(min(devices)):
            streams = self._side_streams.ordered_after_caller(devices, mark)
            sources = []
            for t in job.plan.flat.tensors:
                if t.is_cuda:
                    # a view that must be made contiguous is copied on the side stream, after the
                    # caller's work, like the rest of the snapshot
                    with torch.cuda.stream(streams[t.device.index]):
                        sources.append(byte_source(t))
                else:
                    sources.append(byte_source(t))
            pending = []
            for chunk in job.chunks:
                buf = pool.acquire(self._timeout_s)
                events = copy_chunk_pieces(buf.tensor, chunk.pieces, sources, streams)
                pending.extend(events)
                self._enqueue(job, chunk, buf, pool, events, None)
            for event in pending:
                event.synchronize()
