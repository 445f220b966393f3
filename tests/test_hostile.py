"""Tier 4: hostile input -- property tests of every parser that takes bytes from outside.

* the region's own structures, as found in an untrusted region: Manifest.decode, Superblock /
  SlotHeader / ModelEntry unpack, on random and mutated bytes;
* whole regions: random garbage, and valid regions with fields rewritten *and their CRCs fixed
  up* (a crafted region passes the checksums, so only validation stands between it and the
  code): opening, listing, verify, load and the mount's views raise ckptfs errors only, and
  never write;
* model names through the API (path traversal, NUL, very long, unicode);
* the importer (safetensors headers and files, torch files), when it exists.

Every failure must be a ckptfs.errors.CkptfsError with a message; anything else (a struct.error,
a RecursionError, an IndexError...) is a finding. CKPTFS_HYPOTHESIS_EXAMPLES scales the runs.
"""
import dataclasses
import json
import logging
import os
import struct
import zipfile
import zlib
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import ckptfs
from ckptfs.checksum import crc32
from ckptfs.errors import CkptfsError, InvalidNameError, MalformedInputError, RegionFormatError
from ckptfs.manifest import Manifest
from ckptfs.region.format import (ENTRY_BYTES, ENTRY_COPY_OFFSET, SLOT_HEADER_BYTES, Extent, ModelEntry,
                                  SlotHeader, Superblock)
from ckptfs.testing.recording import copy_sparse

EXAMPLES = int(os.environ.get("CKPTFS_HYPOTHESIS_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=os.environ.get("CKPTFS_HYPOTHESIS_RANDOM") is None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])
TRIED = {"n": 0}  # inputs tried, for tools/reliability.py


def tried():
    TRIED["n"] += 1


# ------------------------------------------------------------------------------ a known region

def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"model": OrderedDict(w=torch.randn(300, generator=g), b=torch.arange(7, dtype=torch.int16)),
            "optim": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "meta": ("x", None, True, 1.5)}


@pytest.fixture(scope="module")
def good_region(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "good.region")
    with ckptfs.Store.create(path, size_bytes=64 << 20) as s:
        with s.writer("m", max_inflight=1, slots=3) as w:
            for step in (1, 2):
                w.save(_state(step), step).result()
    with ckptfs.Store(path) as s:
        entry = s.region.get("m")
        v = s.region.latest(entry)
        layout = {"table": s.region.superblock.table_offset, "entry": entry.index,
                  "slot": entry.slot_offset(v.slot), "header": v.header,
                  "manifest": json.loads(bytes(s.region.backend.view(entry.slot_offset(v.slot) + v.header.manifest_offset,
                                                                     v.header.manifest_bytes)))}
    return path, layout


def _fingerprint(path):
    with open(path, "rb") as f:
        return zlib.crc32(f.read(8 << 20)), os.path.getsize(path)


def exercise(path):
    """Everything a reader (the CLI, the mount, load) does with a region; only ckptfs errors."""
    from ckptfs.views import files_for

    before = _fingerprint(path)
    try:
        store = ckptfs.Store(path)
    except CkptfsError:
        assert _fingerprint(path) == before, "opening a hostile region wrote to it"
        return
    try:
        store.status()
        try:
            for p in store.verify():
                assert str(p)
        except CkptfsError:
            pass
        for model in store.models():
            for call in (lambda: store.versions(model), lambda: store.latest(model), lambda: store.load(model),
                         lambda: store.verify(model)):
                try:
                    call()
                except CkptfsError:
                    pass
            try:
                versions = store.versions(model)
            except CkptfsError:
                continue
            for info in versions:
                try:
                    store.load(model, info.step)
                except CkptfsError:
                    pass
                try:
                    with store.open_version(model, info.step) as v:
                        for name, view in files_for(v.manifest).items():
                            assert view.size >= 0
                            view.read(0, min(view.size, 1 << 16), lambda o, n: bytes(v.read(o, n)))
                except CkptfsError:
                    pass
    finally:
        store.close()
    assert _fingerprint(path) == before, "reading a hostile region wrote to it"


def _patch(path, offset, data):
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32(body))


# ------------------------------------------------------------------------------ structures

@SETTINGS
@given(st.binary(max_size=5000))
def test_structures_on_random_bytes(raw):
    tried()
    for parse in (lambda: Superblock.unpack(raw), lambda: SlotHeader.unpack(raw),
                  lambda: ModelEntry.unpack_copy(0, raw)):
        try:
            parse()
        except RegionFormatError as e:
            assert str(e)


@SETTINGS
@given(st.sampled_from(["sb", "slot", "entry"]), st.data())
def test_structures_with_valid_crc_and_random_fields(which, data):
    # a crafted structure: any field values, a correct checksum
    tried()
    fmt = {"sb": Superblock._FMT, "slot": SlotHeader._FMT, "entry": ModelEntry._FMT}[which]
    magic = {"sb": b"CKPTFSRG", "slot": b"CKPTSLOT", "entry": b"CKMODEL\0"}[which]
    body = magic + data.draw(st.binary(min_size=fmt.size - 12, max_size=fmt.size - 12))
    raw = _with_crc(body).ljust(4096, b"\0")
    try:
        if which == "sb":
            sb = Superblock.unpack(raw)
            assert sb.data_offset <= sb.region_bytes and sb.block_bytes >= 4096
        elif which == "slot":
            SlotHeader.unpack(raw)
        else:
            e = ModelEntry.unpack_copy(0, raw)
            assert e is None or (1 <= e.nslots and all(x.slot_bytes > 0 for x in e.extents))
    except RegionFormatError as e:
        assert str(e)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=25)


@SETTINGS
@given(st.one_of(st.binary(max_size=3000), JSON.map(lambda d: json.dumps(d).encode())))
def test_manifest_decode_random(raw):
    tried()
    try:
        m = Manifest.decode(raw)
    except MalformedInputError as e:
        assert str(e)
        return
    m.validate()


def _manifest_mutations():
    keys = ["format", "model", "step", "counter", "time_ns", "data_bytes", "tensors", "skeleton"]
    tkeys = ["name", "dtype", "shape", "offset", "nbytes", "crc32"]
    return st.one_of(
        st.tuples(st.just("top"), st.sampled_from(keys), JSON),
        st.tuples(st.just("tensor"), st.sampled_from(tkeys), JSON),
        st.tuples(st.just("drop"), st.sampled_from(keys), st.none()),
        st.tuples(st.just("skeleton"), st.just("skeleton"), JSON),
        st.tuples(st.just("deep"), st.integers(10, 5000), st.none()),
    )


def _mutate_manifest(doc, mutation) -> bytes:
    kind, key, value = mutation
    if kind == "deep":  # built as text: json itself cannot encode it
        text = json.dumps(dict(doc, skeleton="@"))
        return text.replace('"@"', '{"list":[' * key + '{"tensor":0}' + "]}" * key).encode()
    doc = json.loads(json.dumps(doc))
    if kind == "top":
        doc[key] = value
    elif kind == "tensor":
        doc["tensors"][0][key] = value
    elif kind == "drop":
        doc.pop(key)
    else:
        doc["skeleton"] = {"dict": [[{"str": "k"}, value]]} if isinstance(value, dict) else value
    return json.dumps(doc).encode()


@SETTINGS
@given(_manifest_mutations())
def test_manifest_decode_mutated(good_region, mutation):
    tried()
    raw = _mutate_manifest(good_region[1]["manifest"], mutation)
    try:
        Manifest.decode(raw)
    except MalformedInputError as e:
        assert str(e)


# ------------------------------------------------------------------------------ whole regions

@SETTINGS
@given(st.binary(min_size=0, max_size=8192), st.booleans())
def test_open_random_garbage_region(tmp_path, garbage, sized):
    tried()
    path = str(tmp_path / "garbage.region")
    with open(path, "wb") as f:
        f.write(garbage)
        if sized:
            f.truncate(64 << 20)
    exercise(path)


@pytest.mark.slow
@SETTINGS
@given(st.sampled_from(["sb", "entry", "latest", "header", "manifest", "bytes"]), st.data())
def test_open_crafted_region(good_region, tmp_path, target, data):
    # fields rewritten with checksums fixed up, so that only validation can refuse them
    tried()
    src, layout = good_region
    path = str(tmp_path / "crafted.region")
    copy_sparse(src, path)
    ints = st.one_of(st.integers(0, 1 << 64 - 1), st.integers(0, 1 << 24), st.sampled_from([0, 1, 4095, 4096, 1 << 20, 1 << 26, (1 << 64) - 1]))
    if target == "sb":
        sb = Superblock.unpack(open(path, "rb").read(4096))
        fields = dict(block_bytes=data.draw(st.sampled_from([4096, 8192, 1 << 21, 3, 0, 1 << 31])),
                      region_bytes=data.draw(ints), table_offset=data.draw(ints),
                      table_entries=data.draw(st.integers(0, 1 << 20)), data_offset=data.draw(ints))
        name = data.draw(st.sampled_from(sorted(fields)))
        sb = Superblock(**{**sb.__dict__, name: fields[name]})
        try:
            _patch(path, 0, sb.pack())
        except struct.error:
            assume(False)
    elif target == "entry":
        base = layout["table"] + layout["entry"] * ENTRY_BYTES
        with ckptfs.Store(src) as s:
            e = s.region.get("m")
        x = e.extents[0]
        fields = dict(nslots=data.draw(st.integers(0, 70000)), slot_bytes=data.draw(ints),
                      offset=data.draw(ints), first_slot=data.draw(st.integers(0, 70000)))
        name = data.draw(st.sampled_from(sorted(fields) + ["name", "ring_slots", "two"]))
        if name == "name":
            e = dataclasses.replace(e, name=data.draw(st.text(max_size=300)), generation=e.generation + 1)
        elif name == "ring_slots":
            e = e.with_extents(e.extents, ring_slots=data.draw(st.integers(0, 70000)))
        elif name == "two":  # a second extent anywhere
            e = e.with_extents((x, Extent(data.draw(ints), data.draw(ints), data.draw(st.integers(0, 9)),
                                          data.draw(st.integers(0, 9)))))
        else:
            e = e.with_extents((Extent(**{**x.__dict__, name: fields[name]}),))
        try:
            raw = e.pack_copy()
        except struct.error:
            assume(False)
        _patch(path, base + ENTRY_COPY_OFFSET, raw)  # copy A, a generation newer than copy B
    elif target == "latest":
        base = layout["table"] + layout["entry"] * ENTRY_BYTES
        _patch(path, base + data.draw(st.sampled_from([0, 8])), struct.pack("<Q", data.draw(ints)))
    elif target == "header":
        h = layout["header"]
        fields = dict(state=data.draw(st.integers(0, 5)), counter=data.draw(ints), slot=data.draw(st.integers(0, 9)),
                      model_index=data.draw(st.integers(0, 3)), manifest_offset=data.draw(ints),
                      manifest_bytes=data.draw(ints), data_offset=data.draw(ints), data_bytes=data.draw(ints),
                      step=data.draw(st.integers(-(1 << 63), (1 << 63) - 1)))
        name = data.draw(st.sampled_from(sorted(fields)))
        h = SlotHeader(**{**h.__dict__, name: fields[name]})
        try:
            _patch(path, layout["slot"], h.pack())
        except struct.error:
            assume(False)
    elif target == "manifest":
        raw = _mutate_manifest(layout["manifest"], data.draw(_manifest_mutations()))
        h = layout["header"]
        assume(h.manifest_offset + len(raw) <= h.data_offset)
        h = SlotHeader(**{**h.__dict__, "manifest_bytes": len(raw), "manifest_crc": crc32(raw)})
        _patch(path, layout["slot"] + h.manifest_offset, raw)
        _patch(path, layout["slot"], h.pack())
    else:  # random bytes anywhere in the metadata or the slot
        offset = data.draw(st.sampled_from([0, layout["table"], layout["slot"], layout["slot"] + SLOT_HEADER_BYTES]))
        offset += data.draw(st.integers(0, 600))
        _patch(path, offset, data.draw(st.binary(min_size=1, max_size=64)))
    exercise(path)


# ------------------------------------------------------------------------------ names

NAMES = st.one_of(
    st.text(min_size=0, max_size=300),
    st.sampled_from(["..", ".", "../escape", "a/../../b", "/abs", "a\0b", "x" * 255, "x" * 256, "é" * 128,
                     "e\u0301", "\u202eevil", " lead", "trail ", "tab\tname", "new\nline", "\ud800", "ok-name_1.2",
                     "日本語モデル", "🦙" * 63, "🦙" * 64, "latest", "step-00000001", "CON", "a" * 300]),
)


def _module_store(tmp_path_factory, name: str):
    """A 256 MiB region shared by one module's tests, and its directory."""
    d = tmp_path_factory.mktemp(name)
    with ckptfs.Store.create(str(d / f"{name}.region"), size_bytes=256 << 20) as s:
        yield s, d


@pytest.fixture(scope="module")
def name_store(tmp_path_factory):
    yield from _module_store(tmp_path_factory, "names")


@SETTINGS
@given(NAMES)
@example("x" * 255)  # the longest name: every file derived from it must still be nameable
@example("🦙" * 63)
@example("../escape")
@example("a\0b")
@example("\ud800")
def test_model_names_through_the_api(name_store, name):
    tried()
    store, d = name_store
    listing = sorted(os.listdir(d))
    try:
        with store.writer(name, max_inflight=1, slots=2, slot_bytes=64 << 10) as w:
            w.save({"t": torch.arange(3)}, 1).result()
    except InvalidNameError as e:
        assert str(e)
        with pytest.raises(InvalidNameError):
            store.load(name)
    except ckptfs.errors.RegionFullError:
        pass
    else:
        assert name in store.models()
        assert torch.equal(store.load(name)["t"], torch.arange(3))
        assert "/" not in name and "\0" not in name and len(name.encode()) <= 255 and name not in (".", "..")
        store.remove_model(name)
    assert sorted(os.listdir(d)) == listing, "a model name created something next to the region"


# ------------------------------------------------------------------------------ importer

from ckptfs import importer  # noqa: E402
from ckptfs.safetensors_file import parse_safetensors_header  # noqa: E402


def _safetensors_bytes():
    from safetensors.torch import save

    return save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)})


@SETTINGS
@given(st.one_of(
    st.binary(max_size=600),
    st.tuples(st.integers(0, 700), st.binary(min_size=1, max_size=16)),
    JSON.map(lambda d: json.dumps(d).encode()),
))
def test_safetensors_header_parser(spec):
    tried()
    good = _safetensors_bytes()
    if isinstance(spec, tuple):
        at, junk = spec
        raw = bytearray(good)
        raw[at:at + len(junk)] = junk
        raw = bytes(raw)
    elif spec[:1] == b"{" or spec[:1] == b"[":
        raw = struct.pack("<Q", len(spec)) + spec
    else:
        raw = spec
    try:
        header = parse_safetensors_header(raw, len(raw))
    except MalformedInputError as e:
        assert str(e)
        return
    assert header.data_start <= len(raw)


def test_import_of_a_zip_that_claims_several_disks(tmp_path):
    import io
    buf = io.BytesIO()
    torch.save({"w": torch.arange(10.0)}, buf)
    raw = bytearray(buf.getvalue())
    locator = raw.rindex(b"PK\x06\x07")  # the zip64 end-of-central-directory locator
    raw[locator + 16:locator + 20] = struct.pack("<I", 2)  # "total number of disks"
    path = str(tmp_path / "multidisk.pt")
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(MalformedInputError):
        importer.load_torch_file(path)


def test_import_of_a_torch_file_whose_tensor_bytes_were_damaged(tmp_path):
    """torch.load never checks the CRC32s of a torch.save archive's entries: the import does, so
    damaged tensor bytes are refused rather than stored (and then verified) as the tensors."""
    import io
    buf = io.BytesIO()
    torch.save({"w": torch.arange(1000.0)}, buf)
    raw = bytearray(buf.getvalue())
    at = raw.index(torch.arange(1000.0)[100:104].numpy().tobytes())
    raw[at:at + 8] = b"XXXXXXXX"
    path = str(tmp_path / "damaged.pt")
    with open(path, "wb") as f:
        f.write(raw)
    assert torch.load(path)["w"][100] != 100.0  # torch itself loads the damage
    with pytest.raises(MalformedInputError, match="damaged zip archive.*BadZipFile: Bad CRC-32 for file '.*data/0'"):
        importer.load_torch_file(path)


def test_import_of_a_torch_file_saved_without_crcs(tmp_path):
    """torch.save with its serialization config's save.compute_crc32 off records CRC 0 for every
    entry: such a file has nothing to check, and imports."""
    import torch.utils.serialization as serialization

    path = str(tmp_path / "no-crc.pt")
    # torch's own patch of its config: pytest 9.2's monkeypatch.undo deletes an attribute it did
    # not find in the object's __dict__, and a deleted entry of torch's config stays deleted
    with serialization.config.patch({"save.compute_crc32": False}):
        torch.save({"w": torch.arange(1000.0)}, path)
    with zipfile.ZipFile(path) as z:  # the file is what the test is about: no entry has a CRC
        assert {info.CRC for info in z.infolist()} == {0}
    assert torch.equal(importer.load_torch_file(path)["w"], torch.arange(1000.0))


@pytest.fixture(scope="module")
def import_store(tmp_path_factory):
    yield from _module_store(tmp_path_factory, "import")


def _region_metadata(store):
    return bytes(store.region.backend.view(0, store.region.superblock.data_offset))


@SETTINGS
@given(st.sampled_from(["safetensors", "torch"]), st.integers(0, 4000), st.binary(min_size=0, max_size=24),
       st.booleans())
def test_import_of_mutated_files(import_store, fmt, at, junk, truncate):
    tried()
    store, d = import_store
    path = str(d / ("in.safetensors" if fmt == "safetensors" else "in.pt"))
    if fmt == "safetensors":
        raw = bytearray(_safetensors_bytes())
    else:
        import io
        buf = io.BytesIO()
        torch.save({"w": torch.arange(10.0), "n": 3, "s": "x"}, buf)
        raw = bytearray(buf.getvalue())
    at = at % (len(raw) + 1)
    if truncate:
        raw = raw[:at]
    else:
        raw[at:at + len(junk)] = junk
    with open(path, "wb") as f:
        f.write(raw)
    models_before = store.models()
    meta_before = _region_metadata(store)
    try:
        info = importer.import_file(store, "imported", path)
    except CkptfsError as e:
        assert str(e)
        assert store.models() == models_before, "a refused import created a model"
        assert _region_metadata(store) == meta_before, "a refused import wrote to the region"
        return
    assert info.model == "imported"
    store.remove_model("imported")


def _hf_directory(path, shards: bool = True) -> dict:
    """A tiny GPT-2 saved as Hugging Face saves it (shards and their index, or one file);
    returns its state as from_pretrained would load it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=32))
    model.save_pretrained(path, max_shard_size="60KB" if shards else "5GB")
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shards", [True, False])
def test_import_of_a_hugging_face_directory(tmp_path, shards):
    """``ckptfs import MODEL DIR`` of save_pretrained's output: the shards' tensors as one
    version (the one file's, without shards), its config.json kept, so that the version's hf/
    directory holds what from_pretrained needs."""
    from ckptfs.views import files_for

    src = str(tmp_path / "hf")
    state = _hf_directory(src, shards)
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json")) == shards
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        v = importer.import_file(store, "gpt2", src)
        back = store.load("gpt2")
        saved = {k for k in state if k != "lm_head.weight"}  # tied to wte: save_pretrained stores it once
        assert set(back) == saved and all(torch.equal(back[k], state[k]) for k in saved)
        with store.open_version("gpt2", v.step) as opened:
            files = dict(opened.manifest.files)
            assert files["config.json"] == open(os.path.join(src, "config.json")).read()
            assert {"hf/config.json", "hf/model.safetensors"} <= set(files_for(opened.manifest))


def test_import_of_a_trainer_checkpoint_names_what_it_leaves_out(tmp_path, caplog):
    """A Trainer's checkpoint-N is a model directory and more (the optimizer and scheduler
    state, RNG states, the trainer's JSON): its import takes the weights and config, and names
    the rest with the way to import a torch file of it. It was left out in silence."""
    src = str(tmp_path / "checkpoint-500")
    _hf_directory(src, shards=False)
    torch.save({"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": []}, os.path.join(src, "optimizer.pt"))
    with open(os.path.join(src, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 500}')
    os.mkdir(os.path.join(src, "runs"))
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            importer.import_file(store, "gpt2", src)
        assert ("left out optimizer.pt, runs/, trainer_state.json (a torch file can be a model of its own: ckptfs "
                f"import gpt2-optimizer {src}/optimizer.pt)") in caplog.text
        assert "config.json" in dict(store.open_version("gpt2", 0).manifest.files)
        caplog.clear()
        importer.import_file(store, "gpt2-optimizer", os.path.join(src, "optimizer.pt"))
        assert torch.equal(store.load("gpt2-optimizer")["state"][0]["exp_avg"], torch.ones(3))
        assert "left out" not in caplog.text


def _hostile_directories():
    def index_of(src):
        with open(os.path.join(src, "model.safetensors.index.json")) as f:
            return json.load(f)

    def rewrite(src, index):
        with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)

    def outside(src):
        index = index_of(src)
        index["weight_map"][next(iter(index["weight_map"]))] = "../escape.safetensors"
        rewrite(src, index)

    def missing_shard(src):
        index = index_of(src)
        os.remove(os.path.join(src, next(iter(index["weight_map"].values()))))

    def misplaced(src):
        index = index_of(src)
        names = sorted(set(index["weight_map"].values()))
        name = next(k for k, v in index["weight_map"].items() if v == names[0])
        index["weight_map"][name] = names[1]
        rewrite(src, index)

    def unheld(src):
        index = index_of(src)
        index["weight_map"]["ghost.weight"] = next(iter(index["weight_map"].values()))
        rewrite(src, index)

    def not_an_index(src):
        with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
            f.write('{"weight_map": [1, 2]}')

    def no_weights(src):
        for name in os.listdir(src):
            if "safetensors" in name:
                os.remove(os.path.join(src, name))
    return {"outside": outside, "missing shard": missing_shard, "misplaced": misplaced, "unheld": unheld,
            "not an index": not_an_index, "no weights": no_weights}


@pytest.mark.parametrize("damage", sorted(_hostile_directories()))
def test_import_of_a_damaged_hugging_face_directory_writes_nothing(tmp_path, damage):
    src = str(tmp_path / "hf")
    _hf_directory(src)
    _hostile_directories()[damage](src)
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with pytest.raises(MalformedInputError) as refused:
            importer.import_file(store, "gpt2", src)
        assert "\n" not in str(refused.value)
        assert store.versions("gpt2", missing_ok=True) == []


def test_import_of_a_directory_of_torch_shards(tmp_path):
    """The older layout of save_pretrained: pytorch_model-0000N-of-0000M.bin and their index,
    each shard read with torch.load(weights_only=True)."""
    src = tmp_path / "hf"
    src.mkdir()
    state = {"a.weight": torch.randn(4, 3), "a.bias": torch.randn(4), "b.weight": torch.randn(2, 4)}
    shards = {"pytorch_model-00001-of-00002.bin": ["a.weight", "a.bias"], "pytorch_model-00002-of-00002.bin": ["b.weight"]}
    for name, keys in shards.items():
        torch.save({k: state[k] for k in keys}, src / name)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, keys in shards.items() for k in keys}}))
    (src / "config.json").write_text('{"model_type": "toy"}')
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        importer.import_file(store, "toy", str(src), key="model")
        back = store.load("toy")
        assert set(back) == {"model"} and all(torch.equal(back["model"][k], v) for k, v in state.items())
        with store.open_version("toy") as v:
            assert dict(v.manifest.files) == {"config.json": '{"model_type": "toy"}'}


def test_the_cli_says_the_librarys_warnings_in_its_own_line(tmp_path, capsys):
    """`ckptfs import` of a Trainer's checkpoint: the left-out files come out as the command's one
    warning line, as `export`'s own warning does; they came out bare (Python's last-resort
    handler), beside `ckptfs export: warning: ...` lines."""
    from ckptfs.cli import main as cli_main

    src = str(tmp_path / "checkpoint-500")
    _hf_directory(src, shards=False)
    torch.save({"state": {}, "param_groups": []}, os.path.join(src, "optimizer.pt"))
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    capsys.readouterr()  # what making the directory printed (transformers)
    with pytest.raises(SystemExit) as e:
        cli_main(["import", "--region", region, "gpt2", src])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and "imported" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckptfs: warning: {src}: imported its weights and config; "
                                                   "left out optimizer.pt"), err
    assert not logging.getLogger("ckptfs").handlers  # the command's handler went with it


def test_a_tied_map_that_lies_is_refused(tmp_path):
    """hf/model.safetensors names tied tensors in __metadata__["ckptfs.tied"], which an import
    ties back into one tensor: a map tying tensors whose values differ, or naming one the file
    does not hold, is refused (tied as told, one tensor's values were lost)."""
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        for tied, words in [({"b": "a"}, r"ties 'b' to 'a', whose values differ"),
                            ({"c": "a"}, r"must map names the file holds to names it holds"),
                            ({"a": "a"}, r"must map names the file holds to names it holds"),
                            ({"b": "a", "a": "b"}, r"ties 'b' to 'a', which it ties to another")]:
            save_file({"a": torch.ones(3), "b": torch.zeros(3)}, path,
                      metadata={"format": "pt", "ckptfs.tied": json.dumps(tied)})
            with pytest.raises(MalformedInputError, match=words):
                importer.import_file(store, "m", path)
        save_file({"a": torch.ones(3), "b": torch.ones(3)}, path,
                  metadata={"ckptfs.tied": '{"b": "a"}', "ckptfs.aliases": '{"c": "b"}'})
        importer.import_file(store, "m", path)
        back = store.load("m")
        assert back["a"].data_ptr() == back["b"].data_ptr() == back["c"].data_ptr()  # an alias of a tied name too
        assert torch.equal(back["c"], torch.ones(3))
        assert store.models() == ["m"] and [v.step for v in store.versions("m")] == [0]
