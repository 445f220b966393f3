"""The floor of checkpointing: what any checkpointer must do to persist a state, and nothing more.

The training emulator runs this beside ckptfs in the same loop: the difference between their
overheads is what ckptfs's own machinery costs (index, checksums, slot claims, commit protocol,
progress), and this one's overhead is what the device and the host charge for writing the bytes
at all (the disk's slow spells, the memory traffic of the writes).

A save copies the state into one of N page-aligned buffers (torch ``copy_``, one chunk at a
time), hands each chunk to writer threads that ``pwrite`` it with O_DIRECT into one of N+1 slots
of a file, and after the last chunk of a save an ``fdatasync`` makes it durable. At most N saves
are in flight; the next waits for a buffer. No index, no checksums, no commit record: the bytes
it writes cannot be found again by anything but this module, which is why it is a floor and not
a checkpointer.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
from concurrent.futures import Future

import torch

from _raw_io import round_up

MADV_POPULATE_WRITE = 23


class _SaveFuture(Future):
    def __init__(self):
        super().__init__()
        self.snapshotted: Future = Future()


class RawCheckpointer:
    """N saves in flight of a fixed set of CPU tensors into ``path``; see the module docstring."""

    def __init__(self, tensors: list[torch.Tensor], max_inflight: int, path: str,
                 chunk_bytes: int = 64 << 20, write_threads: int = 2):
        self._tensors = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
        self._slot_bytes = round_up(sum(t.numel() for t in self._tensors))
        self._chunk_bytes = chunk_bytes
        self._nslots = max_inflight + 1
        self._buffers = [_buffer(self._slot_bytes) for _ in range(max_inflight)]
        self._free: queue.Queue = queue.Queue()
        for i in range(max_inflight):
            self._free.put(i)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.ftruncate(self._fd, self._nslots * self._slot_bytes)
        self._saves = 0
        self._pending: list[Future] = []
        self._last_snapshot: Future | None = None
        self._copy_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._write_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._copy_loop, daemon=True)]
        self._threads += [threading.Thread(target=self._write_loop, daemon=True) for _ in range(write_threads)]
        for t in self._threads:
            t.start()

    def save(self, obj, step: int, async_snapshot: bool = False) -> _SaveFuture:
        """Persist the tensors given at construction (``obj`` and ``step`` are ignored)."""
        future = _SaveFuture()
        slot = self._saves % self._nslots
        self._saves += 1
        self._pending.append(future)
        self._copy_queue.put((future, slot))
        self._last_snapshot = future.snapshotted
        if not async_snapshot:
            future.snapshotted.result()
        return future

    @property
    def saves(self) -> int:
        """Saves made so far (read_back takes 0 .. saves - 1 of the last N+1)."""
        return self._saves

    def wait_snapshot(self) -> None:
        if self._last_snapshot is not None:
            self._last_snapshot.result()

    def wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending.clear()

    def read_back(self, save_index: int) -> bytes:
        """The bytes of save number ``save_index`` (0-based), read with O_DIRECT."""
        buf = _buffer(self._slot_bytes)
        view = memoryview(buf)
        offset, done = (save_index % self._nslots) * self._slot_bytes, 0
        while done < self._slot_bytes:
            done += os.preadv(self._fd, [view[done:]], offset + done)
        nbytes = sum(t.numel() for t in self._tensors)
        data = bytes(view[:nbytes])
        view.release()
        buf.close()
        return data

    def close(self) -> None:
        self.wait()
        self._copy_queue.put(None)
        for _ in self._threads[1:]:
            self._write_queue.put(None)
        for t in self._threads:
            t.join()
        os.close(self._fd)
        for b in self._buffers:
            b.close()

    def _copy_loop(self) -> None:
        while (item := self._copy_queue.get()) is not None:
            future, slot = item
            try:
                index = self._free.get()
                dst = torch.frombuffer(self._buffers[index], dtype=torch.uint8)
                chunks = [(s, min(s + self._chunk_bytes, self._slot_bytes))
                          for s in range(0, self._slot_bytes, self._chunk_bytes)]
                progress = _Progress(len(chunks))
                for start, end in chunks:
                    self._copy_range(dst, start, end)
                    self._write_queue.put((future, index, slot, start, end, progress))
                future.snapshotted.set_result(None)
            except BaseException as e:  # noqa: BLE001 - delivered through the futures
                future.snapshotted.set_exception(e)
                future.set_exception(e)

    def _copy_range(self, dst: torch.Tensor, start: int, end: int) -> None:
        """Copy the state bytes that fall in [start, end) of the buffer (tensors back to back)."""
        position = 0
        for t in self._tensors:
            t_start, position = position, position + t.numel()
            lo, hi = max(t_start, start), min(position, end)
            if lo < hi:
                dst[lo:hi].copy_(t[lo - t_start:hi - t_start])

    def _write_loop(self) -> None:
        while (item := self._write_queue.get()) is not None:
            future, index, slot, start, end, progress = item
            error = None
            try:
                with memoryview(self._buffers[index]) as view:
                    done = 0
                    while done < end - start:
                        done += os.pwrite(self._fd, view[start + done:end], slot * self._slot_bytes + start + done)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                error = e
            if progress.chunk_done(error):
                try:
                    if progress.error is None:
                        os.fdatasync(self._fd)
                except OSError as e:
                    progress.error = e
                self._free.put(index)  # also after a failure: the next saves must not hang
                if progress.error is None:
                    future.set_result(None)
                else:
                    future.set_exception(progress.error)


class _Progress:
    """Chunks of one save still being written, and its first error."""

    def __init__(self, chunks: int):
        self._left = chunks
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def chunk_done(self, error: BaseException | None) -> bool:
        """Record one written chunk; True for the last one."""
        with self._lock:
            self.error = self.error or error
            self._left -= 1
            return self._left == 0


def _buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned, THP-backed where allowed, faulted in (as ckptfs's staging buffers are)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
        buf.madvise(MADV_POPULATE_WRITE)
    except (AttributeError, OSError):
        pass
    return buf
