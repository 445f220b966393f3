"""The torch side of a manifest: ``flatten`` splits a saved object into its skeleton (see
ckptfs.manifest) and the distinct tensors it references, and the tables between torch's dtype
objects and the dtype names an index stores. Kept apart from ckptfs.manifest so that reading an
index needs no torch.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfs import leaves
from ckptfs.errors import UnsupportedObjectError
from ckptfs.gcpause import paused_gc
from ckptfs.manifest import ITEMSIZE
from ckptfs.skeleton import MAX_DEPTH, unique_name

DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in ITEMSIZE if hasattr(torch, n)}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


@dataclass
class Flattened:
    """A saved object split into its skeleton and the distinct tensors it references."""

    skeleton: dict
    tensors: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    # (name, dtype name, shape) of each tensor: all that a layout of the tensor bytes depends on
    signature: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    devices: frozenset[torch.device] = frozenset()
    skeleton_json: str | None = None  # dumps_compact(skeleton), where already known (a cached plan)


def plain_node(value: Any) -> dict:
    """The skeleton node of a plain value (str, int, float, bool, None) or of a leaf of
    ckptfs.leaves (UnsupportedObjectError if it cannot be stored)."""
    return _Walk().node(value)


def flatten(obj: Any) -> Flattened:
    """Split ``obj`` into skeleton + tensors.

    Tensors that are the same view of the same storage (tied weights) are stored once and come
    back shared. Raises UnsupportedObjectError naming the path of the first leaf it cannot store.
    """
    walk = _Walk()
    with paused_gc():
        skeleton = walk.node(obj)
    return Flattened(skeleton, walk.tensors, walk.names, tuple(walk.signature), frozenset(walk.devices))


_KEY_TYPES = (bool, str, int, float, type(None))  # bool first: it is an int too
_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
# the data of an instance of a subclass of each, not its str() or int(), which the subclass may
# define otherwise: str() of a str enum's member is "Split.TRAIN", its value "train"
_BASE_VALUE = ((str, str.__str__), (int, int.__int__), (float, float.__float__))


def _base_value(obj):
    """The plain value of ``obj``, a plain key or value or an instance of a subclass of str, int
    or float (an enum's member, numpy's float64): of the base type itself. A bool or None is
    itself (neither can be subclassed)."""
    if obj is None or type(obj) is bool:
        return obj
    return next(value(obj) for base, value in _BASE_VALUE if isinstance(obj, base))


def _rng_state_words(obj) -> str | None:
    """How to save the state of ``obj`` where it is a random generator (torch.Generator, numpy's
    Generator or RandomState, random.Random), else None."""
    if hasattr(obj, "bit_generator"):  # numpy's Generator
        return "save its bit_generator.state (a dict) instead, and set it back on a new generator"
    for get, put in (("get_state", "set_state"), ("getstate", "setstate")):
        if callable(getattr(obj, get, None)) and callable(getattr(obj, put, None)):
            return f"save its {get}() instead, and restore it with {put}()"
    return None


class _Walk:
    """One walk over a saved object, building its skeleton.

    It runs on every save (a synchronous one on the caller's thread, right after the caller's
    own work, when the interpreter's caches are cold: a 32-tensor dict costs 5x its warm time
    then), so it does each thing once: exact types are dispatched on first (isinstance against
    torch.Tensor goes through its metaclass), the path is a stack joined only for a tensor's name
    or a message, and each tensor's attributes are read once for the checks, the tied-weight key,
    the signature and the devices.
    """

    __slots__ = ("tensors", "names", "signature", "devices", "_taken", "_seen", "_active", "_path")

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.signature: list[tuple[str, str, tuple[int, ...]]] = []
        self.devices: set[torch.device] = set()
        self._taken: set[str] = set()
        self._seen: dict[tuple, int] = {}
        self._active: set[int] = set()
        self._path: list = []  # keys (str) and list indexes / int keys (int), root first

    def node(self, obj: Any) -> dict:
        kind = type(obj)
        if kind is float:
            return {"float": obj.hex()}
        if kind is int:
            return {"int": obj}
        if kind is str:
            return {"str": obj}
        if kind is bool:
            return {"bool": obj}
        if obj is None:
            return {"none": None}
        if kind is dict:
            return self._mapping(obj, "dict")
        if kind is list:
            return self._sequence(obj, "list")
        if kind is OrderedDict:
            return self._mapping(obj, "odict")
        if kind is tuple:
            return self._sequence(obj, "tuple")
        if isinstance(obj, torch.Tensor):
            return {"tensor": self._tensor(obj)}
        return self._other(obj)

    def _enter(self, obj) -> None:
        if id(obj) in self._active:
            raise UnsupportedObjectError(f"{self._where()}: the object contains itself; ckptfs stores trees only")
        if obj and len(self._path) >= MAX_DEPTH:
            raise UnsupportedObjectError(f"{self._where()[:200]}...: the object nests deeper than {MAX_DEPTH} "
                                         "levels; flatten it (e.g. into a dict of tensors)")
        self._active.add(id(obj))

    def _mapping(self, obj: dict, kind: str) -> dict:
        self._enter(obj)
        path = self._path
        items = []
        for k, v in obj.items():
            key_kind = type(k)
            if key_kind is str:
                key, text = {"str": k}, k
            elif key_kind is int:
                key, text = {"int": k}, k
            elif isinstance(k, _KEY_TYPES):
                # a subclass of a plain type (an enum, numpy's float64) as its base value: a key
                # is a plain value in the index, never a leaf of ckptfs.leaves
                plain = _base_value(k)
                path.append("<key>")
                key = self.node(plain)
                path.pop()
                # named as stored (skeleton.ref_names' rule): numpy's float64(1.5) is "1.5"
                text = plain if isinstance(plain, str) else repr(plain)
            else:
                raise UnsupportedObjectError(
                    f"{self._where()}: dict key {k!r} of type {type(k).__name__} is not supported; "
                    "use str, int, float, bool or None keys")
            path.append(text)
            items.append([key, self.node(v)])
            path.pop()
        self._active.discard(id(obj))
        return {kind: items}

    def _sequence(self, obj, kind: str) -> dict:
        self._enter(obj)
        path = self._path
        items = []
        for i, v in enumerate(obj):
            path.append(i)
            items.append(self.node(v))
            path.pop()
        self._active.discard(id(obj))
        return {kind: items}

    def _tensor(self, t: torch.Tensor) -> int:
        if type(t) not in _PLAIN_TENSOR_TYPES:
            t = self._plain_tensor(t)
        if t.is_nested:  # before its shape, which a nested tensor of the strided layout does not have
            raise UnsupportedObjectError(f"{self._where()}: nested tensors are not supported; save .unbind() (a "
                                         "list of tensors)")
        if t.layout != torch.strided:
            raise UnsupportedObjectError(f"{self._where()}: {t.layout} tensors are not supported; use .to_dense()")
        dtype = t.dtype
        dtype_name = DTYPE_NAMES.get(dtype)
        if dtype_name is None:
            raise UnsupportedObjectError(f"{self._where()}: dtype {dtype} is not supported; dequantize or convert it")
        if t.is_meta:
            raise UnsupportedObjectError(f"{self._where()}: meta tensors have no data to save")
        device, shape = t.device, t.shape
        # every reference takes its name, as skeleton.ref_names counts them: a stored tensor is
        # named as its first reference is in the views ({"a": t, "b": {"c": t}, "b.c": u}: u is
        # "b.c#1" in both)
        name = unique_name(self._dotted() or "tensor", self._taken)
        self._taken.add(name)
        key = None
        if 0 not in shape:  # not empty
            # The same first byte, shape, strides and dtype on the same device, and the same lazy
            # conjugate / negative bits (x.conj() is x's memory, read otherwise): the same view, stored once.
            key = (device, t.data_ptr(), shape, t.stride(), dtype, t.is_conj(), t.is_neg())
            index = self._seen.get(key)
            if index is not None:
                return index
            self._seen[key] = len(self.tensors)
        self.tensors.append(t)  # detached where its bytes are taken (snapshot.byte_source)
        self.names.append(name)
        self.signature.append((name, dtype_name, tuple(shape)))
        self.devices.add(device)
        return len(self.tensors) - 1

    def _plain_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor subclass over storage of its own as a plain tensor over the same memory (it
        is stored, and loads, as a torch.Tensor); a wrapper subclass (DTensor, torchao's quantized
        and float8 tensors) is refused: its data is not one strided storage."""
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        kind = type(t)
        if torch.nn.parameter.is_lazy(t):
            raise UnsupportedObjectError(
                f"{self._where()}: an uninitialized parameter of a lazy module has no data yet; run a forward "
                "pass before saving")
        # a subclass with a dispatch of its own (a wrapper: DTensor, torchao's, one made with
        # _make_wrapper_subclass) is not the memory of a plain tensor
        if not is_traceable_wrapper_subclass(t) and kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
            return t.as_subclass(torch.Tensor)
        if kind.__name__ == "DTensor":
            raise UnsupportedObjectError(
                f"{self._where()}: a DTensor is sharded over ranks: save it from every rank together, with "
                "store.writer(model, group=...) or dcp.save with ckptfs.dcp.StorageWriter")
        raise UnsupportedObjectError(
            f"{self._where()}: {kind.__module__}.{kind.__qualname__} is a tensor subclass whose data is not one "
            "plain tensor; save a plain tensor instead (e.g. its dequantized or full form)")

    def _other(self, obj) -> dict:
        """torch's and numpy's small objects (ckptfs.leaves); subclasses of the plain types
        (IntEnum, str enums...) as their base value; else an error."""
        node = leaves.encode(obj, self._where())
        if node is not None:
            return node
        if isinstance(obj, (int, float, str)):
            return self.node(_base_value(obj))
        if isinstance(obj, dict):
            raise UnsupportedObjectError(f"{self._where()}: {type(obj).__name__} is not supported; convert it to a dict")
        if isinstance(obj, (list, tuple)):
            raise UnsupportedObjectError(
                f"{self._where()}: {type(obj).__name__} is not supported; convert it to a list or tuple")
        rng_state = _rng_state_words(obj)
        if rng_state is not None:  # a random generator: its state is plain data
            raise UnsupportedObjectError(
                f"{self._where()}: {type(obj).__module__}.{type(obj).__qualname__} cannot be stored; {rng_state}")
        if callable(getattr(obj, "state_dict", None)):  # a module, an optimizer, a scheduler, a scaler
            raise UnsupportedObjectError(
                f"{self._where()}: {type(obj).__module__}.{type(obj).__qualname__} cannot be stored; save its "
                "state_dict() instead (and load it back with load_state_dict)")
        raise UnsupportedObjectError(
            f"{self._where()}: {type(obj).__module__}.{type(obj).__qualname__} cannot be stored; ckptfs stores "
            "tensors, dicts, lists, tuples, str, int, float, bool, None, torch.Size, torch.dtype, torch.device "
            "and small numpy arrays and scalars (convert it, e.g. to a tensor or a plain value)")

    def _dotted(self) -> str:
        return ".".join([p if isinstance(p, str) else str(p) for p in self._path])

    def _where(self) -> str:
        return self._dotted() or "<root>"
