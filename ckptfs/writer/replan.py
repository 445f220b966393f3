"""The cached save plan: a training loop saves the same structure every time, so a save of an
object whose structure was seen before re-reads only what can change (the tensors and the plain
values) instead of flattening it again (``ckptfs.flatten.flatten``: ~12 µs a tensor, the stall
at 40,000 tensors).

``Structure.of(flat)`` compiles a flattened object into a program that ``match(obj)`` runs on a
new object: the same container types and keys, tensors of the same type, layout, dtype, shape and
device, contiguous, tied where they were tied and nowhere else, plain values of the same kinds.
Anything else returns None and the caller flattens in full: a changed structure is re-planned,
never written with a stale layout. The plain values may change (a learning rate, an epoch): the
skeleton and its JSON encoding are rebuilt from cached pieces for the parts that hold them.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch

from ckptfs.leaves import KINDS as LEAF_KINDS
from ckptfs.errors import UnsupportedObjectError
from ckptfs.flatten import Flattened, plain_node
from ckptfs.gcpause import paused_gc
from ckptfs.manifest import dumps_compact
from ckptfs.skeleton import unflatten

_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "none": type(None)}
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


class _Changed(Exception):
    """The object does not have the cached structure."""


class _Node:
    """One container or leaf of the cached structure. ``plain``: whether a plain value lies in
    it (else its skeleton node and encoding are reused as they are)."""

    __slots__ = ("kind", "keys", "key_types", "key_nodes", "children", "leaf", "node", "_text", "plain",
                 "all_tensors", "leaf_type")

    def __init__(self, kind: str, node: dict):
        self.kind, self.node = kind, node
        self.keys = self.key_nodes = None
        self.key_types: tuple | None = None  # a dict's key types where one is not str (else None)
        self.children: list[_Node] = []
        self.leaf = -1  # tensor leaf: its index among the leaves; plain leaf: among the plain values
        self._text: str | None = None
        self.plain = kind in _PLAIN_TYPES or kind in LEAF_KINDS
        self.all_tensors = False
        # a leaf of ckptfs.leaves: the type its object must have (its node is made again at
        # every save: an RNG state changes every time, and an array has no plain equality)
        self.leaf_type: type | None = None

    @property
    def text(self) -> str:
        """The node's JSON (``dumps_compact``), encoded once, when first reused."""
        if self._text is None:
            self._text = dumps_compact(self.node)
        return self._text


class Structure:
    """A compiled object structure; see the module doc."""

    def __init__(self, root: _Node, flat: Flattened, leaf_tensor: list[int], plain: list):
        self._root = root
        # what a match hands on unchanged; not the tensors: a structure must not keep the first
        # save's tensors alive
        self._names, self._signature, self._devices_seen = flat.names, flat.signature, flat.devices
        tensors = flat.tensors
        self._dtypes = [tensors[i].dtype for i in leaf_tensor]
        self._shapes = [tuple(tensors[i].shape) for i in leaf_tensor]
        self._devices = [tensors[i].get_device() for i in leaf_tensor]
        first: dict[int, int] = {}
        for leaf, t in enumerate(leaf_tensor):
            first.setdefault(t, leaf)
        self._first_leaf = [first[i] for i in range(len(tensors))]
        self._tied = [(leaf, self._first_leaf[t]) for leaf, t in enumerate(leaf_tensor)
                      if self._first_leaf[t] != leaf]
        self._nonempty = [leaf for leaf in self._first_leaf if 0 not in self._shapes[leaf]]
        self._plain = plain

    @classmethod
    def of(cls, flat: Flattened) -> "Structure | None":
        """The compiled structure of ``flat``, or None where the fast check would not be exact
        (non-contiguous or complex tensors: their bytes are made at snapshot)."""
        if any(t.dtype in _COMPLEX or not t.is_contiguous() for t in flat.tensors):
            return None
        leaf_tensor: list[int] = []
        plain: list = []

        def compile_node(node: dict) -> _Node:
            (kind, value), = node.items()
            n = _Node(kind, node)
            if kind == "tensor":
                n.leaf = len(leaf_tensor)
                leaf_tensor.append(value)
            elif kind in _PLAIN_TYPES:
                n.leaf = len(plain)
                plain.append(unflatten(node, []))
            elif kind in LEAF_KINDS:
                n.leaf = len(plain)
                plain.append(None)
                n.leaf_type = type(unflatten(node, []))
            elif kind in ("dict", "odict"):
                n.keys = tuple(unflatten(k, []) for k, _ in value)
                if not all(type(k) is str for k in n.keys):
                    n.key_types = tuple(map(type, n.keys))
                n.key_nodes = [k for k, _ in value]
                n.children = [compile_node(v) for _, v in value]
            else:  # list, tuple
                n.children = [compile_node(v) for v in value]
            n.plain = n.plain or any(c.plain for c in n.children)
            n.all_tensors = bool(n.children) and all(c.kind == "tensor" for c in n.children)
            return n

        return cls(compile_node(flat.skeleton), flat, leaf_tensor, plain)

    def match(self, obj: Any) -> Flattened | None:
        """``obj`` flattened through the cached structure, or None if its structure differs."""
        # The checks make a shape object per tensor, alive together in a list: with the cyclic
        # GC on, 40,000 of them started collections that promoted them, then full collections
        # of the caller's heap (0.15 s of every other save's stall at 40,000 tensors).
        with paused_gc():
            return self._match(obj)

    def _match(self, obj: Any) -> Flattened | None:
        leaves: list = []
        plain: list = []
        try:
            self._walk(self._root, obj, leaves, plain)
            tensors = self._check_leaves(leaves)
        except (_Changed, AttributeError, RuntimeError, TypeError):
            return None
        try:
            skeleton, text = self._rebuild(self._root, plain)
        except UnsupportedObjectError:  # e.g. an array grown too large: flatten names where
            return None
        return Flattened(skeleton, tensors, self._names, self._signature, self._devices_seen, skeleton_json=text)

    def _walk(self, n: _Node, obj: Any, leaves: list, plain: list) -> None:
        kind = n.kind
        if kind == "tensor":
            leaves.append(obj)
        elif kind in _PLAIN_TYPES:
            if type(obj) is not _PLAIN_TYPES[kind]:
                raise _Changed
            plain.append(obj)
        elif n.leaf_type is not None:
            if type(obj) is not n.leaf_type:
                raise _Changed
            plain.append(obj)
        elif kind in ("dict", "odict"):
            if type(obj) is not (dict if kind == "dict" else OrderedDict) or tuple(obj) != n.keys:
                raise _Changed
            if n.key_types is not None and (tuple(map(type, obj)) != n.key_types or float in n.key_types and any(
                    type(k) is float and math.copysign(1.0, k) != math.copysign(1.0, c) for k, c in zip(obj, n.keys))):
                raise _Changed  # True == 1, -0.0 == 0.0: equal keys of another type or sign change the skeleton
            if n.all_tensors:
                leaves.extend(obj.values())
            else:
                for child, value in zip(n.children, obj.values()):
                    self._walk(child, value, leaves, plain)
        else:
            if type(obj) is not (list if kind == "list" else tuple) or len(obj) != len(n.children):
                raise _Changed
            if n.all_tensors:
                leaves.extend(obj)
            else:
                for child, value in zip(n.children, obj):
                    self._walk(child, value, leaves, plain)

    def _check_leaves(self, leaves: list) -> list:
        """The distinct tensors (flatten's order) if every leaf matches; else _Changed. One pass,
        each tensor's fields read together: a pass per field took 2.5x as long at 40,000 tensors
        (60 ms, the larger part of the stall after the copy)."""
        if len(leaves) != len(self._dtypes) or not set(map(type, leaves)) <= _TENSOR_TYPES:
            raise _Changed
        ptrs: list[int] = []
        append, strided = ptrs.append, torch.strided
        for t, dtype, shape, device in zip(leaves, self._dtypes, self._shapes, self._devices):
            if (t.dtype is not dtype or t.shape != shape or t.get_device() != device or t.layout is not strided
                    or not t.is_contiguous()):
                raise _Changed
            append(t.data_ptr())
        if any(ptrs[a] != ptrs[b] or leaves[a].is_neg() != leaves[b].is_neg() or leaves[a].is_conj() != leaves[b].is_conj()
               for a, b in self._tied):  # ties kept (a lazily negated view of the same bytes is no tie) ...
            raise _Changed
        distinct = {ptrs[leaf] for leaf in self._nonempty}
        if len(distinct) != len(self._nonempty) or 0 in distinct:  # ... and none added; no meta tensors
            raise _Changed
        return [leaves[leaf] for leaf in self._first_leaf]

    def _rebuild(self, n: _Node, plain: list) -> tuple[dict, str]:
        """(skeleton node, its JSON) with the new plain values; subtrees without any, or whose
        values are unchanged, are reused."""
        if not n.plain:
            return n.node, n.text
        if n.leaf >= 0:
            value, cached = plain[n.leaf], self._plain[n.leaf]
            if n.leaf_type is None and value == cached and type(value) is type(cached) and value == value and (
                    type(value) is not float or math.copysign(1.0, value) == math.copysign(1.0, cached)):
                return n.node, n.text  # not NaN, nor a zero of the other sign (-0.0 == 0.0)
            node = plain_node(value)
            return node, dumps_compact(node)
        built = [self._rebuild(c, plain) for c in n.children]
        if n.keys is not None:
            node = {n.kind: [[k, b[0]] for k, b in zip(n.key_nodes, built)]}
            items = ",".join(f"[{dumps_compact(k)},{b[1]}]" for k, b in zip(n.key_nodes, built))
        else:
            node = {n.kind: [b[0] for b in built]}
            items = ",".join(b[1] for b in built)
        return node, f'{{"{n.kind}":[{items}]}}'

