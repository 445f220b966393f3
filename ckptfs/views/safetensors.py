"""The ``.safetensors`` view of a checkpoint.

Layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON padded with spaces so that the data starts 8-byte aligned, then the
tensor bytes, each tensor at ``data_offsets`` relative to the data start, contiguous from 0 and
without holes. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}`` and may hold
a ``__metadata__`` object of string to string.
"""
from __future__ import annotations

import json
import os
import struct
from collections import Counter
from json.encoder import encode_basestring_ascii
from typing import Mapping

from ckptfs import _native
from ckptfs.manifest import FILE_NAME_MAX_BYTES, Manifest, TensorRecord
from ckptfs.skeleton import dumps_named_skeleton, key_text, unique_name
from ckptfs.views.registry import register
from ckptfs.views.segments import LazyView, View, ViewBuilder

STATE_FILE = "state.safetensors"

# torch dtype name -> safetensors dtype, for every dtype safetensors 0.8 can represent (its Rust
# ``Dtype`` enum). complex128 and complex32 have no safetensors dtype and are skipped.
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    # Two 4-bit values per byte in torch; safetensors counts the 4-bit elements (see _shape).
    "float4_e2m1fn_x2": "F4",
}

METADATA_KEY = "__metadata__"
SKIPPED_KEY = "ckptfs.skipped"
ALIASES_KEY = "ckptfs.aliases"
TIED_KEY = "ckptfs.tied"
SKELETON_KEY = "ckptfs.skeleton"
SKELETON_OMITTED_KEY = "ckptfs.skeleton_omitted"
_HEADER_ALIGN = 8
MAX_HEADER_BYTES = 100_000_000  # the largest header the safetensors reference implementation reads


def safetensors_view(manifest: Manifest, *, key: str | None = None,
                     metadata: Mapping[str, str] | None = None, every_name: bool = False,
                     unwrapped: bool = False) -> View | None:
    """The safetensors file of ``manifest``'s tensors, or None when no tensor qualifies.

    ``key=None``: every tensor (``manifest.refs()``), named by its dotted path. ``key="model"``:
    the tensors under top-level key ``model``, named by their path below it. A tensor saved under
    several names (tied weights) is stored once, under its first name, as ``save_model`` and
    ``save_pretrained`` do, so that ``safetensors.torch.load_model`` accepts the file; its other
    names map to that one in ``__metadata__["ckptfs.aliases"]`` (a JSON object string).
    ``every_name`` (``hf/``): each of its names is an entry of its own over the same stored bytes,
    as ``torch.save`` of a state dict holds it, so that ``from_pretrained`` of any class finds
    its own name (the base model's embeddings where the head's name came first); the later
    names map to the first in ``__metadata__["ckptfs.tied"]``, for ``ckptfs import`` to tie.
    ``unwrapped`` (``hf/``): names without the prefix that wrappers put before every one of them
    (``WRAPPER_PREFIXES``: a state dict of a DDP-wrapped or compiled model).

    Tensors whose dtype (or shape) safetensors cannot represent, or whose every name is not text
    (a lone surrogate, which Python's json writes as an escape that safetensors' serde_json
    refuses: the whole file would be unreadable), are left out and listed, as a JSON array
    string, in ``__metadata__["ckptfs.skipped"]``. ``__metadata__`` also carries
    ``format`` ("pt"), ``model`` and ``step``; entries of ``metadata`` (strings only) are added
    and win over those. The whole-state file (``key=None``) with every tensor kept also carries
    the saved object's skeleton (``ckptfs.skeleton``: the manifest's, its tensor ``i`` named by
    the file's first name of it), so that ``ckptfs import`` rebuilds the nesting and the plain values,
    unless the header would then pass MAX_HEADER_BYTES (``ckptfs.skeleton_omitted`` says so).
    The header is a pure function of the arguments (byte-exact tests).
    """
    selected, aliases, first_name, skipped = _select(manifest, key, every_name, unwrapped)
    kept = []
    for name, rec in selected:
        if _representable(rec):
            kept.append((name, rec))
        else:
            skipped.append(name)
    if not kept:
        return None
    if aliases and skipped:  # a skipped tensor's other names are left out with it, and listed
        kept_names = {name for name, _ in kept}
        if not every_name:  # (else each name was an entry, skipped with its tensor)
            skipped += [alias for alias, name in aliases.items() if name not in kept_names]
        aliases = {alias: name for alias, name in aliases.items() if name in kept_names}
    meta = dict(metadata or {})
    if every_name and aliases:
        meta[TIED_KEY] = json.dumps(aliases, ensure_ascii=True, separators=(",", ":"))
        aliases = {}
    skeleton_added = key is None and not skipped and SKELETON_KEY not in meta
    if skeleton_added:
        meta[SKELETON_KEY] = dumps_named_skeleton(manifest.skeleton, first_name)
    header, extents, data_bytes = _header_and_extents(_metadata(manifest, skipped, aliases, meta), kept)
    if skeleton_added and len(header) - 8 > MAX_HEADER_BYTES:
        # plain values of hundreds of MB (a sampler's permutation as a list): no reader would open
        # the file ("header too large"); its tensors without them (checkpoint.pt has all)
        del meta[SKELETON_KEY]
        meta[SKELETON_OMITTED_KEY] = (f"{len(header) - 8} bytes of header with the skeleton, over the "
                                      f"{MAX_HEADER_BYTES} that safetensors reads: see checkpoint.pt")
        header, extents, data_bytes = _header_and_extents(_metadata(manifest, skipped, aliases, meta), kept)
    if len(header) - 8 > MAX_HEADER_BYTES:
        # the tensors' entries alone (a million tensors, names of megabytes): no reader would
        # open it, and `ckptfs import` of an export took it over checkpoint.pt beside it
        return None

    def segments():
        # made on the first read: a listing needs the size only, and 40,000 tensors stored apart
        # (aligned) are as many extents
        builder = ViewBuilder()
        builder.literal(header)
        builder.extents(extents)
        return builder.build().segments

    return LazyView(len(header) + data_bytes, segments)


def _select(manifest: Manifest, key: str | None, every_name: bool = False, unwrapped: bool = False
            ) -> tuple[list[tuple[str, TensorRecord]], dict[str, str], dict[int, str], list[str]]:
    """(unique tensor name, record) for every tensor the file should hold, in skeleton order,
    {alias: that name} for the later references to a tensor already selected (with
    ``every_name``, each also in the first list, over the same record), {tensor index: its
    first name in the file}, and the names left out as not text (``_is_text``): a tensor saved
    under another name too keeps that one."""
    if key is None:
        named = [(ref.name, ref.tensor_index) for ref in manifest.refs()]
    else:
        # A top-level value that is itself a tensor has no path below the key: it keeps the key.
        named = [(".".join(ref.key_path[1:]) or key, ref.tensor_index) for ref in manifest.refs_under(key)]
    if unwrapped:
        cut = len(wrapper_prefix([name for name, _ in named]))
        named = [(name[cut:], index) for name, index in named]
    taken = {METADATA_KEY}  # a tensor called "__metadata__" would clash with the header's own
    out, first_name, aliases, untext = [], {}, {}, []
    for name, index in named:
        if not _is_text(name):
            untext.append(name)
            continue
        if name in taken:  # (the call only where needed: 40,000 names on a first listing)
            name = unique_name(name, taken)
        taken.add(name)
        if index in first_name:
            aliases[name] = first_name[index]
            if not every_name:
                continue
        else:
            first_name[index] = name
        out.append((name, manifest.tensors[index]))
    return out, aliases, first_name, untext


# what wrappers put before every name of a model's state dict: DistributedDataParallel's and
# DataParallel's "module.", torch.compile's "_orig_mod." (both: "module._orig_mod.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def wrapper_prefix(names: list[str]) -> str:
    """The wrappers' prefixes (``WRAPPER_PREFIXES``) that every one of ``names`` starts with,
    with more after them, or ''."""
    prefix = ""
    while names:
        longer = next((prefix + p for p in WRAPPER_PREFIXES
                       if all(n.startswith(prefix + p) and len(n) > len(prefix + p) for n in names)), None)
        if longer is None:
            break
        prefix = longer
    return prefix


def _is_text(name: str) -> bool:
    """Whether ``name`` is valid Unicode text (encodable as UTF-8: no lone surrogate)."""
    if name.isascii():  # (most names: no encoding tried for 40,000 of them)
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _representable(rec: TensorRecord) -> bool:
    # A 0-dim float4_e2m1fn_x2 holds two 4-bit values but has no last dimension to double.
    return rec.dtype in SAFETENSORS_DTYPES and not (rec.dtype == "float4_e2m1fn_x2" and not rec.shape)


def _shape(rec: TensorRecord) -> list[int]:
    shape = list(rec.shape)
    if rec.dtype == "float4_e2m1fn_x2":
        shape[-1] *= 2  # safetensors' F4 shape counts 4-bit elements, torch's counts byte pairs
    return shape


def _metadata(manifest: Manifest, skipped: list[str], aliases: dict[str, str],
              extra: Mapping[str, str] | None) -> dict:
    meta = {"format": "pt", "model": manifest.model, "step": str(manifest.step)}
    if skipped:
        meta[SKIPPED_KEY] = json.dumps(skipped, ensure_ascii=True)
    if aliases:
        meta[ALIASES_KEY] = json.dumps(aliases, ensure_ascii=True, separators=(",", ":"))
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    return dict(sorted(meta.items()))  # sorted, as safetensors writes it: deterministic bytes


def encode_header(metadata: dict[str, str], tensors: list[tuple[str, TensorRecord]]) -> bytes:
    """The length word and the padded JSON header of a file of ``tensors`` (name, record), in
    order, contiguous from data offset 0. The JSON is exactly ``json.dumps({"__metadata__":
    metadata, name: {"dtype", "shape", "data_offsets"}...}, separators=(",", ":"),
    ensure_ascii=True)`` (a test holds it to that). ASCII only: every name is encodable (even one
    with a lone surrogate), and serde_json reads the \\u escapes back to the same string."""
    return _header_and_extents(metadata, tensors)[0]


def _header_and_extents(metadata: dict[str, str], tensors: list[tuple[str, TensorRecord]]
                        ) -> tuple[bytes, list[tuple[int, int]], int]:
    """``encode_header``'s bytes, the records' (offset, nbytes) with the adjacent ones merged, and
    the sum of their nbytes.
    The tensor entries are written in C (``_native.safetensors_entries``): a version of 40,000
    tensors is encoded on the first listing of its directory, where json.dumps of the dicts
    costs ten times as much."""
    entries, extents, data_bytes = _native.safetensors_entries(tensors, {}, _entry_head)
    meta = f"{{{encode_basestring_ascii(METADATA_KEY)}:{json.dumps(metadata, separators=(',', ':'), ensure_ascii=True)}"
    length = len(meta) + (len(entries) + 1 if entries else 0) + 1  # ASCII: characters are bytes
    padding = -length % _HEADER_ALIGN
    # one copy of a header of megabytes: no concatenation of the whole after the join
    return b"".join([struct.pack("<Q", length + padding), meta.encode("ascii"), b"," if entries else b"",
                     entries, b"}", b" " * padding]), extents, data_bytes


def _entry_head(rec: TensorRecord) -> str:
    """A tensor entry's text from its dtype up to its data offsets (shared by every tensor of the
    same dtype and shape)."""
    return f'"dtype":"{SAFETENSORS_DTYPES[rec.dtype]}","shape":[{",".join(map(str, _shape(rec)))}],"data_offsets":['


def safetensors_files(manifest: Manifest) -> dict[str, View]:
    """``state.safetensors`` if any tensor can be stored in it, and ``<key>.safetensors`` for each
    top-level key of a dict root whose value is a container holding such a tensor (the key made
    into a safe file name, or left out when it cannot be, see ``key_file_name``, or when another
    key's name is the same)."""
    state = safetensors_view(manifest)
    # the keys' files without it too: a whole state too large for a safetensors header (a
    # huge optimizer state) may hold keys that fit (the model's)
    files = {} if state is None else {STATE_FILE: state}
    views = {}  # file name -> the views of the keys that make it
    for key in _top_level_tensor_keys(manifest):
        name = key_file_name(key)
        if name is not None and name != STATE_FILE:
            view = safetensors_view(manifest, key=key)
            if view is not None:
                views.setdefault(name, []).append(view)
    # keys that make the same file name ("a/b" and "a_b"): neither has a file, as the file of
    # the first showed under the other's name (`export --key a_b` gave a/b's tensors)
    files.update((name, made[0]) for name, made in views.items() if len(made) == 1)
    return files


def key_file_name(key: str) -> str | None:
    """``<key>.safetensors`` with '/' and NUL replaced by '_', or None when no safe name exists
    (empty key, not encodable as a file name, longer than NAME_MAX)."""
    if not key:
        return None
    name = key.replace("/", "_").replace("\0", "_") + ".safetensors"
    try:
        encoded = os.fsencode(name)
    except UnicodeEncodeError:
        return None
    return name if len(encoded) <= FILE_NAME_MAX_BYTES else None


def _top_level_tensor_keys(manifest: Manifest) -> list[str]:
    """Top-level keys (as text, like ``TensorRef.key_path[0]``) whose value is a container
    holding tensors, in order. A key whose value is one tensor gets no file of its own: a flat
    state dict (an imported Hugging Face model: hundreds of tensors at the top level) showed a
    file per tensor, each in state.safetensors already. Nor do two keys that read the same (the
    int 3 and the str "3"): one file held both keys' tensors, and nothing said whose was whose."""
    (kind, items), = manifest.skeleton.items()
    if kind not in ("dict", "odict"):
        return []
    texts = Counter(key_text(k) for k, _ in items)
    return [text for text in dict.fromkeys(ref.key_path[0] for ref in manifest.refs() if len(ref.key_path) > 1)
            if texts[text] == 1]


register("safetensors", safetensors_files,
         summary="state.safetensors (every tensor) and KEY.safetensors per top-level key holding tensors")
