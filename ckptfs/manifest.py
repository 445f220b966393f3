"""What a checkpoint holds, independent of where its bytes live.

A saved object is split in two (``flatten``):
  * the **tensors**, each stored once as raw contiguous bytes (``TensorRecord``);
  * the **skeleton**: the nested structure with every tensor replaced by a reference to its
    record, and every plain leaf stored in a JSON encoding, never pickle (``ckptfs.skeleton``).

The manifest (records + skeleton + identity of the version) is encoded as JSON with fixed-width
CRC fields, so its length is known before the data is written and the CRCs are filled in at
commit without moving anything (see docs/FORMAT.md).
"""
from __future__ import annotations

import functools
import json
import math
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptfs.checksum import crc32_combine
from ckptfs.errors import MalformedInputError, UnsupportedObjectError
from ckptfs.gcpause import paused_gc
from ckptfs.skeleton import check_skeleton, ref_names, tensor_refs, unflatten
from ckptfs.units import human_bytes

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = 1
TENSOR_ALIGN_BYTES = 64
# A tensor larger than this also has the CRC32 of each block this size of its bytes (counted from
# its first byte; the last block shorter), so that a read of part of it checks only the blocks
# under the read: one row of a shard for a resharded load, a 4 KiB read through the mount.
CRC_BLOCK_BYTES = 4 << 20

# Every dtype torch has that is plain bytes in memory, and its bytes per element (the tables of
# torch's dtype objects are ckptfs.flatten's: reading an index needs no torch, so neither do
# `ckptfs ls`, `status` and the rest of the CLI's listing). Quantized and bit-packed placeholder
# dtypes (qint8, bits8, ...) carry out-of-band state and are rejected with a clear error.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
_torch_dtypes: dict | None = None  # ckptfs.flatten.DTYPES, once a record's torch dtype is asked for


class TensorRecord(NamedTuple):
    """One stored tensor: ``nbytes`` contiguous bytes at ``offset`` from the version's data start.
    (A named tuple: an index holds tens of thousands, decoded on every open of a version.)"""

    name: str  # dotted path of its first reference in the object, unique within the version
    dtype: str  # torch dtype name, e.g. "bfloat16" (a key of ITEMSIZE)
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int = 0
    block_crcs: tuple[int, ...] = ()  # block_count(nbytes, Manifest.crc_block_bytes) CRC32s, else none

    def block_span(self, crc_block_bytes: int, start: int, end: int) -> range:
        """The numbers of the blocks that hold bytes ``[start, end)`` of the tensor (counted from
        its first byte, clipped to it), ``crc_block_bytes`` the manifest's; empty where it has
        no blocks."""
        if not self.block_crcs or end <= start:
            return range(0)
        return range(max(start, 0) // crc_block_bytes, min(-(-end // crc_block_bytes), len(self.block_crcs)))

    @property
    def torch_dtype(self) -> torch.dtype:
        global _torch_dtypes
        if _torch_dtypes is None:
            from ckptfs.flatten import DTYPES

            _torch_dtypes = DTYPES
        try:
            return _torch_dtypes[self.dtype]
        except KeyError:
            raise UnsupportedObjectError(f"tensor {self.name!r} is {self.dtype}, which this torch "
                                         f"({_torch_version()}) does not have: load it with a newer torch") from None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorRef(NamedTuple):
    """One occurrence of a stored tensor in the object (tied weights give several per tensor)."""

    name: str  # dotted path, unique among refs
    key_path: tuple[str, ...]
    tensor_index: int


@dataclass(frozen=True)
class Manifest:
    """The index of one version: identity, tensor records, skeleton."""

    model: str
    step: int
    counter: int
    time_ns: int
    tensors: tuple[TensorRecord, ...]
    skeleton: dict
    data_bytes: int = 0
    files: tuple[tuple[str, str], ...] = ()  # small text files saved beside the object (name, text)
    crc_block_bytes: int = 0  # the block size of the records' block_crcs; 0 where none has blocks
    # dumps_compact(skeleton) where the writer already has it (a cached save plan); not compared
    skeleton_json: str | None = field(default=None, compare=False, repr=False)

    def refs(self) -> tuple[TensorRef, ...]:
        """Every tensor occurrence in skeleton order, with unique dotted names (computed once per
        manifest: every view of a version walks them)."""
        cached = self.__dict__.get("_refs")
        if cached is not None:
            return cached
        found: list[tuple[tuple[str, ...], int]] = []
        tensor_refs(self.skeleton, (), found)
        refs = tuple(TensorRef(name, key_path, index) for name, (key_path, index) in zip(ref_names(found), found))
        object.__setattr__(self, "_refs", refs)  # a memo of the frozen fields, not a field
        return refs

    def refs_under(self, key: str) -> tuple[TensorRef, ...]:
        """``refs()`` under top-level key ``key`` (as ``TensorRef.key_path[0]``), from one pass
        over them per manifest: a file per key that each walked every ref took minutes to list
        a version of 8,000 keys."""
        by_key = self.__dict__.get("_refs_by_key")
        if by_key is None:
            grouped: dict[str, list[TensorRef]] = {}
            for ref in self.refs():
                if ref.key_path:
                    grouped.setdefault(ref.key_path[0], []).append(ref)
            by_key = {k: tuple(v) for k, v in grouped.items()}
            object.__setattr__(self, "_refs_by_key", by_key)  # a memo, as refs()'s
        return by_key.get(key, ())

    def plain_part(self) -> Any:
        """The object with every tensor replaced by the string ``"<tensor NAME>"`` (for metadata)."""
        return unflatten(self.skeleton, [f"<tensor {t.name}>" for t in self.tensors])

    def encode(self, tensors_json: str | bytes | None = None) -> bytes:
        """Canonical JSON; its length does not depend on the CRC values. ``tensors_json``:
        ``encode_tensors`` of this manifest's records made earlier (with any CRCs: only the
        length is needed) or with the CRCs to store (``EncodedTensors.with_crcs``), instead of
        the records' own."""
        head, tensors_json, skeleton = self._parts(tensors_json)
        if isinstance(tensors_json, str):
            tensors_json = tensors_json.encode()
        # the same bytes as one json.dumps of the whole document, built from its parts so that
        # the part that only changes with the object's structure can be reused
        return b"".join((head[:-1].encode(), b',"tensors":', tensors_json, b',"skeleton":', skeleton.encode(), b"}"))

    def encoded_length(self, tensors_json: str | bytes | None = None) -> int:
        """``len(self.encode(tensors_json))``, without building the document."""
        head, tensors_json, skeleton = self._parts(tensors_json)
        # ASCII only (ensure_ascii), so characters and bytes count the same
        return len(head) - 1 + len(',"tensors":') + len(tensors_json) + len(',"skeleton":') + len(skeleton) + 1

    def _parts(self, tensors_json: str | bytes | None) -> tuple[str, str | bytes, str]:
        doc = {
            "format": MANIFEST_FORMAT,
            "model": self.model,
            "step": self.step,
            "counter": self.counter,
            "time_ns": self.time_ns,
            "data_bytes": self.data_bytes,
        }
        if self.files:  # only when present: a manifest without files keeps its bytes
            doc["files"] = dict(self.files)
        if self.crc_block_bytes:  # likewise: a manifest without blocks is as ckptfs wrote it before
            doc["crc_block_bytes"] = self.crc_block_bytes
        head = dumps_compact(doc)
        if tensors_json is None:
            tensors_json = encode_tensors(self.tensors)
        skeleton = self.skeleton_json if self.skeleton_json is not None else dumps_compact(self.skeleton)
        return head, tensors_json, skeleton

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        """Parse and validate a manifest; raises MalformedInputError on anything inconsistent."""
        with paused_gc():
            return cls._decode(raw)

    @classmethod
    def _decode(cls, raw: bytes) -> "Manifest":
        # Strict: a region may come from anywhere (tests/test_hostile.py), so every field has
        # exactly its type and nothing can make the parser fail any other way.
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
                raise MalformedInputError(f"manifest format {doc.get('format') if isinstance(doc, dict) else None!r} "
                                          "is not supported")
            if not isinstance(doc["tensors"], list):
                raise MalformedInputError("manifest tensors must be a list")
            tensors = []
            for t in doc["tensors"]:
                name, dtype, shape, offset, nbytes, crc = (t["name"], t["dtype"], t["shape"], t["offset"],
                                                           t["nbytes"], t["crc32"])
                # exact types: JSON gives no subclasses, and a bool is not an int here
                if (type(name) is not str or type(dtype) is not str or type(shape) is not list
                        or type(offset) is not int or type(nbytes) is not int or type(crc) is not str
                        or len(crc) != 8):
                    raise MalformedInputError(f"tensor record {t!r:.80} is not valid")
                blocks = t.get(_BLOCKS_KEY)
                if blocks is None:
                    tensors.append(TensorRecord(name, dtype, tuple(shape), offset, nbytes, int(crc, 16)))
                    continue
                if type(blocks) is not str or not blocks or len(blocks) % 8:
                    raise MalformedInputError(f"tensor record {name!r:.60} has malformed block CRCs")
                tensors.append(TensorRecord(name, dtype, tuple(shape), offset, nbytes, int(crc, 16),
                                            struct.unpack(f">{len(blocks) // 8}I", bytes.fromhex(blocks))))
            # the dimensions' types in one pass over all records (a generator per record costs)
            if any(type(d) is not int for t in tensors for d in t.shape):
                bad = next(t for t in tensors if any(type(d) is not int for d in t.shape))
                raise MalformedInputError(f"tensor record {bad.name!r:.60} has a shape that is not a list of ints")
            files = doc.get("files", {})
            if not isinstance(files, dict):
                raise MalformedInputError("manifest files must be an object")
            m = cls(_str(doc["model"]), _int(doc["step"]), _int(doc["counter"]), _int(doc["time_ns"]),
                    tuple(tensors), doc["skeleton"], _int(doc["data_bytes"]),
                    tuple((check_file_name(_str(k)), _str(v)) for k, v in files.items()),
                    _int(doc.get("crc_block_bytes", 0)))
            m.validate()
        except MalformedInputError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise MalformedInputError(f"manifest is not valid: {e!r:.200}") from None
        return m

    def validate(self) -> None:
        """Check internal consistency: known dtypes, sizes matching shapes, extents in bounds,
        unique tensor names, a well-formed skeleton whose tensor references exist, block CRCs
        (``_check_blocks``) where a tensor has or needs them."""
        if self.data_bytes < 0:
            raise MalformedInputError(f"negative data_bytes {self.data_bytes}")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise MalformedInputError("two tensor records have the same name")
        check_skeleton(self.skeleton, len(self.tensors))
        block = self.crc_block_bytes
        if block and (block < 4096 or block & (block - 1)):
            raise MalformedInputError(f"crc_block_bytes {block} is not a power of two of at least 4096")
        unblocked = block or self.data_bytes  # no tensor is larger than the data
        for t in self.tensors:
            if t.dtype not in ITEMSIZE:
                raise MalformedInputError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            if t.offset < 0 or (t.shape and min(t.shape) < 0):
                raise MalformedInputError(f"tensor {t.name!r} has a negative shape or offset")
            if t.nbytes != expected_nbytes(t.dtype, t.shape):
                raise MalformedInputError(f"tensor {t.name!r}: {t.nbytes} bytes do not match "
                                          f"shape {list(t.shape)} of {t.dtype}")
            if t.offset + t.nbytes > self.data_bytes:
                raise MalformedInputError(f"tensor {t.name!r} extends past the version's data")
            if t.block_crcs or t.nbytes > unblocked:
                _check_blocks(t, block)


def _check_blocks(t: TensorRecord, crc_block_bytes: int) -> None:
    """A tensor larger than a block has one CRC per block (and no other has any), and they
    combine to its CRC32."""
    n = block_count(t.nbytes, crc_block_bytes)
    if len(t.block_crcs) != n:
        raise MalformedInputError(f"tensor {t.name!r} has {len(t.block_crcs)} block CRCs, not {n}")
    if n and combine_blocks(t.block_crcs, t.nbytes, crc_block_bytes) != t.crc32:
        raise MalformedInputError(f"the block CRCs of tensor {t.name!r} do not make its CRC32")


def block_count(nbytes: int, crc_block_bytes: int) -> int:
    """How many block CRCs a tensor of ``nbytes`` has where the block size is ``crc_block_bytes``
    (0: none): one per block where it is larger than one block, else none (its CRC32 is its one
    block's)."""
    if not crc_block_bytes or nbytes <= crc_block_bytes:
        return 0
    return -(-nbytes // crc_block_bytes)


def combine_blocks(crcs, nbytes: int, crc_block_bytes: int) -> int:
    """The CRC32 of a tensor of ``nbytes`` from those of its blocks."""
    out, last = 0, len(crcs) - 1
    for i, crc in enumerate(crcs):
        out = crc if i == 0 else crc32_combine(out, crc, nbytes - i * crc_block_bytes if i == last else crc_block_bytes)
    return out


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def dumps_compact(doc) -> str:
    """Compact ASCII JSON, the encoding of every manifest (json.dumps with these options)."""
    return _ENCODER.encode(doc)



def encode_tensors(records, crcs: list[int] | None = None) -> str:
    """The manifest's ``tensors`` array; ``crcs`` replace the records' own CRC32s. A record's
    block CRCs, where it has them, follow its CRC32 as one string of 8 hex digits per block."""
    if crcs is None:
        crcs = [t.crc32 for t in records]
    items = []
    for t, crc in zip(records, crcs, strict=True):
        item = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset,
                "nbytes": t.nbytes, "crc32": f"{crc:08x}"}
        if t.block_crcs:
            item[_BLOCKS_KEY] = "".join(f"{c:08x}" for c in t.block_crcs)
        items.append(item)
    return dumps_compact(items)


_BLOCKS_KEY = "block_crc32"
_CRC_FIELD = '"crc32":"'
_BLOCKS_FIELD = f'"{_BLOCKS_KEY}":"'


@dataclass(frozen=True)
class EncodedTensors:
    """``encode_tensors(records)`` made once, with the place of each record's CRC field and of
    each of its block CRCs, so a commit fills in the CRCs without encoding the records again (a
    persist thread holds the GIL while it encodes: milliseconds for an optimizer state, beside
    the training loop)."""

    text: str
    crc_at: tuple[int, ...]  # where each record's 8 hex digits start in ``text``
    block_at: tuple[int, ...] = ()  # where each block CRC's 8 digits start, records in order

    @classmethod
    def of(cls, records) -> "EncodedTensors":
        text = encode_tensors(records)
        # Quotes inside a name are escaped, so the unescaped keys can only be the fields
        # themselves; a record's CRC32 comes before its block CRCs, records in order.
        at, start = [], 0
        while (found := text.find(_CRC_FIELD, start)) >= 0:
            at.append(found + len(_CRC_FIELD))
            start = at[-1]
        block_at, start = [], 0
        while (found := text.find(_BLOCKS_FIELD, start)) >= 0:
            first = found + len(_BLOCKS_FIELD)
            start = text.index('"', first)
            block_at.extend(range(first, start, 8))
        if len(at) != len(records) or len(block_at) != sum(len(r.block_crcs) for r in records):
            raise AssertionError(f"found {len(at)} CRC fields and {len(block_at)} block CRCs "
                                 f"for {len(records)} tensor records")
        return cls(text, tuple(at), tuple(block_at))

    def with_crcs(self, crcs: list[int], block_crcs: list[int] = ()) -> bytes:
        """The same bytes as ``encode_tensors(records, crcs).encode()`` with the records' block
        CRCs replaced by ``block_crcs`` (every record's in record order); each an unsigned
        32-bit number. The hex digits of all the CRCs are made in one call and put in place by
        one vectorized store: a loop over 40,000 fields took 18 ms of every commit, a %-format 7."""
        if len(crcs) != len(self.crc_at) or len(block_crcs) != len(self.block_at):
            raise ValueError(f"{len(crcs)} CRCs and {len(block_crcs)} block CRCs for {len(self.crc_at)} "
                             f"tensor records with {len(self.block_at)} blocks")
        text, digits = self._digit_places
        out = text.copy()
        out[digits] = _hex_digits(list(crcs) + list(block_crcs) if block_crcs else crcs)
        return out.tobytes()

    @functools.cached_property
    def _digit_places(self):
        """(``text`` as uint8, the flat index of every CRC field's 8 digits, then of every block
        CRC's), made once."""
        import numpy as np

        at = np.array(self.crc_at + self.block_at, dtype=np.int64)
        return np.frombuffer(self.text.encode("ascii"), dtype=np.uint8), (at[:, None] + np.arange(8)).ravel()


def _hex_digits(crcs):
    """The 8 lowercase hex digits of each of ``crcs`` (unsigned 32-bit), as one uint8 array."""
    import numpy as np

    try:
        words = array("I", crcs)  # 4 bytes each on the platforms torch runs on
    except OverflowError:
        raise ValueError("a CRC32 is an unsigned 32-bit number") from None
    if sys.byteorder == "little":
        words.byteswap()  # big-endian bytes: their hex is each CRC's 8 digits, in order
    return np.frombuffer(words.tobytes().hex().encode("ascii"), dtype=np.uint8)


def _int(x) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise MalformedInputError(f"{x!r:.40} is not an integer")
    return x


def _str(x) -> str:
    if not isinstance(x, str):
        raise MalformedInputError(f"{x!r:.40} is not a string")
    return x


FILE_NAME_MAX_BYTES = 255  # Linux NAME_MAX: the longest name of a file in the mount
FILES_MAX_BYTES = 16 << 20  # extra files are small (configs, tokenizer JSON): they live in the index


def check_file_name(name: str) -> str:
    """``name`` if it can name an extra file of a version (a plain file name of letters, digits,
    '.', '-' and '_', not starting with '.'); MalformedInputError otherwise."""
    if (not name or len(name) > FILE_NAME_MAX_BYTES or name.startswith(".") or not name.isascii()
            or not all(c.isalnum() or c in "._-" for c in name)):
        raise MalformedInputError(f"{name!r:.80} cannot name a file (letters, digits, '.', '-', '_'; "
                                  "not starting with '.')")
    return name


def encode_files(extra: dict | None) -> tuple[tuple[str, str], ...]:
    """The extra files of a save as (name, text): a str value is the file's text, anything else
    is written as JSON (indent 2, e.g. a config dict). TypeError / ValueError on a bad one."""
    if not extra:
        return ()
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of file name -> str or JSON-able value, got {type(extra).__name__}")
    files, total = [], 0
    for name, value in extra.items():
        if not isinstance(name, str):
            raise TypeError(f"extra: file name {name!r:.60} is not a str")
        try:
            check_file_name(name)
        except MalformedInputError as e:
            raise ValueError(f"extra: {e}") from None
        if not isinstance(value, str):
            try:
                value = _json_text(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"extra[{name!r}] is neither a str nor JSON-able: {e}") from None
        try:  # a file is served as UTF-8: a lone surrogate was stored, then unreadable in the mount
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"extra[{name!r}] is not valid text: {e.object[e.start:e.end]!r} at character {e.start} "
                             "is a surrogate code point, which UTF-8 cannot encode; fix the text") from None
        # counted as the index stores it (ASCII JSON: a NUL or a CJK character takes 6 bytes), as
        # the slots are sized: 16 MiB of text counted as UTF-8 made an index, and slots, of 96 MiB
        total += len(dumps_compact(value))
        files.append((name, value))
    if total > FILES_MAX_BYTES:
        raise ValueError(f"extra files take {total} bytes in the version's index (its ASCII JSON text: a "
                         f"character past ASCII takes 6, past U+FFFF 12); at most {FILES_MAX_BYTES} ({human_bytes(FILES_MAX_BYTES)}): "
                         "save large data as tensors")
    return tuple(files)


def _json_text(value) -> str:
    """``value`` as the JSON text of an extra file (indent 2, as ``save_pretrained`` writes a
    config): characters as they are, or escaped (``\\udXXX``) where the text holds one that UTF-8
    cannot encode (a lone surrogate: JSON reads the escape back to it)."""
    text = json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, indent=2, ensure_ascii=True, allow_nan=False) + "\n"
    return text


def _torch_version() -> str:
    import torch

    return torch.__version__


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The bytes of a contiguous tensor of ``dtype`` (an ITEMSIZE name) and ``shape``."""
    return math.prod(shape) * ITEMSIZE[dtype]


