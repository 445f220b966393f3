"""Tier 1-2: what goes in comes back, exactly; what cannot go in is refused before any write."""
import math
import os
from collections import OrderedDict

import pytest
import torch

import ckptfs
from ckptfs.errors import (CheckpointTooLargeError, InvalidNameError, NotFoundError, RegionFullError,
                           UnsupportedObjectError)
from ckptfs.flatten import DTYPES
from conftest import assert_same


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, dim * 2, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied weights share storage
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        return self.head(self.norm(self.encoder(self.embed(x))))


def trained_state(steps=3):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "loss": float(loss)}


def every_dtype_tensors():
    out = {}
    base = torch.arange(-6, 18, dtype=torch.float32).reshape(4, 6) / 3
    for name, dtype in DTYPES.items():
        if dtype.is_complex:
            t = torch.complex(base, -base).to(dtype) if dtype != torch.complex32 else torch.complex(base, base).to(torch.complex32)
        elif dtype == torch.bool:
            t = base > 1
        elif name.startswith("float4"):
            t = torch.arange(24, dtype=torch.uint8).reshape(4, 6).view(dtype)
        elif name == "float8_e8m0fnu":
            t = torch.arange(24, dtype=torch.uint8).reshape(4, 6).view(dtype)
        elif dtype.is_floating_point:
            t = base.to(dtype)
        else:
            t = (base * 3).to(torch.int64).clamp(min=0 if name.startswith("uint") else -100).to(dtype)
        out[name] = t
    return out


def test_transformer_and_adamw_roundtrip(store):
    state = trained_state()
    with store.writer("tiny") as w:
        res = w.save(state, step=3).result()
    assert res.published and res.step == 3
    back = store.load("tiny")
    assert_same(state, back)
    # tied weights come back sharing storage, as torch.save would give them
    assert back["model"]["embed.weight"].data_ptr() == back["model"]["head.weight"].data_ptr()
    model = TinyTransformer()
    model.load_state_dict(back["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(back["optim"])


def test_a_save_leaves_the_callers_storages_resizable(store):
    """The snapshot read a tensor's bytes through Tensor.numpy(), which marks its storage not
    resizable for good: a `storage.resize_(0)` after a save (how FSDP and offloading free
    memory) raised "Trying to resize storage that is not resizable", naming nothing of ckptfs."""
    model = torch.nn.Linear(8, 4)
    plain = torch.randn(1000)
    with store.writer("m") as w:
        w.save({"model": model.state_dict(), "x": plain}, 1).result()
        w.save({"model": model.state_dict(), "x": plain}, 2, async_snapshot=True).result()
    assert all(t.untyped_storage().resizable() for t in [plain, *model.state_dict().values()])
    plain.resize_(8)
    model.weight.untyped_storage().resize_(0)
    assert store.load("m")["x"].shape == (1000,)


def test_every_dtype_and_odd_tensors(store):
    big = torch.randn(64, 48)
    obj = {
        "dtypes": every_dtype_tensors(),
        "noncontig": big.t(),
        "strided": big[::3, 1::5],
        "zero_dim": torch.tensor(7.25),
        "empty": torch.empty(0, 5),
        "empty_int": torch.zeros((3, 0, 2), dtype=torch.int32),
        "view_a": big[:10],
        "view_b": big[5:20],  # overlapping views of one storage: stored separately, both exact
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "requires_grad": torch.nn.Parameter(torch.ones(3)),
    }
    with store.writer("odd", chunk_bytes=4096 * 2) as w:  # tiny chunks: tensors span chunks
        w.save(obj, step=1).result()
    back = store.load("odd")
    expected = {k: (v if not isinstance(v, torch.Tensor) else v.detach().resolve_conj().clone())
                for k, v in obj.items()}
    expected["requires_grad"] = torch.ones(3)
    assert_same(expected, back)


def test_a_load_onto_another_device_stages_every_dtype_in_one_block(store):
    """A load onto a GPU reads the version into views of one host block (pinned there) and
    copies those to the device: every dtype and odd shape lands whole in its own aligned range
    of the block, and the path runs end to end onto a device without memory (meta) here."""
    from ckptfs.skeleton import unflatten
    from ckptfs.restore import STAGING_ALIGN_BYTES, read_into, staging_views

    obj = {"dtypes": every_dtype_tensors(), "zero_dim": torch.tensor(7.25), "empty": torch.empty(0, 5),
           "big": torch.randn(300, 7), "odd": torch.arange(3, dtype=torch.int8)}
    with store.writer("staged", chunk_bytes=8192) as w:
        w.save(obj, step=1).result()
    with store.open_version("staged") as v:
        records = v.manifest.tensors
        views = staging_views(records, pin=False)
        read_into(v.data, views, verify=True, prefault=True)
        staged = unflatten(v.manifest.skeleton, views)
    assert_same(store.load("staged"), staged)
    assert len({t.untyped_storage().data_ptr() for t in views}) == 1
    spans = sorted((t.data_ptr(), t.data_ptr() + r.nbytes) for t, r in zip(views, records) if r.nbytes)
    assert all(start % STAGING_ALIGN_BYTES == 0 for start, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    on_meta = store.load("staged", map_location="meta")

    def leaves(node, path=()):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from leaves(v, (*path, k))
        else:
            yield path, node.device.type, node.dtype, node.shape
    assert list(leaves(on_meta)) == [(p, "meta", dtype, shape) for p, _, dtype, shape in leaves(staged)]


def test_plain_leaves_and_containers(store):
    obj = OrderedDict(a=1, b=2.5, c="text ✓", d=True, e=None, f=[1, (2, 3), {"x": [None]}],
                      g={0: "int key", 1.5: "float key", True: "bool key", None: "none key"},
                      nan=float("nan"), inf=-math.inf, big=2 ** 80, tup=(torch.ones(2),))
    with store.writer("plain") as w:
        w.save(obj, step=0).result()
    assert_same(obj, store.load("plain"))


@pytest.mark.parametrize("leaf, where", [
    (object(), "state.bad"),
    (torch.ones(2).to_sparse(), "state.bad"),
    ({1, 2}, "state.bad"),
    (b"bytes", "state.bad"),
    (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "state.bad"),
])
def test_unsupported_leaf_names_its_path(store, leaf, where):
    with store.writer("bad") as w:
        with pytest.raises(UnsupportedObjectError, match=where.replace(".", r"\.")):
            w.save({"state": {"bad": leaf}}, step=1)
        with pytest.raises(TypeError):  # UnsupportedObjectError is a TypeError too
            w.save([leaf], step=1)
    assert "bad" not in store.models()  # nothing was written, not even the model


@pytest.mark.parametrize("obj, error, match", [
    ({"state": {"bad": object()}}, UnsupportedObjectError, r"state\.bad"),
    ({"w": torch.empty(80 << 20)}, CheckpointTooLargeError, r"Store.create\(path, size_bytes=...\)"),
])
def test_async_save_refusals_come_through_the_future_before_any_write(store, obj, error, match):
    """With async_snapshot the object is read on the snapshot thread: a refusal is raised by
    wait_snapshot() and the future, nothing is written, and the writer goes on saving."""
    with store.writer("later") as w:
        w.save({"w": torch.arange(1000.0)}, step=1).result()
        fut = w.save(obj, step=2, async_snapshot=True)
        with pytest.raises(error, match=match):
            w.wait_snapshot()
        with pytest.raises(error, match=match):
            fut.result(timeout=30)
        with pytest.raises(error):
            fut.snapshotted.result(timeout=30)
        w.save({"w": torch.arange(1000.0) * 3}, step=3, async_snapshot=True).result(timeout=30)
    assert [v.step for v in store.versions("later")] == [1, 3]
    assert torch.equal(store.load("later")["w"], torch.arange(1000.0) * 3)


def test_async_save_checks_its_step_and_writer_at_once(store):
    w = store.writer("now")
    with pytest.raises(ValueError, match="step"):
        w.save({"x": torch.ones(1)}, step=-1, async_snapshot=True)
    w.close()
    with pytest.raises(ckptfs.errors.CkptfsError, match="closed"):
        w.save({"x": torch.ones(1)}, step=1, async_snapshot=True)
    assert store.models() == []


def test_step_must_be_int(store):
    with store.writer("s") as w:
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(ValueError):
                w.save({"x": torch.ones(1)}, step=bad)


def test_a_model_outgrows_its_first_save(store):
    """A state saved before the optimizer has state (step 0) and then three times larger: the
    model gets larger slots from free space, the small version stays readable until the ring
    has enough newer ones, then its slots go back."""
    with store.writer("grow", slots=3) as w:
        w.save({"w": torch.zeros(1000)}, step=0).result()
        small = store.region.get("grow").slot_bytes
        for step in (1, 2):
            assert w.save({"w": torch.full((1 << 20,), float(step))}, step=step).result().published
        entry = store.region.get("grow")
        assert entry.slot_bytes >= (4 << 20) and len(entry.extents) == 2
        assert [v.step for v in store.versions("grow")] == [0, 1, 2]
        assert torch.equal(store.load("grow", step=0)["w"], torch.zeros(1000))
        w.save({"w": torch.full((1 << 20,), 3.0)}, step=3).result()
    entry = store.region.get("grow")
    assert [x.slot_bytes for x in entry.extents] == [entry.slot_bytes] and small < entry.slot_bytes
    assert [v.step for v in store.versions("grow")] == [1, 2, 3]
    assert store.load("grow")["w"][0] == 3.0 and store.verify() == []


def test_a_checkpoint_larger_than_the_region_is_refused_before_any_write(store):
    with store.writer("huge2") as w:
        w.save({"w": torch.zeros(1000)}, step=1).result()
        with pytest.raises(CheckpointTooLargeError, match=r"Store.create\(path, size_bytes=...\)"):
            w.save({"w": torch.empty(80 << 20)}, step=2)
    assert [v.step for v in store.versions("huge2")] == [1]


def test_region_full(store):
    with store.writer("huge") as w:
        with pytest.raises(RegionFullError, match="remove models.*or fewer saves in flight: max_inflight=2 needs 3 slots"):
            w.save({"w": torch.zeros(100 << 20, dtype=torch.uint8)}, step=1)  # 4 slots x 100 MiB > 256 MiB
    assert store.models() == []
    with store.writer("huge", max_inflight=1) as w:  # 2 slots of 110 MiB fit
        w.save({"w": torch.zeros(100 << 20, dtype=torch.uint8)}, step=1).result()
    with store.writer("huger", max_inflight=1) as w:  # at 1 in flight, no fewer to advise
        with pytest.raises(RegionFullError) as e:
            w.save({"w": torch.zeros(100 << 20, dtype=torch.uint8)}, step=1)
    assert "remove models" in str(e.value) and "fewer saves in flight" not in str(e.value)


def test_bad_model_name_via_api(store):
    for bad in ("", "a/b", "..", "x" * 300, "nul\0"):
        with pytest.raises(InvalidNameError):
            store.writer(bad)
    # the names of a multi-rank checkpoint's parts, which a removal of the model takes with it
    for reserved in (".m.rank0", ".gpt2.rank12"):
        with pytest.raises(InvalidNameError, match="multi-rank"):
            store.writer(reserved)
        with pytest.raises(InvalidNameError, match="multi-rank"):
            ckptfs.dcp.StorageWriter(store, reserved, step=1)
    assert store.models() == []
    for fine in ("m.rank0", ".m", ".m.rankx", ".m.rank\u00b2"):  # not a part: a removal of m leaves them
        with store.writer(fine) as w:
            w.save({"w": torch.ones(2)}, step=1).result()
    with store.writer("m") as w:
        w.save({"w": torch.ones(2)}, step=1).result()
    store.remove_model("m")
    assert store.models() == sorted([".m", ".m.rankx", ".m.rank\u00b2", "m.rank0"])


def test_unknown_format_region(tmp_path):
    p = tmp_path / "junk"
    p.write_bytes(b"not a region" * 1000)
    with pytest.raises(ckptfs.errors.RegionFormatError, match=r"junk is not a ckptfs region \(no superblock magic\): "
                                                              r"give the path of a region, or make one with Store.create"):
        ckptfs.Store(str(p))
    assert p.read_bytes() == b"not a region" * 1000  # untouched
    with pytest.raises(NotFoundError, match=r"Store.create\(path"):
        ckptfs.Store(str(tmp_path / "missing"))


def test_load_by_step_and_missing(store):
    with store.writer("v", max_inflight=1, slots=4) as w:
        for s in (10, 20, 30):
            w.save({"s": torch.tensor(s)}, step=s).result()
    assert [v.step for v in store.versions("v")] == [10, 20, 30]
    assert store.load("v", step=20)["s"].item() == 20
    assert store.load("v")["s"].item() == 30
    with pytest.raises(NotFoundError):
        store.load("v", step=15)
    with pytest.raises(NotFoundError):
        store.load("nope")
    for listing in (store.versions, store.latest):
        with pytest.raises(NotFoundError, match="no model 'nope'"):
            listing("nope")
    assert store.versions("nope", missing_ok=True) == [] and store.latest("nope", missing_ok=True) is None
    assert store.latest("v", missing_ok=True).step == 30


def test_default_region_created_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTFS_REGION", str(tmp_path / "sub" / "default.region"))
    # a mount point of /etc/fstab where nothing is mounted: the filesystem meant to hold the
    # region is missing (a job restarted on a node whose NVMe was not mounted made a region on
    # / and resumed from step 0)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# <file system> <mount point> <type>\nUUID=1 / ext4 defaults 0 1\n/dev/nvme0n1 {tmp_path} ext4 0 2\n")
    monkeypatch.setattr(ckptfs.mounttable, "FSTAB", str(fstab))
    with pytest.raises(NotFoundError, match=f"nothing is mounted at {tmp_path}, a mount point in .*Store.create"):
        ckptfs.Store()
    assert not (tmp_path / "sub").exists()
    fstab.write_text("UUID=1 / ext4 defaults 0 1\n")  # a directory made for the job: created there
    with ckptfs.Store() as s:
        with s.writer("m") as w:
            w.save({"a": torch.ones(3)}, step=1).result()
    with ckptfs.Store() as s:
        assert s.models() == ["m"]
    # sparse: a 64 GiB region costs only what was written
    st = (tmp_path / "sub" / "default.region").stat()
    assert st.st_size == 64 << 30 and st.st_blocks * 512 < 64 << 20


def test_remove_version_and_model(store):
    with store.writer("r", max_inflight=1) as w:
        for s in (1, 2, 3):
            w.save({"s": torch.tensor(s)}, step=s).result()
    with pytest.raises(ckptfs.errors.BusyError, match="latest"):
        store.remove("r", 3)
    store.remove("r", 1)
    assert [v.step for v in store.versions("r")] == [2, 3]
    with store.open_version("r", 2):
        with pytest.raises(ckptfs.errors.BusyError):
            store.remove("r", 2)
    store.remove_model("r")
    assert store.models() == []


@pytest.mark.parametrize("async_snapshot", [False, True])
def test_saves_in_flight_are_committed_when_a_script_exits_without_close(region_path, store, async_snapshot):
    import subprocess
    import sys
    script = (
        "import torch, ckptfs\n"
        f"s = ckptfs.Store({region_path!r})\n"
        "w = s.writer('exit', max_inflight=2)\n"
        "for step in range(3):\n"
        f"    w.save({{'w': torch.full((1 << 20,), float(step))}}, step=step, async_snapshot={async_snapshot})\n"
        "# no close(), no wait(): the interpreter exits with saves in flight (async: perhaps not\n"
        "# even snapshotted yet)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert store.latest("exit").step == 2
    assert torch.equal(store.load("exit")["w"], torch.full((1 << 20,), 2.0))


def test_dotted_keys_colliding_with_nested_paths(store):
    obj = {"a.b": torch.ones(2), "a": {"b": torch.zeros(3)}}
    with store.writer("dots") as w:
        w.save(obj, step=1).result()
    assert_same(obj, store.load("dots"))


def test_structure_changes_between_saves_of_one_writer(store):
    """The writer plans a layout once per object structure: the same names with another shape
    or dtype, or a plain leaf that changes, must still come back exactly."""
    states = [
        {"w": torch.arange(1000, dtype=torch.float32), "lr": 0.1, "tag": "a"},
        {"w": torch.arange(1000, dtype=torch.float32) * 2, "lr": 0.05, "tag": "a longer plain leaf" * 20},
        {"w": torch.arange(3000, dtype=torch.float32), "lr": 0.05, "tag": "b"},  # same name, larger
        {"w": torch.arange(1000, dtype=torch.float64), "lr": 0.05, "tag": "b"},  # same shape, new dtype
        {"w": torch.arange(1000, dtype=torch.float32), "extra": torch.ones(5), "lr": None, "tag": "c"},
    ]
    with store.writer("shapes", max_inflight=2, slot_bytes=1 << 20) as w:
        for step, state in enumerate(states):
            w.save(state, step=step)
    for step, state in enumerate(states[-3:], start=len(states) - 3):
        assert_same(state, store.load("shapes", step=step))


def test_tensors_that_require_grad(store):
    """Parameters and tensors in an autograd graph are saved by value (async snapshot too)."""
    p = torch.nn.Parameter(torch.randn(64, 8))
    obj = {"param": p, "activation": p * 2, "conj": (torch.randn(4, dtype=torch.complex64, requires_grad=True)).conj()}
    with store.writer("grad") as w:
        w.save(obj, step=1, async_snapshot=True).result()
    back = store.load("grad")
    assert not back["param"].requires_grad
    assert torch.equal(back["param"], p.detach())
    assert torch.equal(back["activation"], (p * 2).detach())
    assert torch.equal(back["conj"], obj["conj"].detach().resolve_conj())


def test_ring_geometry_of_an_existing_model_takes_effect(store):
    with store.writer("geo", slots=4, slot_bytes=1 << 20) as w:
        w.save({"w": torch.zeros(1000)}, step=1).result()
    with store.writer("geo", slots=10) as w:  # keeps 10 versions from now on
        for step in range(2, 14):
            w.save({"w": torch.full((1000,), float(step))}, step=step).result()
    assert store.region.get("geo").ring_slots == 10 and len(store.versions("geo")) == 10
    with store.writer("geo", slot_bytes=2 << 20):  # slots of at least 2 MiB, at once
        assert store.region.get("geo").slot_bytes >= 2 << 20
    with store.writer("geo", slots=3) as w:  # fewer: the extra slots go back as saves replace their versions
        assert len(store.versions("geo")) == 10  # not at the opening, before anything is saved
        for step in range(14, 28):
            w.save({"w": torch.full((1000,), float(step))}, step=step).result()
    assert store.region.get("geo").nslots == 3 and [v.step for v in store.versions("geo")] == [25, 26, 27]
    for options in ({}, {"slot_bytes": 4096}):  # what the ring has already
        with store.writer("geo", **options) as w:
            w.save({"w": torch.ones(1000)}, step=20).result()
    assert store.load("geo")["w"][0] == 1




def test_map_location_that_cannot_be_used_is_refused_in_its_own_words(store):
    """torch.load's dict and function forms, a device string torch does not know, CUDA on a
    machine without it: a ValueError naming map_location= and what to pass, before any read."""
    with store.writer("m") as w:
        w.save({"w": torch.arange(4.0)}, step=1).result()
    bad = [({"cuda:0": "cpu"}, r"map_location=\{'cuda:0': 'cpu'\}: ckptfs loads onto one device"),
           (lambda storage, location: storage, r"dict and function forms have nothing to map"),
           ("bogus", r"map_location='bogus' is not a device")]
    if not torch.cuda.is_available():
        bad.append(("cuda:0", r"map_location='cuda:0': torch.cuda.is_available\(\) is False on this machine; load onto "
                              r"the CPU"))
    for map_location, match in bad:
        with pytest.raises(ValueError, match=match):
            store.load("m", map_location=map_location)
    assert store.load("m", map_location=torch.device("cpu"))["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert store.load("m", map_location=None)["w"].device.type == "cpu"


def test_open_version_by_its_counter_alone(store):
    """A part or a one-process version is named by its save counter: open_version(counter=)
    finds that save whatever its step, and says so once its slot was reused."""
    with store.writer("m") as w:
        for step in (1, 2, 2):
            w.save({"w": torch.full((3,), float(step))}, step=step).result()
    saves = store.versions("m", hidden=True)
    for info in saves:
        with store.open_version("m", counter=info.counter) as v:
            assert (v.info.step, v.info.counter) == (info.step, info.counter)
    with pytest.raises(NotFoundError, match="no longer holds the save with counter 99"):
        store.open_version("m", counter=99)


def test_a_channels_last_model_and_its_optimizer_resume_in_place(store):
    """into= a state whose tensors are not contiguous (a channels_last CNN and its SGD momentum
    buffers, a transposed view): loaded in place, bit for bit, the tensors the same objects
    (it was refused: "not contiguous: it cannot be loaded in place")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)).sum().backward()
    opt.step()
    extra = torch.randn(5, 7)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "t": extra.t()}
    assert not state["model"]["0.weight"].is_contiguous()
    with store.writer("cnn") as w:
        w.save(state, step=1).result()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0).add_(7)
        for p in model.parameters():
            opt.state[p]["momentum_buffer"].zero_()
    target = {"model": model.state_dict(), "optim": opt.state_dict(), "t": torch.zeros(5, 7).t()}
    before = [t.data_ptr() for t in target["model"].values()]
    store.load("cnn", into=target)
    assert [t.data_ptr() for t in target["model"].values()] == before
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]) and v.is_contiguous(memory_format=torch.channels_last) == (v.dim() == 4), k
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), moments))
    assert torch.equal(target["t"], extra.t())
    # a target whose elements share memory (expand()) is refused before anything is written
    a, b = torch.zeros(5, 7).t(), torch.zeros(1, 8).expand(4, 8)
    with store.writer("overlap") as w:
        w.save({"a": torch.ones(7, 5), "b": torch.ones(4, 8)}, step=1).result()
    with pytest.raises(ValueError, match=r"into= tensor 'b' has elements that may share memory"):
        store.load("overlap", into={"a": a, "b": b})
    assert not a.any() and not b.any()



def test_into_parameters_that_are_not_contiguous_and_strided_views(store):
    """into= a model's parameters themselves (``named_parameters()``: leaves that require grad)
    in channels_last, and views a column slice or a step makes: loaded in place. The first
    failed after other targets were written ("a leaf Variable that requires grad is being used
    in an in-place operation"), the others were refused as sharing memory, which they do not."""
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    saved = {"weight": torch.randn(4, 3, 3, 3), "bias": torch.randn(4)}
    with store.writer("conv") as w:
        w.save(saved, step=1).result()
    params = dict(conv.named_parameters())
    assert not params["weight"].is_contiguous() and params["weight"].requires_grad
    store.load("conv", into=params)
    assert torch.equal(conv.weight.detach(), saved["weight"]) and torch.equal(conv.bias.detach(), saved["bias"])
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and conv.weight.requires_grad

    with store.writer("strided") as w:
        w.save({"cols": torch.arange(8.).reshape(4, 2), "every_other": torch.arange(5.)}, step=1).result()
    wide, long = torch.zeros(4, 6), torch.zeros(10)
    store.load("strided", into={"cols": wide[:, 1:3], "every_other": long[::2]})
    assert torch.equal(wide[:, 1:3], torch.arange(8.).reshape(4, 2)) and not wide[:, [0, 3, 4, 5]].any()
    assert torch.equal(long[::2], torch.arange(5.)) and not long[1::2].any()
    # views of one fused tensor: side by side they load; overlapping, they are refused before a
    # write (accepted once strided views were, the later won: one held the other's values)
    fused = torch.zeros(5, 4)
    store.load("strided", into={"cols": fused[:4, 0:2], "every_other": fused[:, 3]})
    assert torch.equal(fused[:4, 0:2], torch.arange(8.).reshape(4, 2)) and torch.equal(fused[:, 3], torch.arange(5.))
    assert not fused[4, :3].any() and not fused[:, 2].any()
    with store.writer("two") as w:
        w.save({"a": torch.ones(4, 2), "b": torch.full((4, 2), 2.0)}, step=1).result()
    fused = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"into= tensors 'a' and 'b' share memory"):
        store.load("two", into={"a": fused[:, 0:2], "b": fused[:, 1:3]})
    assert not fused.any()
    store.load("two", into={"a": fused[:, 0:2], "b": torch.zeros(4, 2)})
    assert torch.equal(fused[:, 0:2], torch.ones(4, 2))


def test_into_of_another_structure_names_what_differs(store):
    """A model grown since the save (a layer added): the error said "into= holds 3 tensors, m
    step 1 2" and named no key."""
    with store.writer("m") as w:
        w.save({"a": torch.ones(2), "b": torch.ones(3)}, 1).result()
    with pytest.raises(ValueError, match=r"into= holds 3 tensors and m step 1 holds 2 tensors \(only into= has 'c'\): pass "
                                         r"state dicts of the structure"):
        store.load("m", into={"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"\(only into= has 'c'; only the checkpoint has 'a', 'b'\)"):
        store.load("m", into={"c": torch.zeros(1)})
    # a job resumed with a fresh optimizer (no state before its first step): the way out
    with pytest.raises(ValueError, match=r"only the checkpoint has 'b'\): an optimizer has no state before its first "
                                         r"step; load without into= and pass the parts to load_state_dict"):
        store.load("m", into={"a": torch.zeros(2), "b": {}})
    # into= without a top-level entry (the weights alone): the way to load just what it holds
    with pytest.raises(ValueError, match=r"only the checkpoint has 'b'\): to load only the entries into= holds, "
                                         r"pass keys=\['a'\]"):
        store.load("m", into={"a": torch.zeros(2)})


def test_into_is_matched_by_key_path_not_by_order(store):
    """into= whose keys come in another order than the save's (a state dict rebuilt with the
    optimizer first, a model whose modules were registered in another order) loads each tensor
    by its key path; it was refused ("into= differs at 'model.a'..."), matched by position.
    Keys that read alike but differ (the int 1 and the str "1", a list's index 0 and the key
    0) are told apart."""
    state = {"model": {"a": torch.arange(3.0), "b": torch.arange(4.0)},
             "optim": {1: torch.ones(2), "1": torch.full((2,), 2.0), 0: torch.full((1,), 5.0)},
             "lst": [torch.full((1,), 6.0)]}
    with store.writer("ordered") as w:
        w.save(state, 1).result()
    into = {"lst": [torch.zeros(1)],
            "optim": {0: torch.zeros(1), "1": torch.zeros(2), 1: torch.zeros(2)},
            "model": {"b": torch.zeros(4), "a": torch.zeros(3)}}
    got = store.load("ordered", into=into)
    assert list(got) == ["model", "optim", "lst"]  # the saved object's structure, over into='s tensors
    assert got["model"]["a"] is into["model"]["a"] and got["optim"]["1"] is into["optim"]["1"]
    assert torch.equal(into["model"]["a"], state["model"]["a"]) and torch.equal(into["model"]["b"], state["model"]["b"])
    assert torch.equal(into["optim"][1], torch.ones(2)) and torch.equal(into["optim"]["1"], torch.full((2,), 2.0))
    assert torch.equal(into["optim"][0], torch.full((1,), 5.0)) and torch.equal(into["lst"][0], torch.full((1,), 6.0))
    # a list in place of a dict with the key 0: a different key path, refused before any write
    wrong = {"model": {"a": torch.zeros(3), "b": torch.zeros(4)},
             "optim": {0: torch.zeros(1), "1": torch.zeros(2), 1: torch.zeros(2)}, "lst": {0: torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"\(only into= has 'lst.0'; only the checkpoint has 'lst.0'; 'lst.0' on "
                                         r"both sides is a key or a list's item of another type\)"):
        store.load("ordered", into=wrong)
    assert not any(t.any() for t in [*wrong["model"].values(), *wrong["optim"].values(), wrong["lst"][0]])


def test_into_with_separate_tensors_where_the_checkpoint_ties_them(store):
    """A model saved with tied weights (lm_head.weight is transformer.wte.weight) loaded into a
    state dict whose two names are separate tensors (a clone, an untied model): both get the
    saved bytes, as load_state_dict of a torch.load would copy them; it was refused ("into= holds
    3 tensors ... only into= has 'lm_head.weight'"). Ties into= has that the checkpoint lacks,
    and a shape that differs, are refused before anything is written."""
    wte = torch.arange(12.0).reshape(4, 3)
    with store.writer("tied") as w:
        w.save({"model": {"wte": wte, "h": torch.ones(2), "lm_head": wte}, "epoch": 3}, 1).result()
    into = {"model": {"wte": torch.zeros(4, 3), "h": torch.zeros(2), "lm_head": torch.zeros(4, 3).t().contiguous().t()},
            "epoch": 0}
    got = store.load("tied", into=into)
    assert got["model"]["wte"] is into["model"]["wte"] and got["model"]["lm_head"] is into["model"]["lm_head"]
    assert torch.equal(into["model"]["wte"], wte) and torch.equal(into["model"]["lm_head"], wte)
    assert torch.equal(into["model"]["h"], torch.ones(2)) and got["epoch"] == 3
    # into= ties two names the checkpoint holds apart: refused, nothing written
    with store.writer("apart") as w:
        w.save({"a": torch.ones(3), "b": torch.full((3,), 2.0)}, 1).result()
    shared = torch.zeros(3)
    with pytest.raises(ValueError, match=r"into= holds one tensor at 'a' and at 'b', which apart step 1 stores apart: "
                                         r"pass a tensor of its own for each"):
        store.load("apart", into={"a": shared, "b": shared})
    assert not shared.any()
    # the untied name of another shape: refused, nothing written
    bad = {"model": {"wte": torch.zeros(4, 3), "h": torch.zeros(2), "lm_head": torch.zeros(3, 4)}, "epoch": 0}
    with pytest.raises(ValueError, match=r"differs from tied step 1 at 'model.lm_head' \(a name that shares 'model.wte' "
                                         r"in the checkpoint\): saved float32\[4, 3\], into= has float32\[3, 4\]"):
        store.load("tied", into=bad)
    assert not any(t.any() for t in bad["model"].values())


def test_arguments_of_another_type_are_refused_in_their_words(store):
    """A str where an int goes: step "0" said 'no step 0' (versions() listed it), timeout_s
    "60" or slot_bytes "4096" failed the first save with a bare TypeError (and left an empty
    model), slot_bytes=-1 was taken; a device type this torch lacks raised ModuleNotFoundError."""
    with store.writer("m") as w:
        w.save({"w": torch.ones(2)}, 0).result()
    for call in (lambda: store.load("m", step="0"), lambda: store.keep("m", "0"), lambda: store.remove("m", "0")):
        with pytest.raises(ValueError, match=r"step must be an int \(or None: the latest\), got '0'"):
            call()
    for options, said in [({"timeout_s": "60"}, "timeout_s must be a positive number of seconds, got '60'"),
                          ({"slot_bytes": "4096"}, "slot_bytes must be a positive int, got '4096'"),
                          ({"slot_bytes": -1}, "slot_bytes must be a positive int, got -1"),
                          ({"slots": "4"}, "slots must be a positive int, got '4'"),
                          # a ring past the slots a model can have wrote an entry that read as
                          # damaged for good ('rm --all' refused it)
                          ({"max_inflight": 65535}, r"max_inflight=65535 needs a ring of 65537 slots, more than a "
                                                    r"model can have \(65536\); pass a smaller max_inflight")]:
        with pytest.raises(ValueError, match=said):
            store.writer("n", **options)
    assert store.models() == ["m"]
    for size in (1.5e9, "1G", True):  # a bare TypeError of int() or of >=
        with pytest.raises(ValueError, match=r"size_bytes must be an int \(a number of bytes, e.g. 64 << 30\), got "):
            ckptfs.Store.create(store.path + ".other", size)
    assert not os.path.exists(store.path + ".other")
    with pytest.raises(ValueError, match="map_location='hpu': "):
        store.load("m", map_location="hpu")
