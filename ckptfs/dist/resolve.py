"""The data of a DCP save plan's write items, for the saves that reuse the plan.

DCP's ``DefaultSavePlanner`` finds an item's data by flattening the whole state dict at every
save (``set_up_planner``) and looking each item up through DTensor's checkpoint protocol, an
autograd function per shard. For a writer that reuses one plan save after save (``DistWriter``)
that was most of the caller's stall beyond the copy itself: ~11 of ~19 ms per save of GPT-2
under FSDP2 with AdamW (605 items) on the project's 2-core VM, before a single byte moved.

A plan made by ``DefaultSavePlanner`` carries, in the planner's ``mappings``, the path of each
flattened key in the nested state dict. ``ItemResolver`` keeps those paths and resolves an item
of a state of the same structure (the writer matched it against the plan's:
ckptfs.dist.structure) by walking to the object and taking what
``DefaultSavePlanner.resolve_data`` would return: a DTensor's local tensor, a plain tensor, or
the ``torch.save`` bytes of any other value. Anything else (a planner
that is not exactly the default one, a ShardedTensor, a nested tensor subclass) resolves through
a default planner set up with the state, as before.

Either way a resolution also gives the *value* of each BYTE_IO item that is plain data (numbers,
strings, None, and lists, tuples and dicts of them: an optimizer's ``param_groups``, an epoch):
the part stores it beside the item's bytes in ckptfs's own encoding, so that the mount shows it
in the whole checkpoint without unpickling anything (ckptfs.dist.whole).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItemType
from torch.distributed.checkpoint.utils import find_tensor_shard

from ckptfs import leaves
from ckptfs.errors import UnsupportedObjectError

__all__ = ["ItemResolver", "Resolved", "as_tensor", "resolve_items"]


class Resolved(NamedTuple):
    """A rank's items resolved for its part: each item's tensor (``as_tensor``), and, by
    position, the value of each BYTE_IO item that is plain data as ckptfs stores it
    (``storable_value``)."""

    tensors: list[torch.Tensor]
    values: dict[int, Any]


def as_tensor(item, data) -> torch.Tensor:
    """An item's resolved data as the tensor its part saves: the bytes of a BYTE_IO item as
    uint8, a tensor (a shard's local tensor) as it is, detached where it needs a gradient (a
    state dict's tensors need none: a new tensor object each is time only)."""
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return data.detach() if data.requires_grad else data


def resolve_items(items: list, planner: SavePlanner) -> Resolved:
    """Each item's data through ``planner`` (set up with the state), as ``as_tensor``; the
    values where the planner's bytes are ``torch.save`` of the object it looks up (a
    DefaultSavePlanner that keeps its ``resolve_data`` and ``transform_object``: another
    planner may save something else than the value, which is then left to its bytes)."""
    tensors = [as_tensor(item, planner.resolve_data(item)) for item in items]
    values = {}
    kind = type(planner)
    if (isinstance(planner, DefaultSavePlanner) and kind.resolve_data is DefaultSavePlanner.resolve_data
            and kind.transform_object is DefaultSavePlanner.transform_object):
        for pos, item in enumerate(items):
            if item.type == WriteItemType.BYTE_IO:
                obj = planner.lookup_object(item.index)
                if storable_value(obj):
                    values[pos] = obj
    return Resolved(tensors, values)


class ItemResolver:
    """The data of ``items`` (a plan ``planner`` made, after its ``set_up_planner``) in any state
    of the same structure: ``resolve(state)`` returns what ``resolve_items`` would with a
    ``DefaultSavePlanner`` set up with that state."""

    def __init__(self, items: list, planner: SavePlanner):
        self.items = items
        self.is_coordinator = bool(getattr(planner, "is_coordinator", False))
        self.paths: list[tuple] | None = _paths(items, planner)
        self._default = DefaultSavePlanner()  # its transform_object needs no state
        self._bytes: dict[int, tuple[bytes, torch.Tensor]] = {}  # item -> (pickle of its value, its tensor)

    def resolve(self, state: dict) -> Resolved:
        if self.paths is None:
            planner = DefaultSavePlanner()
            planner.set_up_planner(state, None, self.is_coordinator)
            return resolve_items(self.items, planner)
        out, values = [], {}
        for i, (item, path) in enumerate(zip(self.items, self.paths)):
            obj = state
            for key in path:
                obj = obj[key]
            if item.type == WriteItemType.BYTE_IO:
                out.append(self._byte_io(i, item, obj))
                if storable_value(obj):
                    values[i] = obj
            else:
                out.append(as_tensor(item, _lookup(item, obj)))
        return Resolved(out, values)

    def _byte_io(self, i: int, item, obj) -> torch.Tensor:
        """The bytes of BYTE_IO item ``i`` holding ``obj``: the last save's tensor again where
        ``obj`` is plain data (numbers, strings, and lists, tuples and dicts of them) that
        pickles as the last one did, so that its ``torch.save`` bytes (a function of that
        pickle) are the same. A learning rate's ``torch.save`` took ~45 us, and a new tensor at
        each save made its copy spans again."""
        key = _plain_pickle(obj)
        cached = self._bytes.get(i)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        tensor = as_tensor(item, self._default.transform_object(item, obj))
        if key is not None:
            self._bytes[i] = (key, tensor)
        return tensor


_PLAIN_TYPES = frozenset({int, float, complex, bool, str, bytes, type(None)})
_STORABLE_TYPES = frozenset({int, float, bool, str, type(None)})  # a skeleton's scalars (ckptfs.flatten)


def _plain_pickle(obj) -> bytes | None:
    """``pickle.dumps(obj)`` where ``obj`` is plain data (exact builtin types only: a subclass
    pickles by reference to its class, a tensor through storages), else None."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if _is_plain(obj, 0, _PLAIN_TYPES) else None


def storable_value(obj) -> bool:
    """Whether ``obj`` is plain data that a part stores as it is: the exact types of a
    skeleton's scalars and the objects of ckptfs.leaves that it can store (torch.Size, a dtype,
    numpy's RNG state...), and lists, tuples and dicts of them, 8 levels deep at most."""
    return _is_plain(obj, 0, _STORABLE_TYPES, with_leaves=True)


def _is_plain(obj, depth: int, scalars: frozenset, with_leaves: bool = False) -> bool:
    kind = type(obj)
    if kind in scalars:
        return True
    if with_leaves and kind.__module__.startswith(("torch", "numpy")) and not issubclass(kind, torch.Tensor):
        try:
            return leaves.encode(obj, "") is not None
        except UnsupportedObjectError:
            return False
    if depth >= 8:
        return False
    if kind is list or kind is tuple:
        return all(_is_plain(v, depth + 1, scalars, with_leaves) for v in obj)
    if kind is dict:
        return all(_is_plain(k, depth + 1, scalars) and _is_plain(v, depth + 1, scalars, with_leaves)
                   for k, v in obj.items())
    return False


def _lookup(item, obj):
    """``find_state_dict_object``'s answer for ``obj``, the item's object: a DTensor's local
    tensor taken directly (``to_local`` is an autograd function, and its view holds the same
    memory); any other tensor through DCP's ``find_tensor_shard``; a value of a BYTE_IO item as
    it is."""
    if item.type == WriteItemType.BYTE_IO:
        return obj
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        # find_tensor_shard's answer for a plain tensor, without its probes for the checkpoint
        # protocol (an attribute a tensor lacks: an AttributeError raised and caught, ~40,000
        # times per save of a state of that many tensors)
        offset = item.index.offset
        return obj if offset is None or not any(offset) else find_tensor_shard(obj, item.index)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"FQN {item.index.fqn!r} holds a {type(obj).__name__}, and its plan a tensor")
    local = getattr(obj, "_local_tensor", None)
    if type(local) is torch.Tensor or type(local) is torch.nn.Parameter:
        return local
    return find_tensor_shard(obj, item.index)


def _paths(items: list, planner: SavePlanner) -> list[tuple] | None:
    """The state dict path of each item's object, or None where the fast resolution would not
    be exactly the planner's: a planner other than DefaultSavePlanner's own behaviour, a state
    not flattened by it, or one holding ShardedTensors (their shards are flattened apart)."""
    if type(planner) is not DefaultSavePlanner or not getattr(planner, "flatten_state_dict", False):
        return None
    mappings = getattr(planner, "mappings", None)
    flat = getattr(planner, "state_dict", None)
    if mappings is None or flat is None:
        return None
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if any(isinstance(v, ShardedTensor) for v in flat.values()):
        return None
    try:
        return [tuple(mappings[item.index.fqn]) for item in items]
    except KeyError:
        return None
