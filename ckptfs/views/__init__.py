"""Standard files synthesized from a checkpoint's manifest, as segment lists (views).

A view is computed from the manifest alone, never from tensor bytes: literal header bytes and
extents of the version's data area (offsets as in ``TensorRecord.offset``). The FUSE filesystem
and ``ckptfs export`` serve ``View.read(offset, size, version.read)`` /
``View.iter_blocks(version.read)`` from it: ``Version.read`` (ckptfs.reader.VersionData) is the
one place that turns a data offset into a region address and checks the tensors' CRCs.

Each view module registers the files it contributes (``ckptfs.views.registry``):
``torch`` gives ``checkpoint.pt``; ``safetensors`` gives ``state.safetensors`` (every tensor) and
``<key>.safetensors`` per top-level key of a dict root holding such tensors; ``metadata`` gives
``metadata.json``; ``files`` the extra files saved with the version; ``hf`` an ``hf/`` directory
for ``from_pretrained`` where a ``config.json`` was saved. ``files_for(manifest, views=None)``
lists them in that order.

What the views rely on from the write path: every ``TensorRecord`` holds its tensor's bytes,
contiguous, in the writing machine's byte order, at ``offset`` in the data area, and its
``crc32`` is the CRC32 of exactly those ``nbytes`` bytes (0 for an empty tensor).
"""
from __future__ import annotations

from ckptfs.dist.names import RECORD_FILES
from ckptfs.views.segments import Extent, Literal, View, ViewBuilder
# Importing a view module registers it; the order of these imports is the listing order.
from ckptfs.views.torchzip import CHECKPOINT_FILE, torch_zip_view
from ckptfs.views.safetensors import STATE_FILE, key_file_name, safetensors_view
from ckptfs.views.metadata import METADATA_FILE, metadata_json_view
from ckptfs.views.hf import HF_DIR, extra_files, hf_files
from ckptfs.views.registry import ViewSpec, check_view_ids, files_for, register, registered_views

# the names ckptfs's own views take at a version's root: an extra file of one of these names was
# hidden by the view's file, or hid the view's (a file "hf" hid the hf/ directory), in silence
OWN_ROOT_NAMES = (CHECKPOINT_FILE, STATE_FILE, METADATA_FILE, HF_DIR)
OWN_ROOT_SUFFIX = ".safetensors"  # <key>.safetensors


def is_views_own(name: str) -> bool:
    """Whether ``name`` is one the views of every version give their own files at its root
    (``OWN_ROOT_NAMES``, ``*.safetensors``): no extra file may take it."""
    return name in OWN_ROOT_NAMES or name.endswith(OWN_ROOT_SUFFIX)


def checked_extra(extra: dict | None, *, records: bool = False) -> tuple[tuple[str, str], ...]:
    """The extra files of a save (``save(extra=)``) as (name, text), every rule of them checked
    (``manifest.encode_files``: the values; ``check_extra_names``: the names): TypeError /
    ValueError in the argument's words, before anything is written."""
    from ckptfs.manifest import encode_files

    files = encode_files(extra)
    check_extra_names((name for name, _ in files), records=records)
    return files


def check_extra_names(names, *, records: bool = False) -> None:
    """ValueError, in the words of ``save(extra=)``, for an extra file named as ``is_views_own``,
    or as the records of a multi-rank version (``RECORD_FILES``: one of them alone made a version
    of one process read as multi-rank, and unreadable), unless ``records`` (ckptfs's own writers
    of those versions)."""
    for name in names:
        if is_views_own(name):
            raise ValueError(f"extra: {name!r} is a name ckptfs gives its own files in every version "
                             f"({', '.join(OWN_ROOT_NAMES[:3])}, {HF_DIR}/, <key>{OWN_ROOT_SUFFIX}): name it otherwise")
        if name in RECORD_FILES and not records:
            raise ValueError(f"extra: {name!r} is a name ckptfs gives the records of a checkpoint of many ranks "
                             f"({', '.join(sorted(RECORD_FILES))}): name it otherwise")


__all__ = ["CHECKPOINT_FILE", "HF_DIR", "METADATA_FILE", "OWN_ROOT_NAMES", "STATE_FILE", "Extent", "Literal", "View",
           "ViewBuilder", "check_extra_names", "checked_extra", "extra_files", "hf_files", "is_views_own",
           "ViewSpec", "check_view_ids", "files_for", "key_file_name", "metadata_json_view", "register",
           "registered_views", "safetensors_view", "torch_zip_view"]
