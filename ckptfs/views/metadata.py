"""The ``metadata.json`` view: what a checkpoint holds, readable by people and by ``jq``."""
from __future__ import annotations

import json
import math
from json.encoder import encode_basestring_ascii
from datetime import datetime, timezone

from ckptfs import _native, leaves
from ckptfs.manifest import Manifest
from ckptfs.skeleton import unflatten, unique_name
from ckptfs.views.registry import register
from ckptfs.views.segments import Literal, View

METADATA_FILE = "metadata.json"


def metadata_json_view(manifest: Manifest) -> View:
    """A JSON document (indent 2, trailing newline, ASCII) describing the version.

    Keys: ``model``, ``step``, ``counter``, ``time_ns``, ``time`` (ISO 8601 UTC, nanoseconds),
    ``tensors`` (one entry per stored tensor: name, dtype, shape, nbytes, crc32 as 8 lowercase
    hex digits) and ``object``: the saved object with each tensor replaced by
    ``"<tensor NAME>"``, made JSON-safe (see ``_object_json``).
    """
    doc = {
        "model": manifest.model,
        "step": manifest.step,
        "counter": manifest.counter,
        "time_ns": manifest.time_ns,
        "time": iso8601_utc(manifest.time_ns),
        "tensors": _TENSORS,
        "object": _OBJECT,
    }
    if manifest.files:
        doc["files"] = [name for name, _ in manifest.files]
    text = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
    # The tensor list and the object are most of a large version's document: written here, in
    # the very bytes json.dumps(indent=2) gives, at a fraction of its pure-Python encoder's
    # cost, and put in place by one join (no copy of the whole per stand-in).
    before, rest = text.split(json.dumps(_TENSORS), 1)
    between, after = rest.split(json.dumps(_OBJECT), 1)
    return View([Literal("".join([before, _tensor_list(manifest), between, _object_json(manifest), after]).encode("ascii"))])


# stand-ins no JSON value of the document can contain (NUL is escaped)
_TENSORS = "\0ckptfs:tensors\0"
_OBJECT = "\0ckptfs:object\0"


def _tensor_list(manifest: Manifest) -> str:
    """The ``tensors`` array as ``json.dumps(..., indent=2)`` writes it at depth 1; its items are
    written in C (``_native.metadata_tensor_list``: a large index, on the first listing)."""
    if not manifest.tensors:
        return "[]"
    items = _native.metadata_tensor_list(manifest.tensors, {}, _shape_json)
    return "[\n" + items + "\n  ]"


def _shape_json(shape: tuple[int, ...]) -> str:
    """A shape as json.dumps(indent=2) writes it at depth 3."""
    return "[\n" + ",\n".join(f"        {d}" for d in shape) + "\n      ]" if shape else "[]"


def iso8601_utc(time_ns: int) -> str:
    """``time_ns`` (ns since the epoch) as ``YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ``, exact to the ns."""
    seconds, nanos = divmod(time_ns, 1_000_000_000)
    return f"{datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def _object_json(manifest: Manifest) -> str:
    """The ``object`` value as ``json.dumps(..., indent=2)`` writes it at depth 1, straight from
    the skeleton (json.dumps with an indent runs its pure-Python encoder): the saved object with
    each tensor as ``"<tensor NAME>"``, tuples as lists, non-finite floats as the strings "nan",
    "inf", "-inf", torch.Size as a list, a dtype as ``"torch.float16"``, a device as ``"cuda:0"``,
    a numpy scalar as its number, a numpy array as ``"<ndarray <u4 (624,)>"``, and non-string dict keys as their ``str()``; a key that collides with an
    earlier one of its dict gets ``#1``, ``#2``... appended, so no entry is lost."""
    out: list[str] = []
    _write_node(manifest.skeleton, 1, out, [t.name for t in manifest.tensors])
    return "".join(out)


def _write_node(node: dict, level: int, out: list[str], names: list[str]) -> None:
    (kind, value), = node.items()
    if kind == "tensor":
        out.append(encode_basestring_ascii(f"<tensor {names[value]}>"))
    elif kind in _SCALAR_JSON:
        out.append(_SCALAR_JSON[kind](value))
    elif kind in ("list", "tuple", "dict", "odict"):
        if not value:
            out.append("[]" if kind in ("list", "tuple") else "{}")
            return
        inner = "\n" + "  " * (level + 1)
        if kind in ("list", "tuple"):
            out.append("[")
            for i, item in enumerate(value):
                out.append(inner if i == 0 else "," + inner)
                _write_node(item, level + 1, out, names)
            out.append("\n" + "  " * level + "]")
            return
        out.append("{")
        taken: set[str] = set()
        for i, (key, item) in enumerate(value):
            (key_kind, key_value), = key.items()
            name = unique_name(key_value if key_kind == "str" else str(unflatten(key, [])), taken)
            taken.add(name)
            out.append((inner if i == 0 else "," + inner) + encode_basestring_ascii(name) + ": ")
            _write_node(item, level + 1, out, names)
        out.append("\n" + "  " * level + "}")
    elif kind in leaves.KINDS:
        _write_node(_plain_node(leaves.plain_value(kind, value)), level, out, names)
    else:
        raise ValueError(f"unknown skeleton node kind {kind!r}")


def _plain_node(value) -> dict:
    """The skeleton node of a stand-in from leaves.plain_value (a list of ints, a number, a str)."""
    if isinstance(value, list):
        return {"list": [{"int": n} for n in value]}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value.hex()}
    return {"str": value}


def _float_json(hex_text: str) -> str:
    x = float.fromhex(hex_text)
    return float.__repr__(x) if math.isfinite(x) else encode_basestring_ascii(str(x))


_SCALAR_JSON = {
    "str": encode_basestring_ascii,
    "int": lambda v: int.__repr__(int(v)),
    "float": _float_json,
    "bool": lambda v: "true" if v else "false",
    "none": lambda v: "null",
}


register("metadata", lambda manifest: {METADATA_FILE: metadata_json_view(manifest)},
         summary="metadata.json, what the version holds")
