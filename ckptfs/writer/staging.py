"""A pool of page-aligned host staging buffers under a hard byte budget.

``save`` copies tensors into these buffers (the snapshot) and persist workers write them out; a
buffer returns to the pool as soon as its chunk is written. When every buffer is in use, the
next ``acquire`` waits: that is the backpressure that keeps a slow disk from growing memory.

Buffers are anonymous mappings (page aligned, as O_DIRECT needs). For CUDA sources they are
registered with the driver (``cudaHostRegister``) so that device-to-host copies run on the copy
engines at full PCIe speed without a bounce through pageable memory.
"""
from __future__ import annotations

import mmap
import threading
import time
from typing import TYPE_CHECKING

from ckptfs import _native
from ckptfs.chunks import IO_ALIGN_BYTES
from ckptfs.errors import BusyError, StagingMemoryError
from ckptfs.units import human_bytes

if TYPE_CHECKING:
    import torch


MADV_POPULATE_WRITE = 23  # Linux 5.14; not exported by Python 3.11's mmap module


class StagingBuffer:
    """One chunk-sized buffer and a uint8 tensor over it (made on first use: a verify, an export
    or the mount reads through these buffers without torch)."""

    def __init__(self, nbytes: int, pinned: bool, pin_optional: bool = False, pin_device: int | None = None):
        """``pinned``: registered with CUDA; where that fails, RuntimeError, or with
        ``pin_optional`` a buffer that is not (``self.pinned`` says which). ``pin_device``: the
        GPU whose context registers it (and unregisters it at ``close``), else the calling
        thread's current one: a reader thread's is GPU 0, where a rank of another GPU would
        make a context of its own (hundreds of MiB of that GPU's memory)."""
        self.mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _prefault_huge(self.mapping)
        self._tensor: torch.Tensor | None = None
        self.pinned = False
        self._pin_device = pin_device
        if pinned:
            try:
                with _on_device(pin_device):
                    _cuda_host_register(self.tensor)
                    if pin_device is None:  # unregistered by the same GPU's context, from any thread
                        import torch

                        self._pin_device = torch.cuda.current_device()
                self.pinned = True
            except RuntimeError:
                if not pin_optional:
                    raise

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self.mapping, dtype=torch.uint8)
        return self._tensor

    def close(self) -> None:
        if self.pinned:
            import torch

            with _on_device(self._pin_device):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self._tensor = None
        try:
            self.mapping.close()
        except BufferError:
            # something still refers to the buffer (the traceback of a failed save holds the
            # frames that copied into it): the memory goes with the last reference
            pass


def _prefault_huge(mapping: mmap.mmap) -> None:
    """Back the buffer with transparent huge pages where allowed and fault it in now.

    The snapshot copy runs at memcpy speed only with few TLB misses (torch's own large
    allocations are THP-backed, so the memcpy it is compared with is); faulting in at creation
    keeps page faults out of every later save.
    """
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    try:
        _native.madvise_range(mapping, 0, len(mapping), MADV_POPULATE_WRITE)  # the GIL released
    except OSError:
        view = memoryview(mapping)
        for offset in range(0, len(mapping), mmap.PAGESIZE):
            view[offset] = 0
        view.release()


WRITER_ADVICE = "free memory, or pass a smaller staging_budget_bytes / chunk_bytes / max_inflight to the writer"


def _new_buffer(nbytes: int, pinned: bool, advice: str = WRITER_ADVICE, **pinning) -> StagingBuffer:
    """A staging buffer, or StagingMemoryError saying what could not be had and ``advice``;
    ``pinning``: StagingBuffer's pin_optional and pin_device."""
    try:
        return StagingBuffer(nbytes, pinned, **pinning)
    except (OSError, MemoryError, RuntimeError) as e:
        kind = "pinned" if pinned else "host"
        raise StagingMemoryError(
            f"could not allocate {human_bytes(nbytes)} of {kind} staging memory ({e}); {advice}") from e


def _on_device(device: int | None):
    """Within ``torch.cuda.device(device)``, or nothing where None."""
    import contextlib

    if device is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def _cuda_host_register(t: torch.Tensor) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a {t.numel()}-byte staging buffer failed ({err})")


class StagingPool:
    """Up to ``budget_bytes // chunk_bytes`` (at least one) buffers of ``chunk_bytes``, made lazily.
    ``advice``: what StagingMemoryError tells the user to do where one cannot be had;
    ``pin_optional``, ``pin_device``: see StagingBuffer."""

    def __init__(self, chunk_bytes: int, budget_bytes: int, pinned: bool = False, advice: str = WRITER_ADVICE,
                 pin_optional: bool = False, pin_device: int | None = None):
        if chunk_bytes <= 0 or chunk_bytes % IO_ALIGN_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {IO_ALIGN_BYTES}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.max_buffers = max(1, budget_bytes // chunk_bytes)
        self.pinned = pinned
        self._pinning = {"pin_optional": pin_optional, "pin_device": pin_device}
        self._advice = advice
        self._free: list[StagingBuffer] = []
        self._all: list[StagingBuffer] = []
        self._cond = threading.Condition()
        self._waiting = 0
        self._creating = 0  # buffers being made by prefill (they count against the budget)
        self._closed = False
        self._retired = False  # a larger pool took its place: released buffers are closed

    @property
    def starved(self) -> bool:
        """Whether a snapshot is waiting for a buffer (persist workers must not hold theirs)."""
        return self._waiting > 0

    @property
    def budget_bytes(self) -> int:
        return self.max_buffers * self.chunk_bytes

    def acquire(self, timeout_s: float | None = None) -> StagingBuffer:
        """A free buffer, creating one while under budget, else waiting for one to be released."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            try:
                while True:
                    buf = self._take()
                    if buf is not None:
                        return buf
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise BusyError(f"no staging buffer freed within {timeout_s} s; the persist path "
                                        "is stalled (check the region's device) or raise staging_budget_bytes")
                    self._waiting += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._waiting -= 1
            finally:
                self._sweep_retired()  # what it did not take, once no snapshot waits

    def try_acquire(self) -> StagingBuffer | None:
        """A free buffer, or a new one while under budget; None rather than a wait."""
        with self._cond:
            return self._take()

    def _take(self) -> StagingBuffer | None:
        if self._free:
            return self._free.pop()
        if len(self._all) + self._creating < self.max_buffers:
            buf = _new_buffer(self.chunk_bytes, self.pinned, self._advice, **self._pinning)
            self._all.append(buf)
            return buf
        return None

    def prefill(self) -> int:
        """Make and fault in buffers up to the budget (on the calling thread; run it on one of
        its own: faulting in fresh memory runs at a few hundred MB/s on some VMs, and the first
        save would pay it on the training thread). Stops early once the pool closes. Returns
        how many it made."""
        made = 0
        while True:
            with self._cond:
                if self._closed or self._retired or len(self._all) + self._creating >= self.max_buffers:
                    return made
                self._creating += 1
            buf = None
            try:
                buf = _new_buffer(self.chunk_bytes, self.pinned, self._advice, **self._pinning)
            except StagingMemoryError:
                return made  # the saves will make (or fail to make) their own
            finally:
                with self._cond:
                    self._creating -= 1
                    if buf is not None and not self._closed and not self._retired:
                        self._all.append(buf)
                        self._free.append(buf)
                        made += 1
                        buf = None
                    self._cond.notify()
                if buf is not None:  # the pool closed meanwhile
                    buf.close()

    def release(self, buf: StagingBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()
            self._sweep_retired()

    def retire(self) -> None:
        """Give back the free buffers now and the others as they are released, unless a snapshot
        still waits for one: the saves in flight finish on this pool, the next ones use the
        pool that replaced it."""
        with self._cond:
            self._retired = True
            self._sweep_retired()

    @property
    def holds_buffers(self) -> bool:
        return bool(self._all) or self._creating > 0

    def _sweep_retired(self) -> None:
        """Close the free buffers of a retired pool that no snapshot waits on (holds ``_cond``)."""
        if self._retired and not self._waiting:
            for buf in self._free:
                self._all.remove(buf)
                buf.close()
            self._free.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for buf in self._all:
                buf.close()
            self._all.clear()
            self._free.clear()
