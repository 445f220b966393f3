"""How a multi-rank checkpoint is named in a region, without torch.distributed: the part models
of the ranks and the file that marks a global version. The CLI and the mount recognize such
versions through this module, and import the DCP machinery (``ckptfs.dist.storage``,
``ckptfs.dist.whole``: half a second of imports) only when they meet one."""
from __future__ import annotations

METADATA_FILE = "dcp-metadata.json"  # a global version's file: DCP's metadata, each item's place
PARTS_FILE = "dcp-parts.json"  # the whole view's file: which rank's part is where, what is not shown
# the files ckptfs itself puts in a multi-rank version directory, beside the saver's extras: not
# part of a model directory (hf/ copies the extras only)
RECORD_FILES = frozenset({METADATA_FILE, PARTS_FILE})


def part_model(model: str, rank: int) -> str:
    """The model holding rank ``rank``'s parts of ``model``'s DCP checkpoints."""
    return f".{model}.rank{rank}"


def _is_rank(text: str) -> bool:
    return text.isascii() and text.isdigit()


def is_part_model(name: str) -> bool:
    """Whether ``name`` has the form of a part model (``.MODEL.rank<R>``): kept for ckptfs's own
    multi-rank saves, never a name a user saves or imports under (a removal of MODEL takes it)."""
    head, dot_rank, rank = name.rpartition(".rank")
    return name.startswith(".") and bool(dot_rank) and len(head) > 1 and _is_rank(rank)


def refuse_part_name(model) -> None:
    """InvalidNameError for a model name of a part model's form (``is_part_model``)."""
    from ckptfs.errors import InvalidNameError

    if isinstance(model, str) and is_part_model(model):
        raise InvalidNameError(f"model name {model!r} has the form of the parts of a multi-rank checkpoint "
                               "(.MODEL.rank<R>), which ckptfs names itself; choose another name")


def part_models(store, model: str, models: list[str] | None = None) -> list[str]:
    """The part models of ``model`` in ``store``'s region (those ``part_model`` names), among
    ``models`` where the caller listed them already."""
    prefix = part_model(model, 0)[:-1]
    return [m for m in (store.models() if models is None else models)
            if m.startswith(prefix) and _is_rank(m[len(prefix):])]


def is_global_version(manifest) -> bool:
    """Whether a version (its manifest) is the global version of a multi-rank DCP checkpoint."""
    return any(name == METADATA_FILE for name, _ in manifest.files)
