"""The extra files of a version (``save(..., extra={...})``) and the Hugging Face directory.

``files``: each extra file at the root of the version directory (``config.json`` beside
``checkpoint.pt``). ``hf``: where the extras hold a ``config.json``, a directory ``hf/`` that
``transformers``' ``from_pretrained`` opens as it is: the extras (not ckptfs's own records of a
multi-rank version: ``dcp-metadata.json``, ``dcp-parts.json``), and ``model.safetensors`` with the
tensors under the top-level key ``model`` named as in ``model.state_dict()`` (the whole state when
the object has no such key), a tied tensor under each of its names (see
ckptfs.views.safetensors), without the prefix a wrapper puts before every name (DDP's
``module.``, torch.compile's ``_orig_mod.``). One file of any size: ``from_pretrained`` reads
unsharded safetensors of every size. An extra named as ``save_pretrained``'s weights or their
index is not shown in ``hf/`` (an index naming shards that are not there sent loaders that
prefer an index, accelerate's, after them).
"""
from __future__ import annotations

from ckptfs.dist.names import RECORD_FILES
from ckptfs.manifest import Manifest
from ckptfs.views.registry import register
from ckptfs.views.safetensors import safetensors_view
from ckptfs.views.segments import Literal, View

HF_DIR = "hf"
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
MODEL_KEY = "model"
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # save_pretrained's shards
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")


def text_view(text: str) -> View:
    """A file holding ``text`` as UTF-8."""
    return View([Literal(text.encode("utf-8", "surrogatepass"))])


def extra_files(manifest: Manifest) -> dict[str, View]:
    """The version's extra files, by name."""
    return {name: text_view(text) for name, text in manifest.files}


def hf_files(manifest: Manifest) -> dict[str, View]:
    """``hf/<extra>`` and ``hf/model.safetensors`` where the extras hold a ``config.json``."""
    if HF_CONFIG not in dict(manifest.files):
        return {}
    files = {f"{HF_DIR}/{name}": view for name, view in extra_files(manifest).items()
             if name not in RECORD_FILES and name not in HF_INDEXES + HF_SINGLE}
    has_model_key = bool(manifest.refs_under(MODEL_KEY))
    # a tied tensor under each of its names: from_pretrained of the base model (AutoModel) of
    # a checkpoint whose head's name came first (XLM-R, a sorted state dict) found no embeddings;
    # the names of a DDP-wrapped or compiled model's state dict without their wrappers' prefix,
    # as save_pretrained of the model itself names them (with it, from_pretrained found none)
    weights = safetensors_view(manifest, key=MODEL_KEY if has_model_key else None, every_name=True,
                               unwrapped=True)
    if weights is not None:
        files[f"{HF_DIR}/{HF_WEIGHTS}"] = weights
    return files


register("files", extra_files, summary="the extra files saved with the version (save(..., extra=...))")
register("hf", hf_files, summary="hf/: a Hugging Face model directory, where a config.json was saved")
