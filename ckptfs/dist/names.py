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


def checkpoint_id_of(model: str, step) -> str:
    """The ``checkpoint_id`` of a DCP storage of ``model`` at ``step`` (None: the newest):
    ``ckptfs:MODEL@STEP``, which ``step_of_checkpoint_id`` reads back."""
    return f"ckptfs:{model}@{'newest' if step is None else step}"


def step_of_checkpoint_id(checkpoint_id, model: str, given_as: str) -> int | None:
    """The step a ``checkpoint_id`` passed to ``dcp.save`` / ``dcp.load`` beside a ckptfs storage
    of ``model`` names (None: the newest): ``ckptfs:MODEL@STEP`` (or ``@newest``), as the storage's
    own ``checkpoint_id`` says, or a path whose last name is ``step-N`` (torchtitan's folders, the
    mount's version directories), ``checkpoint-N`` (Hugging Face's Trainer), ``iter_N`` (Megatron)
    or ``latest`` (the newest). ValueError, in the words of ``given_as`` (where the user gave
    the model), for another model or anything else: an id that was ignored loaded the newest step
    in silence where the caller asked for another."""
    import os
    import re

    text = os.fspath(checkpoint_id)
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    if text.startswith("ckptfs:"):
        named, at, step = text[len("ckptfs:"):].rpartition("@")
        if not at or named != model:
            raise ValueError(f"checkpoint_id={text!r} names {'model ' + repr(named) if at else 'no step'}, and the "
                             f"{given_as} is of {model!r}: pass checkpoint_id='ckptfs:{model}@STEP', or none")
    else:
        last = os.path.basename(text.rstrip("/"))
        found = re.fullmatch(r"(?:step|checkpoint|iter)[-_](\w+)|(latest)", last)
        if found is None:
            raise ValueError(f"checkpoint_id={text!r} names no step of {model!r}: pass 'ckptfs:{model}@STEP', a path "
                             f"ending in step-N (checkpoint-N, iter_N) or latest, or no checkpoint_id (the "
                             f"{given_as}'s step is used)")
        step = "newest" if found.group(2) else found.group(1)
    if step == "newest":
        return None
    if not (step.isascii() and step.isdigit()):
        raise ValueError(f"checkpoint_id={text!r}: {step!r} is not a step (a whole number)")
    return int(step)
