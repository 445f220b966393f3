"""``ckptfs upgrade``: copy a region of an older format into the current one.

A region of format 1 (one 512-byte table entry per model, one ring each, single slot headers) is
not opened by this ckptfs (OldFormatError says to run this). The upgrade never rewrites the old
region in place: it reads format 1 here (the only code that still knows it), writes every
committed version whose index verifies into a new region file beside it through the normal
commit path (same steps, same order, same times; new counters in the old order), checks every
tensor of the copy against the CRCs of the old index, then links the old file to
``PATH.format1`` and renames the new one over ``PATH``. A crash at any moment leaves ``PATH``
either the old region or the complete new one.
"""
from __future__ import annotations

import dataclasses
import os
import struct
from dataclasses import dataclass

from ckptfs.checksum import crc32
from ckptfs.errors import CkptfsError, RegionFormatError
from ckptfs.manifest import Manifest
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.format import PAGE_BYTES, SUPERBLOCK_BYTES, Superblock, checked
from ckptfs.region.claim import SlotLayout
from ckptfs.units import align_up

V1_ENTRY_BYTES = 512
V1_ENTRY = struct.Struct("<8sIIQQQH255sI")          # from offset 16 of an entry: magic .. CRC
V1_HEADER = struct.Struct("<8sHHIQqQIIQQIQQI")      # a slot's first page: magic .. CRC
COPY_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class V1Version:
    counter: int
    step: int
    time_ns: int
    index: bytes       # the manifest, checked against its header's CRC
    data_start: int    # region offset of the tensor bytes
    data_bytes: int


@dataclass(frozen=True)
class V1Model:
    name: str
    nslots: int
    slot_bytes: int
    versions: tuple[V1Version, ...]  # oldest counter first


def read_v1(fd: int, path: str = "region") -> tuple[Superblock, list[V1Model]]:
    """The geometry and the committed versions of a format-1 region open at ``fd``."""
    sb = Superblock.unpack(os.pread(fd, SUPERBLOCK_BYTES, 0), path, older_ok=True)
    if sb.major != 1:
        raise RegionFormatError(f"{path} uses format {sb.major}.{sb.minor}, not 1: nothing to upgrade")
    if sb.data_offset < sb.table_offset + sb.table_entries * V1_ENTRY_BYTES:
        raise RegionFormatError(f"superblock of {path} has inconsistent geometry; the region is damaged")
    models = []
    for index in range(sb.table_entries):
        entry = _v1(V1_ENTRY, os.pread(fd, V1_ENTRY.size, sb.table_offset + index * V1_ENTRY_BYTES + 16), b"CKMODEL\0")
        if entry is None or entry[1] != 1:  # free, damaged (left behind), or not active
            continue
        _, _, nslots, slot_bytes, ring_offset, _created, name_len, name = entry
        versions = []
        for slot in range(nslots):
            base = ring_offset + slot * slot_bytes
            h = _v1(V1_HEADER, os.pread(fd, V1_HEADER.size, base), b"CKPTSLOT")
            if h is None or h[3] != 2 or h[7] != index or h[8] != slot:  # not a committed version here
                continue
            counter, step, time_ns, m_off, m_bytes, m_crc, d_off, d_bytes = h[4], h[5], h[6], h[9], h[10], h[11], h[12], h[13]
            if m_off + m_bytes > d_off or d_off + d_bytes > slot_bytes:
                continue
            manifest = os.pread(fd, m_bytes, base + m_off)
            if crc32(manifest) == m_crc:
                versions.append(V1Version(counter, step, time_ns, manifest, base + d_off, d_bytes))
        models.append(V1Model(name[:name_len].decode("utf-8"), nslots, slot_bytes,
                              tuple(sorted(versions, key=lambda v: v.counter))))
    return sb, models


def _v1(fmt: struct.Struct, raw: bytes, magic: bytes) -> tuple | None:
    """The fields of a format-1 structure with ``magic`` whose CRC checks, else None."""
    if raw[:8] != magic:
        return None
    try:
        return checked(fmt, raw, "format-1 structure")
    except RegionFormatError:
        return None


def upgrade(path: str, *, progress=None) -> list[tuple[str, int]]:
    """Copy the format-1 region at ``path`` into the current format (see the module's docstring);
    returns (model, versions copied). ``progress(nbytes)`` is called as tensor bytes are copied."""
    from ckptfs.store import Store

    if not os.path.isfile(path):
        raise CkptfsError(f"{path} is not a regular file: upgrade a device by exporting its versions "
                          "(an older ckptfs's `ckptfs export`) into a new region")
    fd = os.open(path, os.O_RDONLY)
    tmp = f"{path}.upgrade-{os.getpid()}"
    try:
        sb, models = read_v1(fd, path)
        done = []
        # a little larger than the old one (sparse): the new table and slot headers take more room
        grow = (4 << 20) + sum(m.nslots for m in models) * PAGE_BYTES
        with Store.create(tmp, size_bytes=sb.region_bytes + grow) as store:
            region = store.region
            for model in models:
                entry = region.create_model(model.name, model.nslots, model.slot_bytes + PAGE_BYTES)
                ring = region.ring(entry, timeout_s=10)
                try:
                    for v in model.versions:
                        _copy_version(fd, ring, v, progress)
                finally:
                    ring.close()
                done.append((model.name, len(model.versions)))
            problems = store.verify()
            if problems:
                raise CkptfsError(f"the upgraded copy of {path} does not verify ({problems[0]}); "
                                  "the old region is untouched")
        backup = f"{path}.format1"
        if os.path.exists(backup):
            raise CkptfsError(f"{backup} exists already; move it away and upgrade again")
        os.link(path, backup)
        os.rename(tmp, path)
        dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        return done
    finally:
        os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copy_version(fd: int, ring, v: V1Version, progress) -> None:
    """One version through the commit path: its tensor bytes as they are, its index with the
    new counter (the per-tensor CRCs it holds vouch for the copy; verify reads them back)."""
    manifest = Manifest.decode(v.index)
    claim = ring.claim(v.step, SlotLayout.of(len(v.index) + 64, v.data_bytes))
    try:
        claim.time_ns = v.time_ns
        index = dataclasses.replace(manifest, counter=claim.counter).encode()
        claim.begin()
        done = 0
        while done < v.data_bytes:
            n = min(COPY_CHUNK_BYTES, v.data_bytes - done)
            buf = aligned_buffer(align_up(n, PAGE_BYTES))
            got = os.preadv(fd, [memoryview(buf)[:n]], v.data_start + done)
            if got != n:
                raise CkptfsError(f"short read of the old region at {v.data_start + done}")
            claim.write(done, buf)
            done += n
            if progress:
                progress(n)
        claim.commit(index, v.data_bytes)
    except BaseException:
        claim.abort()
        raise
