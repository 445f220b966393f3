"""Tier 1: on-disk structures, byte for byte, and the checks that guard them."""
import dataclasses
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.checksum import crc32, crc32_combine
from ckptfs.errors import IncompatibleVersionError, InvalidNameError, MalformedInputError, RegionFormatError
from ckptfs.manifest import EncodedTensors, Manifest, TensorRecord, encode_tensors
from ckptfs.region.format import (MAX_EXTENTS, SLOT_COMMITTED, SLOT_KEPT, Extent, ModelEntry, SlotHeader,
                                  Superblock, pack_latest, slot_layout, unpack_latest)
from ckptfs.region.region import validate_model_name


def test_superblock_bytes_exact():
    sb = Superblock(region_bytes=1 << 30, block_bytes=4096, table_offset=4096, table_entries=1024,
                    data_offset=4096 + 2 * 1024 * 1024, uuid=bytes(range(16)), created_ns=7)
    assert Superblock.new(1 << 30, 4096, 7).data_offset == sb.data_offset  # the table and its mirror
    assert sb.mirror_offset == 4096 + 1024 * 1024
    raw = sb.pack()
    body = (b"CKPTFSRG" + struct.pack("<HHI", 2, 0, 4096) + struct.pack("<QQII", 1 << 30, 4096, 1024, 1024)
            + struct.pack("<Q", 4096 + 2 * 1024 * 1024) + bytes(range(16)) + struct.pack("<Q", 7))
    assert raw[:len(body)] == body
    assert raw[len(body):len(body) + 4] == struct.pack("<I", crc32(body))
    assert len(raw) == 4096 and raw[len(body) + 4:] == bytes(4096 - len(body) - 4)
    assert Superblock.unpack(raw) == sb


def test_superblock_rejects_damage_and_newer_major():
    sb = Superblock.new(1 << 30, 4096, 1)
    raw = bytearray(sb.pack())
    raw[40] ^= 1
    with pytest.raises(RegionFormatError, match="checksum"):
        Superblock.unpack(bytes(raw))
    newer = bytearray(sb.pack())
    newer[8:10] = struct.pack("<H", 3)
    with pytest.raises(IncompatibleVersionError, match="upgrade ckptfs"):
        Superblock.unpack(bytes(newer))
    older = bytearray(sb.pack())
    older[8:10] = struct.pack("<H", 1)
    with pytest.raises(IncompatibleVersionError, match=r"format 1\.0.*ckptfs\.upgrade\('r'\)"):
        Superblock.unpack(bytes(older), "r")
    with pytest.raises(RegionFormatError, match="not a ckptfs region"):
        Superblock.unpack(bytes(4096))


def test_slot_header_bytes_exact():
    h = SlotHeader(SLOT_COMMITTED, counter=5, step=120, time_ns=9, model_index=2, slot=1,
                   manifest_offset=8192, manifest_bytes=100, manifest_crc=0xDEADBEEF,
                   data_offset=12288, data_bytes=1000, flags=SLOT_KEPT)
    raw = h.pack()
    body = (b"CKPTSLOT" + struct.pack("<HHIQqQII", 2, 0, SLOT_COMMITTED, 5, 120, 9, 2, 1)
            + struct.pack("<QQIQQI", 8192, 100, 0xDEADBEEF, 12288, 1000, 1))
    copy = body + struct.pack("<I", crc32(body))
    assert len(raw) == 8192  # two pages: the header and its copy
    assert raw == (copy.ljust(4096, b"\0")) * 2
    assert SlotHeader.unpack_copies(raw) == [h, h] and h.kept
    torn = bytearray(raw)
    torn[20] ^= 0x80
    assert SlotHeader.unpack_copies(bytes(torn)) == [None, h]


def test_model_entry_bytes_exact_roundtrip_and_damage():
    e = ModelEntry(3, "gpt2", 4, 11, (Extent(1 << 22, 1 << 20, 4, 0), Extent(1 << 24, 2 << 20, 1, 4)), 7)
    raw = e.pack_copy()
    extents = struct.pack("<QQII", 1 << 22, 1 << 20, 4, 0) + struct.pack("<QQII", 1 << 24, 2 << 20, 1, 4)
    body = (b"CKMODEL\0" + struct.pack("<QIIQH", 7, 1, 4, 11, 4) + b"gpt2".ljust(255, b"\0") + struct.pack("<H", 2)
            + extents.ljust(24 * MAX_EXTENTS, b"\0"))
    assert raw == body + struct.pack("<I", crc32(body)) and len(raw) <= 1008
    assert ModelEntry.unpack_copy(3, raw) == e
    assert e.slots() == [0, 1, 2, 3, 4] and e.slot_offset(4) == 1 << 24 and e.slot_size(2) == 1 << 20
    assert e.slot_bytes == 2 << 20 and e.nslots == 5
    assert ModelEntry.unpack_copy(3, bytes(len(raw))) is None
    bad = bytearray(raw)
    bad[30] ^= 1
    with pytest.raises(RegionFormatError):
        ModelEntry.unpack_copy(3, bytes(bad))
    overlapping = dataclasses.replace(e, extents=(Extent(1 << 22, 1 << 20, 4, 0), Extent(1 << 24, 1 << 20, 2, 3)))
    with pytest.raises(RegionFormatError, match="inconsistent extents"):
        ModelEntry.unpack_copy(3, overlapping.pack_copy())


def test_latest_word_packing():
    assert unpack_latest(0) is None
    assert unpack_latest(pack_latest(12345, 7)) == (12345, 7)


def test_slot_layout_is_page_aligned():
    assert slot_layout(10, 1) == (8192, 12288, 16384)
    assert slot_layout(4096, 4097) == (8192, 12288, 12288 + 8192)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x\0y", "tab\there", " lead", "trail ", "é" * 200,
                                  "bell\x07", 5, None])
def test_bad_model_names(name):
    with pytest.raises(InvalidNameError):
        validate_model_name(name)


@pytest.mark.parametrize("name", ["gpt2", "llama-3.1_8B", "модель", "a" * 255, "run.42"])
def test_good_model_names(name):
    assert validate_model_name(name) == name


def test_crc32_combine_matches_whole():
    a, b = b"hello " * 1000, b"world" * 777
    assert crc32_combine(crc32(a), crc32(b), len(b)) == crc32(a + b)
    assert crc32_combine(crc32(a), 0, 0) == crc32(a)


def with_crcs(m: Manifest, crcs: list[int]) -> Manifest:
    """``m`` with its records holding ``crcs``: the reference for CRCs given apart from them."""
    return dataclasses.replace(m, tensors=tuple(t._replace(crc32=c) for t, c in zip(m.tensors, crcs)))


def test_manifest_length_independent_of_crcs_and_roundtrips():
    recs = (TensorRecord("w", "float32", (2, 3), 0, 24), TensorRecord("b", "bfloat16", (), 64, 2))
    m = Manifest("m", 3, 42, 1, recs, {"dict": [[{"str": "w"}, {"tensor": 0}], [{"str": "b"}, {"tensor": 1}]]}, 66)
    m2 = with_crcs(m, [0xFFFFFFFF, 1])
    assert len(m.encode()) == len(m2.encode())
    assert Manifest.decode(m2.encode()) == m2


@pytest.mark.parametrize("model, key", [("m", "w"), ("mod\u00e9le", "cl\u00e9 \u2713"), ("m", "a\"b\\c\n")])
def test_manifest_encoded_length_is_the_length_of_its_bytes(model, key):
    """The writer sizes a slot's index from encoded_length without building the document."""
    recs = (TensorRecord(key, "float32", (2, 3), 0, 24), TensorRecord("b", "bfloat16", (), 64, 2))
    m = Manifest(model, 12345, 2 ** 63 - 1, 1_700_000_000_000_000_000, recs,
                 {"dict": [[{"str": key}, {"tensor": 0}], [{"int": -7}, {"float": "0x1.8p+1"}],
                           [{"str": "b"}, {"list": [{"tensor": 1}, {"none": None}, {"bool": True}]}]]}, 66)
    assert m.encoded_length() == len(m.encode())
    tensors_json = encode_tensors(recs, [0xDEADBEEF, 5])
    assert m.encoded_length(tensors_json) == len(m.encode(tensors_json)) == len(m.encode())


def test_manifest_bytes_exact():
    recs = (TensorRecord("w", "float32", (2, 3), 0, 24, 0xDEADBEEF), TensorRecord("b\u00e9", "bfloat16", (), 64, 2))
    m = Manifest("m", 3, 42, 1, recs, {"dict": [[{"str": "w"}, {"tensor": 0}], [{"int": 7}, {"float": "0x1.0p-1"}],
                                                [{"str": "b"}, {"tensor": 1}]]}, 66)
    assert m.encode() == (
        b'{"format":1,"model":"m","step":3,"counter":42,"time_ns":1,"data_bytes":66,"tensors":['
        b'{"name":"w","dtype":"float32","shape":[2,3],"offset":0,"nbytes":24,"crc32":"deadbeef"},'
        b'{"name":"b\\u00e9","dtype":"bfloat16","shape":[],"offset":64,"nbytes":2,"crc32":"00000000"}],'
        b'"skeleton":{"dict":[[{"str":"w"},{"tensor":0}],[{"int":7},{"float":"0x1.0p-1"}],'
        b'[{"str":"b"},{"tensor":1}]]}}')
    # the writer's commit: CRCs given apart from the records give the same bytes as records holding them
    assert m.encode(encode_tensors(recs, [0xDEADBEEF, 5])) == with_crcs(m, [0xDEADBEEF, 5]).encode()
    assert m.encode(EncodedTensors.of(recs).with_crcs([0xDEADBEEF, 5])) == with_crcs(m, [0xDEADBEEF, 5]).encode()
    assert m.encoded_length(EncodedTensors.of(recs).with_crcs([0, 0])) == len(m.encode())
    with pytest.raises(ValueError):
        encode_tensors(recs, [1])


def _blocked_manifest():
    """A manifest of a 10,000-byte tensor with block CRCs of 4096-byte blocks (three: the last
    1808 bytes) beside a 24-byte one without, their CRCs those of real bytes."""
    import random
    import zlib

    data = random.Random(7).randbytes(10000)
    blocks = tuple(zlib.crc32(data[i:i + 4096]) for i in range(0, 10000, 4096))
    recs = (TensorRecord("w", "uint8", (10000,), 0, 10000, zlib.crc32(data), blocks),
            TensorRecord("b", "float32", (2, 3), 10048, 24, 0xDEADBEEF))
    return Manifest("m", 3, 42, 1, recs, {"list": [{"tensor": 0}, {"tensor": 1}]}, 10072, crc_block_bytes=4096)


def test_manifest_with_block_crcs_bytes_exact():
    """A tensor larger than a block carries one CRC32 per block after its own, as 8 hex digits
    each in one string; the block size is in the head only where some tensor has blocks (a
    manifest without keeps its bytes: test_manifest_bytes_exact)."""
    m = _blocked_manifest()
    w = m.tensors[0]
    digits = "".join(f"{c:08x}" for c in w.block_crcs).encode()
    assert len(digits) == 24
    assert m.encode() == (
        b'{"format":1,"model":"m","step":3,"counter":42,"time_ns":1,"data_bytes":10072,"crc_block_bytes":4096,'
        b'"tensors":[{"name":"w","dtype":"uint8","shape":[10000],"offset":0,"nbytes":10000,'
        b'"crc32":"' + f"{w.crc32:08x}".encode() + b'","block_crc32":"' + digits + b'"},'
        b'{"name":"b","dtype":"float32","shape":[2,3],"offset":10048,"nbytes":24,"crc32":"deadbeef"}],'
        b'"skeleton":{"list":[{"tensor":0},{"tensor":1}]}}')
    assert Manifest.decode(m.encode()) == m
    # the commit's splice: CRCs and block CRCs given apart from placeholder records
    blank = dataclasses.replace(m, tensors=(w._replace(crc32=0, block_crcs=(0, 0, 0)), m.tensors[1]._replace(crc32=0)))
    encoded = EncodedTensors.of(blank.tensors)
    assert blank.encode(encoded.with_crcs([w.crc32, 0xDEADBEEF], list(w.block_crcs))) == m.encode()
    assert blank.encoded_length(encoded.text) == len(m.encode())
    with pytest.raises(ValueError):
        encoded.with_crcs([w.crc32, 0xDEADBEEF], [1, 2])


@pytest.mark.parametrize("mutate", [
    lambda d: d.replace(b'"crc_block_bytes":4096', b'"crc_block_bytes":3000'),  # not a power of two
    lambda d: d.replace(b'"crc_block_bytes":4096', b'"crc_block_bytes":2048'),  # below a page
    lambda d: d.replace(b'"crc_block_bytes":4096,', b''),  # blocks without a block size
    lambda d: d.replace(b'"crc_block_bytes":4096', b'"crc_block_bytes":8192'),  # two blocks' worth, three given
    lambda d: d.replace(b'"crc_block_bytes":4096', b'"crc_block_bytes":true'),
    lambda d: d.replace(b'"block_crc32":"', b'"block_crc32":"00000000'),  # one block too many
    lambda d: d.replace(b'"block_crc32":"', b'"block_crc32":"0000'),  # not whole CRCs
    lambda d: _swap_blocks(d, b"zzzzzzzz"),  # not hex
    lambda d: _swap_blocks(d),  # real CRCs in the wrong order: they do not make the tensor's
    lambda d: d.replace(b'"block_crc32":"', b'"block_crc32":[],"x":"'),  # not a string
])
def test_manifest_rejects_inconsistent_block_crcs(mutate):
    """Block CRCs that do not fit their tensor (count, block size, encoding) or do not make its
    CRC32 are refused as malformed, as any other inconsistent index."""
    with pytest.raises(MalformedInputError):
        Manifest.decode(mutate(_blocked_manifest().encode()))


def _swap_blocks(raw: bytes, first: bytes | None = None) -> bytes:
    """``raw`` with the first two block CRCs swapped (each a CRC of real bytes, their
    combination not the tensor's), or the first replaced by ``first``."""
    at = raw.index(b'"block_crc32":"') + len(b'"block_crc32":"')
    if first is not None:
        return raw[:at] + first + raw[at + 8:]
    return raw[:at] + raw[at + 8:at + 16] + raw[at:at + 8] + raw[at + 16:]


@pytest.mark.parametrize("mutate", [
    lambda d: d.replace(b'"nbytes":24', b'"nbytes":25'),
    lambda d: d.replace(b'"float32"', b'"float99"'),
    lambda d: d.replace(b'"offset":64', b'"offset":6400'),
    lambda d: d.replace(b'{"tensor":1}', b'{"tensor":9}'),
    lambda d: d[:-5],
])
def test_manifest_rejects_inconsistent(mutate):
    recs = (TensorRecord("w", "float32", (2, 3), 0, 24), TensorRecord("b", "bfloat16", (), 64, 2))
    m = Manifest("m", 3, 42, 1, recs, {"list": [{"tensor": 0}, {"tensor": 1}]}, 66)
    with pytest.raises(MalformedInputError):
        Manifest.decode(mutate(m.encode()))


@pytest.mark.parametrize("names", [
    ["w", "b"],
    ['crc32', '"crc32":"', 'a","crc32":"ffffffff', "\u00e9\u2713", "back\\slash\n"],  # names that look like the field
    ["100%", "%08x", "%%s%(x)d"],  # names that look like the format's conversions
    [],
])
def test_encoded_tensors_fill_crcs_byte_exact(names):
    """The commit splices CRCs into the array encoded once per layout: the same bytes as encoding
    the records with those CRCs."""
    recs = tuple(TensorRecord(n, "float32", (i, 2), 64 * i, 8 * i) for i, n in enumerate(names))
    encoded = EncodedTensors.of(recs)
    assert encoded.text == encode_tensors(recs)
    for crcs in ([0] * len(recs), [0xFFFFFFFF] * len(recs), [(0x9E3779B9 * (i + 1)) & 0xFFFFFFFF for i in range(len(recs))]):
        assert encoded.with_crcs(crcs) == encode_tensors(recs, crcs).encode()
    with pytest.raises(ValueError):
        encoded.with_crcs([1] * (len(recs) + 1))
    if recs:
        for bad in (1 << 32, -1):
            with pytest.raises(ValueError):
                encoded.with_crcs([bad] * len(recs))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9000), st.sampled_from([1, 64, 4096])), max_size=12),
       st.sampled_from([4096, 8192, 12288]), st.sampled_from([0, 4096, 8192]), st.integers(0, 2**32 - 1))
def test_tensor_crcs_are_the_crcs_of_the_whole_tensors(sizes, chunk_bytes, crc_block_bytes, seed):
    """Per-tensor CRCs made from the pieces' CRCs, chunk by chunk in data order, equal zlib's CRC
    of each whole tensor, however the tensors (empty ones included) fall across the chunks; so
    do the block CRCs of the tensors larger than ``crc_block_bytes`` (their pieces cut at block
    boundaries: none spans two blocks); a chunk's CRCs missing leaves only its own tensors'
    meaningless."""
    import random
    import zlib

    from ckptfs.checksum import crc32_pieces
    from ckptfs.chunks import block_crcs, block_pieces, plan_chunks, tensor_crcs
    from ckptfs.manifest import block_count

    records, offset = [], 0
    for i, (nbytes, align) in enumerate(sizes):
        offset = (offset + align - 1) // align * align
        records.append(TensorRecord(f"t{i}", "uint8", (nbytes,), offset, nbytes))
        offset += nbytes
    data = random.Random(seed).randbytes(offset + 4096)
    chunks = plan_chunks(records, offset, chunk_bytes, crc_block_bytes)
    for c in chunks:
        for p in c.pieces:
            if block_count(records[p.tensor].nbytes, crc_block_bytes):
                assert p.tensor_start // crc_block_bytes == (p.tensor_start + p.length - 1) // crc_block_bytes
    crcs_of = {c.start: crc32_pieces(memoryview(data)[c.start:c.start + c.length], c.pieces) for c in chunks}
    assert tensor_crcs(chunks, crcs_of, len(records)) == [
        zlib.crc32(data[r.offset:r.offset + r.nbytes]) for r in records]
    want = {i: {b: zlib.crc32(data[r.offset + b * crc_block_bytes:min(r.offset + (b + 1) * crc_block_bytes,
                                                                       r.offset + r.nbytes)])
                for b in range(block_count(r.nbytes, crc_block_bytes))}
            for i, r in enumerate(records) if block_count(r.nbytes, crc_block_bytes)}
    assert block_crcs(block_pieces(chunks, records, crc_block_bytes), crcs_of) == want
    if chunks:
        missing = chunks[len(chunks) // 2]
        del crcs_of[missing.start]
        untouched = {p.tensor for p in missing.pieces}
        got = tensor_crcs(chunks, crcs_of, len(records))
        assert [c for i, c in enumerate(got) if i not in untouched] == [
            zlib.crc32(data[r.offset:r.offset + r.nbytes]) for i, r in enumerate(records) if i not in untouched]


def test_crc32_pieces_equal_zlibs_with_isal_and_without():
    """A chunk's piece CRCs in one native call equal zlib's CRC of each piece: through ISA-L
    (what ckptfs.checksum sets up) and through zlib (the fallback); a range outside the buffer
    or a malformed piece is refused."""
    import os
    import zlib

    from ckptfs.checksum import crc32_pieces
    from ckptfs.chunks import Piece

    data = bytes(range(256)) * 4096 + os.urandom(4099)
    pieces = [Piece(0, 0, 0, 0), Piece(1, 0, len(data), 0), Piece(2, 5, 1, len(data) - 1), Piece(3, 0, 0, len(data))]
    pieces += [Piece(4 + i, 0, (i * 7919) % 65536, (i * 104729) % (len(data) - 65536)) for i in range(300)]
    want = [zlib.crc32(data[p.buffer_start:p.buffer_start + p.length]) for p in pieces]
    assert crc32_pieces(memoryview(data), pieces) == want
    from isal import isal_zlib

    from ckptfs import _native

    assert _native.use_isal_crc32("") is False  # zlib's
    try:
        assert crc32_pieces(memoryview(data), pieces) == want
    finally:
        assert _native.use_isal_crc32(isal_zlib.__file__) is True
    for bad in (Piece(0, 0, 2, len(data) - 1), Piece(0, 0, -1, 0), Piece(0, 0, 1, -1), Piece(0, 0, 1 << 62, 1 << 62)):
        with pytest.raises(ValueError):
            crc32_pieces(data, [Piece(9, 0, 1, 0), bad])
    with pytest.raises(TypeError):
        crc32_pieces(data, [(0, 0, 1)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20000), st.sampled_from([1, 64, 4096])), max_size=12),
       st.sampled_from([4096, 8192, 12288]), st.sampled_from([4096, 8192]))
def test_copy_runs_are_the_pieces_without_block_cuts(sizes, chunk_bytes, crc_block_bytes):
    """A chunk's pieces cut at block boundaries, merged back into copies, are its pieces as
    planned without blocks: one copy per tensor per chunk, the bytes and places unchanged."""
    from ckptfs.chunks import copy_runs, plan_chunks

    records, offset = [], 0
    for i, (nbytes, align) in enumerate(sizes):
        offset = (offset + align - 1) // align * align
        records.append(TensorRecord(f"t{i}", "uint8", (nbytes,), offset, nbytes))
        offset += nbytes
    cut = plan_chunks(records, offset, chunk_bytes, crc_block_bytes)
    whole = plan_chunks(records, offset, chunk_bytes, 0)
    assert [copy_runs(c.pieces) for c in cut] == [c.pieces for c in whole]


def test_an_entry_of_more_slots_than_a_model_can_have_is_not_packed():
    """What unpack would refuse as damaged is never written: 65537 slots made an entry that no
    command could read or remove."""
    from ckptfs.region.format import SLOTS_MAX, ModelEntry

    assert ModelEntry.new(0, "m", SLOTS_MAX, 4096, 1 << 20, 1).pack_copy()
    with pytest.raises(ValueError, match="65537 slots .* more than a model can have"):
        ModelEntry.new(0, "m", SLOTS_MAX + 1, 4096, 1 << 20, 1).pack_copy()
