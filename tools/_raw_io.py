"""The raw-I/O baselines every ckptfs figure of the benchmark tools is compared with: O_DIRECT
writes and reads (new file, overwrite, several threads), buffered write + fsync, mmap + msync,
from a page-aligned buffer in huge pages (``AlignedBuffer``). Nothing here belongs to the library.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Callable

import torch

MiB = 1 << 20
ALIGN = 4096  # O_DIRECT alignment of buffer address, file offset and length


class AlignedBuffer:
    """Page-aligned private anonymous buffer filled with random bytes (O_DIRECT-capable), in
    huge pages where the kernel gives them (MADV_HUGEPAGE, as ckptfs's staging): the raw peers'
    best. An O_DIRECT transfer is cut into requests of at most max_segments pages; from 4 KiB
    pages that is ~1 MiB on a virtio disk, and this VM's disk then read at 1.3-1.8 GB/s where
    the same reads into huge pages ran at 3.4-3.7 GB/s: a floor measured from 4 KiB pages (as it
    was, in a shared mapping, which never gets huge pages) was no floor."""

    def __init__(self, nbytes: int, seed: int = 0):
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP here: 4 KiB pages
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (min(nbytes, 8 * MiB),), dtype=torch.uint8, generator=g)
        view = torch.frombuffer(self.mm, dtype=torch.uint8)
        for off in range(0, nbytes, src.numel()):
            n = min(src.numel(), nbytes - off)
            view[off:off + n].copy_(src[:n])
        del view
        self.mv = memoryview(self.mm)

    def close(self) -> None:
        self.mv.release()
        self.mm.close()


def round_up(n: int, a: int = ALIGN) -> int:
    """The least multiple of ``a`` that is at least ``n``."""
    return (n + a - 1) // a * a


def _split(total: int, block: int, threads: int) -> list[list[tuple[int, int]]]:
    """(offset, length) blocks, dealt out as contiguous ranges (one per thread)."""
    blocks = [(off, min(block, total - off)) for off in range(0, total, block)]
    per = (len(blocks) + threads - 1) // threads
    return [blocks[i * per:(i + 1) * per] for i in range(threads)]


def _run_threads(fn: Callable[[list[tuple[int, int]]], None], parts: list) -> None:
    if len(parts) == 1:
        fn(parts[0])
        return
    errs: list[BaseException] = []

    def wrap(p):
        try:
            fn(p)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(p,)) for p in parts if p]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]


def odirect_write(path: str, nbytes: int, buf: AlignedBuffer, threads: int = 1,
                  overwrite: bool = False) -> float:
    """Sequential O_DIRECT write of ``nbytes`` (rounded up to 4 KiB) from an aligned buffer in
    ``buf.nbytes`` blocks, then fdatasync. Returns seconds (open to sync). A new file (blocks
    allocated as it goes), or with ``overwrite`` in place over an existing file's blocks."""
    total = round_up(nbytes)
    block = buf.nbytes
    flags = os.O_WRONLY | os.O_DIRECT | (0 if overwrite else os.O_CREAT | os.O_TRUNC)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        def work(blocks):
            for off, n in blocks:
                mv = buf.mv[:n]
                done = 0
                while done < n:
                    done += os.pwrite(fd, mv[done:], off + done)

        _run_threads(work, _split(total, block, threads))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def odirect_write_states(path: str, nbytes: int, k: int, buf: AlignedBuffer) -> float:
    """``k`` states of ``nbytes`` overwritten in a row over an existing file's blocks (state i at
    i * nbytes rounded up to 4 KiB), each followed by fdatasync, as back-to-back saves into the
    slots of a ring make them durable. Returns seconds for all of them."""
    total = round_up(nbytes)
    block = buf.nbytes
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        for i in range(k):
            for off, n in _split(total, block, 1)[0]:
                mv = buf.mv[:n]
                done = 0
                while done < n:
                    done += os.pwrite(fd, mv[done:], i * total + off + done)
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def odirect_read(path: str, nbytes: int, buf: AlignedBuffer, threads: int = 1, offset: int = 0) -> float:
    """Sequential O_DIRECT read of ``nbytes`` (rounded up to 4 KiB) of ``path`` from ``offset``
    (a multiple of 4 KiB)."""
    assert offset % 4096 == 0, offset
    total = round_up(nbytes)
    block = buf.nbytes
    bufs = [buf] + [AlignedBuffer(block) for _ in range(threads - 1)]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        parts = _split(total, block, threads)

        def work(blocks, b):
            for off, n in blocks:
                mv = b.mv[:n]
                done = 0
                while done < n:
                    r = os.preadv(fd, [mv[done:]], offset + off + done)
                    if r <= 0:
                        raise IOError(f"short O_DIRECT read of {path} at {offset + off + done}")
                    done += r

        if threads == 1:
            work(parts[0], buf)
        else:
            _run_threads(lambda pb: work(*pb), [(p, b) for p, b in zip(parts, bufs) if p])
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    for b in bufs[1:]:
        b.close()
    return dt


def odirect_read_fresh(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """Sequential O_DIRECT read of the first ``nbytes`` (rounded up to 4 KiB) of ``path`` into
    memory allocated for it (anonymous, freed after), on one thread: what a load that returns
    new tensors pays for their fresh pages (the kernel zeroes each one at its first touch), which
    ``odirect_read`` into one reused buffer does not. Returns seconds, the allocation included."""
    total = round_up(nbytes)
    t0 = time.perf_counter()
    m = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's (torch.empty's) memory
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with memoryview(m) as mv:
            for off in range(0, total, block):
                n = min(block, total - off)
                done = 0
                while done < n:
                    r = os.preadv(fd, [mv[off + done:off + n]], off + done)
                    if r <= 0:
                        raise IOError(f"short O_DIRECT read of {path} at {off + done}")
                    done += r
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        m.close()


def buffered_write_fsync(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off, n in _split(nbytes, buf.nbytes, 1)[0]:
            mv = buf.mv[:n]
            done = 0
            while done < n:
                done += os.pwrite(fd, mv[done:], off + done)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def mmap_write_msync(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    """ftruncate a new file, map it shared, copy the bytes in, msync (MS_SYNC) the mapping."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            src = torch.frombuffer(buf.mm, dtype=torch.uint8)
            for off, n in _split(nbytes, buf.nbytes, 1)[0]:
                dst[off:off + n].copy_(src[:n])
            del dst, src
            mm.flush()  # msync(MS_SYNC)
        finally:
            mm.close()
        os.fsync(fd)  # metadata (size, block allocation)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def buffered_read(path: str, nbytes: int, buf: AlignedBuffer) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            r = f.readinto(buf.mv[:min(buf.nbytes, nbytes - done)])
            if not r:
                break
            done += r
    return time.perf_counter() - t0
