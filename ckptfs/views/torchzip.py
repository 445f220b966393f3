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
import io
import pickle
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch._utils

from ckptfs.checksum import crc32, crc32_combine
from ckptfs.manifest import Manifest, TensorRecord, unflatten
from ckptfs.views.registry import register
from ckptfs.views.segments import View, ViewBuilder

STORAGE_ALIGNMENT = 64
PICKLE_PROTOCOL = 2

# torch pickles these dtypes through their legacy typed-storage class and _rebuild_tensor_v2
# (torch.storage._dtype_to_storage_type_map, frozen: "we should no longer add dtypes to this
# map"); every other dtype goes through UntypedStorage, _rebuild_tensor_v3 and an explicit dtype.
_LEGACY_STORAGE: dict[str, type] = {
    "float64": torch.DoubleStorage, "float32": torch.FloatStorage, "float16": torch.HalfStorage,
    "bfloat16": torch.BFloat16Storage, "complex128": torch.ComplexDoubleStorage,
    "complex64": torch.ComplexFloatStorage, "int64": torch.LongStorage, "int32": torch.IntStorage,
    "int16": torch.ShortStorage, "int8": torch.CharStorage, "uint8": torch.ByteStorage,
    "bool": torch.BoolStorage,
}

_U32_MAX = 0xFFFFFFFF
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAG_HAS_DESCRIPTOR = 0x0008
_FLAG_UTF8 = 0x0800
_FB_EXTRA_HEADER = 4  # "FB" + u16 length


@dataclass(frozen=True)
class _Entry:
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
    entries = [
        _literal("data.pkl", pickled),
        _literal(".format_version", b"1"),
        _literal(".storage_alignment", str(STORAGE_ALIGNMENT).encode()),
        # Tensor bytes are stored as the writing machine holds them in memory.
        _literal("byteorder", sys.byteorder.encode()),
        *(_tensor(key, manifest.tensors[index]) for key, index in enumerate(storage_order)),
        _literal("version", b"3\n"),
    ]
    entries.append(_literal(".data/serialization_id", _serialization_id(archive_name, entries)))
    return _zip_view(archive_name, entries)


def _check_archive_name(name: str) -> None:
    # torch's reader takes everything before the first "/" of the first entry as the folder.
    if not name or not name.isascii() or any(c in name for c in "/\\\0"):
        raise ValueError(f"archive_name {name!r} must be non-empty ASCII without '/', '\\\\' or NUL")


def _literal(name: str, data: bytes) -> _Entry:
    return _Entry(name, len(data), crc32(data), data)


def _tensor(key: int, record: TensorRecord) -> _Entry:
    return _Entry(f"data/{key}", record.nbytes, record.crc32, None, record.offset)


def _serialization_id(archive_name: str, entries: list[_Entry]) -> bytes:
    """20 digits hashing the member names, 20 digits of the CRC of all member data in order
    (torch's recipe, with a portable hash), computed from the entries' CRCs alone."""
    names = "\n".join(f"{archive_name}/{e.name}" for e in entries).encode("ascii")
    name_hash = int.from_bytes(hashlib.blake2b(names, digest_size=8).digest(), "little")
    data_crc = 0
    for e in entries:
        data_crc = crc32_combine(data_crc, e.crc, e.size)
    return f"{name_hash:020d}{data_crc:020d}".encode()


# --------------------------------------------------------------------------------------------
# data.pkl


class _TensorStub:
    """Stands for ``manifest.tensors[index]`` in the tree that gets pickled."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _StorageStub(_TensorStub):
    """Stands for the storage of ``manifest.tensors[index]``; pickled as a persistent id."""

    __slots__ = ()


class _SkeletonPickler(pickle.Pickler):
    """Pickles a tree of plain values and ``_TensorStub``s the way torch.save pickles tensors.

    One stub per stored tensor, so a tensor referenced twice is pickled once and memoized (as
    torch.save does for one tensor object referenced twice), and loads back as one tensor.
    ``storage_keys`` maps tensor index to storage key, in order of first use.
    """

    def __init__(self, file: io.BytesIO, tensors: tuple[TensorRecord, ...]):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._tensors = tensors
        self.storage_keys: dict[int, str] = {}

    def persistent_id(self, obj):
        if type(obj) is not _StorageStub:
            return None
        record = self._tensors[obj.index]
        key = self.storage_keys.setdefault(obj.index, str(len(self.storage_keys)))
        legacy = _LEGACY_STORAGE.get(record.dtype)
        if legacy is None:  # UntypedStorage counts bytes, typed storages count elements
            return ("storage", torch.UntypedStorage, key, "cpu", record.nbytes)
        return ("storage", legacy, key, "cpu", record.numel)

    def reducer_override(self, obj):
        if type(obj) is not _TensorStub:
            return NotImplemented
        record = self._tensors[obj.index]
        # (storage, storage_offset, size, stride, requires_grad, backward_hooks), as in
        # torch.Tensor._reduce_ex_internal; torch builds fresh tuples, so do we ((*t,) copies).
        args = (_StorageStub(obj.index), 0, (*record.shape,), contiguous_strides(record.shape),
                False, OrderedDict())
        if record.dtype in _LEGACY_STORAGE:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, record.torch_dtype)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``, exactly as torch computes them (a dimension
    of size 0 counts as 1, so ``(2, 0, 3)`` gives ``(3, 3, 1)``)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def pickle_skeleton(manifest: Manifest) -> tuple[bytes, list[int]]:
    """``data.pkl`` for the manifest's object, and the tensor indices in storage-key order."""
    stubs = [_TensorStub(i) for i in range(len(manifest.tensors))]
    buf = io.BytesIO()
    pickler = _SkeletonPickler(buf, manifest.tensors)
    pickler.dump(unflatten(manifest.skeleton, stubs))
    return buf.getvalue(), list(pickler.storage_keys)


# --------------------------------------------------------------------------------------------
# zip container (miniz's mz_zip_writer_add_mem_ex_v2 and mz_zip_writer_finalize_archive)


def _zip_view(archive_name: str, entries: list[_Entry]) -> View:
    builder = ViewBuilder()
    central = bytearray()
    for entry in entries:
        name = f"{archive_name}/{entry.name}".encode("ascii")
        header_offset = builder.position
        zip64 = _zip64_extra(entry.size, header_offset)
        builder.literal(_local_header(name, entry, zip64, header_offset))
        if entry.data is None:
            builder.extent(entry.data_offset, entry.size)
        else:
            builder.literal(entry.data)
        if entry.size:
            builder.literal(_data_descriptor(entry, wide=bool(zip64)))
        central += _central_header(name, entry, zip64, header_offset)
    central_offset = builder.position
    builder.literal(bytes(central))
    builder.literal(_end_records(len(entries), len(central), central_offset))
    return builder.build()


def _flags(entry: _Entry) -> int:
    # miniz announces a data descriptor only when there is data to follow.
    return _FLAG_UTF8 | (_FLAG_HAS_DESCRIPTOR if entry.size else 0)


def _zip64_extra(size: int, header_offset: int) -> bytes:
    """The Zip64 extended-information field miniz adds when a size or the offset overflows."""
    fields = []
    if size >= _U32_MAX:
        fields += [size, size]  # uncompressed, compressed
    if header_offset >= _U32_MAX:
        fields.append(header_offset)
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields)


def _alignment_extra(data_start_without_padding: int) -> bytes:
    """torch's "FB" extra field: filler that moves the entry's data to a 64-byte boundary."""
    padding = -data_start_without_padding % STORAGE_ALIGNMENT
    return b"FB" + struct.pack("<H", padding) + b"Z" * padding


def _local_header(name: bytes, entry: _Entry, zip64: bytes, header_offset: int) -> bytes:
    data_start = header_offset + _LOCAL_HEADER.size + len(name) + len(zip64) + _FB_EXTRA_HEADER
    extra = zip64 + _alignment_extra(data_start)
    # Streaming style: CRC and sizes are 0 here and come in the data descriptor.
    return _LOCAL_HEADER.pack(0x04034B50, 0, _flags(entry), 0, 0, 0, 0, 0, 0,
                              len(name), len(extra)) + name + extra


def _data_descriptor(entry: _Entry, *, wide: bool) -> bytes:
    if wide:  # miniz writes 64-bit sizes whenever the entry has a Zip64 extra field
        return struct.pack("<IIQQ", 0x08074B50, entry.crc, entry.size, entry.size)
    return struct.pack("<IIII", 0x08074B50, entry.crc, entry.size, entry.size)


def _central_header(name: bytes, entry: _Entry, zip64: bytes, header_offset: int) -> bytes:
    size32 = min(entry.size, _U32_MAX)
    return _CENTRAL_HEADER.pack(
        0x02014B50, 0, 0, _flags(entry), 0, 0, 0, entry.crc, size32, size32,
        len(name), len(zip64), 0, 0, 0, 0, min(header_offset, _U32_MAX)) + name + zip64


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
