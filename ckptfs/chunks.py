"""How a version's tensor bytes are cut into chunks, the unit of the write and read pipelines.

The data area of a slot is one contiguous, page-padded run of tensor bytes; chunk i covers
[i * chunk_bytes, (i + 1) * chunk_bytes) of it. A tensor may span chunks, so each chunk lists the
*pieces* of tensors it holds; per-piece CRCs combine into per-tensor CRCs in tensor order. A
tensor that has block CRCs (``manifest.block_count``) is also cut at its block boundaries, so that
each piece lies in one block and the pieces' CRCs combine into the blocks' as well.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ckptfs.checksum import crc32_combine
from ckptfs.manifest import TensorRecord, block_count
from ckptfs.region.format import PAGE_BYTES
from ckptfs.units import align_up

# O_DIRECT alignment of chunk lengths, file offsets and buffers: the format's page, at which data
# areas start (not the host's page size: 64 KiB on some arm64 hosts, where mmap rounds up anyway)
IO_ALIGN_BYTES = PAGE_BYTES


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
                chunk_bytes: int, crc_block_bytes: int = 0) -> list[Chunk]:
    """Chunks covering the page-padded data area; records must be sorted by offset. A tensor
    with blocks (larger than ``crc_block_bytes``, the manifest's) is cut into pieces at its
    block boundaries too."""
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
            if hi > lo and block_count(r.nbytes, crc_block_bytes):
                _block_pieces(pieces, i, lo - r.offset, hi - r.offset, lo - start, crc_block_bytes)
            elif hi > lo:
                pieces.append(Piece(i, lo - r.offset, hi - lo, lo - start))
            i += 1
        chunks.append(Chunk(start, end - start, tuple(pieces)))
    return chunks


def _block_pieces(pieces: list[Piece], tensor: int, lo: int, hi: int, buffer_start: int, block: int) -> None:
    """Append the pieces of bytes ``[lo, hi)`` of ``tensor``, placed at ``buffer_start`` in the
    chunk, cut at the tensor's multiples of ``block``."""
    while lo < hi:
        cut = min(hi, (lo // block + 1) * block)
        pieces.append(Piece(tensor, lo, cut - lo, buffer_start))
        buffer_start += cut - lo
        lo = cut


def copy_runs(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
    """``pieces`` with each run of pieces of one tensor that follow each other both in the tensor
    and in the buffer merged into one: what a copy moves in one call. The cuts at block
    boundaries are for the CRCs alone: as copies, each cost a GPU its own launch (a save of GPT-2
    + AdamW had ~290 more of them than tensors)."""
    runs: list[Piece] = []
    for p in pieces:
        if runs:
            q = runs[-1]
            if (q.tensor == p.tensor and q.tensor_start + q.length == p.tensor_start
                    and q.buffer_start + q.length == p.buffer_start):
                runs[-1] = q._replace(length=q.length + p.length)
                continue
        runs.append(p)
    return tuple(runs)


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


class BlockPiece(NamedTuple):
    chunk_start: int  # the chunk's key in ``crcs_of``
    position: int  # the piece's place among the chunk's pieces
    tensor: int
    block: int  # the block number within the tensor
    first: bool  # the block's first piece
    length: int


def block_pieces(chunks: Iterable[Chunk], records: Sequence[TensorRecord], crc_block_bytes: int) -> list[BlockPiece]:
    """The pieces of ``chunks`` (planned with ``crc_block_bytes``) of the tensors that have
    blocks, in data order: what ``block_crcs`` combines, found once per plan (a save plan of
    40,000 small tensors has none, and its commit then walks none of its pieces)."""
    if not crc_block_bytes:
        return []
    return [BlockPiece(chunk.start, k, p.tensor, p.tensor_start // crc_block_bytes,
                       p.tensor_start % crc_block_bytes == 0, p.length)
            for chunk in chunks for k, p in enumerate(chunk.pieces)
            if block_count(records[p.tensor].nbytes, crc_block_bytes)]


def block_crcs(pieces: Iterable[BlockPiece], crcs_of: Mapping[int, Sequence[int]]) -> dict[int, dict[int, int]]:
    """{tensor index: {block number: CRC32}} from the CRCs of ``pieces`` (``block_pieces``)
    found in ``crcs_of`` (as for ``tensor_crcs``). A block is there only if its first piece
    is; one whose other pieces are not all there has a meaningless CRC (a partial scan reads
    every piece of the blocks it reads)."""
    out: dict[int, dict[int, int]] = {}
    for p in pieces:
        crcs = crcs_of.get(p.chunk_start)
        if crcs is None:
            continue
        blocks = out.setdefault(p.tensor, {})
        if p.first:
            blocks[p.block] = crcs[p.position]
        elif p.block in blocks:
            blocks[p.block] = crc32_combine(blocks[p.block], crcs[p.position], p.length)
    return out
