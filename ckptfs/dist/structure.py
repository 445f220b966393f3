"""What a reused DCP save plan depends on: a state dict's structure (keys, container types and
lengths, each tensor's type, shape, dtype, device and placements, other values by type only),
described once when the plan is made and matched in lockstep at each later save.

A match walks the new state beside the stored description and compares as it goes, so that a
save makes no objects that outlive it: a description made at every save (thousands of strings or
tuples) cost ~1.5 ms for GPT-2 + AdamW's 594 leaves, and those that survived a collection brought
on gen-2 collections that paused every thread of the job.
"""
from __future__ import annotations

import torch

_DICT, _SEQ, _TENSOR, _OTHER = "dict", "seq", "tensor", "other"


def describe(obj) -> list:
    """The structure of ``obj`` as a flat list of tokens (see ``matches``)."""
    out: list = []
    _describe(obj, out)
    return out


def matches(obj, described: list) -> bool:
    """Whether ``obj`` has exactly the structure ``described`` (``describe`` of an earlier state)."""
    tokens = iter(described)
    try:
        return _match(obj, tokens) and next(tokens, _END) is _END
    except StopIteration:  # the description ended first: obj has more
        return False


_END = object()


def _describe(obj, out: list) -> None:
    if isinstance(obj, dict):
        out += (_DICT, type(obj), len(obj))
        for k, v in obj.items():
            out += (type(k), k)
            _describe(v, out)
    elif isinstance(obj, (list, tuple)):
        out += (_SEQ, type(obj), len(obj))
        for v in obj:
            _describe(v, out)
    elif isinstance(obj, torch.Tensor):
        out += (_TENSOR, type(obj), obj.shape, obj.dtype, obj.device, getattr(obj, "placements", None))
    else:
        out += (_OTHER, type(obj))


def _match(obj, tokens) -> bool:
    kind = next(tokens)
    if isinstance(obj, dict):
        if kind is not _DICT or next(tokens) is not type(obj) or next(tokens) != len(obj):
            return False
        for k, v in obj.items():
            if next(tokens) is not type(k) or next(tokens) != k or not _match(v, tokens):
                return False
        return True
    if isinstance(obj, (list, tuple)):
        if kind is not _SEQ or next(tokens) is not type(obj) or next(tokens) != len(obj):
            return False
        return all(_match(v, tokens) for v in obj)
    if isinstance(obj, torch.Tensor):
        return (kind is _TENSOR and next(tokens) is type(obj) and next(tokens) == obj.shape
                and next(tokens) == obj.dtype and next(tokens) == obj.device
                and next(tokens) == getattr(obj, "placements", None))
    return kind is _OTHER and next(tokens) is type(obj)
