"""The ``checkpoint.pt`` view: the zip archive ``torch.save`` would write for the checkpoint.

torch.save (torch/serialization.py ``_save``; caffe2/serialize/inline_container.cc, a miniz zip
writer) produces, under a top-level folder ``<archive>/``, in this order:

  data.pkl                protocol-2 pickle of the object; tensors are ``_rebuild_tensor_v2/v3``
                          calls on storages referenced by persistent id
  .format_version         "1"
  .storage_alignment      "64"
  byteorder               "little"
  data/<key>              the raw bytes of each storage, keys "0", "1"... in order of first use
  version                 "3\\n"
  .data/serialization_id  40 decimal digits

Every entry is STORED, flagged UTF-8, dated 0, and written streaming-style: zero CRC and sizes
in the local header, a data descriptor after non-empty data. An ``FB`` extra field in the local
header pads the data to a 64-byte boundary (what makes ``torch.load(mmap=True)`` possible), and
the archive is always Zip64 (miniz's MZ_ZIP_FLAG_WRITE_ZIP64): Zip64 end records, plus a Zip64
extra field on each entry whose size or local-header offset reaches 0xFFFFFFFF.

This module reproduces those bytes exactly, so that torch's loader, which computes storage
offsets from that layout without reading the headers (``_get_offset`` in serialization.py), finds
the data. The only difference from torch.save is the serialization id, which torch derives
from a hash that depends on its C++ library; ours is deterministic too.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from typing import NamedTuple

from ckptfs.checksum import crc32, crc32_combine
from ckptfs.manifest import Manifest, TensorRecord
from ckptfs.views.registry import register
from ckptfs.views.torchpickle import pickle_skeleton
from ckptfs.views.segments import LazyView, View, ViewBuilder

STORAGE_ALIGNMENT = 64
_U32_MAX = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAG_HAS_DESCRIPTOR = 0x0008
_FLAG_UTF8 = 0x0800
_FB_EXTRA_HEADER = 4  # "FB" + u16 length
_U16 = struct.Struct("<H")
_SERIALIZATION_ID_NAME = ".data/serialization_id"
_SERIALIZATION_ID_BYTES = 40
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")


class _Entry(NamedTuple):
    """One archive member: literal ``data``, or ``size`` bytes at ``data_offset`` of the version."""

    name: str
    size: int
    crc: int
    data: bytes | None = None
    data_offset: int = 0


def torch_zip_view(manifest: Manifest, *, archive_name: str = "checkpoint") -> View:
    """The torch.save zip of the checkpoint; its tensor entries are extents of the version's data area.

    ``torch.load(..., weights_only=True)`` (with or without ``mmap=True``) on the bytes gives
    back the saved object: same containers (dict / OrderedDict / list / tuple), key order and
    leaves; tensors bit-exact, CPU, contiguous; a tensor referenced several times is one tensor.
    Entry CRCs are the records' ``crc32`` (never recomputed from tensor bytes).
    """
    _check_archive_name(archive_name)
    pickled, storage_order = pickle_skeleton(manifest)
    tensors = manifest.tensors
    head = [
        _literal("data.pkl", pickled),
        _literal(".format_version", b"1"),
        _literal(".storage_alignment", str(STORAGE_ALIGNMENT).encode()),
        # Tensor bytes are stored as the writing machine holds them in memory.
        _literal("byteorder", sys.byteorder.encode()),
    ]
    version = _literal("version", b"3\n")

    def entries() -> list[_Entry]:
        out = [*head, *(_tensor(key, tensors[index]) for key, index in enumerate(storage_order)), version]
        out.append(_literal(_SERIALIZATION_ID_NAME, _serialization_id(archive_name, out)))
        return out

    # The size from the members' names and sizes alone; the headers only when first read.
    prefix = len(archive_name) + 1
    members = [(prefix + len(e.name), e.size) for e in head]
    members += [(prefix + len(_tensor_name(key)), tensors[index].nbytes) for key, index in enumerate(storage_order)]
    members += [(prefix + len(version.name), version.size), (prefix + len(_SERIALIZATION_ID_NAME), _SERIALIZATION_ID_BYTES)]
    return LazyView(_zip_size(members), lambda: _zip_view(archive_name, entries()).segments)


def _check_archive_name(name: str) -> None:
    # torch's reader takes everything before the first "/" of the first entry as the folder.
    if not name or not name.isascii() or any(c in name for c in "/\\\0"):
        raise ValueError(f"archive_name {name!r} must be non-empty ASCII without '/', '\\\\' or NUL")


def _literal(name: str, data: bytes) -> _Entry:
    return _Entry(name, len(data), crc32(data), data)


def _tensor_name(key: int) -> str:
    return f"data/{key}"


def _tensor(key: int, record: TensorRecord) -> _Entry:
    return _Entry(_tensor_name(key), record.nbytes, record.crc32, None, record.offset)


def _serialization_id(archive_name: str, entries: list[_Entry]) -> bytes:
    """20 digits hashing the member names, 20 digits of the CRC of all member data in order
    (torch's recipe, with a portable hash), computed from the entries' CRCs alone."""
    names = "\n".join(f"{archive_name}/{e.name}" for e in entries).encode("ascii")
    name_hash = int.from_bytes(hashlib.blake2b(names, digest_size=8).digest(), "little")
    data_crc = 0
    for e in entries:
        data_crc = crc32_combine(data_crc, e.crc, e.size)
    return f"{name_hash:020d}{data_crc:020d}".encode()  # _SERIALIZATION_ID_BYTES


# --------------------------------------------------------------------------------------------
# zip container (miniz's mz_zip_writer_add_mem_ex_v2 and mz_zip_writer_finalize_archive)


def _zip_view(archive_name: str, entries: list[_Entry]) -> View:
    # One pass, the headers packed inline (a version of 40,000 tensors has as many entries);
    # the members are placed by _placement, as _zip_size counts them.
    builder = ViewBuilder()
    literal, extent = builder.literal, builder.extent
    central = []
    prefix = archive_name.encode("ascii") + b"/"
    tail = b""  # the entry's data descriptor, appended with the next local header (one call less)
    for name, size, crc, data, data_offset in entries:
        name = prefix + name.encode("ascii")
        header_offset = builder.position + len(tail)
        zip64, padding, _ = _placement(header_offset, len(name), size)
        # miniz announces a data descriptor only when there is data to follow
        flags = _FLAG_UTF8 | _FLAG_HAS_DESCRIPTOR if size else _FLAG_UTF8
        # streaming style: CRC and sizes are 0 here and come in the data descriptor; torch's "FB"
        # extra field pads the data to a 64-byte boundary
        literal(tail + _LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name),
                                          len(zip64) + _FB_EXTRA_HEADER + padding)
                + name + (_zip64_extra(size, header_offset, local=True) if zip64 else b"") + b"FB"
                + _U16.pack(padding) + b"Z" * padding)
        if data is None:
            extent(data_offset, size)
        else:
            literal(data)
        tail = (_DESCRIPTOR64 if zip64 else _DESCRIPTOR32).pack(0x08074B50, crc, size, size) if size else b""
        size32 = min(size, _U32_MAX)
        central.append(_CENTRAL_HEADER.pack(0x02014B50, 0, 0, flags, 0, 0, 0, crc, size32, size32, len(name),
                                            len(zip64), 0, 0, 0, 0, min(header_offset, _U32_MAX)) + name + zip64)
    literal(tail)
    central_offset = builder.position
    central_bytes = b"".join(central)
    literal(central_bytes)
    literal(_end_records(len(entries), len(central_bytes), central_offset))
    return builder.build()


def _placement(header_offset: int, name_len: int, size: int) -> tuple[bytes, int, int]:
    """(Zip64 extra field, "FB" padding, offset after the member) of a member of ``size`` bytes
    with a name of ``name_len`` bytes whose local header is at ``header_offset``."""
    zip64 = _zip64_extra(size, header_offset) if size >= _U32_MAX or header_offset >= _U32_MAX else b""
    data_start = header_offset + _LOCAL_HEADER.size + name_len + len(zip64) + _FB_EXTRA_HEADER
    padding = -data_start % STORAGE_ALIGNMENT
    # miniz writes 64-bit sizes in the data descriptor whenever the entry has a Zip64 field
    descriptor = (_DESCRIPTOR64.size if zip64 else _DESCRIPTOR32.size) if size else 0
    return zip64, padding, data_start + padding + size + descriptor


def _zip_size(members: list[tuple[int, int]]) -> int:
    """The size of the archive of members (name length, size), from their placement alone."""
    position = central = 0
    for name_len, size in members:
        zip64, _, position = _placement(position, name_len, size)
        central += _CENTRAL_HEADER.size + name_len + len(zip64)
    return position + central + _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size


def _zip64_extra(size: int, header_offset: int, local: bool = False) -> bytes:
    """The Zip64 extended-information field miniz adds when a size or the offset overflows; in
    the ``local`` header the compressed size is 0 (miniz writes it before the data, whose
    compressed size it does not know yet: the data descriptor and the central header have it)."""
    fields = []
    if size >= _U32_MAX:
        fields += [size, 0 if local else size]  # uncompressed, compressed
    if header_offset >= _U32_MAX:
        fields.append(header_offset)
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields)


def _end_records(count: int, central_size: int, central_offset: int) -> bytes:
    zip64_end_offset = central_offset + central_size
    zip64_end = _ZIP64_END.pack(
        0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0,  # made by Unix 3.0, needs 4.5
        count, count, central_size, central_offset)
    locator = _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_offset, 1)
    end = _END.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                    min(central_size, _U32_MAX), min(central_offset, _U32_MAX), 0)
    return zip64_end + locator + end


CHECKPOINT_FILE = "checkpoint.pt"
register("torch", lambda manifest: {CHECKPOINT_FILE: torch_zip_view(manifest)},
         summary="checkpoint.pt, the whole object as torch.save writes it")
