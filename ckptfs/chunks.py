"""How a version's tensor bytes are cut into chunks, the unit of the write and read pipelines.

The data area of a slot is one contiguous, page-padded run of tensor bytes; chunk i covers
[i * chunk_bytes, (i + 1) * chunk_bytes) of it. A tensor may span chunks, so each chunk lists the
*pieces* of tensors it holds; per-piece CRCs combine into per-tensor CRCs in tensor order.
"""
from __future__ import annotations

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


def combine_piece_crcs(pieces: list[tuple[int, int, int]]) -> int:
    """CRC of a whole tensor from (tensor_start, length, crc) of its pieces, in any order."""
    if len(pieces) == 1 and pieces[0][0] == 0:
        return pieces[0][2]  # a tensor in one piece (most of them, when there are many)
    crc = 0
    for _, length, piece_crc in sorted(pieces):
        crc = crc32_combine(crc, piece_crc, length)
    return crc
