"""Byte layout of a region (documented in docs/FORMAT.md; keep the two in step).

    offset 0                superblock (one 4 KiB page; written once by mkfs, then read-only)
    table_offset            model table: table_entries entries of ENTRY_BYTES each
    data_offset             rings: per model, nslots slots of slot_bytes, block aligned

    slot:  header (4 KiB) | manifest (JSON, padded to 4 KiB) | tensor bytes (padded to 4 KiB)

All integers are little-endian. Every fixed structure ends with the CRC32 of its preceding bytes,
so a torn or bit-flipped structure is recognized instead of trusted. The two 64-bit words at the
start of a model entry (latest pointer, counter) are updated atomically in place and carry no CRC:
an aligned 8-byte store cannot tear, and recovery checks what they point at.
"""
from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass

from ckptfs.checksum import crc32
from ckptfs.errors import IncompatibleVersionError, RegionFormatError

FORMAT_MAJOR = 1
FORMAT_MINOR = 0
PAGE_BYTES = 4096
SUPERBLOCK_BYTES = PAGE_BYTES
SUPERBLOCK_MAGIC = b"CKPTFSRG"
ENTRY_BYTES = 512
DEFAULT_TABLE_ENTRIES = 1024
NAME_MAX_BYTES = 255
SLOT_HEADER_BYTES = PAGE_BYTES
SLOT_MAGIC = b"CKPTSLOT"
ENTRY_MAGIC = b"CKMODEL\0"
COUNTER_MAX = (1 << 48) - 1
SLOTS_MAX = 1 << 16

# slot states
SLOT_WRITING = 1
SLOT_COMMITTED = 2

# model entry: [latest u64][counter u64][static part ... crc]
LATEST_WORD_OFFSET = 0
COUNTER_WORD_OFFSET = 8
ENTRY_STATIC_OFFSET = 16
ENTRY_FREE = 0
ENTRY_ACTIVE = 1


def _checked(fmt: struct.Struct, raw: bytes, what: str) -> tuple:
    """Unpack ``raw`` whose last field is the CRC32 of the bytes before it."""
    if len(raw) < fmt.size:
        raise RegionFormatError(f"{what} is truncated ({len(raw)} of {fmt.size} bytes)")
    fields = fmt.unpack_from(raw)
    if crc32(raw[: fmt.size - 4]) != fields[-1]:
        raise RegionFormatError(f"{what} checksum mismatch")
    return fields[:-1]


def _with_crc(fmt: struct.Struct, *fields) -> bytes:
    body = fmt.pack(*fields, 0)[:-4]
    return body + struct.pack("<I", crc32(body))


@dataclass(frozen=True)
class Superblock:
    region_bytes: int
    block_bytes: int
    table_offset: int
    table_entries: int
    data_offset: int
    uuid: bytes
    created_ns: int
    major: int = FORMAT_MAJOR
    minor: int = FORMAT_MINOR

    _FMT = struct.Struct("<8sHHIQQIIQ16sQI")

    @classmethod
    def new(cls, region_bytes: int, block_bytes: int, created_ns: int,
            table_entries: int = DEFAULT_TABLE_ENTRIES) -> "Superblock":
        table_offset = SUPERBLOCK_BYTES
        data_offset = _align(table_offset + table_entries * ENTRY_BYTES, block_bytes)
        return cls(region_bytes, block_bytes, table_offset, table_entries, data_offset,
                   uuidlib.uuid4().bytes, created_ns)

    def pack(self) -> bytes:
        raw = _with_crc(self._FMT, SUPERBLOCK_MAGIC, self.major, self.minor, self.block_bytes,
                        self.region_bytes, self.table_offset, self.table_entries, ENTRY_BYTES,
                        self.data_offset, self.uuid, self.created_ns)
        return raw.ljust(SUPERBLOCK_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes, path: str = "region") -> "Superblock":
        if raw[:8] != SUPERBLOCK_MAGIC:
            raise RegionFormatError(
                f"{path} is not a ckptfs region (no superblock magic); format it with `ckptfs mkfs {path}`")
        if len(raw) < cls._FMT.size:
            raise RegionFormatError(f"superblock of {path} is truncated ({len(raw)} bytes); the region is damaged")
        major, minor = struct.unpack_from("<HH", raw, 8)
        if major > FORMAT_MAJOR:
            raise IncompatibleVersionError(
                f"{path} uses region format {major}.{minor}, newer than this ckptfs understands "
                f"({FORMAT_MAJOR}.{FORMAT_MINOR}); upgrade ckptfs to open it")
        try:
            (_, major, minor, block_bytes, region_bytes, table_offset, table_entries, entry_bytes,
             data_offset, uid, created_ns) = _checked(cls._FMT, raw, f"superblock of {path}")
        except RegionFormatError as e:
            raise RegionFormatError(f"{e}; the region is damaged") from None
        sb = cls(region_bytes, block_bytes, table_offset, table_entries, data_offset, uid,
                 created_ns, major, minor)
        if (entry_bytes != ENTRY_BYTES or block_bytes < PAGE_BYTES or block_bytes & (block_bytes - 1)
                or table_offset < SUPERBLOCK_BYTES
                or data_offset < table_offset + table_entries * ENTRY_BYTES
                or data_offset > region_bytes):
            raise RegionFormatError(f"superblock of {path} has inconsistent geometry; the region is damaged")
        return sb


@dataclass(frozen=True)
class ModelEntry:
    """Static description of one model: its name and its ring of slots."""

    index: int
    name: str
    nslots: int
    slot_bytes: int
    ring_offset: int
    created_ns: int

    _FMT = struct.Struct(f"<8sIIQQQH{NAME_MAX_BYTES}sI")
    NAME_OFFSET = 42  # of the name bytes within the static part (for salvage in messages)

    @property
    def ring_bytes(self) -> int:
        return self.nslots * self.slot_bytes

    def slot_offset(self, slot: int) -> int:
        return self.ring_offset + slot * self.slot_bytes

    def pack_static(self) -> bytes:
        name = self.name.encode()
        return _with_crc(self._FMT, ENTRY_MAGIC, ENTRY_ACTIVE, self.nslots, self.slot_bytes,
                         self.ring_offset, self.created_ns, len(name), name)

    @classmethod
    def unpack_static(cls, index: int, raw: bytes) -> "ModelEntry | None":
        """The entry, or None for a free slot of the table. Raises on a damaged entry."""
        if raw[:8] != ENTRY_MAGIC:
            if any(raw[:8]):
                # Free entries have an all-zero magic (never used, or cleared by removal): anything
                # else there is damage, not a free entry -- else one flipped bit hides a model.
                raise RegionFormatError(f"model table entry {index} has a damaged magic")
            return None
        magic, state, nslots, slot_bytes, ring_offset, created_ns, name_len, name = _checked(
            cls._FMT, raw, f"model table entry {index}")
        if state != ENTRY_ACTIVE:
            return None
        if name_len > NAME_MAX_BYTES or nslots < 1 or nslots > SLOTS_MAX or slot_bytes <= 0:
            raise RegionFormatError(f"model table entry {index} is inconsistent")
        try:
            text = name[:name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise RegionFormatError(f"model table entry {index} holds a name that is not UTF-8") from None
        return cls(index, text, nslots, slot_bytes, ring_offset, created_ns)

    @classmethod
    def free_static(cls) -> bytes:
        """Bytes that mark a table entry free (the magic is cleared first-class)."""
        return bytes(cls._FMT.size)


@dataclass(frozen=True)
class SlotHeader:
    state: int
    counter: int
    step: int
    time_ns: int
    model_index: int
    slot: int
    manifest_offset: int = 0
    manifest_bytes: int = 0
    manifest_crc: int = 0
    data_offset: int = 0
    data_bytes: int = 0

    _FMT = struct.Struct("<8sHHIQqQIIQQIQQI")

    def pack(self) -> bytes:
        raw = _with_crc(self._FMT, SLOT_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, self.state, self.counter,
                        self.step, self.time_ns, self.model_index, self.slot, self.manifest_offset,
                        self.manifest_bytes, self.manifest_crc, self.data_offset, self.data_bytes)
        return raw.ljust(SLOT_HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> "SlotHeader | None":
        """The header, or None if the slot holds no valid header (never written, torn, damaged)."""
        if raw[:8] != SLOT_MAGIC:
            return None
        try:
            (_, major, _minor, state, counter, step, time_ns, model_index, slot, m_off, m_bytes,
             m_crc, d_off, d_bytes) = _checked(cls._FMT, raw, "slot header")
        except RegionFormatError:
            return None
        if major > FORMAT_MAJOR:
            raise IncompatibleVersionError(
                f"a slot was written with format {major}, newer than this ckptfs; upgrade ckptfs")
        return cls(state, counter, step, time_ns, model_index, slot, m_off, m_bytes, m_crc, d_off, d_bytes)


def pack_latest(counter: int, slot: int) -> int:
    return (counter << 16) | slot


def unpack_latest(word: int) -> tuple[int, int] | None:
    """(counter, slot) of a latest word, or None when the model has no committed checkpoint."""
    if word == 0:
        return None
    return word >> 16, word & 0xFFFF


def slot_layout(manifest_bytes: int, data_bytes: int) -> tuple[int, int, int]:
    """(manifest_offset, data_offset, total bytes) of a slot holding such a checkpoint."""
    manifest_offset = SLOT_HEADER_BYTES
    data_offset = manifest_offset + _align(manifest_bytes, PAGE_BYTES)
    return manifest_offset, data_offset, data_offset + _align(data_bytes, PAGE_BYTES)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
