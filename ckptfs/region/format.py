"""Byte layout of a region (documented in docs/FORMAT.md; keep the two in step).

    offset 0                superblock (one 4 KiB page; written once by mkfs, then read-only)
    table_offset            model table: table_entries entries of ENTRY_BYTES each, then its mirror
    data_offset             extents: per model up to MAX_EXTENTS runs of equal slots, block aligned

    slot:  header (two 4 KiB copies) | manifest (JSON, padded to 4 KiB) | tensor bytes (padded to 4 KiB)

All integers are little-endian. Every fixed structure ends with the CRC32 of its preceding bytes,
so a torn or bit-flipped structure is recognized instead of trusted. The two 64-bit words at the
start of a model entry (latest pointer, counter) are updated atomically in place and carry no CRC:
an aligned 8-byte store cannot tear, and recovery checks what they point at. Every other structure
a version depends on is written twice, in different sectors (entries, slot headers): one sector
lost to the media is repaired from the other copy, with a warning.
"""
from __future__ import annotations

import struct
import uuid as uuidlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.checksum import crc32
from ckptfs.errors import IncompatibleVersionError, OldFormatError, RegionFormatError, in_words, not_a_region
from ckptfs.units import align_up

if TYPE_CHECKING:
    import numpy as np

FORMAT_MAJOR = 2  # 2: mirrored entries and slot headers, extents, kept versions (1: docs/FORMAT.md's history)
FORMAT_MINOR = 0
PAGE_BYTES = 4096
SUPERBLOCK_BYTES = PAGE_BYTES
SUPERBLOCK_MAGIC = b"CKPTFSRG"
ENTRY_BYTES = 1024
MAX_EXTENTS = 16
DEFAULT_TABLE_ENTRIES = 1024
NAME_MAX_BYTES = 255
SLOT_HEADER_BYTES = 2 * PAGE_BYTES  # two pages: the header and its copy (a lost page leaves the other)
SLOT_MAGIC = b"CKPTSLOT"
ENTRY_MAGIC = b"CKMODEL\0"
COUNTER_MAX = (1 << 48) - 1
SLOTS_MAX = 1 << 16
STEP_LIMIT = 1 << 62  # steps are below it: a slot header holds a signed 64-bit step, with room to spare

# slot states, and flags of a committed slot
SLOT_WRITING = 1
SLOT_COMMITTED = 2
SLOT_KEPT = 1  # a kept version: never reused by the ring until unkept or removed
HEADER_COPY_OFFSETS = (0, PAGE_BYTES)  # the two copies of a slot header, a page apart

# model entry in the table: [latest u64][counter u64][copy A of the rest]; the mirror table that
# follows the table holds copy B of entry i at the same place of its own entry i
LATEST_WORD_OFFSET = 0
COUNTER_WORD_OFFSET = 8
ENTRY_COPY_OFFSET = 16
ENTRY_COPY_BYTES = ENTRY_BYTES - ENTRY_COPY_OFFSET
ENTRY_FREE = 0
ENTRY_ACTIVE = 1


def checked(fmt: struct.Struct, raw: bytes, what: str) -> tuple:
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
    """The region's geometry. The model table has ``table_entries`` entries at ``table_offset``,
    and its mirror as many right after it (``mirror_offset``)."""

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

    @property
    def mirror_offset(self) -> int:
        return self.table_offset + self.table_entries * ENTRY_BYTES

    @property
    def data_end(self) -> int:
        """The end of the data area: the last whole block before the backup superblock."""
        return backup_superblock_offset(self.region_bytes) // self.block_bytes * self.block_bytes

    @classmethod
    def new(cls, region_bytes: int, block_bytes: int, created_ns: int,
            table_entries: int = DEFAULT_TABLE_ENTRIES) -> "Superblock":
        table_offset = SUPERBLOCK_BYTES
        data_offset = align_up(table_offset + 2 * table_entries * ENTRY_BYTES, block_bytes)  # table and mirror
        return cls(region_bytes, block_bytes, table_offset, table_entries, data_offset,
                   uuidlib.uuid4().bytes, created_ns)

    def pack(self) -> bytes:
        raw = _with_crc(self._FMT, SUPERBLOCK_MAGIC, self.major, self.minor, self.block_bytes,
                        self.region_bytes, self.table_offset, self.table_entries, ENTRY_BYTES,
                        self.data_offset, self.uuid, self.created_ns)
        return raw.ljust(SUPERBLOCK_BYTES, b"\0")

    @staticmethod
    def begins(head: bytes) -> bool:
        """Whether ``head`` (the first bytes of a file or device) begins with a region's
        superblock, as far as its magic tells: what mkfs refuses to overwrite, and what the CLI
        calls a region where a model name was expected."""
        return head[:len(SUPERBLOCK_MAGIC)] == SUPERBLOCK_MAGIC

    @classmethod
    def unpack(cls, raw: bytes, path: str = "region", *, older_ok: bool = False) -> "Superblock":
        """The superblock of ``raw`` (checked); OldFormatError for an older major version unless
        ``older_ok`` (``ckptfs upgrade`` reads those: the superblock's layout is the same)."""
        if not cls.begins(raw):
            raise not_a_region(path, "no superblock magic")
        if len(raw) < cls._FMT.size:
            raise RegionFormatError(f"superblock of {path} is truncated ({len(raw)} bytes); the region is damaged")
        major, minor = struct.unpack_from("<HH", raw, 8)
        if major > FORMAT_MAJOR:
            raise IncompatibleVersionError(
                f"{path} uses region format {major}.{minor}, newer than this ckptfs understands "
                f"({FORMAT_MAJOR}.{FORMAT_MINOR}); upgrade ckptfs to open it")
        if major < FORMAT_MAJOR and not older_ok:
            raise OldFormatError(
                f"{path} uses region format {major}.{minor}, which this ckptfs does not open (it writes "
                f"{FORMAT_MAJOR}.{FORMAT_MINOR}: mirrored metadata, growing slots, kept versions); copy it into "
                "the new format with " + in_words(python=f"ckptfs.upgrade({path!r})", cli=f"`ckptfs upgrade --region {path}`")
                + " (the old region stays as it is until the copy is complete)")
        try:
            (_, major, minor, block_bytes, region_bytes, table_offset, table_entries, entry_bytes,
             data_offset, uid, created_ns) = checked(cls._FMT, raw, f"superblock of {path}")
        except RegionFormatError as e:
            raise RegionFormatError(f"{e}; the region is damaged") from None
        sb = cls(region_bytes, block_bytes, table_offset, table_entries, data_offset, uid,
                 created_ns, major, minor)
        # the table's own geometry is this format's; an older one's is its reader's to check
        table_ok = major < FORMAT_MAJOR or (entry_bytes == ENTRY_BYTES
                                            and data_offset >= table_offset + 2 * table_entries * ENTRY_BYTES)
        if (not table_ok or block_bytes < PAGE_BYTES or block_bytes & (block_bytes - 1)
                or table_offset < SUPERBLOCK_BYTES or data_offset > region_bytes):
            raise RegionFormatError(f"superblock of {path} has inconsistent geometry; the region is damaged")
        return sb


@dataclass(frozen=True)
class Extent:
    """A run of ``nslots`` slots of ``slot_bytes`` each at region ``offset``, holding slot ids
    ``first_slot .. first_slot + nslots - 1`` of its model (ids stay put when extents come and go,
    so a latest word or a lock byte always names the same slot)."""

    offset: int
    slot_bytes: int
    nslots: int
    first_slot: int

    @property
    def nbytes(self) -> int:
        return self.nslots * self.slot_bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def slots(self) -> range:
        return range(self.first_slot, self.first_slot + self.nslots)


@dataclass(frozen=True)
class ModelEntry:
    """Static description of one model: its name, how many versions its ring keeps, and the
    extents its slots live in. ``generation`` grows by one at every change of the extents."""

    index: int
    name: str
    ring_slots: int
    created_ns: int
    extents: tuple[Extent, ...]
    generation: int = 1

    # magic, generation, state, ring_slots, created_ns, name length, name, extent count, extents, CRC
    _FMT = struct.Struct(f"<8sQIIQH{NAME_MAX_BYTES}sH{'QQII' * MAX_EXTENTS}I")
    NAME_OFFSET = 34  # of the name bytes within a copy (for salvage in messages)

    @classmethod
    def new(cls, index: int, name: str, nslots: int, slot_bytes: int, offset: int, created_ns: int) -> "ModelEntry":
        """A model with one extent of ``nslots`` slots (ids 0..nslots-1), keeping ``nslots`` versions."""
        return cls(index, name, nslots, created_ns, (Extent(offset, slot_bytes, nslots, 0),))

    @property
    def nslots(self) -> int:
        return sum(e.nslots for e in self.extents)

    @property
    def slot_bytes(self) -> int:
        """The size of the model's largest slots: what a save is sized against."""
        return max(e.slot_bytes for e in self.extents)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents)

    def slots(self) -> list[int]:
        """Every slot id of the model, ascending."""
        return sorted(s for e in self.extents for s in e.slots)

    def extent_of(self, slot: int) -> Extent:
        for e in self.extents:
            if e.first_slot <= slot < e.first_slot + e.nslots:
                return e
        raise KeyError(f"model {self.name!r} has no slot {slot}")

    def has_slot(self, slot: int) -> bool:
        return any(e.first_slot <= slot < e.first_slot + e.nslots for e in self.extents)

    def same_slot(self, earlier: "ModelEntry", slot: int) -> bool:
        """Whether this generation of the entry still has ``earlier``'s ``slot``, at the same
        offset (it was not given back, its bytes perhaps another model's since)."""
        return self.has_slot(slot) and self.slot_offset(slot) == earlier.slot_offset(slot)

    def slot_offset(self, slot: int) -> int:
        e = self.extent_of(slot)
        return e.offset + (slot - e.first_slot) * e.slot_bytes

    def slot_size(self, slot: int) -> int:
        return self.extent_of(slot).slot_bytes

    def with_extents(self, extents, ring_slots: int | None = None) -> "ModelEntry":
        """The next generation of this entry, with ``extents`` (and ``ring_slots``), ascending
        by slot id, each two that continue one another (bytes and ids) joined into one: every
        slot keeps its id and offset, and the entry the room for more of its MAX_EXTENTS."""
        joined: list[Extent] = []
        for x in sorted(extents, key=lambda x: x.first_slot):
            last = joined[-1] if joined else None
            if last and (last.end, last.first_slot + last.nslots, last.slot_bytes) == (x.offset, x.first_slot,
                                                                                         x.slot_bytes):
                joined[-1] = Extent(last.offset, last.slot_bytes, last.nslots + x.nslots, last.first_slot)
            else:
                joined.append(x)
        return ModelEntry(self.index, self.name, self.ring_slots if ring_slots is None else ring_slots,
                          self.created_ns, tuple(joined), self.generation + 1)

    def pack_copy(self) -> bytes:
        """One copy of the entry (the table holds two, at ENTRY_COPY_OFFSETS). ValueError for a
        slot count that ``unpack`` would not admit: such an entry read as damaged, for good."""
        if not 1 <= self.ring_slots <= SLOTS_MAX or any(e.first_slot + e.nslots > SLOTS_MAX for e in self.extents):
            raise ValueError(f"model {self.name!r}: {self.nslots} slots (ring of {self.ring_slots}) is more than a "
                             f"model can have ({SLOTS_MAX})")
        name = self.name.encode()
        flat = []
        for e in self.extents:
            flat += [e.offset, e.slot_bytes, e.nslots, e.first_slot]
        flat += [0] * (4 * (MAX_EXTENTS - len(self.extents)))
        return _with_crc(self._FMT, ENTRY_MAGIC, self.generation, ENTRY_ACTIVE, self.ring_slots, self.created_ns,
                         len(name), name, len(self.extents), *flat)

    @staticmethod
    def copies_in_use(rows) -> "np.ndarray":
        """For entries laid out as the rows (of ENTRY_BYTES, a uint8 array) of a table or its
        mirror: whether each row's copy is anything but free, that is, whether its magic is not
        all zeros (``unpack_copy``'s rule, for every entry at once; a damaged magic counts)."""
        return rows[:, ENTRY_COPY_OFFSET:ENTRY_COPY_OFFSET + len(ENTRY_MAGIC)].any(axis=1)

    @classmethod
    def unpack_copy(cls, index: int, raw: bytes) -> "ModelEntry | None":
        """The entry one copy holds, or None for an all-zero magic (free, or a copy not written).
        Raises RegionFormatError on a damaged copy."""
        if raw[:len(ENTRY_MAGIC)] != ENTRY_MAGIC:
            if any(raw[:len(ENTRY_MAGIC)]):
                # Free entries have an all-zero magic (never used, or cleared by removal): anything
                # else there is damage, not a free entry -- else one flipped bit hides a model.
                raise RegionFormatError(f"model table entry {index} has a damaged magic")
            return None
        fields = checked(cls._FMT, raw, f"model table entry {index}")
        _, generation, state, ring_slots, created_ns, name_len, name, nextents = fields[:8]
        flat = fields[8:]
        if state != ENTRY_ACTIVE:
            return None
        if name_len > NAME_MAX_BYTES or not 1 <= nextents <= MAX_EXTENTS or not 1 <= ring_slots <= SLOTS_MAX:
            raise RegionFormatError(f"model table entry {index} is inconsistent")
        extents = tuple(Extent(*flat[4 * i:4 * i + 4]) for i in range(nextents))
        ids = set()
        for e in extents:
            if e.nslots < 1 or e.slot_bytes <= 0 or e.first_slot + e.nslots > SLOTS_MAX or ids & set(e.slots):
                raise RegionFormatError(f"model table entry {index} has inconsistent extents")
            ids |= set(e.slots)
        try:
            text = name[:name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise RegionFormatError(f"model table entry {index} holds a name that is not UTF-8") from None
        return cls(index, text, ring_slots, created_ns, extents, generation)


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
    flags: int = 0  # SLOT_KEPT

    _FMT = struct.Struct("<8sHHIQqQIIQQIQQII")

    @property
    def kept(self) -> bool:
        return bool(self.flags & SLOT_KEPT)

    def pack(self) -> bytes:
        """The header's pages: the header at each of HEADER_COPY_OFFSETS (a page apart), so that
        a sector or page lost to the media leaves the other copy."""
        raw = _with_crc(self._FMT, SLOT_MAGIC, FORMAT_MAJOR, FORMAT_MINOR, self.state, self.counter,
                        self.step, self.time_ns, self.model_index, self.slot, self.manifest_offset,
                        self.manifest_bytes, self.manifest_crc, self.data_offset, self.data_bytes, self.flags)
        page = bytearray(SLOT_HEADER_BYTES)
        for off in HEADER_COPY_OFFSETS:
            page[off:off + len(raw)] = raw
        return bytes(page)

    @classmethod
    def unpack_copies(cls, raw: bytes) -> "list[SlotHeader | None]":
        """Each copy of a header page (None where a copy is not a valid header)."""
        return [cls.unpack(copy) for copy in cls.copy_bytes(raw)]

    @classmethod
    def copy_bytes(cls, raw: bytes) -> tuple[bytes, ...]:
        """The bytes of each copy of a header page (what ``unpack`` reads)."""
        return tuple(raw[off:off + cls._FMT.size] for off in HEADER_COPY_OFFSETS)

    @classmethod
    def unpack(cls, raw: bytes) -> "SlotHeader | None":
        """One copy: the header, or None if it is not valid (never written, torn, damaged)."""
        if raw[:8] != SLOT_MAGIC:
            return None
        try:
            (_, major, _minor, state, counter, step, time_ns, model_index, slot, m_off, m_bytes,
             m_crc, d_off, d_bytes, flags) = checked(cls._FMT, raw, "slot header")
        except RegionFormatError:
            return None
        if major > FORMAT_MAJOR:
            raise IncompatibleVersionError(
                f"a slot was written with format {major}, newer than this ckptfs; upgrade ckptfs")
        return cls(state, counter, step, time_ns, model_index, slot, m_off, m_bytes, m_crc, d_off, d_bytes, flags)


def backup_superblock_offset(region_bytes: int) -> int:
    """Where mkfs writes the superblock's backup: the region's last page, never given to a ring,
    so that a damaged superblock does not take every checkpoint of the region with it."""
    return region_bytes - SUPERBLOCK_BYTES


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
    data_offset = manifest_offset + align_up(manifest_bytes, PAGE_BYTES)
    return manifest_offset, data_offset, data_offset + align_up(data_bytes, PAGE_BYTES)


