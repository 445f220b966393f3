"""The ``metadata.json`` view: what a checkpoint holds, readable by people and by ``jq``."""
from __future__ import annotations

import json
import math
from json.encoder import encode_basestring_ascii
from datetime import datetime, timezone
from typing import Any

from ckptfs.manifest import Manifest
from ckptfs.views.registry import register
from ckptfs.views.segments import Literal, View

METADATA_FILE = "metadata.json"


def metadata_json_view(manifest: Manifest) -> View:
    """A JSON document (indent 2, trailing newline, ASCII) describing the version.

    Keys: ``model``, ``step``, ``counter``, ``time_ns``, ``time`` (ISO 8601 UTC, nanoseconds),
    ``tensors`` (one entry per stored tensor: name, dtype, shape, nbytes, crc32 as 8 lowercase
    hex digits) and ``object``: the saved object with each tensor replaced by
    ``"<tensor NAME>"``, made JSON-safe (see ``json_safe``).
    """
    doc = {
        "model": manifest.model,
        "step": manifest.step,
        "counter": manifest.counter,
        "time_ns": manifest.time_ns,
        "time": iso8601_utc(manifest.time_ns),
        "tensors": _TENSORS,
        "object": json_safe(manifest.plain_part()),
    }
    if manifest.files:
        doc["files"] = [name for name, _ in manifest.files]
    text = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
    # The tensor list is most of a large version's document: written here, in the very bytes
    # json.dumps(indent=2) gives, at a fraction of its pure-Python encoder's cost.
    text = text.replace(json.dumps(_TENSORS), _tensor_list(manifest), 1)
    return View([Literal(text.encode("ascii"))])


_TENSORS = "\0ckptfs:tensors\0"  # a stand-in no JSON value of the document can contain (NUL is escaped)


def _tensor_list(manifest: Manifest) -> str:
    """The ``tensors`` array as ``json.dumps(..., indent=2)`` writes it at depth 1."""
    if not manifest.tensors:
        return "[]"
    quote = encode_basestring_ascii
    items = []
    for t in manifest.tensors:
        shape = "[\n" + ",\n".join(f"        {d}" for d in t.shape) + "\n      ]" if t.shape else "[]"
        items.append(f'    {{\n      "name": {quote(t.name)},\n      "dtype": {quote(t.dtype)},\n'
                     f'      "shape": {shape},\n      "nbytes": {t.nbytes},\n      "crc32": "{t.crc32:08x}"\n    }}')
    return "[\n" + ",\n".join(items) + "\n  ]"


def iso8601_utc(time_ns: int) -> str:
    """``time_ns`` (ns since the epoch) as ``YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ``, exact to the ns."""
    seconds, nanos = divmod(time_ns, 1_000_000_000)
    return f"{datetime.fromtimestamp(seconds, timezone.utc):%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON data: tuples become lists, non-finite floats the strings "nan",
    "inf", "-inf", and non-string dict keys their ``str()``; a key that collides with an
    earlier one gets ``#1``, ``#2``... appended, so no entry is lost."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            name = base = k if isinstance(k, str) else str(k)
            n = 1
            while name in out:
                name = f"{base}#{n}"
                n += 1
            out[name] = json_safe(v)
        return out
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


register("metadata", lambda manifest: {METADATA_FILE: metadata_json_view(manifest)},
         summary="metadata.json, what the version holds")
