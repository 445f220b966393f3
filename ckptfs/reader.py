"""Reading versions back: restore tensors (to CPU or a device) and verify checksums.

Both walk the version's data area in chunks (the same chunking as the write path) with a few
threads: each reads a chunk into its own page-aligned bounce buffer, bypassing the page cache,
then copies the tensor pieces out and checksums them. Reads, copies and CRCs of different
chunks overlap, and the CRCs cost no extra pass over the data.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from ckptfs.checksum import crc32
from ckptfs.chunks import Chunk, combine_piece_crcs, plan_chunks
from ckptfs.errors import CorruptionError
from ckptfs.manifest import Manifest, unflatten
from ckptfs.region.region import Region
from ckptfs.writer.staging import StagingBuffer

READ_CHUNK_BYTES = 32 << 20
READ_THREADS = 3


@dataclass(frozen=True)
class VerifyProblem:
    """One failed check: the version, the tensor (None for the index) and what is wrong."""

    model: str
    step: int
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = (self.model + (f" step {self.step}" if self.step >= 0 else "")
                 + (f" tensor {self.tensor}" if self.tensor else ""))
        return f"{where}: {self.message}"


def scan(region: Region, data_base: int, manifest: Manifest,
         on_chunk: Callable[[StagingBuffer, Chunk], None],
         progress: Callable[[int], None] | None = None) -> list[int]:
    """Read every chunk of a version's data, call ``on_chunk(buffer, chunk)`` for each, and
    return the CRC32 of every tensor as read."""
    chunks = plan_chunks(manifest.tensors, manifest.data_bytes, READ_CHUNK_BYTES)
    buffer_bytes = max((c.length for c in chunks), default=0)
    piece_crcs: list[list[tuple[int, int, int]]] = [[] for _ in manifest.tensors]
    mutex = threading.Lock()
    local = threading.local()
    buffers: list[StagingBuffer] = []

    def work(chunk: Chunk) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = StagingBuffer(buffer_bytes, pinned=False)
            with mutex:
                buffers.append(buf)
        region.backend.read_direct(data_base + chunk.start, memoryview(buf.mapping)[:chunk.length])
        on_chunk(buf, chunk)
        view = memoryview(buf.mapping)
        crcs = [(p.tensor, p.tensor_start, p.length, crc32(view[p.buffer_start:p.buffer_start + p.length]))
                for p in chunk.pieces]
        view.release()
        with mutex:
            for tensor, start, n, crc in crcs:
                piece_crcs[tensor].append((start, n, crc))
        if progress:
            progress(chunk.length)

    try:
        if len(chunks) <= 1:
            for chunk in chunks:
                work(chunk)
            return [combine_piece_crcs(p) for p in piece_crcs]
        with ThreadPoolExecutor(min(READ_THREADS, len(chunks)), thread_name_prefix="ckptfs-read") as pool:
            list(pool.map(work, chunks))
    finally:
        for buf in buffers:
            buf.close()
    return [combine_piece_crcs(p) for p in piece_crcs]


def restore(region: Region, data_base: int, manifest: Manifest, map_location="cpu", verify: bool = True):
    """The saved object, with every tensor on ``map_location``.

    Raises CorruptionError naming the first tensor whose bytes fail their CRC (when ``verify``).
    """
    tensors = [torch.empty(r.shape, dtype=r.torch_dtype) for r in manifest.tensors]
    targets = [t.reshape(-1).view(torch.uint8) if t.numel() else None for t in tensors]

    def copy_out(buf: StagingBuffer, chunk: Chunk) -> None:
        for p in chunk.pieces:
            targets[p.tensor][p.tensor_start:p.tensor_start + p.length].copy_(
                buf.tensor[p.buffer_start:p.buffer_start + p.length])

    crcs = scan(region, data_base, manifest, copy_out)
    if verify:
        for record, crc in zip(manifest.tensors, crcs):
            if crc != record.crc32:
                raise CorruptionError(
                    f"tensor {record.name!r} of {manifest.model} step {manifest.step} fails its checksum; "
                    "the stored bytes are damaged: load another version (`ckptfs ls`) and run `ckptfs verify`")
    device = torch.device(map_location) if map_location is not None else torch.device("cpu")
    if device.type != "cpu":
        moved = [t.pin_memory().to(device, non_blocking=True) for t in tensors]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tensors = moved
    return unflatten(manifest.skeleton, tensors)


def verify_version(region: Region, data_base: int, manifest: Manifest,
                   progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
    """Recompute every tensor's CRC from the region; one problem per mismatching tensor."""
    crcs = scan(region, data_base, manifest, lambda buf, chunk: None, progress)
    return [VerifyProblem(manifest.model, manifest.step, r.name,
                          f"checksum mismatch (stored {r.crc32:08x}, computed {crc:08x})")
            for r, crc in zip(manifest.tensors, crcs) if crc != r.crc32]
