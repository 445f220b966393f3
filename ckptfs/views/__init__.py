"""Standard files synthesized from a checkpoint's manifest, as segment lists (views).

A view is computed from the manifest alone, never from tensor bytes: literal header bytes and
extents of the version's data area (offsets as in ``TensorRecord.offset``). The FUSE filesystem
and ``ckptfs export`` serve ``View.read(offset, size, version.read)`` /
``View.iter_blocks(version.read)`` from it: ``Version.read`` (ckptfs.reader.VersionData) is the
one place that turns a data offset into a region address and checks the tensors' CRCs.

What the views rely on from the write path: every ``TensorRecord`` holds its tensor's bytes,
contiguous, in the writing machine's byte order, at ``offset`` in the data area, and its
``crc32`` is the CRC32 of exactly those ``nbytes`` bytes (0 for an empty tensor).
"""
from __future__ import annotations

import os

from ckptfs.manifest import Manifest
from ckptfs.views.metadata import metadata_json_view
from ckptfs.views.safetensors import safetensors_view
from ckptfs.views.segments import Extent, Literal, View, ViewBuilder
from ckptfs.views.torchzip import torch_zip_view

__all__ = ["CHECKPOINT_FILE", "METADATA_FILE", "STATE_FILE", "Extent", "Literal", "View",
           "ViewBuilder", "files_for", "key_file_name", "metadata_json_view", "safetensors_view",
           "torch_zip_view"]

CHECKPOINT_FILE = "checkpoint.pt"
STATE_FILE = "state.safetensors"
METADATA_FILE = "metadata.json"
_RESERVED = {CHECKPOINT_FILE, STATE_FILE, METADATA_FILE}
_NAME_MAX = 255  # bytes, Linux NAME_MAX


def files_for(manifest: Manifest) -> dict[str, View]:
    """Every file of a version directory, by name, in listing order.

    ``checkpoint.pt``; ``state.safetensors`` if any tensor can be stored in it;
    ``<key>.safetensors`` for each top-level key of a dict root whose subtree holds such a
    tensor (the key made into a safe file name, or left out when it cannot be, see
    ``key_file_name``); ``metadata.json``.
    """
    files = {CHECKPOINT_FILE: torch_zip_view(manifest)}
    state = safetensors_view(manifest)
    if state is not None:
        files[STATE_FILE] = state
    for key in _top_level_tensor_keys(manifest):
        name = key_file_name(key)
        if name is None or name in files or name in _RESERVED:
            continue
        view = safetensors_view(manifest, key=key)
        if view is not None:
            files[name] = view
    files[METADATA_FILE] = metadata_json_view(manifest)
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
    return name if len(encoded) <= _NAME_MAX else None


def _top_level_tensor_keys(manifest: Manifest) -> list[str]:
    """Top-level keys (as text, like ``TensorRef.key_path[0]``) holding tensors, in order."""
    (kind, _), = manifest.skeleton.items()
    if kind not in ("dict", "odict"):
        return []
    return list(dict.fromkeys(ref.key_path[0] for ref in manifest.refs()))
