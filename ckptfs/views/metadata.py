"""The ``metadata.json`` view: what a checkpoint holds, readable by people and by ``jq``."""
from __future__ import annotations

import json
import math
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
        "tensors": [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
             "crc32": f"{t.crc32:08x}"}
            for t in manifest.tensors
        ],
        "object": json_safe(manifest.plain_part()),
    }
    if manifest.files:
        doc["files"] = [name for name, _ in manifest.files]
    text = json.dumps(doc, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
    return View([Literal(text.encode("ascii"))])


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
