"""Import a ``.safetensors`` file or a torch file as a new version of a model.

Everything is parsed and validated before anything is written: a malformed or hostile file raises
:class:`~ckptfs.errors.MalformedInputError` (or UnsupportedObjectError for a leaf ckptfs cannot
store) and leaves the region untouched -- no writer is created, no model ring allocated.

* safetensors: the header is parsed strictly (ckptfs.safetensors_file) -- the 8-byte length
  within bounds and within the file, a JSON object with no duplicate keys, known dtypes,
  non-negative integer shapes, ``shape x itemsize == end - begin``, extents that start at 0 and
  tile the data exactly (no overlap, no hole, nothing past the end, nothing after the last
  tensor). The tensors are then read from a private mapping of the file (no copy before the
  writer's own snapshot) and saved as a flat ``{name: tensor}`` dict in header order (or
  ``{key: {...}}`` with ``key=``).
* torch files: ``torch.load(weights_only=True)``, which refuses any global outside torch's
  allowlist (``os.system``, arbitrary classes) and numpy's numeric arrays and scalars
  (ckptfs.leaves); every failure becomes MalformedInputError.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from ckptfs import leaves
from ckptfs.errors import CkptfsError, MalformedInputError, UnsupportedObjectError
from ckptfs.dist.names import RECORD_FILES
from ckptfs.manifest import check_file_name
from ckptfs.safetensors_file import SafetensorsFile, no_duplicates, reject
from ckptfs.skeleton import check_skeleton, map_tensor_refs, unflatten
from ckptfs.views import is_views_own
from ckptfs.views.hf import HF_INDEXES, HF_SINGLE
from ckptfs.views.metadata import METADATA_FILE
from ckptfs.views.safetensors import (ALIASES_KEY, SKELETON_KEY, SKELETON_OMITTED_KEY, SKIPPED_KEY, STATE_FILE,
                                      TIED_KEY)
from ckptfs.views.torchzip import CHECKPOINT_FILE

log = logging.getLogger(__name__)

def nested(path: str, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict[str, str]) -> Any:
    """The object that a ckptfs ``state.safetensors`` was exported from, rebuilt from the
    skeleton in its ``__metadata__`` (nesting, plain values, ties); ``tensors`` as they are for
    any other file, or for one whose tensors no longer match its skeleton (with a warning)."""
    partial = _partial(metadata)
    if partial is not None:  # not the object: imported, it would lose what it leaves out, unsaid
        raise reject(path, f"{partial}: import the version's {CHECKPOINT_FILE}")
    text = metadata.get(SKELETON_KEY)
    if text is None:
        return with_aliases(path, tensors, metadata)
    position = {name: i for i, name in enumerate(tensors)}
    # the later names of a tied tensor (hf/model.safetensors holds it under each): the skeleton
    # names the first, these hold the same bytes
    used = {position[name] for name in _tied(path, tensors, metadata)}

    def index(name):
        if not isinstance(name, str) or name not in position:
            raise MalformedInputError(f"it names a tensor {name!r:.60} that the file does not hold")
        used.add(position[name])
        return position[name]

    try:
        skeleton = map_tensor_refs(json.loads(text), index)
        check_skeleton(skeleton, len(position))
    except (ValueError, RecursionError, MalformedInputError) as exc:
        raise reject(path, f"__metadata__[{SKELETON_KEY!r}] is damaged ({exc})") from None
    if len(used) != len(position):
        log.warning("%s: %d tensors are not in its %s (the file was changed after its export): imported "
                    "flat, by name", path, len(position) - len(used), SKELETON_KEY)
        return tensors
    return unflatten(skeleton, list(tensors.values()))


def with_aliases(path: str, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict[str, str]
                 ) -> "OrderedDict[str, torch.Tensor]":
    """``tensors`` with their ties back, each name of a tied tensor the same tensor: the names
    that the file's ``__metadata__["ckptfs.aliases"]`` gives to another of them (a ckptfs
    ``<key>.safetensors`` stores tied weights once: an import dropped the other names), and those
    that ``["ckptfs.tied"]`` ties to another it holds (``hf/model.safetensors`` holds them under
    each name: an import stored them apart, twice)."""
    out = OrderedDict(tensors)
    for name, first in _tied(path, tensors, metadata).items():
        out[name] = tensors[first]
    for alias, name in _name_map(path, metadata, ALIASES_KEY, held=False, tensors=tensors).items():
        out[alias] = out[name]  # (a tied name's: the tensor it is tied to)
    return out


def _tied(path: str, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict[str, str]) -> dict[str, str]:
    """``__metadata__["ckptfs.tied"]``: {a later name of a tied tensor: its first name}, both
    held by the file (``hf/model.safetensors`` holds a tied tensor under each name), each first
    name not itself tied to another, and the two holding the same bytes; MalformedInputError
    where not (tied as told, a tensor's values would be lost)."""
    tied = _name_map(path, metadata, TIED_KEY, held=True, tensors=tensors)
    for name, first in tied.items():
        if first in tied:
            raise reject(path, f"__metadata__[{TIED_KEY!r}] ties {name!r} to {first!r}, which it ties to another")
        if not _same(tensors[name], tensors[first]):
            raise reject(path, f"__metadata__[{TIED_KEY!r}] ties {name!r} to {first!r}, whose values differ")
    return tied


def _name_map(path: str, metadata: dict[str, str], key: str, *, held: bool, tensors) -> dict[str, str]:
    """``__metadata__[key]``: {name: a name the file holds}, the first names either held too
    (``held``: ckptfs.tied) or not (ckptfs.aliases); MalformedInputError where it is not."""
    text = metadata.get(key)
    if text is None:
        return {}
    try:
        names = json.loads(text, object_pairs_hook=no_duplicates)
    except (ValueError, MalformedInputError) as exc:
        raise reject(path, f"__metadata__[{key!r}] is damaged ({exc})") from None
    if not isinstance(names, dict) or not all(
            isinstance(a, str) and isinstance(b, str) and (a in tensors) == held and b in tensors and a != b
            for a, b in names.items()):
        raise reject(path, f"__metadata__[{key!r}] must map names the file {'holds' if held else 'does not hold'} "
                           "to names it holds")
    return names


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes (a tie: compared as bytes, so NaNs are equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


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
        raise reject(path, "truncated or damaged: a zip archive (torch.save format) without its central directory")
    if is_zip:
        _check_zip_crcs(path)
    try:
        # numeric numpy arrays (an RNG state) allowed for this load only: torch's allowlist is
        # the process's, so ckptfs's imports take it one at a time
        with _SAFE_GLOBALS_LOCK, torch.serialization.safe_globals(leaves.numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as exc:
        raise reject(path, f"refused by torch.load(weights_only=True): {_unpickler_reason(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - hostile input may fail anywhere in torch.load
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise reject(path, f"not a loadable torch file ({type(exc).__name__}: {text})") from None


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
        raise reject(path, f"damaged zip archive (torch.save format): {type(exc).__name__}: {exc}") from None


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
                weight_map = json.load(f, object_pairs_hook=no_duplicates)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, MalformedInputError) as exc:
            raise reject(index, f"not a weight index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v and v not in (".", "..")
                for k, v in weight_map.items()):
            raise reject(index, "its weight_map must map tensor names to file names in its directory")
        files = [os.path.join(path, v) for v in dict.fromkeys(weight_map.values())]
        for f in files:
            if not os.path.isfile(f):
                raise reject(index, f"it names {os.path.basename(f)!r}, which the directory does not hold")
    else:
        files = [os.path.join(path, n) for n in HF_SINGLE if os.path.isfile(os.path.join(path, n))][:1]
        if not files:
            raise MalformedInputError(f"{path}: a directory without model weights: import a file, or a Hugging "
                                      f"Face model directory ({' or '.join(HF_SINGLE)}, or shards with "
                                      f"{' or '.join(HF_INDEXES)})")
    return files, weight_map, _read_texts(path, HF_EXTRAS, missing_ok=True)


def hf_left_out(path: str, files: list[str]) -> list[str]:
    """The entries of Hugging Face model directory ``path`` that its import leaves out: all but
    the weight ``files``, their index and ``HF_EXTRAS`` (a Trainer's checkpoint-N also holds
    optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, tokenizer files), a
    subdirectory with a '/'. Named in a warning: a resumable checkpoint imported as its weights
    alone lost its optimizer state in silence."""
    taken = {os.path.basename(f) for f in files} | set(HF_INDEXES) | set(HF_EXTRAS)
    return sorted(n + "/" * os.path.isdir(os.path.join(path, n)) for n in os.listdir(path) if n not in taken)


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
    partial = _partial_file(whole) if whole.endswith(STATE_FILE) else None
    if partial is not None:  # checkpoint.pt holds what state.safetensors leaves out
        whole = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(whole):
            raise reject(path, f"its {STATE_FILE} {partial}, and it has no {CHECKPOINT_FILE}: copy the version's "
                                f"{CHECKPOINT_FILE} beside it, or import that file")
    try:
        with open(meta_path, encoding="utf-8") as f:
            names = json.load(f, object_pairs_hook=no_duplicates).get("files", [])
    except (OSError, ValueError, AttributeError, MalformedInputError) as exc:
        raise reject(meta_path, f"not a version's metadata ({exc})") from None
    try:
        if not isinstance(names, list) or not all(isinstance(n, str) and check_file_name(n) for n in names):
            raise MalformedInputError("not a list of names")
    except MalformedInputError as exc:
        raise reject(meta_path, f"its files must be names of extra files of a version ({exc})") from None
    # a multi-rank version's own records are left: the copy is a version of one process; and an
    # extra that an older ckptfs let a save name as a view's own file (hidden by it in the version
    # directory; a save now refuses such a name)
    views_own = [n for n in names if is_views_own(n)]
    if views_own:
        log.warning("%s: extra file(s) %s, named as ckptfs's own files, are left out", meta_path, ", ".join(views_own))
    return [whole], _read_texts(path, [n for n in names if n not in RECORD_FILES and not is_views_own(n)],
                                missing_ok=False)


def _partial(metadata: dict[str, str]) -> str | None:
    """What a ckptfs safetensors file of a version leaves out of the saved object, per its
    ``__metadata__`` (see ``views.safetensors``): the tensors safetensors cannot hold (complex128,
    a name that is not text), or the skeleton (nesting and plain values, where the header would
    be too large); None for a file that leaves nothing out, or is not ckptfs's."""
    if SKIPPED_KEY in metadata:
        try:
            names = json.loads(metadata[SKIPPED_KEY])
            said = ", ".join(map(repr, names[:4])) + (", ..." if len(names) > 4 else "")
        except (ValueError, TypeError):
            said = metadata[SKIPPED_KEY][:80]
        return f"leaves out tensors that safetensors cannot hold ({said})"
    if SKELETON_OMITTED_KEY in metadata:
        return f"was made without the object's skeleton ({metadata[SKELETON_OMITTED_KEY]})"
    return None


def _partial_file(path: str) -> str | None:
    """``_partial`` of the safetensors file at ``path``; None for one that cannot be read (its
    import says why)."""
    try:
        with SafetensorsFile(path) as f:
            return _partial(f.header.metadata)
    except (OSError, MalformedInputError):
        return None


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
                raise reject(os.path.join(path, name), "listed in its metadata.json, missing") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise reject(os.path.join(path, name), f"unreadable ({exc})") from None
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
            raise reject(path, "a shard must hold tensors by name")
        for name, tensor in obj.items():
            if name in merged:
                raise reject(path, f"tensor {name!r} is in two shards")
            if weight_map is not None and weight_map.get(name) != os.path.basename(path):
                raise reject(path, f"it holds {name!r}, which its index places elsewhere")
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
        left_out = []
        if version is not None:
            (files, extra), weight_map = version, None
        else:
            files, weight_map, extra = hf_directory(path)
            left_out = hf_left_out(path, files)
    elif os.path.isfile(path):
        files, weight_map, extra, left_out = [path], None, None, []
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
    if left_out:
        shown = ", ".join(left_out[:8]) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
        torch_file = next((n for n in left_out if n.endswith((".pt", ".pth", ".bin"))), None)
        log.warning("%s: imported its weights and config; left out %s%s", path, shown,
                    "" if torch_file is None else f" (a torch file can be a model of its own: ckptfs import "
                    f"{model}-{torch_file.rsplit('.', 1)[0]} {os.path.join(path, torch_file)})")
    return next(v for v in store.versions(model) if v.step == step)
