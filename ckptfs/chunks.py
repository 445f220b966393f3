"""How a version's tensor bytes are cut into chunks, the unit of the write and read pipelines.

The data area of a slot is one contiguous, page-padded run of tensor bytes; chunk i covers
[i * chunk_bytes, (i + 1) * chunk_bytes) of it. A tensor may span chunks, so each chunk lists the
*pieces* of tensors it holds; per-piece CRCs combine into per-tensor CRCs in tensor order.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ckptfs.checksum import crc32_combine
from ckptfs.manifest import TensorRecord, align_up

IO_ALIGN_BYTES = 4096


class Piece(NamedTuple):  # named tuples: a plan of 40,000 tensors makes as many
    tensor: int  # index of the record
    tensor_start: int  # byte offset within the tensor
    length: int
    buffer_start: int  # byte offset within the chunk


class Chunk(NamedTuple):
    start: int  # byte offset within the data area
    length: int  # a multiple of IO_ALIGN_BYTES
    pieces: tuple[Piece, ...]


def plan_chunks(records: list[TensorRecord] | tuple[TensorRecord, ...], data_bytes: int,
                chunk_bytes: int) -> list[Chunk]:
    """Chunks covering the page-padded data area; records must be sorted by offset."""
    padded = align_up(data_bytes, IO_ALIGN_BYTES)
    chunks, first = [], 0
    for start in range(0, padded, chunk_bytes):
        end = min(start + chunk_bytes, padded)
        while first < len(records) and records[first].offset + records[first].nbytes <= start:
            first += 1
        pieces, i = [], first
        while i < len(records) and records[i].offset < end:
            r = records[i]
            lo, hi = max(r.offset, start), min(r.offset + r.nbytes, end)
            if hi > lo:
                pieces.append(Piece(i, lo - r.offset, hi - lo, lo - start))
            i += 1
        chunks.append(Chunk(start, end - start, tuple(pieces)))
    return chunks


def tensor_crcs(chunks: Iterable[Chunk], crcs_of: Mapping[int, Sequence[int]], n_tensors: int) -> list[int]:
    """The CRC32 of every tensor from those of its pieces: ``crcs_of[chunk.start]`` holds the
    CRCs of ``chunk.pieces``, in order. ``chunks`` in data order, as planned, so that each
    tensor's pieces come in the order of its bytes, and a piece past a tensor's first extends
    the CRC so far. A tensor with no piece (empty) has CRC 0; one whose chunks are not all in
    ``crcs_of`` has a meaningless one. One pass, no per-tensor lists: 40,000 small tensors are
    as many pieces at every save."""
    out = [0] * n_tensors
    for chunk in chunks:
        crcs = crcs_of.get(chunk.start)
        if crcs is None:
            continue
        for p, crc in zip(chunk.pieces, crcs, strict=True):
            out[p.tensor] = crc if p.tensor_start == 0 else crc32_combine(out[p.tensor], crc, p.length)
    return out
