"""Views: torch zip, safetensors and metadata.json synthesized from a manifest.

Each test stores a real object the way the writer does (``flatten``, tensor bytes at 64-byte
aligned offsets after a junk prefix so that an offset that is not data-relative shows, CRC32 per tensor),
builds views from the manifest alone, materializes them through ``read_region`` and checks them
with the real consumers: torch.load, safetensors, zipfile, unzip.
"""
from __future__ import annotations

import io
import json
import math
import pickle
import random
import shutil
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from safetensors import safe_open
import safetensors.torch
from safetensors.torch import load_file

from ckptfs.checksum import crc32, crc32_combine
from ckptfs.flatten import DTYPE_NAMES, DTYPES, flatten
from ckptfs.manifest import Manifest, TensorRecord
from ckptfs.units import align_up
from ckptfs.skeleton import unflatten
from ckptfs.views import (Extent, Literal, View, ViewBuilder, files_for, key_file_name,
                          metadata_json_view, safetensors_view, torch_zip_view)
from ckptfs.views.safetensors import SAFETENSORS_DTYPES, encode_header
from ckptfs.views.torchpickle import LEGACY_STORAGE, contiguous_strides, pickle_skeleton
from conftest import assert_same

# torch warns whenever it creates a complex32 tensor
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

TIME_NS = 1_700_000_000_123_456_789  # 2023-11-14T22:13:20.123456789Z


# --------------------------------------------------------------------------------------------
# helpers


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Stored:
    """A checkpoint laid out as the writer lays it out: what the views are computed from."""

    manifest: Manifest
    region: bytes
    data_base: int

    def read_region(self, offset: int, length: int) -> memoryview:
        """What ``Version.read`` does: a data offset to bytes of the data area."""
        assert 0 <= offset and self.data_base + offset + length <= len(self.region), (offset, length)
        return memoryview(self.region)[self.data_base + offset:self.data_base + offset + length]

    def materialize(self, view: View) -> bytes:
        return b"".join(bytes(b) for b in view.iter_blocks(self.read_region))

    def write(self, view: View, path) -> str:
        path.write_bytes(self.materialize(view))
        return str(path)


def lay_out(obj, *, model: str = "gpt2", step: int = 1200, data_base: int = 192) -> Stored:
    flat = flatten(obj)
    data = bytearray()
    records = []
    for name, t in zip(flat.names, flat.tensors):
        raw = tensor_bytes(t)
        offset = align_up(len(data), 64)
        data += b"\xee" * (offset - len(data)) + raw  # junk between tensors
        records.append(TensorRecord(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, len(raw),
                                    crc32(raw)))
    manifest = Manifest(model, step, 3, TIME_NS, tuple(records), flat.skeleton, len(data))
    manifest.validate()
    return Stored(manifest, b"\xee" * data_base + bytes(data), data_base)


def sample(dtype: torch.dtype, shape=(2, 3), seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (valid 0/1 for bool), so every bit pattern path is exercised."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                        dtype=torch.uint8)
    return raw.view(dtype)


def all_dtypes() -> dict:
    return {name: sample(dtype, seed=i) for i, (name, dtype) in enumerate(DTYPES.items())}


def rich_object() -> OrderedDict:
    base = sample(torch.float32, (4, 6), seed=1).nan_to_num()
    tied = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    obj = OrderedDict()
    obj["dtypes"] = all_dtypes()
    obj["zero_dim"] = torch.tensor(3.5, dtype=torch.bfloat16)
    obj["zero_dim_f8"] = torch.tensor(1.0).to(torch.float8_e5m2)
    obj["empty"] = torch.empty(0, 3)
    obj["empty_3d"] = torch.empty(2, 0, 3, dtype=torch.float16)
    obj["transposed"] = base.t()
    obj["strided"] = base[1:3, ::2]
    obj["tied_a"] = tied
    obj["tied_b"] = tied
    obj[7] = [1, (2.5, None, "x"), [True, False, ("nested", [torch.arange(3)])]]
    obj["floats"] = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-310]
    obj["plain"] = {"lr": 1e-3, "name": "ünïcode", None: 1, 2.5: "k", -3: b"".hex()}
    obj["inner"] = OrderedDict(b=torch.ones(2), a={"x": torch.zeros(1, dtype=torch.int64)})
    return obj


def crc32_of_zeros(n: int) -> int:
    """CRC32 of n zero bytes without making them: combine CRCs of 1, 2, 4... zero bytes."""
    crc, piece, piece_len = 0, crc32(b"\0"), 1
    while n:
        if n & 1:
            crc = crc32_combine(crc, piece, piece_len)
        piece = crc32_combine(piece, piece, piece_len)
        piece_len *= 2
        n >>= 1
    return crc


class ViewFile(io.RawIOBase):
    """A read-only, seekable file over a view (for zipfile, without materializing the view)."""

    def __init__(self, view: View, read_region):
        self.view, self.read_region, self.pos = view, read_region, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.view.size}[whence] + offset
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        data = self.view.read(self.pos, len(buf), self.read_region)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


def mask_serialization_id(data: bytes, archive: str) -> bytes:
    """The archive with the serialization id and its two CRC copies zeroed (torch's id comes
    from a C++ hash; everything else must match torch.save byte for byte)."""
    out = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(f"{archive}/.data/serialization_id")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    out[start:start + 40] = bytes(40)
    out[start + 44:start + 48] = bytes(4)  # descriptor: signature, then CRC
    central = data.rfind(b"PK\x01\x02")   # the id is the last member
    out[central + 16:central + 20] = bytes(4)
    return bytes(out)


# --------------------------------------------------------------------------------------------
# View


def test_view_drops_empty_segments_and_reads_across_them():
    region = bytes(range(256)) * 4
    view = View([Literal(b"ab"), Extent(10, 3), Literal(b""), Extent(500, 0), Literal(b"Z")])
    read = lambda o, n: memoryview(region)[o:o + n]
    assert view.size == 6 and len(view.segments) == 3
    assert view.read(0, 6, read) == b"ab\x0a\x0b\x0cZ"
    assert view.read(1, 3, read) == b"b\x0a\x0b"
    assert view.read(4, 100, read) == b"\x0cZ"  # short read at EOF
    assert view.read(6, 1, read) == b"" and view.read(60, 1, read) == b""
    assert view.read(2, 0, read) == b""
    with pytest.raises(ValueError):
        view.read(-1, 2, read)
    assert type(view.read(2, 2, read)) is bytes


def test_view_reads_extents_stored_within_the_alignment_as_one_span():
    """A read over many small tensors asks the data area once per run of extents less than the
    tensors' alignment (64 bytes) apart, literals between them included; a farther extent, one
    stored before the last, or bytes of a tensor outside the file are never in a span (a
    damaged neighbour must not fail a read of this file)."""
    region = bytes(range(256)) * 8
    calls = []

    def read(o, n):
        calls.append((o, n))
        assert not (o < 700 < o + n), "a span reached the bytes between 600 and 800"
        return memoryview(region)[o:o + n]

    segments = [Extent(0, 10), Extent(64, 10), Literal(b"hdr"), Extent(128, 60),  # gaps 54, 54, 4
                Extent(600, 5), Extent(800, 8),  # 412 and 195 bytes apart: new spans
                Extent(700 - 200, 8)]  # before the last one: a new span
    view = View(segments)
    expected = b"".join(s.data if type(s) is Literal else region[s.offset:s.offset + s.length] for s in segments)
    assert view.read(0, view.size, read) == expected
    assert calls == [(0, 188), (600, 5), (800, 8), (500, 8)]
    calls.clear()
    assert view.read(5, 12, read) == expected[5:17]  # from inside the first extent into the second
    assert calls == [(5, 66)]
    calls.clear()  # a pass over the whole file (export): the same spans, at most block_bytes each
    assert b"".join(view.iter_blocks(read, block_bytes=100)) == expected
    assert calls == [(0, 74), (128, 60), (600, 5), (800, 8), (500, 8)]


def test_view_builder_coalesces_literals_and_tracks_position():
    b = ViewBuilder()
    b.literal(b"ab")
    b.literal(b"cd")
    b.extent(100, 0)
    assert b.position == 4
    b.extent(100, 5)
    b.extent(105, 2)  # continues the extent before: one extent
    b.extent(200, 1)  # a gap: a new one
    b.literal(b"e")
    b.extent(201, 1)  # after a literal: a new one
    view = b.build()
    assert view.segments == (Literal(b"abcd"), Extent(100, 7), Extent(200, 1), Literal(b"e"), Extent(201, 1))
    assert view.size == b.position == 14
    with pytest.raises(ValueError):
        b.extent(-1, 1)


def test_extent_rejects_negative():
    with pytest.raises(ValueError):
        Extent(-1, 3)


def test_iter_blocks_splits_extents():
    stored = lay_out({"w": torch.arange(40, dtype=torch.int32)})
    view = safetensors_view(stored.manifest)
    blocks = list(view.iter_blocks(stored.read_region, block_bytes=7))
    assert all(len(b) <= 7 for b in blocks[1:])
    assert b"".join(bytes(b) for b in blocks) == view.read(0, view.size, stored.read_region)


def test_read_at_random_offsets_equals_slicing_every_file():
    stored = lay_out(rich_object())
    rng = random.Random(1234)
    for name, view in files_for(stored.manifest).items():
        whole = stored.materialize(view)
        assert len(whole) == view.size, name
        for _ in range(150):
            offset = rng.randrange(view.size + 10)
            size = rng.choice([0, 1, 7, 64, 300, rng.randrange(view.size + 10)])
            assert view.read(offset, size, stored.read_region) == whole[offset:offset + size], name


# --------------------------------------------------------------------------------------------
# safetensors


def test_safetensors_header_is_byte_exact():
    stored = lay_out({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([1, 2, 3], dtype=torch.int8)},
                   model="m", step=5)
    view = safetensors_view(stored.manifest)
    # the whole-state file carries the skeleton, its tensors named as in the file
    expected_header = (
        b'{"__metadata__":{"ckptfs.skeleton":"{\\"dict\\":[[{\\"str\\":\\"w\\"},{\\"tensor\\":\\"w\\"}],'
        b'[{\\"str\\":\\"b\\"},{\\"tensor\\":\\"b\\"}]]}","format":"pt","model":"m","step":"5"},'
        b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}}'
        b"    ")
    assert len(expected_header) == 272
    assert view.segments[0] == Literal(b"\x10\x01\x00\x00\x00\x00\x00\x00" + expected_header)
    assert view.segments[1:] == (Extent(0, 8), Extent(64, 3))  # offsets in the data area
    assert stored.materialize(view)[280:] == b"\x00\x00\x80?\x00\x00\x00@\x01\x02\x03"
    # a per-key file does not (its object is the subtree: safetensors' own load_model reads it)
    assert b"ckptfs.skeleton" not in stored.materialize(safetensors_view(stored.manifest, key="w"))


def test_a_skeleton_past_the_header_limit_of_safetensors_is_left_out_and_said(monkeypatch):
    # plain values of hundreds of MB (a sampler's permutation as a list) made a header that no
    # safetensors reader opens ("header too large")
    from ckptfs.views import safetensors as view_module

    stored = lay_out({"w": torch.tensor([1.0, 2.0]), "order": list(range(50))}, model="m", step=5)
    whole = stored.materialize(safetensors_view(stored.manifest))
    assert b"ckptfs.skeleton" in whole and len(whole) - 8 - 8 < 1000
    monkeypatch.setattr(view_module, "MAX_HEADER_BYTES", 300)
    small = stored.materialize(safetensors_view(stored.manifest))
    header = json.loads(small[8:8 + struct.unpack("<Q", small[:8])[0]])
    assert "ckptfs.skeleton" not in header["__metadata__"] and len(small) < len(whole)
    assert "over the 300 that safetensors reads" in header["__metadata__"]["ckptfs.skeleton_omitted"]
    assert safetensors.torch.load(small)["w"].tolist() == [1.0, 2.0]


def test_safetensors_every_dtype_round_trips(tmp_path):
    obj = {**all_dtypes(),
           "f4_scalar": torch.tensor(7, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
           "scalar": torch.tensor(2.5, dtype=torch.float64),
           "empty": torch.empty(3, 0, dtype=torch.bfloat16)}
    stored = lay_out(obj)
    path = stored.write(safetensors_view(stored.manifest), tmp_path / "s.safetensors")
    loaded = load_file(path)
    unsupported = {"complex128", "complex32", "f4_scalar"}
    assert sorted(loaded) == sorted(set(obj) - unsupported)
    for name, t in loaded.items():
        assert_same(obj[name], t, name)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert json.loads(meta.pop("ckptfs.skipped")) == ["complex128", "complex32", "f4_scalar"]
        assert meta == {"format": "pt", "model": "gpt2", "step": "1200"}
        assert_same(obj["float8_e8m0fnu"], f.get_tensor("float8_e8m0fnu"))
        assert f.get_slice("float4_e2m1fn_x2").get_shape() == [2, 6]  # F4 counts 4-bit values


def test_safetensors_leaves_out_tensors_named_by_no_text(tmp_path):
    """A name with a lone surrogate (a valid str key of a state dict) has no UTF-8: written as
    json.dumps escapes it, safetensors' serde_json refused the whole header ("lone leading
    surrogate"), so no tensor of the file could be read. Such names are left out and listed;
    a tensor tied to one keeps its other name, and the other tensors load."""
    w = torch.arange(4.0)
    obj = {"model": {"bad\udc80": torch.ones(2), "tied\ud800": w, "tied": w, "ok": torch.zeros(3)}}
    stored = lay_out(obj)
    path = stored.write(safetensors_view(stored.manifest), tmp_path / "s.safetensors")
    loaded = load_file(path)
    assert sorted(loaded) == ["model.ok", "model.tied"]
    assert_same(w, loaded["model.tied"])
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["ckptfs.skipped"]) == ["model.bad\udc80", "model.tied\ud800"]
        assert "ckptfs.aliases" not in f.metadata()
    model = load_file(stored.write(safetensors_view(stored.manifest, key="model"), tmp_path / "m.safetensors"))
    assert sorted(model) == ["ok", "tied"]


@settings(max_examples=150, deadline=None)
@given(meta=st.dictionaries(st.text(), st.text(), max_size=3),
       tensors=st.lists(st.tuples(st.text(), st.sampled_from(sorted(SAFETENSORS_DTYPES)),
                                  st.lists(st.integers(1, 5000), min_size=1, max_size=4),
                                  st.integers(0, 1 << 40)), max_size=8))
@example(meta={"a\ud800": '"\x00'}, tensors=[('x\ud800"\n\u2603\\', "float4_e2m1fn_x2", [2, 3], 3)])
def test_safetensors_header_is_json_dumps_of_the_dicts(meta, tensors):
    """encode_header writes the JSON by hand: it must be byte for byte what json.dumps of the
    header dicts gives (names with quotes, control characters, non-ASCII, lone surrogates)."""
    records = [(name, TensorRecord(name, dtype, tuple(shape), 0, nbytes)) for name, dtype, shape, nbytes in tensors]
    header, offset = {"__metadata__": meta}, 0
    for name, rec in records:
        shape = list(rec.shape)
        if rec.dtype == "float4_e2m1fn_x2":
            shape[-1] *= 2
        header[name] = {"dtype": SAFETENSORS_DTYPES[rec.dtype], "shape": shape,
                        "data_offsets": [offset, offset + rec.nbytes]}
        offset += rec.nbytes
    if len(header) != len(records) + 1:
        return  # names are unique in a real file
    expected = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    expected += b" " * (-len(expected) % 8)
    assert encode_header(meta, records) == struct.pack("<Q", len(expected)) + expected


def test_safetensors_per_key_view_tied_weights_and_names(tmp_path):
    w = torch.randn(4, 4)
    obj = {"model": {"emb.weight": w, "head.weight": w, "blocks": [{"b": torch.ones(2)}]},
           "optim": {"step": torch.tensor(3.0)}, "__metadata__": torch.zeros(1)}
    stored = lay_out(obj)
    full_path = stored.write(safetensors_view(stored.manifest), tmp_path / "a")
    full = load_file(full_path)
    # a tied tensor is stored once, under its first name; the other name is an alias
    assert sorted(full) == ["__metadata__#1", "model.blocks.0.b", "model.emb.weight", "optim.step"]
    with safe_open(full_path, "pt") as f:
        assert json.loads(f.metadata()["ckptfs.aliases"]) == {"model.head.weight": "model.emb.weight"}
    model_path = stored.write(safetensors_view(stored.manifest, key="model"), tmp_path / "m")
    model = load_file(model_path)
    assert sorted(model) == ["blocks.0.b", "emb.weight"]
    assert_same(w, model["emb.weight"])
    with safe_open(model_path, "pt") as f:
        assert json.loads(f.metadata()["ckptfs.aliases"]) == {"head.weight": "emb.weight"}
    view = safetensors_view(stored.manifest, key="model")
    # header, then emb.weight and blocks.0.b (one extent where stored one after the other): the
    # tied bytes once
    assert sum(s.length for s in view.segments if isinstance(s, Extent)) == w.nbytes + 2 * 4
    optim = safetensors_view(stored.manifest, key="optim")
    assert b'"step":{"dtype":"F32","shape":[]' in optim.segments[0].data


def test_safetensors_top_level_tensor_keeps_its_key_and_metadata_is_merged(tmp_path):
    stored = lay_out({"w": torch.ones(3)})
    view = safetensors_view(stored.manifest, key="w",
                            metadata={"step": "x", "a": "1"})
    path = stored.write(view, tmp_path / "w.safetensors")
    with safe_open(path, "pt") as f:
        assert f.keys() == ["w"]
        assert f.metadata() == {"a": "1", "format": "pt", "model": "gpt2", "step": "x"}
    with pytest.raises(TypeError):
        safetensors_view(stored.manifest, metadata={"n": 1})


def test_safetensors_none_when_nothing_qualifies():
    stored = lay_out({"c": torch.zeros(2, dtype=torch.complex128), "n": 1})
    assert safetensors_view(stored.manifest) is None
    assert safetensors_view(stored.manifest, key="n") is None
    assert safetensors_view(lay_out({"n": 1}).manifest) is None


# --------------------------------------------------------------------------------------------
# torch zip


TINY_DATA_PKL = (
    b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00aq\x02ctorch._utils\n"
    b"_rebuild_tensor_v2\nq\x03((X\x07\x00\x00\x00storageq\x04ctorch\nFloatStorage\nq\x05X\x01"
    b"\x00\x00\x000q\x06X\x03\x00\x00\x00cpuq\x07K\x03tq\x08QK\x00K\x03\x85q\tK\x01\x85q\n\x89h"
    b"\x00)Rq\x0btq\x0cRq\rX\x01\x00\x00\x00bq\x0eh\x03((h\x04ctorch\nLongStorage\nq\x0fX\x01"
    b"\x00\x00\x001q\x10h\x07K\x01tq\x11QK\x00))\x89h\x00)Rq\x12tq\x13Rq\x14u.")


def tiny_object():
    return OrderedDict(a=torch.arange(3, dtype=torch.float32), b=torch.tensor(5))


def test_torch_zip_first_member_is_byte_exact():
    stored = lay_out(tiny_object())
    data = stored.materialize(torch_zip_view(stored.manifest))
    local_header = (b"PK\x03\x04" b"\x00\x00" b"\x08\x08" + bytes(18) + b"\x13\x00\x0f\x00"
                    b"checkpoint/data.pkl" b"FB\x0b\x00" + b"Z" * 11)
    assert data[:64] == local_header
    assert data[64:64 + len(TINY_DATA_PKL)] == TINY_DATA_PKL
    descriptor = struct.pack("<IIII", 0x08074B50, crc32(TINY_DATA_PKL), 234, 234)
    assert data[298:314] == descriptor
    assert zipfile.ZipFile(io.BytesIO(data)).read("checkpoint/data.pkl") == TINY_DATA_PKL


@pytest.mark.parametrize("make", [
    tiny_object,
    lambda: {"f": all_dtypes(), "same": [t := torch.ones(2, 2), t], "e": torch.empty(0, 2),
             "s": torch.tensor(True), 3: ("x", 1.5, None, float("inf"))},
], ids=["tiny", "dtypes"])
def test_torch_zip_equals_torch_save_but_for_the_serialization_id(tmp_path, make):
    obj = make()
    stored = lay_out(obj)
    ours = stored.materialize(torch_zip_view(stored.manifest))
    torch.save(obj, tmp_path / "checkpoint.pt")
    theirs = (tmp_path / "checkpoint.pt").read_bytes()
    assert mask_serialization_id(ours, "checkpoint") == mask_serialization_id(theirs, "checkpoint")
    sid = zipfile.ZipFile(io.BytesIO(ours)).read("checkpoint/.data/serialization_id")
    assert len(sid) == 40 and sid.isdigit()


def test_torch_zip_members_and_alignment():
    stored = lay_out(rich_object())
    view = torch_zip_view(stored.manifest, archive_name="archive")
    data = stored.materialize(view)
    zf = zipfile.ZipFile(io.BytesIO(data))
    names = zf.namelist()
    n = len(stored.manifest.tensors)
    assert names == ["archive/data.pkl", "archive/.format_version", "archive/.storage_alignment",
                     "archive/byteorder", *(f"archive/data/{k}" for k in range(n)),
                     "archive/version", "archive/.data/serialization_id"]
    assert zf.testzip() is None
    assert zf.read("archive/version") == b"3\n" and zf.read("archive/.storage_alignment") == b"64"
    for info in zf.infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    # every tensor entry is an extent of the region, never a copy
    extents = [s for s in view.segments if isinstance(s, Extent)]
    assert sum(e.length for e in extents) == sum(t.nbytes for t in stored.manifest.tensors)


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_weights_only_round_trip(tmp_path, mmap):
    obj = rich_object()
    stored = lay_out(obj)
    path = stored.write(torch_zip_view(stored.manifest), tmp_path / "checkpoint.pt")
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    assert_same(obj, loaded)
    assert loaded["tied_a"] is loaded["tied_b"]
    assert loaded["transposed"].is_contiguous()


def test_numpy_arrays_load_weights_only_within_the_documented_safe_globals(tmp_path):
    """README: checkpoint.pt loads with weights_only=True within
    safe_globals(ckptfs.leaves.numpy_safe_globals()); an empty array's pickle names bytes
    (__builtin__.bytes), which the list left out, as torch.save's own file does."""
    import ckptfs.leaves

    obj = {"w": torch.ones(2), "empty": np.zeros((0, 3)), "ints": np.arange(4, dtype=np.int32),
           "scalar": np.float32(2.5), "rng": np.random.RandomState(0).get_state()}
    stored = lay_out(obj)
    path = stored.write(torch_zip_view(stored.manifest), tmp_path / "checkpoint.pt")
    with torch.serialization.safe_globals(ckptfs.leaves.numpy_safe_globals()):
        loaded = torch.load(path, weights_only=True)
    assert loaded["empty"].shape == (0, 3) and loaded["empty"].dtype == np.float64
    assert np.array_equal(loaded["ints"], obj["ints"]) and loaded["scalar"] == np.float32(2.5)
    assert np.array_equal(loaded["rng"][1], obj["rng"][1])


def computed_storage_offsets():
    """torch's option to compute storage offsets, set for a ``with`` block by torch's own scoped
    patch (never monkeypatch: its undo can delete the option from torch's config object)."""
    from torch.utils.serialization import config
    return config.patch("load.calculate_storage_offsets", True)


def test_torch_load_with_computed_storage_offsets(tmp_path, monkeypatch):
    """torch can compute storage offsets from miniz's layout rules instead of reading local
    headers; with the debug env var it asserts they agree with the headers."""
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    obj = rich_object()
    stored = lay_out(obj)
    path = stored.write(torch_zip_view(stored.manifest), tmp_path / "c.pt")
    with computed_storage_offsets():
        assert_same(obj, torch.load(path, weights_only=True, mmap=True))
        assert_same(obj, torch.load(path, weights_only=True))


def test_zip_tools_accept_the_archive(tmp_path):
    stored = lay_out(rich_object())
    path = stored.write(torch_zip_view(stored.manifest), tmp_path / "checkpoint.pt")
    subprocess.run([sys.executable, "-m", "zipfile", "-t", path], check=True, capture_output=True)
    if shutil.which("unzip") is None:
        pytest.skip("unzip is not installed")
    out = subprocess.run(["unzip", "-t", path], check=True, capture_output=True, text=True).stdout
    assert "No errors detected" in out


def test_torch_zip_rejects_bad_archive_names():
    manifest = lay_out({"a": 1}).manifest
    for bad in ["", "a/b", "a\\b", "a\0", "ckpt\u2713"]:
        with pytest.raises(ValueError):
            torch_zip_view(manifest, archive_name=bad)


class _TensorStub:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _StorageStub(_TensorStub):
    __slots__ = ()


class ReferencePickler(pickle.Pickler):
    """torch.save's way to pickle a tensor (``persistent_id`` for its storage, a reduction to
    ``_rebuild_tensor_v2/v3``) as Pickler hooks over stubs: the oracle for torchpickle, which
    writes the same bytes without the hooks."""

    def __init__(self, file, tensors):
        super().__init__(file, protocol=2)
        self.tensors = tensors
        self.storage_keys: dict[int, str] = {}

    def persistent_id(self, obj):
        if type(obj) is not _StorageStub:
            return None
        record = self.tensors[obj.index]
        key = self.storage_keys.setdefault(obj.index, str(len(self.storage_keys)))
        legacy = LEGACY_STORAGE.get(record.dtype)
        if legacy is None:
            return ("storage", torch.UntypedStorage, key, "cpu", record.nbytes)
        return ("storage", getattr(torch, legacy[1]), key, "cpu", record.numel)

    def reducer_override(self, obj):
        if type(obj) is not _TensorStub:
            return NotImplemented
        record = self.tensors[obj.index]
        args = (_StorageStub(obj.index), 0, (*record.shape,), contiguous_strides(record.shape), False, OrderedDict())
        if record.dtype in LEGACY_STORAGE:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, record.torch_dtype)


def test_the_globals_data_pkl_names_are_what_pickle_writes_for_torchs_objects():
    """torchpickle names torch's classes, functions and dtypes without importing torch: each
    GLOBAL it writes is the one pickle writes for the object itself."""
    import torch._utils
    from ckptfs.views.torchpickle import (ORDERED_DICT, REBUILD_TENSOR_V2, REBUILD_TENSOR_V3, UNTYPED_STORAGE,
                                          dtype_global, global_opcode)

    def pickled(obj) -> bytes:
        raw = pickle.dumps(obj, protocol=2)
        assert raw[2:3] == b"c" and raw[-3:] == b"q\x00.", raw  # PROTO, GLOBAL..., BINPUT 0, STOP
        return raw[2:-3]

    named = {ORDERED_DICT: OrderedDict, UNTYPED_STORAGE: torch.UntypedStorage,
             REBUILD_TENSOR_V2: torch._utils._rebuild_tensor_v2, REBUILD_TENSOR_V3: torch._utils._rebuild_tensor_v3}
    named.update({dtype_global(name): dtype for name, dtype in DTYPES.items()})
    named.update({name: getattr(torch, name[1]) for name in LEGACY_STORAGE.values()})
    for name, obj in named.items():
        assert global_opcode(name) == pickled(obj), name
    assert set(LEGACY_STORAGE) == {n for n, d in DTYPES.items() if d in torch.storage._dtype_to_storage_type_map()}


def reference_pickle(manifest):
    buf = io.BytesIO()
    pickler = ReferencePickler(buf, manifest.tensors)
    pickler.dump(unflatten(manifest.skeleton, [_TensorStub(i) for i in range(len(manifest.tensors))]))
    return buf.getvalue(), list(pickler.storage_keys)


_TENSOR_POOL = [t for i, dtype in enumerate(DTYPES.values())
                for t in [sample(dtype, (2, 3), seed=i), sample(dtype, (1,), seed=i).reshape(()),
                          sample(dtype, (0, 2)), sample(dtype, (1, 1, 1, 300)), sample(dtype, (70000,))]]
# numpy's dtypes that ckptfs stores, both byte orders (a big-endian dtype is no singleton)
_NUMPY_CODES = ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
                ">f8", ">i4"]


def numpy_sample(code: str, shape: tuple, fortran: bool, seed: int):
    """A numpy array of ``code`` and ``shape`` with random bytes (bools 0 or 1), Fortran-ordered
    where asked."""
    dtype = np.dtype(code)
    n = math.prod(shape) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 2 if code == "|b1" else 256, size=n, dtype=np.uint8).tobytes()
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return np.asfortranarray(a) if fortran else a


_numpy_arrays = st.builds(numpy_sample, st.sampled_from(_NUMPY_CODES), st.lists(st.integers(0, 3), max_size=3).map(tuple),
                          st.booleans(), st.integers(0, 1000))
_torch_objects = st.sampled_from([torch.Size([]), torch.Size([2, 3]), torch.float16, torch.bfloat16, torch.int64,
                                  torch.float8_e4m3fn, torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda")])
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.integers(-300, 70000),
                    st.floats(allow_nan=True), st.text(max_size=3), st.sampled_from(["a", "cpu", "storage", "", "b", "<"]),
                    st.integers(0, len(_TENSOR_POOL) - 1).map(lambda i: _TENSOR_POOL[i]),
                    _torch_objects, _numpy_arrays, _numpy_arrays.filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0]))
_keys = st.one_of(st.text(max_size=4), st.integers(-5, 300), st.booleans(), st.none())
_objects = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
    st.dictionaries(_keys, inner, max_size=5),
    st.dictionaries(_keys, inner, max_size=5).map(OrderedDict)), max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(obj=_objects)
def test_data_pkl_is_what_the_pickler_writes(obj):
    """torchpickle writes data.pkl opcode by opcode: byte for byte what the Pickler with
    torch.save's hooks writes, for skeletons as flattened and as decoded from the region."""
    manifest = lay_out(obj).manifest
    for m in (manifest, Manifest.decode(manifest.encode())):
        assert pickle_skeleton(m) == reference_pickle(m)


@settings(max_examples=200, deadline=None)
@given(obj=_objects, suffix=st.text(max_size=3))
def test_named_skeleton_is_json_dumps_of_the_mapped_skeleton(obj, suffix):
    """The whole-state safetensors file's skeleton is dumped in C, tensor references replaced by
    names in the same pass: byte for byte json.dumps of the mapped copy."""
    from ckptfs.manifest import dumps_compact
    from ckptfs.skeleton import dumps_named_skeleton, map_tensor_refs

    manifest = lay_out(obj).manifest
    for m in (manifest, Manifest.decode(manifest.encode())):
        names = {i: f"{t.name}{suffix}\u2603\U0001f600" for i, t in enumerate(m.tensors)}
        assert dumps_named_skeleton(m.skeleton, names) == dumps_compact(map_tensor_refs(m.skeleton, names.__getitem__))


@pytest.mark.parametrize("n", [1, 2, 999, 1000, 1001, 2000])
def test_data_pkl_batches_and_memo_indices_past_256(n):
    """Containers around pickle's batch size (1,000) and memo indices past 255 (LONG_BINPUT)."""
    t = torch.ones(2)
    for obj in ({f"k{i}": t if i % 7 else torch.zeros(i % 5) for i in range(n)},
                OrderedDict((i, [i, (i,), "x"]) for i in range(n)), [t] * n, tuple(range(n))):
        manifest = lay_out(obj).manifest
        assert pickle_skeleton(manifest) == reference_pickle(manifest)


def test_data_pkl_of_counts_shapes_and_strides_past_2_31():
    """Numbers the native writer leaves to the Python one (LONG1 past 2**31): same bytes."""
    records = (TensorRecord("small", "float32", (3,), 0, 12),
               TensorRecord("long", "float32", (1 << 31,), 64, 1 << 33),  # numel past 2**31
               TensorRecord("wide", "bfloat16", (2, 1 << 30, 2), 0, 1 << 33),  # a stride past 2**31
               TensorRecord("bytes", "uint16", (1 << 30, 2), 0, 1 << 32),  # UntypedStorage nbytes
               TensorRecord("after", "float32", (5,), 0, 20))
    skeleton = {"dict": [[{"str": r.name}, {"tensor": i}] for i, r in enumerate(records)]}
    manifest = Manifest("m", 1, 1, 0, records, skeleton, 1 << 34)
    assert pickle_skeleton(manifest) == reference_pickle(manifest)


def test_contiguous_strides_match_torch():
    for shape in [(), (0,), (3,), (2, 0, 3), (1, 1), (4, 1, 5), (0, 2)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape


def test_zip64_for_a_tensor_over_4_gib(tmp_path, monkeypatch):
    """A 4 GiB + 100 byte tensor that never exists: the region reads as zeros and its CRC is
    computed by combination. Checks the Zip64 fields with zipfile over the view itself, then
    with unzip and torch.load(mmap=True) on a sparse materialization (with torch computing the
    storage offsets from its Zip64 rules and checking them against the headers)."""
    big = (1 << 32) + 100
    small = 64
    offset_small = align_up(big, 64)
    records = (TensorRecord("big", "uint8", (big,), 0, big, crc32_of_zeros(big)),
               TensorRecord("small", "float32", (16,), offset_small, small, crc32(bytes(small))))
    skeleton = {"dict": [[{"str": "big"}, {"tensor": 0}], [{"str": "small"}, {"tensor": 1}]]}
    manifest = Manifest("huge", 1, 1, TIME_NS, records, skeleton, offset_small + small)
    zeros = lambda offset, length: bytes(length)
    view = torch_zip_view(manifest)
    assert Extent(0, big) in view.segments

    zf = zipfile.ZipFile(ViewFile(view, zeros))
    big_info, small_info = zf.getinfo("checkpoint/data/0"), zf.getinfo("checkpoint/data/1")
    assert (big_info.file_size, big_info.compress_size, big_info.CRC) == (big, big, records[0].crc32)
    assert small_info.header_offset > 0xFFFFFFFF  # needs the Zip64 offset field
    assert small_info.file_size == small
    with zf.open(small_info) as f:  # reading to the end checks the CRC
        assert f.read() == bytes(small)
    assert zf.read("checkpoint/version") == b"3\n"
    # the big entry's local header carries a Zip64 extra (its compressed size 0, as miniz writes
    # it before the data: byte for byte torch.save's), and its data descriptor 64-bit sizes
    header = view.read(big_info.header_offset, 30 + 17 + 20, zeros)
    assert header[47:51] == b"\x01\x00\x10\x00" and header[51:67] == struct.pack("<QQ", big, 0)
    data_start = big_info.header_offset + 30 + 17 + 20 + 4 + (-(big_info.header_offset + 71) % 64)
    assert data_start % 64 == 0
    descriptor = view.read(data_start + big, 24, zeros)
    assert descriptor == struct.pack("<IIQQ", 0x08074B50, records[0].crc32, big, big)
    tail = view.read(view.size - 98, 98, zeros)
    assert tail[:4] == b"PK\x06\x06" and tail[56:60] == b"PK\x06\x07" and tail[76:80] == b"PK\x05\x06"

    # sparse file: literals written, extents left as holes (zeros)
    path = tmp_path / "huge.pt"
    with open(path, "wb") as f:
        for seg in view.segments:
            if isinstance(seg, Literal):
                f.write(seg.data)
            else:
                f.seek(seg.length, io.SEEK_CUR)
        f.truncate()
    if shutil.which("unzip"):
        listing = subprocess.run(["unzip", "-lv", str(path)], check=True, capture_output=True,
                                 text=True).stdout
        assert str(big) in listing and f"{records[0].crc32:08x}" in listing
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with computed_storage_offsets():
        loaded = torch.load(path, weights_only=True, mmap=True)
    assert loaded["big"].shape == (big,) and loaded["big"][-1].item() == 0
    assert torch.equal(loaded["small"], torch.zeros(16))


def test_crc32_of_zeros_helper():
    for n in [0, 1, 2, 3, 63, 64, 1000]:
        assert crc32_of_zeros(n) == crc32(bytes(n))


# --------------------------------------------------------------------------------------------
# metadata.json


def test_metadata_json():
    stored = lay_out(rich_object())
    text = stored.materialize(metadata_json_view(stored.manifest)).decode("ascii")
    doc = json.loads(text)
    assert text.endswith("}\n") and text == json.dumps(doc, indent=2) + "\n"
    assert (doc["model"], doc["step"], doc["counter"], doc["time_ns"]) == ("gpt2", 1200, 3, TIME_NS)
    assert doc["time"] == "2023-11-14T22:13:20.123456789Z"
    first = stored.manifest.tensors[0]
    assert doc["tensors"][0] == {"name": first.name, "dtype": first.dtype, "shape": list(first.shape),
                                 "nbytes": first.nbytes, "crc32": f"{first.crc32:08x}"}
    assert len(doc["tensors"]) == len(stored.manifest.tensors)
    obj = doc["object"]
    assert obj["floats"][:4] == ["nan", "inf", "-inf", -0.0]
    assert obj["7"][1] == [2.5, None, "x"]
    assert obj["plain"] == {"lr": 1e-3, "name": "ünïcode", "None": 1, "2.5": "k", "-3": ""}
    assert obj["tied_b"] == obj["tied_a"] == "<tensor tied_a>"


def test_metadata_json_keeps_colliding_keys():
    stored = lay_out({1: "int", "1": "str", "1#1": "x"})
    doc = json.loads(stored.materialize(metadata_json_view(stored.manifest)))
    assert doc["object"] == {"1": "int", "1#1": "str", "1#1#1": "x"}


# --------------------------------------------------------------------------------------------
# files_for


def test_files_for_names_and_order(tmp_path):
    obj = {"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"m": torch.zeros(2)}}},
           "a/b": {"x": torch.ones(1)}, "state": {"s": torch.ones(1)}, "": {"e": torch.ones(1)}, "step": 3,
           "c128": {"c": torch.zeros(1, dtype=torch.complex128)}, "a_b": {"y": torch.zeros(1)},
           "c/d": {"z": torch.ones(1)}, "lone": torch.ones(3),  # a top-level tensor: in state.safetensors only
           "x/y": {"c": torch.zeros(1, dtype=torch.complex128)}, "x_y": {"v": torch.ones(2)}}
    stored = lay_out(obj)
    files = files_for(stored.manifest)
    # "a/b" and "a_b" make the same name: neither has a file (a_b.safetensors held a/b's tensors,
    # under a_b's name; `export --key a_b` wrote them); "x/y" has no file (complex128), so x_y does
    assert list(files) == ["checkpoint.pt", "state.safetensors", "model.safetensors",
                           "optim.safetensors", "c_d.safetensors", "x_y.safetensors", "metadata.json"]
    assert list(load_file(stored.write(files["x_y.safetensors"], tmp_path / "x_y.safetensors"))) == ["v"]
    c_d = load_file(stored.write(files["c_d.safetensors"], tmp_path / "c_d.safetensors"))
    assert list(c_d) == ["z"]
    assert "lone" in load_file(stored.write(files["state.safetensors"], tmp_path / "state.safetensors"))
    optim = load_file(stored.write(files["optim.safetensors"], tmp_path / "o.safetensors"))
    assert list(optim) == ["state.0.m"]


def test_two_top_level_keys_that_read_the_same_get_no_file():
    """The int 3 and the str "3" read "3" in a dotted name: 3.safetensors held both keys'
    tensors, nothing saying whose was whose. Neither gets a file of its own now (both are in
    state.safetensors, as 3.x and 3.x#1); a key of its own still does."""
    obj = {3: {"x": torch.ones(1)}, "3": {"x": torch.zeros(1)}, "model": {"w": torch.ones(2)}}
    assert list(files_for(lay_out(obj).manifest)) == ["checkpoint.pt", "state.safetensors", "model.safetensors",
                                                      "metadata.json"]


def test_files_for_other_roots():
    assert list(files_for(lay_out([torch.ones(1), {"k": torch.ones(1)}]).manifest)) == [
        "checkpoint.pt", "state.safetensors", "metadata.json"]
    assert list(files_for(lay_out({"step": 1}).manifest)) == ["checkpoint.pt", "metadata.json"]
    assert list(files_for(lay_out(torch.ones(1)).manifest)) == [
        "checkpoint.pt", "state.safetensors", "metadata.json"]


def test_plain_object_without_tensors_loads(tmp_path):
    obj = {"step": 3, "hist": [0.5, float("nan")], "cfg": ("a", None, True)}
    stored = lay_out(obj)
    path = stored.write(torch_zip_view(stored.manifest), tmp_path / "c.pt")
    assert_same(obj, torch.load(path, weights_only=True))
    assert_same(obj, torch.load(path, weights_only=True, mmap=True))


def test_key_file_name():
    assert key_file_name("model") == "model.safetensors"
    assert key_file_name("a/b\0c") == "a_b_c.safetensors"
    assert key_file_name("..") == "...safetensors"
    assert key_file_name("") is None
    assert key_file_name("\ud800") is None  # no file-system encoding
    assert key_file_name("x" * 243) == "x" * 243 + ".safetensors"
    assert key_file_name("x" * 244) is None  # over NAME_MAX


# --------------------------------------------------------------------------------------------
# a real training state


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        return self.head(self.norm(self.block(self.emb(x))))


def test_adamw_transformer_round_trip(tmp_path):
    torch.manual_seed(0)
    lm = TinyLM()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randint(0, 11, (2, 5))
        torch.nn.functional.cross_entropy(lm(x).reshape(-1, 11), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    state = {"model": lm.state_dict(), "optim": opt.state_dict(), "step": 2}
    stored = lay_out(state)
    files = files_for(stored.manifest)
    path = stored.write(files["checkpoint.pt"], tmp_path / "checkpoint.pt")
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert_same(state, loaded)
    lm2 = TinyLM()
    opt2 = torch.optim.AdamW(lm2.parameters(), lr=1e-3)
    lm2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    assert_same(opt.state_dict(), opt2.state_dict())
    model_path = stored.write(files["model.safetensors"], tmp_path / "model.safetensors")
    model = load_file(model_path)
    assert sorted(model) == sorted(set(state["model"]) - {"head.weight"})  # tied to emb.weight
    for name, t in model.items():
        assert_same(state["model"][name], t, name)
    # what safetensors' own loader for shared tensors accepts, and the ties come back
    lm3 = TinyLM()
    assert safetensors.torch.load_model(lm3, model_path) == (set(), [])
    assert lm3.head.weight is lm3.emb.weight
    assert_same(lm.state_dict(), lm3.state_dict())


@pytest.mark.parametrize("names", [[], ["w"], ["a\"b\\\\c", "é✓", "line\nbreak", "\x00nul"],
                                   ["\x7fdel\x1f", "x😀y", "lone\udc80", "\t\b\f\r/"]])
def test_metadata_json_is_what_json_dumps_writes(names):
    """metadata.json writes its tensor list by hand (a large version's document is mostly that
    list): the bytes are exactly json.dumps(indent=2)'s."""
    import json

    from ckptfs.manifest import Manifest, TensorRecord
    from ckptfs.views.metadata import iso8601_utc, metadata_json_view

    recs = tuple(TensorRecord(n, "float32", shape, 64 * i, 4 * max(1, len(shape)), 0xFFFFFFFF - 0x1000 * i)
                 for i, (n, shape) in enumerate(zip(names, [(), (3,), (2, 0, 5), (7, 1)])))
    skel = {"dict": [[{"str": n}, {"tensor": i}] for i, n in enumerate(names)] + [[{"str": "lr"}, {"float": "0x1.0p-1"}]]}
    m = Manifest("m", 3, 42, 1_700_000_000_123_456_789, recs, skel, 64 * len(recs))
    doc = {"model": "m", "step": 3, "counter": 42, "time_ns": m.time_ns, "time": iso8601_utc(m.time_ns),
           "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
                        "crc32": f"{t.crc32:08x}"} for t in recs],
           "object": json_safe(m.plain_part())}
    expected = (json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()
    assert metadata_json_view(m).segments[0].data == expected


def json_safe(value):
    """The oracle of metadata.json's ``object``: the plain part made JSON-safe as documented
    (tuples as lists, non-finite floats as strings, keys as str() with #n on a collision, torch's
    and numpy's objects as _object_json says)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            name = base = k if isinstance(k, str) else str(k)
            n = 1
            while name in out:
                name = f"{base}#{n}"
                n += 1
            out[name] = json_safe(v)
        return out
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (torch.dtype, torch.device)):  # torch.Size is a tuple
        return str(value)
    if isinstance(value, np.ndarray):
        return f"<ndarray {value.dtype.str} {value.shape}>"
    if isinstance(value, np.generic):  # a numpy scalar: its number (a complex as its str)
        number = value.item()
        return json_safe(str(number) if isinstance(number, complex) else number)
    return value


@settings(max_examples=200, deadline=None)
@given(obj=_objects)
@example(obj={1: "a", "1": "b", True: None, "True": 2.5, None: [float("inf"), float("nan"), -0.0], 1.5: ((),)})
def test_metadata_object_is_json_dumps_of_the_json_safe_object(obj):
    """metadata.json writes the object straight from the skeleton: byte for byte what
    json.dumps(indent=2) writes of the plain part made JSON-safe."""
    from ckptfs.views.metadata import _OBJECT, metadata_json_view

    stored = lay_out(obj)
    m = stored.manifest
    text = metadata_json_view(m).segments[0].data.decode("ascii")
    doc = json.loads(text)
    expected_object = json.dumps(json_safe(m.plain_part()), indent=2, ensure_ascii=True, allow_nan=False)
    doc["object"] = _OBJECT
    rebuilt = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
    assert text == rebuilt.replace(json.dumps(_OBJECT), expected_object.replace("\n", "\n  "), 1)


def test_the_files_of_many_top_level_keys_walk_the_tensors_once(monkeypatch, tmp_path):
    """A version of K top-level keys (per-parameter optimizer state keyed by name) makes a
    <key>.safetensors each; each walked every tensor of the version to find its own, K x N:
    its listing took 56 s at 8,000 keys. The tensors are walked once per manifest now."""
    from ckptfs.manifest import Manifest
    from ckptfs.views.safetensors import safetensors_files

    obj = {f"layers.{i}.weight": {"exp_avg": torch.full((2,), float(i)), "step": torch.tensor(i)} for i in range(300)}
    stored = lay_out(obj)
    manifest = stored.manifest
    walked = []
    real = Manifest.refs
    monkeypatch.setattr(Manifest, "refs", lambda self: walked.append(1) or real(self))
    files = safetensors_files(manifest)
    assert len(walked) <= 4, len(walked)  # state.safetensors, the keys' grouping: not one per key
    assert len(files) == 301
    got = load_file(stored.write(files["layers.7.weight.safetensors"], tmp_path / "k"))
    assert sorted(got) == ["exp_avg", "step"] and got["exp_avg"].tolist() == [7.0, 7.0]


def test_no_safetensors_file_whose_tensor_entries_alone_pass_what_readers_open(monkeypatch):
    """Past MAX_HEADER_BYTES of header without the skeleton (a million tensors, or names of
    megabytes), state.safetensors and <key>.safetensors were shown, and exported, though
    safetensors refuses them ("header too large") and `ckptfs import` of the export failed on
    them: they are left out (checkpoint.pt has every tensor)."""
    import ckptfs.views.safetensors as sv
    from ckptfs.views import files_for

    obj = {"model": {"w": torch.ones(1)}, "optim": {f"layer{i}." + "w" * 40: torch.ones(1) for i in range(20)}}
    manifest = lay_out(obj).manifest
    assert {"state.safetensors", "model.safetensors", "optim.safetensors"} <= set(files_for(manifest))
    monkeypatch.setattr(sv, "MAX_HEADER_BYTES", 1000)
    shown = set(files_for(manifest))
    # the model's file fits: it stays, without the whole state's
    assert "checkpoint.pt" in shown and "model.safetensors" in shown, shown
    assert not {"state.safetensors", "optim.safetensors"} & shown, shown
