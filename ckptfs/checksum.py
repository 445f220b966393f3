"""CRC32 (the zip / IEEE polynomial) computed on the write path and combined without re-reading.

``crc32`` runs at memory speed and releases the GIL (ISA-L through the ``isal`` package), so the
persist workers checksum their chunks in parallel; ``crc32_pieces`` does so for a chunk's many
pieces in one call. ``crc32_combine`` turns the CRCs of adjacent
pieces into the CRC of their concatenation, which is how per-chunk CRCs become per-tensor CRCs.
"""
from isal import isal_zlib

from ckptfs import _native

_native.use_isal_crc32(isal_zlib.__file__)  # the same CRC code for crc32_pieces (else zlib's)


def crc32(data, value: int = 0) -> int:
    """CRC32 of a bytes-like object, continuing from ``value``."""
    return isal_zlib.crc32(data, value) & 0xFFFFFFFF


def crc32_pieces(data, pieces) -> list[int]:
    """The CRC32 of ``data[p[3]:p[3] + p[2]]`` for each of ``pieces`` (ckptfs.chunks.Piece:
    (tensor, tensor_start, length, buffer_start)), in order: one native call with the GIL
    released, every range checked first (ValueError). 40,000 pieces of a chunk of small
    tensors cost a Python loop as much as their bytes, holding the GIL beside the training
    loop's thread."""
    return _native.crc32_pieces(data, pieces)


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32 of A+B given crc32(A), crc32(B) and len(B)."""
    if length_b < 0:
        raise ValueError(f"length_b must be >= 0, got {length_b}")
    return _native.crc32_combine(crc_a & 0xFFFFFFFF, crc_b & 0xFFFFFFFF, length_b)
