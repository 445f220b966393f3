"""The snapshot copy of CPU tensors into a staging buffer, at the memory bandwidth of the host.

``save`` stalls the training loop for exactly this copy, so it must be as fast as a plain copy
of the state. torch's ``copy_`` is an element-wise kernel with ordinary stores; the native copy
splits the spans over a few threads with the GIL released and writes spans of 256 KiB and more
with streaming stores (no read of the destination lines first). On the hosts measured it is
about a third faster (tools/bench_save.py prints both), which also pays for the persist workers
writing the previous chunks at the same time.
"""
from __future__ import annotations

import os

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


def host_bytes(t: torch.Tensor):
    """A buffer over the bytes of a contiguous CPU uint8 tensor (shares its memory)."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU uint8 tensor, got {t.dtype} on {t.device}")
    return t.detach().numpy()


def copy_spans(dst, spans: list[tuple[int, object, int, int]], threads: int) -> None:
    """Copy each ``(dst_offset, src, src_offset, length)`` span into the writable buffer ``dst``.

    ``src`` is a bytes-like object (see ``host_bytes``); every range must lie inside its buffer
    (ValueError otherwise, before any byte is copied). Destinations must not overlap. The copy is
    split evenly over ``threads`` threads with the GIL released."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    for span in spans:
        dst_offset, _, src_offset, length = span
        if dst_offset < 0 or src_offset < 0 or length < 0:
            raise ValueError(f"negative offset or length in span {span[0], span[2], span[3]}")
    _native.copy_spans(dst, spans, threads)
