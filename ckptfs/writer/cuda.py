"""The CUDA side of a snapshot: device-to-host copies on side streams, ordered after exactly the
kernels the caller queued before ``save``.

A GPU snapshot must see every kernel the caller queued before ``save`` (the optimizer step that
produced the weights) and must not wait for the ones it queues afterwards (the next forward and
backward, which the copy is meant to overlap). For a background snapshot that order cannot be
taken on the snapshot thread: by the time it runs, the caller has queued more work, and that
thread's current stream is not the caller's. So ``save`` records an event on the caller's current
stream (``caller_mark``) and the side stream waits for that event alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CallerMark:
    """An event recorded on the caller's current stream of ``device`` when ``save`` was called."""

    device: int
    event: "torch.cuda.Event"


def caller_mark() -> CallerMark | None:
    """On the caller's thread, at ``save``: a mark after everything it has queued so far on its
    current CUDA stream, or None when CUDA is not initialized (no tensor can be on a GPU then)."""
    if not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has_context is not None and not has_context(device):
        # nothing ran on the current device: recording there would make a context (hundreds of
        # MiB of GPU memory) for nothing; the snapshot orders itself without a mark
        return None
    event = torch.cuda.Event()
    event.record()
    return CallerMark(device, event)


class SideStreams:
    """The side streams of one writer, one per CUDA device, made on first use."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    def ordered_after_caller(self, devices: set[int], mark: CallerMark | None) -> dict[int, "torch.cuda.Stream"]:
        """A side stream for each of ``devices``, made to wait for the caller's work there: the
        caller's mark on its device; on any other device (or without a mark: a snapshot on the
        caller's own thread) everything queued so far on this thread's current stream of it."""
        streams = {}
        for device in sorted(devices):
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            if mark is not None and mark.device == device:
                stream.wait_event(mark.event)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
            streams[device] = stream
        return streams


def copy_chunk_pieces(buf_tensor: torch.Tensor, pieces, sources,
                      streams: dict[int, "torch.cuda.Stream"]) -> tuple["torch.cuda.Event", ...]:
    """Queue the copy of each piece of a chunk into the pinned ``buf_tensor`` (``sources[i]``:
    the bytes of tensor i, as ``byte_source``): CUDA sources on their device's side stream
    (asynchronous), CPU sources at once. Returns the events after which the buffer holds every
    piece."""
    by_device: dict[int, list] = {}
    for p in pieces:
        src = sources[p.tensor]
        if src.is_cuda:
            by_device.setdefault(src.device.index, []).append(p)
        else:
            buf_tensor[p.buffer_start:p.buffer_start + p.length].copy_(src[p.tensor_start:p.tensor_start + p.length])
    events = []
    for device, device_pieces in by_device.items():
        with torch.cuda.stream(streams[device]):
            for p in device_pieces:
                src = sources[p.tensor]
                if p.tensor_start or p.length != src.numel():  # a slice costs as much as the copy's queueing
                    src = src[p.tensor_start:p.tensor_start + p.length]
                buf_tensor[p.buffer_start:p.buffer_start + p.length].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(streams[device])
        events.append(event)
    return tuple(events)
