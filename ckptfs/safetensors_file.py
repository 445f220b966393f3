"""Reading a ``.safetensors`` file to import it: its header validated (``parse_safetensors_header``:
every rule of the format checked before a byte of data is trusted; a refusal names the file and
says nothing was imported), its tensors mapped read-only from disk (``SafetensorsFile``)."""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.errors import MalformedInputError
from ckptfs.flatten import DTYPES
from ckptfs.manifest import expected_nbytes
from ckptfs.views.safetensors import MAX_HEADER_BYTES, SAFETENSORS_DTYPES

# safetensors dtype code -> ckptfs (torch) dtype name: the inverse of the map the views write with.
FROM_SAFETENSORS = {code: name for name, code in SAFETENSORS_DTYPES.items() if name in DTYPES}


@dataclass(frozen=True)
class SafetensorsEntry:
    name: str
    dtype: str  # ckptfs dtype name
    shape: tuple[int, ...]  # torch's shape
    begin: int  # relative to the start of the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    entries: tuple[SafetensorsEntry, ...]  # in header order
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section


def reject(path: str, what: str) -> MalformedInputError:
    """The refusal of an input file to import: its path, what is wrong, and that nothing was
    imported."""
    return MalformedInputError(f"{path}: {what}; nothing was imported")


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook that refuses a key given twice (ValueError): a header or an
    index must not mean two things."""
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_safetensors_header(head: bytes, file_size: int, path: str = "<input>") -> SafetensorsHeader:
    """Validate a safetensors header; ``head`` holds at least the first ``8 + n`` bytes of a file
    of ``file_size`` bytes (fewer if the file is shorter). Raises MalformedInputError."""
    if file_size < 8 or len(head) < 8:
        raise reject(path, f"truncated: {file_size} bytes, a safetensors file starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", head[:8])
    if n < 2 or n > MAX_HEADER_BYTES:
        raise reject(path, f"bad header length {n} (must be 2..{MAX_HEADER_BYTES} bytes)")
    if 8 + n > file_size or len(head) < 8 + n:
        raise reject(path, f"truncated: header length {n} runs past the end of the {file_size}-byte file")
    raw = head[8:8 + n]
    if raw[:1] != b"{":
        raise reject(path, "the header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise reject(path, f"the header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise reject(path, "the header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in metadata.items()):
        raise reject(path, "__metadata__ must map strings to strings")
    entries = []
    for name, info in doc.items():
        if not name:
            raise reject(path, "a tensor has an empty name")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise reject(path, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = FROM_SAFETENSORS.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise reject(path, f"tensor {name!r} has unknown or unsupported dtype {code!r} "
                                f"(supported: {', '.join(FROM_SAFETENSORS)})")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise reject(path, f"tensor {name!r} has an invalid shape {shape!r}")
        torch_shape = list(shape)
        if code == "F4":  # safetensors counts 4-bit elements; torch packs two per byte
            if not shape or shape[-1] % 2:
                raise reject(path, f"tensor {name!r}: F4 needs an even last dimension, got {shape}")
            torch_shape[-1] //= 2
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise reject(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        expected = expected_nbytes(dtype, torch_shape)
        if offsets[1] - offsets[0] != expected:
            raise reject(path, f"tensor {name!r}: shape {shape} of {code} needs {expected} bytes, "
                                f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        entries.append(SafetensorsEntry(name, dtype, tuple(torch_shape), offsets[0], offsets[1]))
    data_len = file_size - 8 - n
    position = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < position:
            raise reject(path, f"tensor {e.name!r} overlaps the previous tensor (data_offsets {[e.begin, e.end]})")
        if e.begin > position:
            raise reject(path, f"a hole of {e.begin - position} bytes before tensor {e.name!r}")
        position = e.end
    if position > data_len:
        raise reject(path, f"truncated: the tensors need {position} data bytes, the file holds {data_len}")
    if position < data_len:
        raise reject(path, f"{data_len - position} unexpected bytes after the last tensor")
    return SafetensorsHeader(tuple(entries), metadata, 8 + n)


class SafetensorsFile:
    """A validated safetensors file, its tensors mapped read-only (copy-on-write) from disk.

    Use as a context manager; tensors from :meth:`tensors` are valid until it closes."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) == 8:
                n = struct.unpack("<Q", head)[0]
                if n <= MAX_HEADER_BYTES:
                    head += f.read(n)
            self.header = parse_safetensors_header(head, size, path)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def tensors(self) -> "OrderedDict[str, torch.Tensor]":
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        base = self.header.data_start
        for e in self.header.entries:
            dtype = DTYPES[e.dtype]
            if e.end == e.begin:
                out[e.name] = torch.empty(e.shape, dtype=dtype)
            else:
                raw = torch.frombuffer(self._map, dtype=torch.uint8, count=e.end - e.begin, offset=base + e.begin)
                out[e.name] = raw.view(dtype).reshape(e.shape)
        return out

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor still refers to it; the mapping goes with the last one
                pass
            self._map = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
