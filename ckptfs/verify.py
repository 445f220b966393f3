"""``Store.verify``: every tensor of the selected versions against its CRC, and the damage
outside them (superblocks, model table entries, latest pointers, slot headers)."""
from __future__ import annotations

from typing import Callable

from ckptfs.dist.parts import part_problems
from ckptfs.errors import CorruptionError, NotFoundError, RegionFormatError, no_step
from ckptfs.reader import VerifyProblem, VersionData
from ckptfs.region.format import COUNTER_MAX


def verify(store, model: str | None = None, step: int | None = None,
           progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
    """Check every tensor of the selected versions against its CRC; [] means all good. Of
    a ``model`` saved by many ranks (DCP), each version's parts in this region are checked
    with it; a part that is gone is a problem of the latest, of a kept version and of a
    ``step`` asked for (the other steps whose parts went back to their rings are not listed:
    ``ckptfs ls``; nor is an earlier save of a step saved again, whose parts go back)."""
    problems: list[VerifyProblem] = []
    region_models = store.models()
    models = [model] if model is not None else region_models  # the whole region: parts are models
    if model is None:
        problems += region_problems(store)
    for name in models:
        try:
            entry = store.region.get(name)
        except NotFoundError:
            if model is not None:
                raise
            continue  # removed since the listing (`ckptfs rm --all` beside it)
        targets = [v for v in store.region.committed(entry) if step is None or v.header.step == step]
        if step is not None and not targets:
            raise no_step(name, step)
        if step is None:
            problems += model_problems(store, entry)
        latest = store.region.latest(entry)
        newest = {v.header.step: v.header.counter for v in targets}  # in counter order: a step's last save
        checked = 0
        for v in targets:
            if not store.region.pin(v):
                continue  # reused since listing: nothing left to verify
            checked += 1
            try:
                manifest = store.region.read_manifest(v)
                problems += VersionData(store.region, v.data_base, manifest).verify(progress)
                if model is not None:
                    info = store._info(v, latest)
                    hidden = newest[info.step] != info.counter
                    problems += part_problems(store, name, manifest, progress, skip_gone=hidden or (
                        step is None and not info.latest and not info.kept), models=region_models)
            except CorruptionError as e:
                problems.append(VerifyProblem(name, v.header.step, None, str(e)))
            finally:
                store.region.unpin(v)
        if step is not None and not checked:  # every save of it went meanwhile: not "verified"
            raise no_step(name, step)
    return problems

def region_problems(store) -> list[VerifyProblem]:
    """Damage outside the versions: superblock and its backup, model table entries."""
    out = []
    region = store.region
    try:
        primary = region.primary_superblock()
    except RegionFormatError as e:
        primary = None
        out.append(VerifyProblem("<region>", -1, None, f"{e}; the region was opened from its backup superblock"))
    backup = region.backup_superblock()
    if backup is None or (primary is not None and backup != primary):
        out.append(VerifyProblem("<region>", -1, None, "the backup superblock in the region's last 4 KiB is "
                                 "missing or damaged (the region still works; re-create it to restore the copy)"))
    for index, name, what in region.damaged_entries():
        out.append(VerifyProblem(name or f"<model table entry {index}>", -1, None,
                                 f"{what}: the model is unreadable; its versions are lost"))
    for entry, what in region.entry_problems():
        out.append(VerifyProblem(entry.name, -1, None, f"model table entry {entry.index}: {'; '.join(what)}; the "
                                 "intact copy is used, and the model's next writer rewrites the other copy",
                                 repairable=True))
    return out

def model_problems(store, entry) -> list[VerifyProblem]:
    """Damage of a model outside its intact versions: the latest pointer, unreadable headers."""
    out = []
    counter = store.region.counter_word(entry)
    if counter > COUNTER_MAX:
        out.append(VerifyProblem(entry.name, -1, None, f"the version counter holds {counter:#x}, more than a latest "
                                 "pointer can name: the model table entry is damaged; new saves of this model "
                                 "are refused (export its versions and re-create it)"))
    problem = store.region.latest_problem(entry)
    if problem is not None:
        out.append(VerifyProblem(entry.name, -1, None, f"{problem}; `load` falls back to the newest intact version"))
    for v in store.region.committed(entry):
        if store.region.header_copy_lost(entry, v.slot):
            out.append(VerifyProblem(entry.name, v.header.step, None,
                                     f"one copy of the header of slot {v.slot} (region offset "
                                     f"{entry.slot_offset(v.slot)}) is damaged, or was torn by a crash; the intact "
                                     "copy is used, and the model's next writer rewrites the other copy",
                                     repairable=True))
    for slot, offset, index in store.region.unreadable_slots(entry):
        said = (f"its index says step {index.step} ({len(index.tensors)} tensors)" if index is not None
                else "its index is unreadable too")
        out.append(VerifyProblem(entry.name, index.step if index is not None else -1, None,
                                 f"the header of slot {slot} (region offset {offset}) is unreadable -- damaged, "
                                 f"or torn by a crash while it was rewritten; {said}; that version is lost"))
    return out
