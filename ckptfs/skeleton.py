"""The skeleton of a saved object: its nested structure with every tensor replaced by a
reference to its record (``ckptfs.manifest``) and every plain leaf in a JSON encoding (never
pickle). Here: checking a skeleton read from the media, walking it, renaming its references,
the names made from its key paths, and ``unflatten`` (flatten, the torch side, is
ckptfs.flatten).

Skeleton nodes are one-key JSON objects:
  ``{"tensor": i}``, ``{"dict": [[k, v], ...]}``, ``{"odict": [[k, v], ...]}``, ``{"list": [...]}``,
  ``{"tuple": [...]}``, ``{"str": s}``, ``{"int": n}``, ``{"float": float.hex()}``,
  ``{"bool": b}``, ``{"none": null}``, and the leaves of ckptfs.leaves (torch.Size, torch.dtype,
  torch.device, small numpy arrays and scalars)
where dict keys ``k`` are nodes too, so that ``optimizer.state_dict()``'s integer keys stay ints.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ckptfs import _native, leaves
from ckptfs.errors import MalformedInputError

MAX_DEPTH = 200  # nesting of a saved object (and of a skeleton); deeper ones are refused
_SCALAR_KINDS = {"str": str, "int": int, "float": str, "bool": bool, "none": type(None)}



def check_skeleton(node, ntensors: int) -> None:
    """MalformedInputError unless ``node`` is a well-formed skeleton whose tensor references are
    indices below ``ntensors``."""
    _check_skeleton(node, ntensors, 0)


def _one_key_node(node, depth: int) -> tuple[str, Any]:
    """(kind, value) of a skeleton node at ``depth``; MalformedInputError if it nests too deep or
    is not a one-key object."""
    if depth > MAX_DEPTH:
        raise MalformedInputError(f"skeleton nests deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1:
        raise MalformedInputError(f"skeleton node {node!r:.60} is not a one-key object")
    (kind, value), = node.items()
    return kind, value


def tensor_leaf(node) -> Any:
    """The reference of a skeleton node ``{"tensor": r}``, None for any other node: the usual
    value of a state dict, which the walkers over tens of thousands of them take without
    recursing (the reference itself is checked by ``check_skeleton``)."""
    return node.get("tensor") if type(node) is dict and len(node) == 1 else None


def map_tensor_refs(node, ref: Callable[[Any], Any], depth: int = 0) -> dict:
    """A copy of skeleton ``node`` with each tensor reference ``r`` replaced by ``ref(r)``
    (e.g. indices to names and back). Checks only the shape of the containers
    (MalformedInputError); ``check_skeleton`` checks the rest."""
    kind, value = _one_key_node(node, depth)
    if kind == "tensor":
        return {kind: ref(value)}
    if kind in ("list", "tuple") and isinstance(value, list):
        return {kind: [map_tensor_refs(v, ref, depth + 1) for v in value]}
    if kind in ("dict", "odict") and isinstance(value, list):
        if not all(isinstance(item, list) and len(item) == 2 for item in value):
            raise MalformedInputError(f"skeleton {kind} node holds an item that is not a [key, value] pair")
        return {kind: [[k, map_tensor_refs(v, ref, depth + 1) if (r := tensor_leaf(v)) is None else {"tensor": ref(r)}]
                       for k, v in value]}
    return node


def dumps_named_skeleton(skeleton: dict, names) -> str:
    """``dumps_compact(map_tensor_refs(skeleton, names.__getitem__))`` of a checked skeleton, in
    one pass in C (``_native.skeleton_json``): the whole-state safetensors file carries it, made
    on the first listing of a version, where the copy and the dump of a skeleton of 40,000
    tensors cost more than the rest of that file's header. (A test holds the two equal.)"""
    return _native.skeleton_json(skeleton, names)


def _check_skeleton(node, ntensors: int, depth: int) -> None:
    """Raise MalformedInputError unless ``node`` is a skeleton node (see the module doc)."""
    kind, value = _one_key_node(node, depth)
    if kind == "tensor":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ntensors:
            raise MalformedInputError(f"skeleton refers to tensor {value!r:.20} of {ntensors}")
    elif kind in _SCALAR_KINDS:
        if isinstance(value, bool) != (kind == "bool") or not isinstance(value, _SCALAR_KINDS[kind]):
            raise MalformedInputError(f"skeleton {kind} node holds {value!r:.40}")
        if kind == "float":
            float.fromhex(value)  # ValueError if it is not a hex float
    elif kind in ("list", "tuple"):
        if not isinstance(value, list):
            raise MalformedInputError(f"skeleton {kind} node holds {value!r:.40}")
        for v in value:
            _check_skeleton(v, ntensors, depth + 1)
    elif kind in ("dict", "odict"):
        if not isinstance(value, list):
            raise MalformedInputError(f"skeleton {kind} node holds {value!r:.40}")
        for item in value:
            if not isinstance(item, list) or len(item) != 2:
                raise MalformedInputError(f"skeleton {kind} item {item!r:.40} is not a [key, value] pair")
            key, v = item
            if not isinstance(key, dict) or len(key) != 1 or next(iter(key)) not in _SCALAR_KINDS:
                raise MalformedInputError(f"skeleton {kind} key {key!r:.40} is not a plain value")
            # the usual key (a str) and value (a tensor) are checked here, below the depth limit
            if depth >= MAX_DEPTH or type(key.get("str")) is not str:
                _check_skeleton(key, ntensors, depth + 1)
            index = tensor_leaf(v)
            if depth >= MAX_DEPTH or type(index) is not int or not 0 <= index < ntensors:
                _check_skeleton(v, ntensors, depth + 1)
    else:
        leaves.check(kind, value)  # or MalformedInputError: an unknown kind


def key_text(key_node: dict) -> str:
    """A dict key node's part of a dotted name: a str key itself, any other key its value's repr
    (the int 1 and the str "1" read the same here: ``tensor_refs(exact=True)`` tells them apart)."""
    key = key_node.get("str")
    if type(key) is str:
        return key
    key = unflatten(key_node, [])
    return key if isinstance(key, str) else repr(key)


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name#1``, ``name#2``... when another entry already has it (keys that
    contain dots can collide with nested paths: {"a.b": x, "a": {"b": y}}); the one rule of
    every list of names made from a skeleton (tensor names, views' entries). The caller adds
    the result to ``taken``."""
    if name not in taken:
        return name
    n = 1
    while f"{name}#{n}" in taken:
        n += 1
    return f"{name}#{n}"


def unflatten(skeleton: dict, tensors: list) -> Any:
    """Rebuild the object from its skeleton; tensor nodes take ``tensors[i]``."""
    try:
        (kind, value), = skeleton.items()
    except (AttributeError, ValueError):
        raise MalformedInputError(f"skeleton node {skeleton!r} is not a one-key object") from None
    if kind == "tensor":
        return tensors[value]
    if kind in ("dict", "odict"):
        d = OrderedDict() if kind == "odict" else {}
        for k, v in value:
            d[unflatten(k, tensors)] = unflatten(v, tensors)
        return d
    if kind == "list":
        return [unflatten(v, tensors) for v in value]
    if kind == "tuple":
        return tuple(unflatten(v, tensors) for v in value)
    if kind == "none":
        return None
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float.fromhex(value)
    if kind == "str":
        return str(value)
    return leaves.decode(kind, value)


def ref_names(refs: list) -> list[str]:
    """The name of each (key path, index) of ``tensor_refs`` (text paths): its parts joined by
    dots ("tensor" for a bare tensor), made unique with ``unique_name`` in order."""
    names: list[str] = []
    seen: set[str] = set()
    for key_path, _ in refs:
        name = ".".join(key_path) or "tensor"
        if name in seen:
            name = unique_name(name, seen)
        seen.add(name)
        names.append(name)
    return names


def tensor_refs(node: dict, path: tuple, out: list, exact: bool = False) -> None:
    """Append (key path, tensor index) of every tensor node under ``node``, in order (a list,
    not a generator: a skeleton of 40,000 tensors is walked on every first view of a version).
    The path's parts are text (a key that is not a str as its repr, a list's index as digits),
    the parts of a dotted name; where ``exact``, they tell every two keys apart: a str key is
    itself, any other key (kind, value) of its node (and the how-manieth such key of the dict it
    is, where one before it reads the same: NaNs), a list's index an int."""
    (kind, value), = node.items()
    if kind == "tensor":
        out.append((path, int(value)))
    elif kind in ("dict", "odict"):
        seen = set() if exact else None
        for k, v in value:
            key = k.get("str")
            if type(key) is not str:
                if exact:
                    key = next(iter(k.items()))
                    while key in seen:  # two NaN keys: float("nan") != float("nan"), one hex text
                        key = (key, len(seen))
                    seen.add(key)
                else:
                    key = key_text(k)
            sub = path + (key,)
            index = tensor_leaf(v)
            if index is None:
                tensor_refs(v, sub, out, exact)
            else:
                out.append((sub, int(index)))
    elif kind in ("list", "tuple"):
        for i, v in enumerate(value):
            tensor_refs(v, path + (i if exact else str(i),), out, exact)