"""``data.pkl`` of ``checkpoint.pt``: the protocol-2 pickle torch.save writes for the object,
written opcode by opcode from the manifest's skeleton.

torch.save pickles with ``pickle.Pickler`` and two hooks (``persistent_id`` for storages, a
reducer for tensors). Driving that Pickler from Python calls a hook for every object pickled,
19 calls per tensor: 0.25 s for a version of 40,000 tensors, paid on the first ``stat`` of its
files. This module writes the same bytes directly, a template per tensor. It mirrors what
CPython's C Pickler (Modules/_pickle.c, protocol 2) does with the tree ``unflatten`` builds:

* memo: every str, non-empty tuple, list, dict and reduced object is memoized (BINPUT, or
  LONG_BINPUT from index 256), in the order it is pickled; a str or tensor met again is a BINGET
  of its first memo index (by identity: the skeleton's own str objects, as ``unflatten`` reuses
  them). Globals are memoized on first use;
* containers: an exact dict writes its items in batches of 1,000 between MARK and SETITEMS,
  with one more (empty) batch when the count is a multiple of 1,000, and a lone item as SETITEM;
  an OrderedDict goes through ``__reduce__``'s item iterator: batches of up to 1,000, a lone
  trailing item as SETITEM; a list: batches of 1,000 (APPENDS), a lone item as APPEND;
* a tensor: ``_rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())`` (legacy
  storage dtypes, counted in elements) or ``_rebuild_tensor_v3(..., dtype)`` (UntypedStorage,
  counted in bytes), the storage as the persistent id ``("storage", class, key, "cpu", count)``.

``tests/test_views.py`` holds it byte for byte to a reference Pickler with those hooks, on
generated skeletons, and to torch.save itself.
"""
from __future__ import annotations

import functools
import pickle
import struct
import sys

from ckptfs import _native, leaves
from ckptfs.manifest import Manifest
from ckptfs.skeleton import tensor_leaf

PICKLE_PROTOCOL = 2

# The globals data.pkl names, as (module, name): what pickle writes for torch's objects
# (tests/test_views.py holds each to pickle of the object itself), so that the mount and the CLI
# write checkpoint.pt without importing torch. torch pickles these dtypes through their legacy
# typed-storage class (in module torch) and _rebuild_tensor_v2 (torch.storage.
# _dtype_to_storage_type_map, frozen: "we should no longer add dtypes to this map"); every other
# dtype goes through UntypedStorage, _rebuild_tensor_v3 and an explicit dtype (torch.<name>).
LEGACY_STORAGE: dict[str, tuple[str, str]] = {dtype: ("torch", name) for dtype, name in {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage"}.items()}
UNTYPED_STORAGE = ("torch.storage", "UntypedStorage")
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
ORDERED_DICT = ("collections", "OrderedDict")
TORCH_SIZE = ("torch", "Size")
TORCH_DEVICE = ("torch", "device")
NUMPY_NDARRAY = ("numpy", "ndarray")
NUMPY_DTYPE = ("numpy", "dtype")
CODECS_ENCODE = ("_codecs", "encode")  # protocol 2 has no bytes opcode: encode(text, "latin1")
EMPTY_BYTES = ("__builtin__", "bytes")  # b"": bytes()


@functools.lru_cache(maxsize=None)
def numpy_core() -> str:
    """The module numpy's arrays and scalars pickle their constructors from: ``numpy._core.
    multiarray`` since numpy 2 (which still loads ``numpy.core`` ones), ``numpy.core.multiarray``
    before. Read from the installed numpy's version, without importing it (the mount needs no numpy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("numpy").split(".")[0])
    except (PackageNotFoundError, ValueError):
        major = 2
    return "numpy._core.multiarray" if major >= 2 else "numpy.core.multiarray"


def dtype_global(dtype: str) -> tuple[str, str]:
    """The global a torch dtype of this name pickles as."""
    return "torch", dtype


_BATCH = 1000  # pickle's BATCHSIZE
_LITTLE_ENDIAN = sys.byteorder == "little"
_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}  # TUPLE1..3


def pickle_skeleton(manifest: Manifest) -> tuple[bytes, list[int]]:
    """``data.pkl`` for the manifest's object, and the tensor indices in storage-key order
    (the order of first use, as torch.save numbers its storages)."""
    writer = _Writer(manifest)
    writer.out += b"\x80\x02"  # PROTO 2
    writer.save(manifest.skeleton)
    writer.out += b"."  # STOP
    return bytes(writer.out), writer.storage_order


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``, exactly as torch computes them (a dimension
    of size 0 counts as 1, so ``(2, 0, 3)`` gives ``(3, 3, 1)``)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _put_op(n: int) -> bytes:
    """BINPUT n (LONG_BINPUT from 256)."""
    return b"q" + bytes((n,)) if n < 256 else b"r" + struct.pack("<I", n)


_U32 = struct.Struct("<I")
_long_put_op = functools.partial(struct.Struct("<cI").pack, b"r")  # LONG_BINPUT n, a C call


def _get_op(n: int) -> bytes:
    """BINGET n (LONG_BINGET from 256)."""
    return b"h" + bytes((n,)) if n < 256 else b"j" + struct.pack("<I", n)


def _int_op(x: int) -> bytes:
    """The shortest protocol-2 int opcode, as the Pickler chooses it."""
    if 0 <= x <= 0xFF:
        return b"K" + bytes((x,))
    if 0 <= x <= 0xFFFF:
        return b"M" + struct.pack("<H", x)
    if -0x80000000 <= x <= 0x7FFFFFFF:
        return b"J" + struct.pack("<i", x)
    raw = pickle.encode_long(x)
    return (b"\x8a" + bytes((len(raw),)) if len(raw) < 256 else b"\x8b" + struct.pack("<i", len(raw))) + raw


def _int_tuple_op(values: tuple[int, ...]) -> bytes:
    """A tuple of ints up to (not with) its BINPUT; EMPTY_TUPLE, never memoized, when empty."""
    if not values:
        return b")"
    body = b"".join(map(_int_op, values))
    return b"(" + body + b"t" if len(values) > 3 else body + _TUPLE_N[len(values)]


@functools.lru_cache(maxsize=None)
def global_opcode(name: tuple[str, str]) -> bytes:
    """GLOBAL "module\\nname\\n" of a (module, name)."""
    module, qualname = name
    return b"c" + module.encode() + b"\n" + qualname.encode() + b"\n"


class _Writer:
    """One pickling pass; ``out`` collects the bytes."""

    def __init__(self, manifest: Manifest):
        self.tensors = tuple(manifest.tensors)  # (no copy of a tuple) the native writer wants one
        self.out = bytearray()
        self.memo_size = 0
        # id of a str -> its memo index: the skeleton's strs, and the interned "storage" and "cpu"
        # of every persistent id (the same objects as a skeleton's interned "cpu", if any)
        self.memo: dict[int, int] = {}
        self.named_memo: dict[object, int] = {}  # a global -> its memo index
        self.tensor_memo: dict[int, int] = {}  # tensor index -> memo index of the rebuilt tensor
        self.storage_order: list[int] = []
        self.templates: dict[str, tuple] = {}  # dtype name -> its tensors' fixed opcodes (save_tensor)
        self.shape_ops: dict[tuple, tuple[bytes, bytes]] = {}  # shape -> its and its strides' tuple opcodes

    # -- memo
    def put(self) -> int:
        n = self.memo_size
        self.out += _put_op(n)
        self.memo_size = n + 1
        return n

    def get(self, n: int) -> None:
        self.out += _get_op(n)

    def save_global(self, obj) -> None:
        n = self.named_memo.get(obj)
        if n is not None:
            self.get(n)
            return
        self.out += global_opcode(obj)
        self.named_memo[obj] = self.put()

    # -- atoms
    def save_new_str(self, text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
        self.put()

    def save_str(self, text: str) -> None:
        n = self.memo.get(id(text))
        if n is not None:
            self.get(n)
            return
        self.save_new_str(text)
        self.memo[id(text)] = self.memo_size - 1

    def save_int(self, x: int) -> None:
        self.out += _int_op(x)

    def save_int_tuple(self, values: tuple[int, ...]) -> None:
        """A fresh tuple of ints (a shape or stride)."""
        self.out += _int_tuple_op(values)
        if values:
            self.put()

    # -- the skeleton
    def save(self, node: dict) -> None:
        (kind, value), = node.items()
        if kind == "tensor":
            self.save_tensor(value)
        elif kind == "str":
            self.save_str(value)
        elif kind == "int":
            self.save_int(int(value))
        elif kind == "float":
            self.out += b"G" + struct.pack(">d", float.fromhex(value))
        elif kind == "bool":
            self.out += b"\x88" if value else b"\x89"
        elif kind == "none":
            self.out += b"N"
        elif kind == "list":
            self.out += b"]"  # EMPTY_LIST
            self.put()
            self.save_list_items(value)
        elif kind == "tuple":
            self.save_tuple(value)
        elif kind == "dict":
            self.out += b"}"  # EMPTY_DICT
            self.put()
            self.save_dict_items(value)
        elif kind == "odict":
            self.save_global(ORDERED_DICT)
            self.out += b")R"  # OrderedDict()
            self.put()
            self.save_odict_items(value)
        elif kind in leaves.KINDS:
            self.save_leaf(kind, value)
        else:
            raise ValueError(f"unknown skeleton node kind {kind!r}")

    # -- torch's and numpy's small objects (ckptfs.leaves), as their own __reduce__ pickles them.
    # What pickle memoizes by identity is modelled on the objects leaves.decode builds: torch
    # dtypes, numpy's native dtypes, its bool scalars, bytes of 0 or 1 byte and 1-character strs are
    # singletons (BINGET when met again); other strs, tuples and arrays are new objects.
    def save_leaf(self, kind: str, value) -> None:
        if kind == "dtype":
            self.save_global(dtype_global(value))
            return
        if kind == "size":
            self.save_global(TORCH_SIZE)
            self.save_int_tuple(tuple(value))
            self.out += b"\x85"  # TUPLE1: the args
            self.put()
        elif kind == "device":
            self.save_global(TORCH_DEVICE)
            self.save_new_str(value[0])
            if value[1] is not None:
                self.save_int(value[1])
            self.out += b"\x86" if value[1] is not None else b"\x85"
            self.put()
        elif kind == "npscalar":
            singleton = ("npscalar", value["data"]) if value["dtype"] == "|b1" else None  # np.True_, np.False_
            if self.get_named(singleton):
                return
            self.save_global((numpy_core(), "scalar"))
            self.save_numpy_dtype(value["dtype"])
            self.save_bytes(leaves.raw_bytes(value))
            self.reduce2(singleton)
            return
        else:  # ndarray: _reconstruct(ndarray, (0,), b"b"), then its state by BUILD
            self.save_global((numpy_core(), "_reconstruct"))
            self.save_global(NUMPY_NDARRAY)
            self.out += b"K\x00\x85"  # (0,)
            self.put()
            self.save_bytes(b"b")
            self.out += b"\x87"
            self.put()
            self.out += b"R"
            self.put()
            self.out += b"(K\x01"  # MARK, version 1
            self.save_int_tuple(tuple(value["shape"]))
            self.save_numpy_dtype(value["dtype"])
            self.out += b"\x88" if value["fortran"] else b"\x89"
            self.save_bytes(leaves.raw_bytes(value))
            self.out += b"t"
            self.put()
            self.out += b"b"  # BUILD
            return
        self.out += b"R"
        self.put()

    def get_named(self, key) -> bool:
        """BINGET of a singleton already pickled under ``key`` (True), or False."""
        n = self.named_memo.get(key) if key is not None else None
        if n is None:
            return False
        self.get(n)
        return True

    def save_numpy_dtype(self, code: str) -> None:
        """numpy.dtype(code[1:], False, True) with its state (3, byte order, None, None, None,
        -1, -1, 0); the dtypes of the native byte order are singletons."""
        singleton = ("npdtype", code) if code[0] in "|" + ("<" if _LITTLE_ENDIAN else ">") else None
        if self.get_named(singleton):
            return
        self.save_global(NUMPY_DTYPE)
        self.save_new_str(code[1:])
        self.out += b"\x89\x88\x87"  # False, True, TUPLE3
        self.put()
        self.out += b"R"
        n = self.put()
        self.out += b"(K\x03"
        self.save_str(code[0])  # a 1-character str: a singleton
        self.out += b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"
        self.put()
        self.out += b"b"
        if singleton:
            self.named_memo[singleton] = n

    def save_bytes(self, data: bytes) -> None:
        """bytes as protocol 2 pickles them: ``bytes()`` for b"" and ``_codecs.encode(text,
        "latin1")`` for the others; bytes of 0 or 1 byte are singletons."""
        singleton = ("bytes", data) if len(data) <= 1 else None
        if self.get_named(singleton):
            return
        if not data:
            self.save_global(EMPTY_BYTES)
            self.out += b")R"
            self.named_memo[singleton] = self.put()
            return
        self.save_global(CODECS_ENCODE)
        text = data.decode("latin1")
        if len(text) == 1:
            self.save_str(text)  # a 1-character str: a singleton, memoized by identity
        else:
            self.save_new_str(text)
        self.save_str("latin1")  # the Pickler's own interned "latin1"
        self.reduce2(singleton)

    def reduce2(self, singleton) -> None:
        """TUPLE2 of the two arguments just written and REDUCE, the result memoized (under
        ``singleton`` too, where it is one)."""
        self.out += b"\x86"
        self.put()
        self.out += b"R"
        n = self.put()
        if singleton:
            self.named_memo[singleton] = n

    def save_items(self, pairs: list) -> None:
        """Dict items in order: runs of the usual ones (a str key, a tensor whose dtype has its
        template) by _native.pickle_tensor_items, the same bytes as ``save_item`` writes; each
        other item here."""
        i = 0
        while i < len(pairs):
            i, self.memo_size = _native.pickle_tensor_items(self.out, pairs, i, self.memo, self.tensor_memo,
                                                            self.storage_order, self.tensors, self.templates,
                                                            self.memo_size)
            if i < len(pairs):
                self.save_item(*pairs[i])
                i += 1

    def save_item(self, key: dict, value: dict) -> None:
        """A dict item; the usual one (a str key, a tensor value) without ``save``'s dispatch."""
        text = key.get("str")
        if type(text) is str and len(key) == 1:
            n = self.memo.get(id(text))
            if n is None:  # save_str, inline: once per key of a large state dict
                raw = text.encode("utf-8", "surrogatepass")
                n = self.memo[id(text)] = self.memo_size
                self.memo_size = n + 1
                self.out += b"".join((b"X", _U32.pack(len(raw)), raw, _put_op(n)))
            else:
                self.get(n)
        else:
            self.save(key)
        index = tensor_leaf(value)
        if index is None:
            self.save(value)
        else:
            self.save_tensor(index)

    def save_tuple(self, items: list) -> None:
        if not items:
            self.out += b")"
            return
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self.save(item)
        self.out += _TUPLE_N.get(len(items), b"t")
        self.put()

    def save_list_items(self, items: list) -> None:
        if len(items) == 1:
            self.save(items[0])
            self.out += b"a"  # APPEND
            return
        for start in range(0, len(items), _BATCH):
            self.out += b"("
            for item in items[start:start + _BATCH]:
                self.save(item)
            self.out += b"e"  # APPENDS

    def save_dict_items(self, pairs: list) -> None:
        if not pairs:
            return
        if len(pairs) == 1:
            self.save(pairs[0][0])
            self.save(pairs[0][1])
            self.out += b"s"  # SETITEM
            return
        # _pickle.c batch_dict_exact: MARK..SETITEMS while the last batch was full, so a count
        # that is a multiple of 1,000 ends with an empty batch
        for start in range(0, len(pairs) + 1, _BATCH):
            self.out += b"("
            self.save_items(pairs[start:start + _BATCH])
            self.out += b"u"  # SETITEMS

    def save_odict_items(self, pairs: list) -> None:
        # _pickle.c batch_dict over an item iterator: a lone item (alone or left after full
        # batches) is a SETITEM, others MARK..SETITEMS, never an empty batch
        for start in range(0, len(pairs), _BATCH):
            batch = pairs[start:start + _BATCH]
            if len(batch) > 1:
                self.out += b"("
            self.save_items(batch)
            self.out += b"u" if len(batch) > 1 else b"s"

    def save_tensor(self, index: int) -> None:
        n = self.tensor_memo.get(index)
        if n is not None:
            self.get(n)
            return
        record = self.tensors[index]
        template = self.templates.get(record.dtype)
        if template is None:
            self.save_first_tensor(index)  # of its dtype: memoizes the globals the template gets
            return
        # what save_first_tensor writes, once every global it uses is memoized: the fixed parts
        # of the dtype's template, with the storage key, count, shape and memo indices filled in
        head, mid, hooks, args_end, legacy = template
        key = str(len(self.storage_order)).encode()
        self.storage_order.append(index)
        shape = record.shape
        shape_ops = self.shape_ops.get(shape)
        if shape_ops is None:
            shape_ops = self.shape_ops[shape] = (_int_tuple_op(tuple(shape)), _int_tuple_op(contiguous_strides(shape)))
        n = self.memo_size
        put = _put_op if n < 256 else _long_put_op  # past 255 every put is a LONG_BINPUT
        pieces = [head, b"X", _U32.pack(len(key)), key, put(n), mid,
                  _int_op(record.numel if legacy else record.nbytes), b"t", put(n + 1), b"QK\x00"]
        n += 2
        for op in shape_ops:
            pieces.append(op)
            if op != b")":
                pieces.append(put(n))
                n += 1
        pieces += (hooks, put(n), args_end, put(n + 1), b"R", put(n + 2))
        self.out += b"".join(pieces)
        self.memo_size = n + 3
        self.tensor_memo[index] = n + 2

    def save_first_tensor(self, index: int) -> None:
        """A tensor op by op; then the template of its dtype (for ``save_tensor``)."""
        record = self.tensors[index]
        legacy = LEGACY_STORAGE.get(record.dtype)
        rebuild = REBUILD_TENSOR_V2 if legacy else REBUILD_TENSOR_V3
        self.save_global(rebuild)
        self.out += b"(("  # MARK of the arguments, MARK of the persistent id
        self.save_str("storage")  # one interned object, as in torch's hook: memoized once
        self.save_global(legacy or UNTYPED_STORAGE)
        self.save_new_str(str(len(self.storage_order)))  # storage key, in order of first use
        self.storage_order.append(index)
        self.save_str("cpu")
        self.save_int(record.numel if legacy else record.nbytes)  # typed storages count elements
        self.out += b"t"
        self.put()
        self.out += b"QK\x00"  # BINPERSID, storage offset 0
        self.save_int_tuple(tuple(record.shape))
        self.save_int_tuple(contiguous_strides(record.shape))
        self.out += b"\x89"  # requires_grad False
        self.save_global(ORDERED_DICT)
        self.out += b")R"  # backward hooks: OrderedDict()
        self.put()
        if not legacy:
            self.save_global(dtype_global(record.dtype))
        self.out += b"t"
        self.put()
        self.out += b"R"
        self.tensor_memo[index] = self.put()
        get, memo = self.named_memo.__getitem__, self.memo
        self.templates[record.dtype] = (
            _get_op(get(rebuild)) + b"((" + _get_op(memo[id("storage")]) + _get_op(get(legacy or UNTYPED_STORAGE)),
            _get_op(memo[id("cpu")]),
            b"\x89" + _get_op(get(ORDERED_DICT)) + b")R",
            (b"" if legacy else _get_op(get(dtype_global(record.dtype)))) + b"t",
            legacy)
