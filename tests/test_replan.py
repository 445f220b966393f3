"""The cached save plan (ckptfs.writer.replan): a save of a known structure skips flatten, and any
change of structure is caught and re-planned, never written with a stale layout."""
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.flatten import flatten
from ckptfs.manifest import dumps_compact
from ckptfs.writer.replan import Structure
from conftest import assert_same


def training_state(n: int = 6, lr: float = 0.1, epoch: int = 1) -> dict:
    model = OrderedDict((f"layer{i}.weight", torch.randn(4, 3)) for i in range(n))
    model["head.weight"] = model["layer0.weight"]  # tied
    return {"model": model,
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3)}},
                      "param_groups": [{"lr": lr, "betas": (0.9, 0.999), "amsgrad": False, "name": None}]},
            "epoch": epoch, "tag": "run-1",
            # leaves of ckptfs.leaves: an RNG state that changes with every save, torch's objects
            "rng": {"numpy": np.random.RandomState(abs(epoch)).get_state(), "metric": np.float32(epoch / 4)},
            "amp": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "shape": torch.Size([4, 3])}}


def same_as_flatten(obj) -> bool:
    """The cached structure's result equals a full flatten of ``obj``, JSON byte for byte."""
    full = flatten(obj)
    fast = Structure.of(flatten(training_state())).match(obj)
    assert fast is not None
    assert fast.skeleton == full.skeleton and fast.skeleton_json == dumps_compact(full.skeleton)
    assert fast.names == full.names and fast.signature == full.signature
    assert len(fast.tensors) == len(full.tensors)
    assert all(a is b for a, b in zip(fast.tensors, full.tensors))
    return True


def test_the_same_structure_matches_and_gives_flattens_result():
    torch.manual_seed(0)
    assert same_as_flatten(training_state())
    assert same_as_flatten(training_state(lr=0.05, epoch=7))  # plain values may change
    assert same_as_flatten(training_state(lr=float("nan"), epoch=-1))


def changed_states():
    """Every kind of change that must be re-planned (name, object)."""
    def edit(f):
        s = training_state()
        f(s)
        return s

    yield "key added", edit(lambda s: s["model"].__setitem__("extra", torch.ones(2)))
    yield "key removed", edit(lambda s: s["model"].pop("layer3.weight"))
    yield "keys reordered", edit(lambda s: s["model"].move_to_end("layer1.weight"))
    yield "shape changed", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.randn(3, 4)))
    yield "dtype changed", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.randn(4, 3).half()))
    yield "non-contiguous", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.randn(3, 4).t()))
    yield "tie broken", edit(lambda s: s["model"].__setitem__("head.weight", s["model"]["layer0.weight"].clone()))
    yield "tie added", edit(lambda s: s["model"].__setitem__("layer1.weight", s["model"]["layer2.weight"]))
    # the same bytes, address, shape and strides, read negated: no tie (it was kept as one)
    yield "tie to a negative view", edit(
        lambda s: s["model"].__setitem__("head.weight", s["model"]["layer0.weight"]._neg_view()))
    yield "meta tensor", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.empty(4, 3, device="meta")))
    yield "sparse tensor", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.randn(4, 3).to_sparse()))
    yield "not a tensor", edit(lambda s: s["model"].__setitem__("layer2.weight", torch.randn(4, 3).numpy()))
    yield "plain kind changed", edit(lambda s: s.__setitem__("epoch", 1.0))
    yield "bool for int", edit(lambda s: s.__setitem__("epoch", True))
    yield "list for tuple", edit(lambda s: s["optim"]["param_groups"][0].__setitem__("betas", [0.9, 0.999]))
    yield "dict for OrderedDict", edit(lambda s: s.__setitem__("model", dict(s["model"])))
    yield "int key for str key", edit(lambda s: s["optim"].__setitem__("state", {"0": s["optim"]["state"][0]}))
    yield "bool key for int key", edit(lambda s: s["optim"].__setitem__("state", {True: s["optim"]["state"][0]}))
    yield "tensor for plain", edit(lambda s: s.__setitem__("epoch", torch.tensor(1)))
    yield "numpy float for float", edit(lambda s: s["optim"]["param_groups"][0].__setitem__("lr", np.float64(0.1)))
    yield "list for RNG state", edit(lambda s: s["rng"].__setitem__("numpy", list(s["rng"]["numpy"])))
    yield "int for numpy scalar", edit(lambda s: s["rng"].__setitem__("metric", 3))
    yield "numpy int for numpy float", edit(lambda s: s["rng"].__setitem__("metric", np.int32(3)))
    yield "Size for tuple", edit(lambda s: s["optim"]["param_groups"][0].__setitem__("betas", torch.Size([1, 2])))
    yield "tuple for Size", edit(lambda s: s["amp"].__setitem__("shape", (4, 3)))
    yield "str for dtype", edit(lambda s: s["amp"].__setitem__("dtype", "bfloat16"))


@pytest.mark.parametrize("name,obj", list(changed_states()), ids=[n for n, _ in changed_states()])
def test_every_change_of_structure_is_caught(name, obj):
    assert Structure.of(flatten(training_state())).match(obj) is None, name


def test_no_cached_structure_for_what_the_snapshot_must_transform():
    assert Structure.of(flatten({"w": torch.randn(3, 4).t()})) is None
    assert Structure.of(flatten({"c": torch.randn(3, dtype=torch.complex64)})) is None


def test_saves_through_a_cached_plan_hold_the_current_bytes_and_structure(store):
    """In-place updates, a replaced tensor, new plain values and a changed structure between
    saves of one writer: every version loads exactly as it was saved."""
    torch.manual_seed(1)
    state = training_state()
    expected = {}
    with store.writer("m", max_inflight=1, slots=10) as w:
        for step in range(8):
            if step in (2, 5):
                state["model"]["layer1.weight"] = torch.randn(4, 3)  # another tensor (new memory)
            if step == 4:
                state["model"]["new"] = torch.arange(5.0)  # structure changed: re-planned
            if step == 6:
                state["model"]["layer2.weight"] = torch.randn(4, 3).double()
            for t in state["model"].values():
                t.add_(1)  # in place, as an optimizer step
            state["optim"]["param_groups"][0]["lr"] = 0.1 * 0.9 ** step
            state["epoch"] = step
            state["rng"]["numpy"] = np.random.RandomState(step).get_state()
            state["amp"]["dtype"] = (torch.bfloat16, torch.float16)[step % 2]
            w.save(state, step=step).result()
            expected[step] = OrderedDict((k, v.clone()) for k, v in state["model"].items())
            expected[step] = (expected[step], state["optim"]["param_groups"][0]["lr"], step)
    for step, (model, lr, epoch) in expected.items():
        back = store.load("m", step)
        assert_same(back["model"], model)
        assert_same(back["rng"]["numpy"], np.random.RandomState(step).get_state())
        assert back["amp"]["dtype"] is (torch.bfloat16, torch.float16)[step % 2]
        assert back["model"]["head.weight"] is back["model"]["layer0.weight"]
        assert back["optim"]["param_groups"][0]["lr"] == lr and back["epoch"] == epoch
        assert math.isclose(lr, 0.1 * 0.9 ** step)


def test_a_refusal_after_a_cached_plan_still_names_its_path(store):
    with store.writer("m") as w:
        w.save(training_state(), step=1).result()
        bad = training_state()
        bad["optim"]["param_groups"][0]["lr"] = object()
        with pytest.raises(ckptfs.errors.UnsupportedObjectError, match=r"optim\.param_groups\.0\.lr"):
            w.save(bad, step=2)
        bad = training_state()
        bad["rng"]["numpy"] = np.zeros(1 << 18)  # an array past what the index takes inline
        with pytest.raises(ckptfs.errors.UnsupportedObjectError, match=r"^rng\.numpy: a numpy array of 2097152 bytes"):
            w.save(bad, step=2)
        w.save(training_state(), step=3).result()
    assert [v.step for v in store.versions("m")] == [1, 3]


def test_a_snapshot_remakes_the_spans_of_replaced_tensors_only_and_copies_transposed_ones_each_time(store):
    """The copy spans of a tensor updated in place are reused; a replaced tensor's chunk and a
    transposed view's (copied contiguous for each snapshot) are made again; every save holds the
    bytes of its moment."""
    base = torch.zeros(64, 32)
    state = {"a": torch.zeros(1 << 16), "t": base.t(), "b": torch.zeros(1 << 16)}
    with store.writer("m", max_inflight=1, chunk_bytes=1 << 18, slots=8) as w:
        for step in range(1, 5):
            state["a"].fill_(step)
            base.fill_(10 * step)
            if step == 3:
                state["b"] = torch.full((1 << 16,), -3.0)  # another tensor, at another address
            w.save(state, step=step).result()
            spans = w._snapshotter._host_spans
            if step == 2:
                kept = list(spans.spans)
            if step == 3:
                assert spans.spans[0] is kept[0]  # "a"'s chunk: the same tensor, the same spans
                assert spans.spans[-1] is not kept[-1]  # "b" was replaced
            assert not spans._copies  # the transposed view's copy was let go after the snapshot
    for step in range(1, 5):
        back = store.load("m", step)
        assert torch.equal(back["a"], torch.full((1 << 16,), float(step)))
        assert torch.equal(back["t"], torch.full((32, 64), 10.0 * step))
        assert torch.equal(back["b"], torch.full((1 << 16,), -3.0 if step >= 3 else 0.0))


@pytest.mark.parametrize("async_snapshot", [False, True])
@pytest.mark.parametrize("view", ["transposed", "strided", "conjugate", "negative", "transposed_in_place"])
def test_another_view_at_the_same_address_is_saved_as_its_own_bytes(store, view, async_snapshot):
    """The spans a snapshot reuses are found by the tensor's address: another view that starts
    there, with the same shape and dtype (the same layout), holds other bytes in that order, or
    lazily transformed ones. Each save must hold the bytes of the tensor it was given (these
    saves held the previous save's bytes, their checksums passing)."""
    square = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    complex_ = torch.randn(8, dtype=torch.complex64)
    ring = torch.randn(8, 4)
    first = {"transposed": square, "strided": ring[0:4], "conjugate": complex_, "negative": complex_,
             "transposed_in_place": square}[view]
    saved = [first.clone()]
    with store.writer("m", max_inflight=1) as w:
        w.save({"a": first}, step=1, async_snapshot=async_snapshot).result()
        second = {"transposed": lambda: square.t(), "strided": lambda: ring[::2], "conjugate": lambda: complex_.conj(),
                  "negative": lambda: torch._neg_view(complex_), "transposed_in_place": lambda: square.t_()}[view]()
        assert second.data_ptr() == first.data_ptr()
        saved.append(second.clone().resolve_conj().resolve_neg())
        w.save({"a": second}, step=2, async_snapshot=async_snapshot).result()
    assert [torch.equal(store.load("m", step)["a"], want) for step, want in enumerate(saved, 1)] == [True, True]


def test_a_match_of_many_tensors_starts_no_collection():
    """The cached plan's checks make a shape object per tensor, alive together: with the cyclic
    GC on, 20,000 of them start collections on the caller's stall (full ones of its heap, every
    other save at 40,000 tensors). The match runs with the GC paused; it still matches."""
    import gc

    state = {f"layer{i // 100}.w{i % 100}": torch.zeros(4) for i in range(20000)}
    structure = Structure.of(flatten(state))
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        flat = structure.match(state)
    finally:
        gc.callbacks.remove(count)
    assert flat is not None and len(flat.tensors) == 20000
    assert collections == []


def test_a_conjugate_or_negative_view_beside_its_tensor_is_saved_as_its_own_values(store):
    """``x.conj()`` and ``x._neg_view()`` are x's memory, same address, shape and strides, read
    otherwise: in one save with x (in either order, and again through the cached plan) each is
    stored as the values it shows (all three loaded as x's, or x as the conjugate, before)."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for name, state in (("fwd", {"a": x, "b": x.conj(), "c": x._neg_view()}),
                        ("rev", {"c": x._neg_view(), "b": x.conj(), "a": x})):
        with store.writer(name) as w:
            for step in (1, 2):
                w.save(state, step=step).result()
        for step in (1, 2):
            got = store.load(name, step=step)
            assert torch.equal(got["a"], x) and torch.equal(got["b"], x.conj().resolve_conj())
            assert torch.equal(got["c"], x._neg_view().resolve_neg()), (name, step)


def test_a_plain_float_that_changes_sign_of_zero_is_saved_as_it_is(store):
    """-0.0 == 0.0: the cached plan's reuse of an unchanged plain value kept 0.0 for a later -0.0."""
    import math

    with store.writer("z") as w:
        for step, value in enumerate((0.0, -0.0, 0.0, -0.0)):
            w.save({"t": torch.ones(2), "x": value}, step=step).result()
    signs = [math.copysign(1.0, store.load("z", step=s)["x"]) for s in range(4)]
    assert signs == [1.0, -1.0, 1.0, -1.0]


def test_a_float_key_that_changes_sign_of_zero_is_saved_as_it_is(store):
    """-0.0 == 0.0 as dict keys too: the cached plan kept the key 0.0 for a later -0.0."""
    import math

    with store.writer("zk") as w:
        for step, key in enumerate((0.0, -0.0, 0.0)):
            w.save({"z": {key: torch.ones(2)}}, step=step).result()
    signs = [math.copysign(1.0, next(iter(store.load("zk", step=s)["z"]))) for s in range(3)]
    assert signs == [1.0, -1.0, 1.0]
