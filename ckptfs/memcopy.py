"""The snapshot copy of CPU tensors into a staging buffer, at the memory bandwidth of the host.

``save`` stalls the training loop for exactly this copy, so it must be as fast as a plain copy
of the state. torch's ``copy_`` is an element-wise kernel with ordinary stores; the native copy
splits the spans over a few threads with the GIL released and writes spans of 256 KiB and more
with streaming stores (no read of the destination lines first). On the hosts measured it is
about a third faster (tools/bench_save.py prints both), which also pays for the persist workers
writing the previous chunks at the same time.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from array import array
from typing import Iterator

import torch

from ckptfs import _native

COPY_THREADS_MAX = 4  # memory bandwidth is saturated by a few cores; more only steal from training


def default_copy_threads() -> int:
    """Threads for one snapshot copy: the cores this process may run on, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(COPY_THREADS_MAX, cores))


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable buffer over the bytes of a contiguous CPU uint8 tensor: it shares the tensor's
    memory and keeps the tensor alive while it is referenced. Not ``Tensor.numpy()``: that marks
    the tensor's storage not resizable, for good, so a caller's ``storage().resize_(0)`` after a
    save (FSDP's and offloading's way to free memory) failed."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU uint8 tensor, got {t.dtype} on {t.device}")
    t = t.detach()
    window = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    window.tensor = t  # the memory's owner, held as long as the buffer is
    return memoryview(window).cast("B")


class HostTargets:
    """Contiguous CPU tensors that a read's bounce buffers are scattered into by address: one
    native call per chunk, GIL released (a buffer object of each of 40,000 tensors, or one torch
    copy_ per piece, cost more than the bytes). The tensors are held for the object's life, so
    their addresses stay valid; a None target takes no bytes."""

    def __init__(self, tensors: list[torch.Tensor | None]):
        for t in tensors:
            if t is not None and (not t.is_cpu or not t.is_contiguous()):
                raise ValueError(f"expected contiguous CPU tensors, got one on {t.device}")
        self._tensors = tensors
        self._addresses = array("Q", [0 if t is None else t.data_ptr() for t in tensors])
        self._sizes = array("Q", [0 if t is None else t.nbytes for t in tensors])

    def scatter_crc32(self, src, spans, pieces) -> list[int]:
        """Copy ``src[src_offset:src_offset + length]`` to byte ``dst_offset`` of tensor
        ``target`` for each ``(target, dst_offset, length, src_offset)`` of ``spans`` (the
        reverse of ``copy_spans``), and return the CRC32 of each of ``pieces``' bytes of
        ``src`` (``ckptfs.checksum.crc32_pieces``'s result; a chunk's pieces,
        ckptfs.chunks.Piece), in one pass over ``src``: a load's checker reads each bounce
        buffer from memory once, not once to copy it and again to checksum it. ValueError on
        a target or range outside the tensors or ``src``, before any byte is copied."""
        return _native.scatter_crc32(src, self._addresses, self._sizes, spans, pieces)


PREFAULT_MIN_BYTES = 1 << 20  # smaller tensors come from malloc's heap, mostly faulted in already


@contextlib.contextmanager
def prefaulted(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Fault in the pages of fresh CPU ``tensors`` (of PREFAULT_MIN_BYTES and more) on a thread
    of its own while the block fills them, front to back, as a load's reads do.

    A fresh tensor's memory is mapped on first touch, one 4 KiB page fault at a time: a load's
    reader threads took a fault per page in their copy-out (370,000 for 1.5 GB, 0.6 s of kernel
    time), copying instead of reading meanwhile; here the faults are taken while the reads wait
    for the device. The thread ends before the block does."""
    big = [t for t in tensors if t.nbytes >= PREFAULT_MIN_BYTES]
    if not big:
        yield
        return
    thread = threading.Thread(target=_prefault, args=(big,), name="ckptfs-prefault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def _prefault(tensors: list[torch.Tensor]) -> None:
    # One call per tensor. A single native call over all of them, the GIL released throughout,
    # made the same 1.5 GB load slower, not faster (0.74-0.80 s against 0.54-0.61 s, alternating
    # runs): the reader threads overlap their reads better when this thread takes the GIL
    # between tensors.
    for t in tensors:
        if not _native.populate_write(t.data_ptr(), t.nbytes):
            return  # the kernel has no MADV_POPULATE_WRITE: the copy takes the faults, as before


def _check_threads(threads) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")


def copy_spans(dst, spans: list[tuple[int, object, int, int]], threads: int) -> None:
    """Copy each ``(dst_offset, src, src_offset, length)`` span into the writable buffer ``dst``.

    ``src`` is a bytes-like object (see ``host_bytes``); every range must lie inside its buffer
    (ValueError otherwise, before any byte is copied: the native call checks every range, a
    negative offset or length too). Destinations must not overlap. The copy is split evenly
    over ``threads`` threads with the GIL released."""
    _check_threads(threads)
    _native.copy_spans(dst, spans, threads)


def copy_spans_crc32(dst, spans: list[tuple[int, object, int, int]], pieces, threads: int) -> list[int]:
    """``copy_spans``, and the CRC32 of each of ``pieces`` (ckptfs.chunks.Piece: its bytes
    ``dst[buffer_start:buffer_start + length]`` once copied) taken in the same pass: each thread
    checksums a window of its share from the source and then copies it out of the cache, so the
    bytes are read from memory once, not once by the copy and again by a CRC of ``dst``
    (``crc32_pieces``'s result, at about the copy's own speed). Every piece must lie inside the
    spans' destinations (ValueError otherwise, as for a range outside a buffer)."""
    _check_threads(threads)
    return _native.copy_spans_crc32(dst, spans, pieces, threads)
