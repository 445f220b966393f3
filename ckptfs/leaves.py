"""Skeleton leaves for the objects of torch and numpy that training checkpoints carry beside their
tensors: ``torch.Size``, ``torch.dtype`` and ``torch.device`` (torch.load(weights_only=True)
accepts them), numpy arrays and scalars (numpy's RNG state, metrics computed with numpy).

The one home of each such node: what a saved object becomes (``encode``, on the torch side),
what a read node must look like (``check``, without torch or numpy: a hostile index is refused
before anything is built from it) and the object it gives back (``decode``). The pickle of
``checkpoint.pt`` writes them from the same fields (ckptfs.views.torchpickle).

Nodes (see ckptfs.manifest for the others)::

  {"size": [n, ...]}                                   torch.Size
  {"dtype": "float16"}                                 torch.float16 (a name of manifest.ITEMSIZE)
  {"device": ["cuda", 0]}, {"device": ["cpu", null]}   torch.device(type, index)
  {"ndarray": {"dtype": "<u4", "shape": [624], "fortran": false, "data": BASE64}}
  {"npscalar": {"dtype": "<i8", "data": BASE64}}       numpy.int64(...) and the like

A numpy array lives in the index, inline (its bytes in base64): it is meant for small state such
as an RNG's; one above ``MAX_NDARRAY_BYTES`` is refused with the advice to save it as a tensor.
Numpy dtypes: bool, signed and unsigned integers, floats of 2, 4 and 8 bytes, complex of 8 and 16,
in either byte order.
"""
from __future__ import annotations

import base64
import binascii
import math
import re
import struct
import sys
from typing import Any

from ckptfs.errors import MalformedInputError, UnsupportedObjectError

KINDS = frozenset({"size", "dtype", "device", "ndarray", "npscalar"})
MAX_NDARRAY_BYTES = 1 << 20  # inline in the index, which every open of the version reads whole
_MAX_NDIM = 64  # numpy's own limit
_NATIVE = "<" if sys.byteorder == "little" else ">"
_MAX_DEVICE_INDEX = 127  # torch's device index is 8 bits: torch.device("cuda", 128) is cuda:-128
_NUMPY_DTYPE = re.compile(r"(\|(b1|i1|u1)|[<>](i[248]|u[248]|f[248]|c8|c16))\Z")
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
# struct codes of the numpy dtypes (without the byte order), for values shown without numpy
_STRUCT = {"b1": "?", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q", "u8": "Q",
           "f2": "e", "f4": "f", "f8": "d"}


def encode(obj: Any, where: str) -> dict | None:
    """The node of ``obj`` when it is one of this module's objects, else None. Raises
    UnsupportedObjectError (naming ``where``, the object's path) for such an object that cannot
    be stored: a dtype or numpy dtype outside the supported ones, an array too large to be inline."""
    module = type(obj).__module__
    if module.startswith("numpy"):
        return _encode_numpy(obj, where)
    if not module.startswith("torch"):
        return None
    import torch

    from ckptfs.flatten import DTYPE_NAMES

    if type(obj) is torch.Size:
        return _checked({"size": [int(n) for n in obj]}, obj, where)
    if isinstance(obj, torch.dtype):
        name = DTYPE_NAMES.get(obj)
        if name is None:
            raise UnsupportedObjectError(f"{where}: dtype {obj} cannot be stored; store its name as a str")
        return {"dtype": name}
    if isinstance(obj, torch.device):
        return _checked({"device": [obj.type, obj.index]}, obj, where)
    return None


def _checked(node: dict, obj: Any, where: str) -> dict:
    """``node`` where ``check`` admits it (what a load will read), else UnsupportedObjectError:
    nothing is saved that its load would refuse."""
    (kind, value), = node.items()
    try:
        check(kind, value, data=False)  # the fields; the data is encode's own base64
    except MalformedInputError as e:
        raise UnsupportedObjectError(f"{where}: {obj!r:.60} cannot be stored ({e})") from None
    return node


def _encode_numpy(obj: Any, where: str) -> dict | None:
    import numpy as np

    if isinstance(obj, np.ndarray):
        if type(obj) is not np.ndarray:
            raise UnsupportedObjectError(f"{where}: {type(obj).__name__} is not supported; convert it with np.asarray")
        code = _numpy_dtype_code(obj.dtype, where)
        if obj.nbytes > MAX_NDARRAY_BYTES:
            raise UnsupportedObjectError(
                f"{where}: a numpy array of {obj.nbytes} bytes is stored in the index, which takes up to "
                f"{MAX_NDARRAY_BYTES}; save a large array as a tensor (torch.from_numpy(array))")
        # numpy's own pickle: Fortran order where the array is Fortran- and not C-contiguous
        fortran = bool(obj.flags.f_contiguous and not obj.flags.c_contiguous)
        data = obj.tobytes(order="F" if fortran else "C")
        return _checked({"ndarray": {"dtype": code, "shape": [int(n) for n in obj.shape], "fortran": fortran,
                                     "data": base64.b64encode(data).decode("ascii")}}, obj, where)
    if isinstance(obj, (str, bytes)):  # np.str_, np.bytes_: a str is stored as its base value
        return None
    if isinstance(obj, np.generic):
        code = _numpy_dtype_code(obj.dtype, where)
        raw = (b"\1" if obj else b"\0") if code == "|b1" else obj.tobytes()  # a bool's byte may be any non-zero
        return _checked({"npscalar": {"dtype": code, "data": base64.b64encode(raw).decode("ascii")}}, obj, where)
    return None


def numpy_safe_globals() -> list:
    """What torch.load(weights_only=True) must allow for the numpy arrays and scalars this
    module stores (numpy's constructors and its numeric dtype classes); nothing that runs code.
    Others (object or structured arrays, datetimes) stay refused."""
    import numpy as np

    core = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    codes = ["|b1", "|i1", "|u1"] + [f"<{k}{n}" for k in "iu" for n in (2, 4, 8)] + ["<f2", "<f4", "<f8", "<c8", "<c16"]
    # a file torch.save wrote under numpy 1 names numpy.core.multiarray (numpy 2's is numpy._core)
    old_names = [(core._reconstruct, "numpy.core.multiarray._reconstruct"), (core.scalar, "numpy.core.multiarray.scalar")]
    # an empty array's state holds b"", which a protocol-2 pickle builds through __builtin__.bytes
    # (torch reads that name as builtins.bytes; torch.save's own file needs it too)
    empty = [bytes]
    return [core._reconstruct, core.scalar, *old_names, *empty, np.ndarray, np.dtype, *{type(np.dtype(c)) for c in codes}]


def _numpy_dtype_code(dtype, where: str) -> str:
    code = dtype.str
    if not _NUMPY_DTYPE.match(code) or dtype.names is not None or dtype.subdtype is not None:
        raise UnsupportedObjectError(
            f"{where}: numpy dtype {dtype} cannot be stored; ckptfs stores numpy arrays of bool, integers, "
            "float16/32/64 and complex64/128 (convert it, e.g. to a tensor or a plain value)")
    return code


def check(kind: str, value: Any, *, data: bool = True) -> None:
    """Raise MalformedInputError unless ``{kind: value}`` is a well-formed node of this module.
    ``data`` False: an array's bytes are taken as they are (``encode`` made them, canonical)."""
    if kind == "size":
        if not isinstance(value, list) or len(value) > _MAX_NDIM or not all(_is_count(n) for n in value):
            raise MalformedInputError(f"skeleton size node holds {value!r:.40}")
    elif kind == "dtype":
        from ckptfs.manifest import ITEMSIZE

        if not isinstance(value, str) or value not in ITEMSIZE:
            raise MalformedInputError(f"skeleton dtype node holds {value!r:.40}")
    elif kind == "device":
        if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
                or not _DEVICE_TYPE.match(value[0])
                or not (value[1] is None or (_is_count(value[1]) and value[1] <= _MAX_DEVICE_INDEX))):
            raise MalformedInputError(f"skeleton device node holds {value!r:.40}")
    elif kind in ("ndarray", "npscalar"):
        fields = {"dtype", "data", "shape", "fortran"} if kind == "ndarray" else {"dtype", "data"}
        if not isinstance(value, dict) or set(value) != fields:
            raise MalformedInputError(f"skeleton {kind} node holds {value!r:.60}")
        shape = value.get("shape", [])
        if kind == "ndarray" and (not isinstance(value["fortran"], bool) or not isinstance(shape, list)
                                  or len(shape) > _MAX_NDIM or not all(_is_count(n) for n in shape)):
            raise MalformedInputError(f"skeleton ndarray node has shape {shape!r:.40}")
        code = value["dtype"]
        if not isinstance(code, str) or not _NUMPY_DTYPE.match(code) or (
                kind == "npscalar" and code[0] not in ("|", _NATIVE)):  # a scalar's dtype is native
            raise MalformedInputError(f"skeleton {kind} node has numpy dtype {code!r:.20}")
        itemsize = int(code[2:])
        expected = math.prod(shape) * itemsize
        if expected > MAX_NDARRAY_BYTES or math.prod(max(n, 1) for n in shape) * itemsize >= 1 << 62:
            raise MalformedInputError(f"skeleton {kind} node of shape {shape!r:.40} is too large")
        if data:
            _check_data(kind, code, value["data"], expected)
    else:
        raise MalformedInputError(f"unknown skeleton node kind {kind!r:.40}")


def _check_data(kind: str, code: str, data: Any, expected: int) -> None:
    """An array's or scalar's data: canonical base64 of exactly ``expected`` bytes."""
    if not isinstance(data, str) or len(data) != 4 * -(-expected // 3):
        raise MalformedInputError(f"skeleton {kind} node holds {len(data) if isinstance(data, str) else data!r:.20} "
                                  f"characters of data for {expected} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise MalformedInputError(f"skeleton {kind} node's data is not base64") from None
    # canonical base64 of exactly the bytes: what encode wrote, nothing a pickle would differ on
    if len(raw) != expected or base64.b64encode(raw).decode("ascii") != data:
        raise MalformedInputError(f"skeleton {kind} node's data is not the base64 of {expected} bytes")
    if kind == "npscalar" and code == "|b1" and raw not in (b"\0", b"\1"):
        raise MalformedInputError("skeleton npscalar node holds a bool that is neither 0 nor 1")


def _is_count(n: Any) -> bool:
    return type(n) is int and 0 <= n < 1 << 63


def decode(kind: str, value: Any) -> Any:
    """The object of a node of this module (``check``-ed), built with torch or numpy."""
    if kind in ("ndarray", "npscalar"):
        import numpy as np

        dtype = np.dtype(value["dtype"])
        flat = np.frombuffer(raw_bytes(value), dtype=dtype)
        if kind == "npscalar":
            return flat[0]
        order = "F" if value["fortran"] else "C"
        return flat.reshape(value["shape"], order=order).copy(order=order)  # writable, its own memory
    import torch

    if kind == "size":
        return torch.Size(value)
    if kind == "dtype":
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise MalformedInputError(f"torch {torch.__version__} has no dtype {value!r}: load it with a newer torch")
        return dtype
    if kind == "device":
        try:
            return torch.device(*value) if value[1] is not None else torch.device(value[0])
        except RuntimeError as e:
            raise MalformedInputError(f"skeleton device node {value!r:.40}: {e}") from None
    raise MalformedInputError(f"unknown skeleton node kind {kind!r:.40}")


def raw_bytes(value: dict) -> bytes:
    """The bytes of a (checked) ndarray or npscalar node, as numpy's ``tobytes`` gave them."""
    return base64.b64decode(value["data"])


def plain_value(kind: str, value: Any) -> Any:
    """A JSON-able stand-in of a node of this module, without torch or numpy (metadata.json): a
    size as its list, a numpy scalar as its number, the others as a short text."""
    if kind == "size":
        return list(value)
    if kind == "dtype":
        return f"torch.{value}"
    if kind == "device":
        return value[0] if value[1] is None else f"{value[0]}:{value[1]}"
    if kind == "npscalar":
        code = value["dtype"]
        raw = raw_bytes(value)
        if code[1] == "c":
            half = len(raw) // 2
            fmt = ("<" if code[0] != ">" else ">") + ("f" if half == 4 else "d")
            return str(complex(struct.unpack(fmt, raw[:half])[0], struct.unpack(fmt, raw[half:])[0]))
        return struct.unpack(("<" if code[0] != ">" else ">") + _STRUCT[code[1:]], raw)[0]
    if kind == "ndarray":
        return f"<ndarray {value['dtype']} {tuple(value['shape'])}>"
    raise MalformedInputError(f"unknown skeleton node kind {kind!r:.40}")
