"""Tier 1: flatten, the split of a saved object into skeleton + tensors (no region involved)."""
import base64
import collections
import enum
import random

import numpy as np
import pytest
import torch

from ckptfs.errors import MalformedInputError, UnsupportedObjectError
from ckptfs.flatten import flatten
from ckptfs.skeleton import MAX_DEPTH, check_skeleton, unflatten
from conftest import assert_same
from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass, as DTensor and torchao's


def nested(depth: int, leaf):
    obj = leaf
    for _ in range(depth):
        obj = {"k": obj}
    return obj


def test_skeleton_names_signature_and_devices_of_a_state_dict():
    w, b = torch.ones(2, 3), torch.zeros(3, dtype=torch.bfloat16)
    obj = {"model": {"w": w, "b": b}, "optim": {"state": {0: {"m": torch.ones(1)}}, "lr": 0.5},
           "steps": [w, 7]}
    flat = flatten(obj)
    assert flat.skeleton == {"dict": [
        [{"str": "model"}, {"dict": [[{"str": "w"}, {"tensor": 0}], [{"str": "b"}, {"tensor": 1}]]}],
        [{"str": "optim"}, {"dict": [[{"str": "state"}, {"dict": [[{"int": 0}, {"dict": [[{"str": "m"}, {"tensor": 2}]]}]]}],
                                     [{"str": "lr"}, {"float": "0x1.0000000000000p-1"}]]}],
        [{"str": "steps"}, {"list": [{"tensor": 0}, {"int": 7}]}]]}
    assert flat.names == ["model.w", "model.b", "optim.state.0.m"]
    assert flat.tensors[0] is w and flat.tensors[1] is b and len(flat.tensors) == 3
    assert flat.signature == (("model.w", "float32", (2, 3)), ("model.b", "bfloat16", (3,)),
                              ("optim.state.0.m", "float32", (1,)))
    assert flat.devices == frozenset({torch.device("cpu")})
    back = unflatten(flat.skeleton, flat.tensors)
    assert back["steps"][0] is back["model"]["w"]  # a tensor referenced twice is stored once


def test_signature_tells_apart_what_changes_a_layout():
    a = flatten({"w": torch.ones(4)}).signature
    assert flatten({"w": torch.zeros(4)}).signature == a  # values do not matter
    assert flatten({"w": torch.ones(5)}).signature != a
    assert flatten({"w": torch.ones(4, dtype=torch.float64)}).signature != a
    assert flatten({"v": torch.ones(4)}).signature != a


def test_views_of_one_storage_are_distinct_unless_identical():
    base = torch.arange(12.0).reshape(3, 4)
    flat = flatten({"a": base, "b": base.view(3, 4), "t": base.t(), "row": base[1], "empty": base[:0]})
    assert flat.names == ["a", "t", "row", "empty"]  # b is the same view as a


def test_plain_subclasses_are_stored_as_their_base_value():
    class Color(enum.IntEnum):
        RED = 3

    class Mode(str, enum.Enum):
        FAST = "fast"

    flat = flatten({Color.RED: Color.RED, Mode.FAST: [Mode.FAST], "t": torch.ones(1)})
    (k1, v1), (k2, v2), _ = flat.skeleton["dict"]
    assert (k1, v1) == ({"int": 3}, {"int": 3})
    # its value, not its str(): "Mode.FAST" was stored, and loaded back where "fast" was saved
    assert k2 == {"str": "fast"} and v2 == {"list": [{"str": "fast"}]}
    assert unflatten(flat.skeleton, [torch.ones(1)])[Mode.FAST] == [Mode.FAST]  # equal, as str


@pytest.mark.parametrize("obj, match", [
    ({"a": {"b": [1, object()]}}, r"^a\.b\.1: builtins\.object cannot be stored"),
    ({"a": collections.defaultdict(int)}, r"^a: defaultdict is not supported; convert it to a dict"),
    ({"a": collections.namedtuple("Point", "x y")(1, 2)}, r"^a: Point is not supported; convert it to a list"),
    ({"a": {(1, 2): 3}}, r"^a: dict key \(1, 2\) of type tuple is not supported"),
    ({"a": [torch.ones(2).to_sparse()]}, r"^a\.0: torch\.sparse_coo tensors are not supported"),
    ({"a": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
     r"^a: nested tensors are not supported; save \.unbind\(\)"),  # torch said "Internal error"
    ({"a": torch.ones(2, device="meta")}, r"^a: meta tensors have no data"),
    ({0: {1.5: {None: object()}}}, r"^0\.1\.5\.None: builtins\.object"),
    (object(), r"^<root>: builtins\.object"),
    ({"model": torch.nn.Linear(2, 2)}, r"^model: torch\.nn\.modules\.linear\.Linear cannot be stored; save its "
                                       r"state_dict\(\) instead"),
    ({"opt": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)}, r"^opt: .*SGD .*state_dict\(\) instead"),
    ({"q": [TwoTensor(torch.ones(2), torch.zeros(2))]}, r"^q\.0: torch\.testing\._internal\.two_tensor\.TwoTensor is a "
                                                        r"tensor subclass whose data is not one plain tensor"),
    # a random generator: its state is what a training checkpoint saves (it said "convert it")
    ({"g": torch.Generator()}, r"^g: .*Generator cannot be stored; save its get_state\(\) instead, and restore "
                               r"it with set_state\(\)"),
    ({"rs": np.random.RandomState(0)}, r"^rs: .*RandomState .*save its get_state\(\) instead"),
    ({"py": random.Random(1)}, r"^py: random\.Random .*save its getstate\(\) instead, and restore it with setstate"),
    ({"np": np.random.default_rng(0)}, r"^np: .*Generator .*save its bit_generator\.state \(a dict\) instead"),
])
def test_refusals_name_the_path(obj, match):
    with pytest.raises(UnsupportedObjectError, match=match):
        flatten(obj)


def test_an_object_that_contains_itself_is_refused():
    loop = {"a": [1]}
    loop["a"].append(loop)
    with pytest.raises(UnsupportedObjectError, match=r"^a\.1: the object contains itself"):
        flatten(loop)
    shared = [1, 2]
    assert len(flatten({"x": shared, "y": shared}).skeleton["dict"]) == 2  # shared, not cyclic: fine


def test_nesting_limit():
    assert flatten(nested(MAX_DEPTH, torch.ones(1))).names == [".".join(["k"] * MAX_DEPTH)]
    assert flatten(nested(MAX_DEPTH, {})).skeleton  # an empty container at the limit holds nothing deeper
    for obj in (nested(MAX_DEPTH + 1, torch.ones(1)), nested(MAX_DEPTH + 1, 5), nested(MAX_DEPTH, [[1]])):
        with pytest.raises(UnsupportedObjectError, match=f"deeper than {MAX_DEPTH} levels"):
            flatten(obj)


def test_the_index_dtype_sizes_are_torchs():
    """ckptfs.manifest reads an index without torch, from its own table of bytes per element:
    that table must be torch's, dtype for dtype, and flatten's tables cover every name in it."""
    from ckptfs.flatten import DTYPE_NAMES, DTYPES
    from ckptfs.manifest import ITEMSIZE

    assert {name: getattr(torch, name).itemsize for name in ITEMSIZE} == ITEMSIZE
    assert set(DTYPES) == set(ITEMSIZE) and all(DTYPE_NAMES[d] == n for n, d in DTYPES.items())


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def test_torch_and_numpy_objects_are_leaves_that_come_back_as_they_were():
    """What training checkpoints carry beside tensors: numpy's RNG state, numpy metrics, torch's
    Size, dtype and device objects. Each is a JSON leaf (ckptfs.leaves) and comes back with its
    type, dtype, byte order and memory order."""
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    obj = {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "cpu": torch.device("cpu"),
           "gpu": torch.device("cuda", 1), "rng": np.random.RandomState(7).get_state(), "fortran": fortran,
           "be": np.arange(3, dtype=">i4"), "metric": np.float64(0.25), "argmax": np.int64(3), "flag": np.bool_(True),
           "empty": np.zeros((0, 2), np.float16), "zero_dim": np.array(5, np.uint8), "name": np.str_("run")}
    flat = flatten(obj)
    nodes = {k["str"]: v for k, v in flat.skeleton["dict"]}
    assert nodes["size"] == {"size": [2, 3]} and nodes["dtype"] == {"dtype": "bfloat16"}
    assert nodes["cpu"] == {"device": ["cpu", None]} and nodes["gpu"] == {"device": ["cuda", 1]}
    assert nodes["be"] == {"ndarray": {"dtype": ">i4", "shape": [3], "fortran": False,
                                       "data": _b64(b"\0\0\0\0\0\0\0\1\0\0\0\2")}}
    assert nodes["fortran"] == {"ndarray": {"dtype": "<f8", "shape": [2, 3], "fortran": True,
                                            "data": _b64(fortran.tobytes(order="F"))}}
    assert nodes["metric"] == {"npscalar": {"dtype": "<f8", "data": _b64(np.float64(0.25).tobytes())}}
    assert nodes["flag"] == {"npscalar": {"dtype": "|b1", "data": _b64(b"\1")}}
    assert nodes["name"] == {"str": "run"}  # a str subclass, as its base value
    assert flat.tensors == []
    back = unflatten(flat.skeleton, [])
    del obj["name"], back["name"]
    assert_same(obj, back)
    assert back["fortran"].flags.f_contiguous and not back["fortran"].flags.c_contiguous
    assert back["rng"][1].flags.writeable  # its own memory, not the index's
    restored = np.random.RandomState()
    restored.set_state(back["rng"])
    assert restored.randint(1 << 30) == np.random.RandomState(7).randint(1 << 30)


@pytest.mark.parametrize("obj, match", [
    ({"a": np.array([1, "x"], dtype=object)}, r"^a: numpy dtype object cannot be stored"),
    ({"a": np.zeros(2, dtype=[("x", "<i4")])}, r"^a: numpy dtype .* cannot be stored"),
    ({"a": [np.datetime64("2020-01-01")]}, r"^a\.0: numpy dtype datetime64\[D\] cannot be stored"),
    ({"a": np.zeros(200_000)}, r"^a: a numpy array of 1600000 bytes .*torch\.from_numpy"),
    ({"a": np.ma.masked_array([1, 2])}, r"^a: MaskedArray is not supported; convert it with np\.asarray"),
    ({"a": torch.qint8}, r"^a: dtype torch\.qint8 cannot be stored"),
    ({"a": [torch.Size([-1])]}, r"^a\.0: torch\.Size\(\[-1\]\) cannot be stored \(skeleton size node"),
    ({"lazy": torch.nn.LazyLinear(2).weight}, r"^lazy: an uninitialized parameter of a lazy module has no data yet"),
])
def test_torch_and_numpy_objects_that_cannot_be_stored_are_refused_by_path(obj, match):
    with pytest.raises(UnsupportedObjectError, match=match):
        flatten(obj)


@pytest.mark.parametrize("node", [
    {"size": [2, -1]}, {"size": "2"}, {"size": [True]}, {"dtype": "qint8"}, {"dtype": ["float16"]},
    {"device": ["cuda", -1]}, {"device": ["cuda", 128]}, {"device": ["CUDA", 0]}, {"device": ["cpu"]}, {"device": ["cpu; rm", None]},
    {"ndarray": {"dtype": "<u4", "shape": [2], "fortran": False, "data": _b64(b"\0" * 4)}},  # too short
    {"ndarray": {"dtype": "<u4", "shape": [1], "fortran": False, "data": "!!!!!!!!"}},  # not base64
    {"ndarray": {"dtype": "<u4", "shape": [1], "fortran": False, "data": "AAAA=AA="}},  # padding inside
    {"ndarray": {"dtype": "|O8", "shape": [1], "fortran": False, "data": _b64(b"\0" * 8)}},
    {"ndarray": {"dtype": "<u4", "shape": [1], "fortran": 0, "data": _b64(b"\0" * 4)}},
    {"ndarray": {"dtype": "<u4", "shape": [1], "data": _b64(b"\0" * 4)}},
    {"ndarray": {"dtype": "<u4", "shape": [1 << 40], "fortran": False, "data": ""}},
    {"npscalar": {"dtype": "<f8", "data": _b64(b"\0" * 4)}}, {"npscalar": {"dtype": "<U1", "data": _b64(b"a\0\0\0")}},
    {"npscalar": {"dtype": "<f8", "data": _b64(b"\0" * 8), "shape": []}},
    {"ndarray": {"dtype": "<i2", "shape": [1], "fortran": False, "data": "AAAA"}},  # 3 bytes for 2
    {"npscalar": {"dtype": "|u1", "data": "AAA="}},  # 2 bytes for 1
    {"npscalar": {"dtype": "|u1", "data": "AB=="}},  # not canonical: the base64 of b"\0" is "AA=="
    {"ndarray": {"dtype": "<f8", "shape": [0, 1 << 62], "fortran": False, "data": ""}},  # numpy: too big
    {"npscalar": {"dtype": ">i4", "data": _b64(b"\0" * 4)}},  # a scalar's dtype is native
    {"npscalar": {"dtype": "|b1", "data": _b64(b"\2")}},
])
def test_malformed_leaf_nodes_are_refused_on_read(node):
    """An index is input: a leaf node that flatten could not have written is refused before
    anything is built from it (``check_skeleton``, on every decode of an index)."""
    with pytest.raises(MalformedInputError):
        check_skeleton({"dict": [[{"str": "k"}, node]]}, 0)


def test_a_tensor_subclass_over_its_own_storage_is_stored_as_a_plain_tensor():
    class Tagged(torch.Tensor):
        pass

    t = torch.arange(4.0).as_subclass(Tagged)
    flat = flatten({"t": t, "again": t})
    assert [type(x) for x in flat.tensors] == [torch.Tensor] and flat.tensors[0].data_ptr() == t.data_ptr()
    assert flat.skeleton == {"dict": [[{"str": "t"}, {"tensor": 0}], [{"str": "again"}, {"tensor": 0}]]}


def test_subclassed_plain_keys_are_stored_as_their_base_value():
    """numpy's float64 is a float: as a dict key it is stored as one (a key is a plain value in
    the index; a numpy leaf there made a version that saved and then never loaded)."""
    flat = flatten({np.float64(1.5): 1, np.str_("k"): 2, True: 3})
    assert [k for k, _ in flat.skeleton["dict"]] == [{"float": (1.5).hex()}, {"str": "k"}, {"bool": True}]
    check_skeleton(flat.skeleton, 0)
    assert unflatten(flat.skeleton, []) == {1.5: 1, "k": 2, True: 3}


class _Mode(str, enum.Enum):
    X = "x"


class _Level(enum.IntEnum):
    A = 1


@pytest.mark.parametrize("obj, names", [
    ({"a": "T0", "b": {"c": "T0"}, "b.c": "T1"}, ["a", "b.c#1"]),  # b.c is taken by T0's second place
    ({np.float64(1.5): "T0", _Level.A: "T1", _Mode.X: "T2"}, ["1.5", "1", "x"]),  # keys as stored
    (["T0", "T0", {"1": "T1"}, "T1"], ["0", "2.1"]),
])
def test_a_stored_tensor_is_named_as_its_first_place_in_the_views(obj, names):
    """The name a version stores for a tensor (verify's and `ckptfs info`'s) is the name of its
    first place in every view (skeleton.ref_names: state.safetensors, metadata.json): the two
    rules differed for a key that is a subclass of a plain type (numpy's float64 was named
    'np.float64(1.5)' where the views say '1.5') and where a tied tensor's second place took a
    name first."""
    from ckptfs.skeleton import ref_names, tensor_refs

    made = {"T0": torch.ones(1), "T1": torch.zeros(2), "T2": torch.full((3,), 7.0)}

    def build(o):  # "Tn": the tensor made[n], the same object at each of its places
        if isinstance(o, dict):
            return {k: build(v) for k, v in o.items()}
        if isinstance(o, list):
            return [build(v) for v in o]
        return made[o]

    flat = flatten(build(obj))
    refs: list = []
    tensor_refs(flat.skeleton, (), refs)
    first: dict = {}
    for name, (_, i) in zip(ref_names(refs), refs):
        first.setdefault(i, name)
    assert flat.names == names == [first[i] for i in range(len(flat.tensors))]
