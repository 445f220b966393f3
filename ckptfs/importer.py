"""Import a ``.safetensors`` file or a torch file as a new version of a model.

Everything is parsed and validated before anything is written: a malformed or hostile file raises
:class:`~ckptfs.errors.MalformedInputError` (or UnsupportedObjectError for a leaf ckptfs cannot
store) and leaves the region untouched -- no writer is created, no model ring allocated.

* safetensors: the header is parsed here, strictly -- the 8-byte length within bounds and within
  the file, a JSON object with no duplicate keys, known dtypes, non-negative integer shapes,
  ``shape x itemsize == end - begin``, extents that start at 0 and tile the data exactly (no
  overlap, no hole, nothing past the end, nothing after the last tensor). The tensors are then
  read from a private mapping of the file (no copy before the writer's own snapshot) and saved as
  a flat ``{name: tensor}`` dict in header order (or ``{key: {...}}`` with ``key=``).
* torch files: ``torch.load(weights_only=True)``, which refuses any global outside torch's
  allowlist (``os.system``, arbitrary classes) and numpy's numeric arrays and scalars
  (ckptfs.leaves); every failure becomes MalformedInputError.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs import leaves
from ckptfs.errors import CkptfsError, MalformedInputError, UnsupportedObjectError
from ckptfs.dist.names import RECORD_FILES
from ckptfs.flatten import DTYPES
from ckptfs.manifest import check_file_name, expected_nbytes
from ckptfs.skeleton import check_skeleton, map_tensor_refs, unflatten
from ckptfs.views import is_views_own
from ckptfs.views.metadata import METADATA_FILE
from ckptfs.views.safetensors import (ALIASES_KEY, MAX_HEADER_BYTES, SAFETENSORS_DTYPES, SKELETON_KEY,
                                     SKELETON_OMITTED_KEY, STATE_FILE)
from ckptfs.views.torchzip import CHECKPOINT_FILE

log = logging.getLogger(__name__)

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


def _reject(path: str, what: str) -> MalformedInputError:
    return MalformedInputError(f"{path}: {what}; nothing was imported")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
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
        raise _reject(path, f"truncated: {file_size} bytes, a safetensors file starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", head[:8])
    if n < 2 or n > MAX_HEADER_BYTES:
        raise _reject(path, f"bad header length {n} (must be 2..{MAX_HEADER_BYTES} bytes)")
    if 8 + n > file_size or len(head) < 8 + n:
        raise _reject(path, f"truncated: header length {n} runs past the end of the {file_size}-byte file")
    raw = head[8:8 + n]
    if raw[:1] != b"{":
        raise _reject(path, "the header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _reject(path, f"the header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _reject(path, "the header is not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in metadata.items()):
        raise _reject(path, "__metadata__ must map strings to strings")
    entries = []
    for name, info in doc.items():
        if not name:
            raise _reject(path, "a tensor has an empty name")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _reject(path, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        dtype = FROM_SAFETENSORS.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise _reject(path, f"tensor {name!r} has unknown or unsupported dtype {code!r} "
                                f"(supported: {', '.join(FROM_SAFETENSORS)})")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise _reject(path, f"tensor {name!r} has an invalid shape {shape!r}")
        torch_shape = list(shape)
        if code == "F4":  # safetensors counts 4-bit elements; torch packs two per byte
            if not shape or shape[-1] % 2:
                raise _reject(path, f"tensor {name!r}: F4 needs an even last dimension, got {shape}")
            torch_shape[-1] //= 2
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _reject(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        expected = expected_nbytes(dtype, torch_shape)
        if offsets[1] - offsets[0] != expected:
            raise _reject(path, f"tensor {name!r}: shape {shape} of {code} needs {expected} bytes, "
                                f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        entries.append(SafetensorsEntry(name, dtype, tuple(torch_shape), offsets[0], offsets[1]))
    data_len = file_size - 8 - n
    position = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < position:
            raise _reject(path, f"tensor {e.name!r} overlaps the previous tensor (data_offsets {[e.begin, e.end]})")
        if e.begin > position:
            raise _reject(path, f"a hole of {e.begin - position} bytes before tensor {e.name!r}")
        position = e.end
    if position > data_len:
        raise _reject(path, f"truncated: the tensors need {position} data bytes, the file holds {data_len}")
    if position < data_len:
        raise _reject(path, f"{data_len - position} unexpected bytes after the last tensor")
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


def nested(path: str, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict[str, str]) -> Any:
    """The object that a ckptfs ``state.safetensors`` was exported from, rebuilt from the
    skeleton in its ``__metadata__`` (nesting, plain values, ties); ``tensors`` as they are for
    any other file, or for one whose tensors no longer match its skeleton (with a warning)."""
    if SKELETON_OMITTED_KEY in metadata:  # tensors without their nesting and plain values: not the object
        raise _reject(path, f"it holds the tensors of a version whose skeleton was left out "
                            f"({metadata[SKELETON_OMITTED_KEY]}): import the version's {CHECKPOINT_FILE}")
    text = metadata.get(SKELETON_KEY)
    if text is None:
        return with_aliases(path, tensors, metadata)
    position = {name: i for i, name in enumerate(tensors)}
    used: set[int] = set()

    def index(name):
        if not isinstance(name, str) or name not in position:
            raise MalformedInputError(f"it names a tensor {name!r:.60} that the file does not hold")
        used.add(position[name])
        return position[name]

    try:
        skeleton = map_tensor_refs(json.loads(text), index)
        check_skeleton(skeleton, len(position))
    except (ValueError, RecursionError, MalformedInputError) as exc:
        raise _reject(path, f"__metadata__[{SKELETON_KEY!r}] is damaged ({exc})") from None
    if len(used) != len(position):
        log.warning("%s: %d tensors are not in its %s (the file was changed after its export): imported "
                    "flat, by name", path, len(position) - len(used), SKELETON_KEY)
        return tensors
    return unflatten(skeleton, list(tensors.values()))


def with_aliases(path: str, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict[str, str]
                 ) -> "OrderedDict[str, torch.Tensor]":
    """``tensors`` with the names that the file's ``__metadata__["ckptfs.aliases"]`` gives to
    another of them back, each the same tensor (the tie kept): a ckptfs ``<key>.safetensors`` or
    ``hf/model.safetensors`` stores tied weights once (an import dropped the other names)."""
    text = metadata.get(ALIASES_KEY)
    if text is None:
        return tensors
    try:
        aliases = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, MalformedInputError) as exc:
        raise _reject(path, f"__metadata__[{ALIASES_KEY!r}] is damaged ({exc})") from None
    if not isinstance(aliases, dict) or not all(
            isinstance(alias, str) and isinstance(name, str) and alias not in tensors and name in tensors
            for alias, name in aliases.items()):
        raise _reject(path, f"__metadata__[{ALIASES_KEY!r}] must map names the file does not hold to names it holds")
    out = OrderedDict(tensors)
    for alias, name in aliases.items():
        out[alias] = tensors[name]
    return out


_SAFE_GLOBALS_LOCK = threading.Lock()


def load_torch_file(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU; any failure -- a forbidden global,
    a truncated or corrupt archive, not a torch file at all -- is MalformedInputError."""
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        is_zip = zipfile.is_zipfile(path)
    except Exception:  # noqa: BLE001 - e.g. BadZipFile("zipfiles that span multiple disks ...")
        is_zip = False
    if magic == b"PK\x03\x04" and not is_zip:
        raise _reject(path, "truncated or damaged: a zip archive (torch.save format) without its central directory")
    if is_zip:
        _check_zip_crcs(path)
    try:
        # numeric numpy arrays (an RNG state) allowed for this load only: torch's allowlist is
        # the process's, so ckptfs's imports take it one at a time
        with _SAFE_GLOBALS_LOCK, torch.serialization.safe_globals(leaves.numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as exc:
        raise _reject(path, f"refused by torch.load(weights_only=True): {_unpickler_reason(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - hostile input may fail anywhere in torch.load
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise _reject(path, f"not a loadable torch file ({type(exc).__name__}: {text})") from None


ZIP_CHECK_BYTES = 16 << 20  # read at a time when checking an archive's entries


def _check_zip_crcs(path: str) -> None:
    """MalformedInputError unless every entry of the zip archive at ``path`` has the CRC32 its
    directory records (zipfile checks it at the end of each entry read): torch.load never
    checks them, so bytes damaged after torch.save wrote them would be imported, and verify,
    as if they were the tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    # torch.save with serialization config save.compute_crc32=False records 0
                    # for every entry: nothing to check (one real CRC in 2**32 is 0 too)
                    continue
                with archive.open(info) as member:
                    while member.read(ZIP_CHECK_BYTES):
                        pass
    except Exception as exc:  # noqa: BLE001 - hostile input fails anywhere in zipfile (names, sizes, CRCs)
        raise _reject(path, f"damaged zip archive (torch.save format): {type(exc).__name__}: {exc}") from None


def _unpickler_reason(text: str) -> str:
    """The specific part of torch's weights-only refusal, without its advice to turn it off."""
    text = text.split("Check the documentation", 1)[0]
    text = text.split("WeightsUnpickler error:", 1)[-1]
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(("Weights only load failed", "Please file an issue"))]
    return lines[0] if lines else "the pickle holds something other than tensors and plain containers"


def detect_format(path: str) -> str:
    """"safetensors" or "torch": by extension, else by the first bytes."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".safetensors":
        return "safetensors"
    if ext in (".pt", ".pth", ".bin", ".ckpt", ".tar"):
        return "torch"
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise MalformedInputError(f"{path}: neither a safetensors nor a torch file; "
                              "name it .safetensors or .pt, or pass --format")


HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # save_pretrained's shards
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")
HF_EXTRAS = ("config.json", "generation_config.json")  # kept with the version: its hf/ directory


def hf_directory(path: str) -> tuple[list[str], dict[str, str] | None, dict[str, str]]:
    """What a Hugging Face model directory (``save_pretrained``'s) holds: its weight files (the
    shards its index names, in order, or its one ``model.safetensors`` / ``pytorch_model.bin``),
    the index's weight map ({tensor: shard file}; None without an index) and the extra files to
    keep with the version ({name: text}: config.json, generation_config.json).
    MalformedInputError where it holds none of these, or its index is not one."""
    index = next((os.path.join(path, n) for n in HF_INDEXES if os.path.isfile(os.path.join(path, n))), None)
    weight_map = None
    if index is not None:
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f, object_pairs_hook=_no_duplicates)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, MalformedInputError) as exc:
            raise _reject(index, f"not a weight index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v and v not in (".", "..")
                for k, v in weight_map.items()):
            raise _reject(index, "its weight_map must map tensor names to file names in its directory")
        files = [os.path.join(path, v) for v in dict.fromkeys(weight_map.values())]
        for f in files:
            if not os.path.isfile(f):
                raise _reject(index, f"it names {os.path.basename(f)!r}, which the directory does not hold")
    else:
        files = [os.path.join(path, n) for n in HF_SINGLE if os.path.isfile(os.path.join(path, n))][:1]
        if not files:
            raise MalformedInputError(f"{path}: a directory without model weights: import a file, or a Hugging "
                                      f"Face model directory ({' or '.join(HF_SINGLE)}, or shards with "
                                      f"{' or '.join(HF_INDEXES)})")
    return files, weight_map, _read_texts(path, HF_EXTRAS, missing_ok=True)


VERSION_FILES = (STATE_FILE, CHECKPOINT_FILE)  # a version's whole object, by preference


def version_directory(path: str) -> tuple[list[str], dict[str, str]] | None:
    """Where ``path`` is a ckptfs version directory (the mount's, or ``ckptfs export``'s: a
    ``metadata.json`` beside the whole object's file): ([that file], {name: text} of the extra
    files its metadata lists, but a multi-rank version's records); else None. Read as a Hugging
    Face directory, such a directory gave its ``model.safetensors`` alone (the optimizer state
    and plain values were dropped)."""
    meta_path = os.path.join(path, METADATA_FILE)
    whole = next((os.path.join(path, n) for n in VERSION_FILES if os.path.isfile(os.path.join(path, n))), None)
    if whole is None or not os.path.isfile(meta_path):
        return None
    if whole.endswith(STATE_FILE) and _skeleton_omitted(whole):
        # its tensors without the object's nesting and plain values: checkpoint.pt holds them
        whole = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(whole):
            raise _reject(path, f"its {STATE_FILE} was made without the object's skeleton (too large for a "
                                f"safetensors header) and it has no {CHECKPOINT_FILE}: copy the version's "
                                f"{CHECKPOINT_FILE} beside it, or import that file")
    try:
        with open(meta_path, encoding="utf-8") as f:
            names = json.load(f, object_pairs_hook=_no_duplicates).get("files", [])
    except (OSError, ValueError, AttributeError, MalformedInputError) as exc:
        raise _reject(meta_path, f"not a version's metadata ({exc})") from None
    try:
        if not isinstance(names, list) or not all(isinstance(n, str) and check_file_name(n) for n in names):
            raise MalformedInputError("not a list of names")
    except MalformedInputError as exc:
        raise _reject(meta_path, f"its files must be names of extra files of a version ({exc})") from None
    # a multi-rank version's own records are left: the copy is a version of one process; and an
    # extra that an older ckptfs let a save name as a view's own file (hidden by it in the version
    # directory; a save now refuses such a name)
    views_own = [n for n in names if is_views_own(n)]
    if views_own:
        log.warning("%s: extra file(s) %s, named as ckptfs's own files, are left out", meta_path, ", ".join(views_own))
    return [whole], _read_texts(path, [n for n in names if n not in RECORD_FILES and not is_views_own(n)],
                                missing_ok=False)


def _skeleton_omitted(path: str) -> bool:
    """Whether the ckptfs ``state.safetensors`` at ``path`` was made without its skeleton (see
    ``views.safetensors``); False for a file that cannot be read (its import says why)."""
    try:
        with SafetensorsFile(path) as f:
            return SKELETON_OMITTED_KEY in f.header.metadata
    except (OSError, MalformedInputError):
        return False


def _read_texts(path: str, names, missing_ok: bool) -> dict[str, str]:
    """{name: text} of the files ``names`` of directory ``path`` (those missing skipped where
    ``missing_ok``); MalformedInputError for one that cannot be read as text."""
    out = {}
    for name in names:
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                out[name] = f.read()
        except FileNotFoundError:
            if not missing_ok:
                raise _reject(os.path.join(path, name), "listed in its metadata.json, missing") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise _reject(os.path.join(path, name), f"unreadable ({exc})") from None
    return out


def _load_weights(files: list[str], weight_map: dict[str, str] | None, fmt: str | None, sources: list) -> Any:
    """The object of one weight file, or the tensors of several shards merged by name (each
    shard holding exactly what ``weight_map`` says it does). Safetensors files opened here are
    appended to ``sources`` (for the caller to close once saved)."""
    merged: OrderedDict[str, torch.Tensor] = OrderedDict()
    for path in files:
        kind = fmt or detect_format(path)
        if kind == "safetensors":
            source = SafetensorsFile(path)
            sources.append(source)
            obj = nested(path, source.tensors(), source.header.metadata)
        elif kind == "torch":
            obj = load_torch_file(path)
        else:
            raise CkptfsError(f"unknown format {fmt!r}; use safetensors or torch")
        if len(files) == 1 and weight_map is None:
            return obj
        if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in obj.items()):
            raise _reject(path, "a shard must hold tensors by name")
        for name, tensor in obj.items():
            if name in merged:
                raise _reject(path, f"tensor {name!r} is in two shards")
            if weight_map is not None and weight_map.get(name) != os.path.basename(path):
                raise _reject(path, f"it holds {name!r}, which its index places elsewhere")
            merged[name] = tensor
    missing = [name for name in weight_map or () if name not in merged]
    if missing:
        raise MalformedInputError(f"{files[0]}: the index names {len(missing)} tensors no shard holds "
                                  f"(first {missing[0]!r})")
    return merged


def import_file(store, model: str, path: str, *, step: int | None = None, fmt: str | None = None,
                key: str | None = None):
    """Import ``path`` as version ``step`` of ``model`` (default: one past the latest step, or 0)
    and wait until it is durable. Returns the new VersionInfo. ``path``: a safetensors or torch
    file, a ckptfs version directory (``version_directory``: the whole object, with its extra
    files), or a Hugging Face model directory (``hf_directory``: its shards merged into one
    state, its config.json kept, so that the mount shows the version's ``hf/``).

    ``key`` nests the imported tensors under that top-level key (``{key: tensors}``), e.g.
    ``model`` so that the mount shows ``model.safetensors``. Raises MalformedInputError /
    CkptfsError before anything is written; the writer's ``save`` does the remaining checks
    (UnsupportedObjectError, CheckpointTooLargeError) before it writes."""
    if os.path.isdir(path):
        if fmt is not None:
            raise CkptfsError(f"{path}: a directory; the format applies to a file (each of its files is "
                              "recognized by its name)")
        version = version_directory(path)
        if version is not None:
            (files, extra), weight_map = version, None
        else:
            files, weight_map, extra = hf_directory(path)
    elif os.path.isfile(path):
        files, weight_map, extra = [path], None, None
    else:
        raise CkptfsError(f"{path}: no such file or directory")
    if step is None:
        latest = store.latest(model, missing_ok=True)
        step = 0 if latest is None else latest.step + 1
    elif step < 0:
        raise CkptfsError(f"step must be >= 0, got {step}")
    if any(v.step == step for v in store.versions(model, missing_ok=True)):
        raise CkptfsError(f"{model} already has step {step}; pick another --step or remove it first")

    sources: list[SafetensorsFile] = []
    obj: Any = None
    try:
        obj = _load_weights(files, weight_map, fmt, sources)
        if key is not None:
            obj = {key: obj}
        writer = store.writer(model)
        try:
            writer.save(obj, step, extra=extra).result()
            writer.wait()
        finally:
            writer.close()
    except UnsupportedObjectError as exc:  # raised by save before it writes anything
        raise UnsupportedObjectError(f"{path}: {exc}; nothing was imported") from None
    finally:
        obj = None
        for source in sources:
            source.close()
    return next(v for v in store.versions(model) if v.step == step)
