"""A rank's part of a multi-rank (DCP) version: where the global version's metadata says each
part is, the part opened and pinned, and its lifecycle: a part is written **kept** (no ring reuses
it while a global version may name it), and given back to its ring once no global version
can name it any more: superseded by a newer global step, or of a step that never completed
(``docs/DISTRIBUTED.md``). No torch here: the mount and the CLI read parts through it."""
from __future__ import annotations

import contextlib
import logging
import re
import threading

from ckptfs.dist.names import METADATA_FILE, part_model, part_models
from ckptfs.errors import BusyError, CkptfsError, NotFoundError, PartGoneError

log = logging.getLogger("ckptfs")


def checkpoint_bytes(store, model: str, step: int) -> tuple[int, int, int] | None:
    """(bytes of the parts in ``store``'s region, ranks, ranks whose part is in another region)
    of the global DCP version ``step`` of ``model``, or None if that version is not one."""
    from ckptfs.dist.codec import placed_parts  # imports torch.distributed.checkpoint

    with store.open_version(model, step, whole=False) as v:
        text = dict(v.manifest.files).get(METADATA_FILE)
    if text is None:
        return None
    here = store.region.superblock.uuid.hex()
    parts = [(rank, region, counter) for region, rank, counter in placed_parts(text)]
    nbytes = 0
    for rank, region, counter in parts:
        if region == here:
            versions = store.versions(part_model(model, rank), hidden=True)
            nbytes += sum(x.data_bytes for x in versions if x.counter == counter)
    return nbytes, len({rank for rank, _, _ in parts}), len({rank for rank, region, _ in parts if region != here})


def open_part(store, model: str, rank: int, counter: int, checked: set | None = None,
              names: dict[int, str] | None = None):
    """The pinned part version of ``rank`` with ``counter``; PartGoneError if it is gone.
    ``checked``: as ``Store.open_version``'s; ``names``: {position in the part's item list:
    the name its errors say (``shown_item_name``)}, else they say the part's own (``items.3``)."""
    name = part_model(model, rank)
    try:
        # not waited for where held: a part named by a committed global version is committed
        # itself (held only by a removal, or a claim taking its slot), and the mount opens it on its loop
        part = store.open_version(name, checked=checked, counter=counter, wait_s=0.0, whole=False)
    except NotFoundError:
        pass  # its slot was reused
    else:
        part.data.shown_names = {f"items.{pos}": shown for pos, shown in (names or {}).items()}
        return part
    # no "load the latest" here: the latest's own part is gone where it was removed or damaged
    raise PartGoneError(f"the part of rank {rank} (counter {counter}) of {model!r} is gone from {name!r} (its slot "
                        "was reused, or it was removed): that step can no longer be loaded. A step other than the "
                        "latest holds its parts only until a newer step commits and the ranks need the space; keep "
                        f"a step to hold its parts (Store.keep, `ckptfs keep`); `ckptfs ls {model}` lists the steps "
                        "that can be loaded", rank)


def loadable(store, model: str, versions: list, models: list[str] | None = None) -> list:
    """``versions`` (VersionInfo of ``model``, as ``Store.versions``) less those that no load
    can read any more: the global versions other than the latest whose parts in this region
    are gone (given back once a newer step committed, then their slots reused). The mount and
    ``ckptfs ls`` list these; a model of one process is listed as it is. ``models``: the
    region's models, where the caller listed them already."""
    names = part_models(store, model, models)
    if not names:
        return versions
    present = {name: {v.counter for v in store.versions(name, missing_ok=True, hidden=True)} for name in names}
    out = []
    for v in versions:
        if not v.latest:
            try:
                parts = _parts_of(store, model, v.step, v.counter)
            except CkptfsError:  # a damaged record: listed, as before, and its read says what is wrong
                parts = frozenset()
            if parts is None or any(c not in present.get(part_model(model, rank), ()) for rank, c in parts):
                continue
        out.append(v)
    if versions:
        _forget_parts_before(store, model, min(v.counter for v in versions))
    return out


def part_problems(store, model: str, manifest, progress=None, skip_gone: bool = False,
                  models: list[str] | None = None) -> list:
    """The problems (reader.VerifyProblem) of the parts in ``store``'s region that the version
    of ``model`` whose index is ``manifest`` names (none for a version of one process): each
    part's tensors checked against their CRCs, and a part that is gone; nothing at all where a
    part is gone and ``skip_gone`` (a version that no load is expected to read: one whose parts
    went back to their rings, as ``loadable`` leaves out, or an earlier save of a step saved
    again). ``models``: the region's models, where the caller listed them already."""
    from ckptfs.reader import VerifyProblem

    if not part_models(store, model, models):
        return []  # a model of one process: its versions' indexes are not decoded for nothing
    problems = []
    names = _item_names(store, manifest)
    with contextlib.ExitStack() as pins:
        opened = []
        for rank, part_counter in sorted(_named_in(store, manifest)):
            try:
                opened.append(pins.enter_context(open_part(store, model, rank, part_counter,
                                                           names=names.get((rank, part_counter)))))
            except PartGoneError as gone:
                if skip_gone:
                    return []  # before reading any part
                problems.append(VerifyProblem(model, manifest.step, None, str(gone)))
        for part in opened:
            problems += part.data.verify(progress)
    return problems


def part_state(tensors: list, values: dict) -> dict:
    """What a rank saves as its part of a step: ``items``, the tensor of each of its write items
    in plan order (a byte item's ``torch.save`` bytes as uint8), and ``values``, {position: the
    value} of the byte items that are plain data (stored in the index's own encoding, never
    pickled: the whole checkpoint shows them)."""
    return {"items": tensors, "values": values}


def named_by_fqn(message: str, items: list) -> str:
    """``message``, an error about a path of ``part_state`` (``items.3: ...``, ``values.3...``),
    with that path said as the state dict's key of the item (its FQN, ``model.emb: ...``)."""
    found = re.match(r"(?:items|values)\.(\d+)(?=[.:\s\[]|$)", message)
    if found is None or int(found.group(1)) >= len(items):
        return message
    return items[int(found.group(1))].index.fqn + message[found.end():]


def _item_names(store, manifest) -> dict[tuple[int, int], dict[int, str]]:
    """{(rank, counter): {position: ``shown_item_name``}} of the items of this region's parts
    that the global version whose index is ``manifest`` names."""
    from ckptfs.dist.codec import item_places  # imports torch.distributed.checkpoint

    text = dict(manifest.files).get(METADATA_FILE)
    if text is None:  # a version saved by one process (a DCP model saved on by store.writer)
        return {}
    return shown_item_names(item_places(text), store.region.superblock.uuid.hex())


def shown_item_names(places, region: str) -> dict[tuple[int, int], dict[int, str]]:
    """``_item_names`` of ``places``, (FQN, offsets, place) of each item of a global version."""
    out: dict[tuple[int, int], dict[int, str]] = {}
    for fqn, offset, place in places:
        if place["region"] == region:
            out.setdefault((place["rank"], place["counter"]), {})[place["pos"]] = shown_item_name(fqn, offset, place["rank"])
    return out


def shown_item_name(fqn: str, offset, rank: int) -> str:
    """How errors name an item of a part (whose own name is ``items.3``): the state dict's key,
    a shard's with its offsets (``model.w@32,0``, as the mount's ``parts/`` names it), and the
    rank that saved it."""
    key = fqn if not any(offset or ()) else f"{fqn}@{','.join(map(str, offset))}"
    return f"{key} (the part of rank {rank})"


def item_records(part) -> dict[int, int]:
    """{position in the part's item list: its tensor's index in the manifest}."""
    return {int(ref.key_path[1]): ref.tensor_index for ref in part.manifest.refs() if ref.key_path[:1] == ("items",)}


def item_values(part) -> dict[int, dict]:
    """{position in the part's item list: the skeleton node of its value} of the byte items whose
    value the part holds (``part_state``; none in a part of a version before it)."""
    for key, node in part.manifest.skeleton.get("dict", ()):
        if key == {"str": "values"}:
            return {k["int"]: v for k, v in node.get("dict", ()) if type(k.get("int")) is int}
    return {}


# ------------------------------------------------ the lifecycle: kept while written, then given back
_in_flight: set[tuple[str, str, int]] = set()  # (region, part model, step) of this process's saves not yet committed
_in_flight_lock = threading.Lock()


def started(store, name: str, step: int) -> None:
    """This process began writing part model ``name``'s part of ``step``: no
    ``release_abandoned`` gives it back until ``done_with``."""
    with _in_flight_lock:
        _in_flight.add((store.path, name, step))


def done_with(store, name: str, step: int) -> None:
    """The part of ``step`` is no longer in flight (committed, or given up)."""
    with _in_flight_lock:
        _in_flight.discard((store.path, name, step))


def release_abandoned(store, model: str, name: str, step: int) -> None:
    """After a rank's commit of ``step``, or its failure: unkeep its parts older than ``step`` that
    no global version of this region needs (saves that failed or whose process died; this
    process's own saves still in flight, the latest's and kept versions' parts excepted), so that
    a job whose saves keep failing does not fill the region (the part of a failed step goes at
    the next step's commit)."""
    latest = store.latest(model, missing_ok=True)
    versions = store.versions(name, missing_ok=True, hidden=True)  # a failed attempt's part of a step saved again too
    with _in_flight_lock:
        busy = {s for path, n, s in _in_flight if path == store.path and n == name}
    milestones = named_parts(store, model, kept_only=True)
    keep_milestones_again(store, model, _unkeep(
        store, name, [v for v in versions if v.step < step and (latest is None or v.step != latest.step)
                      and v.step not in busy and (name, v.counter) not in milestones]))


_first_parts: set[tuple[str, str]] = set()  # (region, part model) this process has begun a part of


def release_earlier_runs(store, model: str, name: str, step: int) -> None:
    """Before this process's first part of part model ``name`` (its part of ``step``): unkeep
    the parts of steps up to ``step`` that earlier processes of the rank left kept and no global
    version needs (``release_abandoned``'s rule). A job restarted again and again at one step
    (a rank dying in every save) left each attempt's part kept until a later step committed,
    which never came: the attempts filled the region, then every save waited for a slot. Later
    parts of this process leave it to ``release_abandoned`` after each commit."""
    with _in_flight_lock:
        if (store.path, name) in _first_parts:
            return
        _first_parts.add((store.path, name))
    release_abandoned(store, model, name, step + 1)


def reclaim(store, model: str, keep_step: int) -> None:
    """After global step ``keep_step`` is committed in ``store``'s region: unkeep every part of
    ``model`` there older than it (superseded, or of a step that never completed), and those of
    ``keep_step`` itself written before the ones its global latest names (earlier saves of a
    step saved again: a job that resumed at the step it saves next kept one more part at every
    resume), so that the part models' rings reuse them, except the parts of kept global versions
    (milestones: ``keep``).
    Every part model, not only those of the job's ranks on this node: a job resumed at a smaller
    world size leaves the part models of its earlier ranks (ranks 2 and 3 of a job of 4 resumed
    at 2), which hold no part of this step; once no global version left in the region names
    them, they are removed, and their rings' space goes back to the region (kept, they would
    have held it for good)."""
    milestones = named_parts(store, model, kept_only=True)
    latest = store.latest(model, missing_ok=True)
    # {part model: the counter of its part that the latest (of keep_step) names}; a newer step
    # latest already: its own commit reclaims
    current = dict(named_by(store, model, [(latest.step, latest.counter)])) if latest is not None \
        and latest.step == keep_step else {}

    def superseded(name: str, v) -> bool:
        # of keep_step, the parts written before the latest's (a counter grows with every save
        # of a part model): not a save of the step again still in flight, whose part is newer
        return v.step < keep_step or (v.step == keep_step and v.counter < current.get(name, -1))
    gone = []  # part models without a part of this step: ranks the job no longer has here
    unkept = []
    for name in part_models(store, model):
        versions = store.versions(name, missing_ok=True, hidden=True)
        unkept += _unkeep(store, name, [v for v in versions if superseded(name, v) and (name, v.counter) not in milestones])
        if all(v.step < keep_step for v in versions):
            gone.append(name)
    keep_milestones_again(store, model, unkept)
    if gone:
        named = {name for name, _ in named_parts(store, model)}
        for name in gone:
            if name not in named:
                try:
                    store.remove_model(name)
                except (BusyError, NotFoundError):
                    pass  # a reader holds one of its versions (the next commit tries again), or it went


def release_unnamed(store, model: str) -> None:
    """After a save of ``model`` by a single process's writer: unkeep every part of its part
    models that no global version of ``model`` left in ``store``'s region names, and remove the
    part models none of whose parts is named. Those parts are otherwise given back only by a
    later multi-rank commit, which a model fine-tuned on by one process after its multi-rank
    saves never has: they held a whole sharded checkpoint for good, unlisted. No multi-rank save
    of ``model`` is in flight meanwhile: the single process's writer holds the model's lock
    byte exclusively, which the multi-rank writers share."""
    names = part_models(store, model)
    if not names:
        return
    named = named_parts(store, model)
    for name in names:
        versions = store.versions(name, missing_ok=True, hidden=True)
        _unkeep(store, name, [v for v in versions if (name, v.counter) not in named])
        if not any(n == name for n, _ in named):
            try:
                store.remove_model(name)
            except (BusyError, NotFoundError):
                pass  # a reader holds one of its versions (the next save tries again), or it went


def keep_parts(store, model: str, step: int, counter: int | None = None) -> list[tuple[str, int, int]]:
    """Keep the parts in ``store``'s region of global version ``step`` of ``model`` (of a step
    saved twice the newer, or the one whose counter is ``counter``; nothing for a version that
    is not one); PartGoneError, nothing kept, if one of them is gone; the error of the part that
    could not be kept (RegionFullError: its ring had no room), the others unkept again. Returns
    (part model, step, counter) of the parts it kept that were not kept before."""
    if not part_models(store, model):
        return []  # a model of one process (its index is not decoded for nothing: 40,000 tensors, 0.2 s)
    version = next((v for v in reversed(store.versions(model, hidden=True))
                    if v.step == step and counter in (None, v.counter)), None)
    wanted = _parts_of(store, model, version.step, version.counter) if version is not None else None
    found = []
    for rank, part_counter in sorted(wanted or ()):
        name = part_model(model, rank)
        match = [p for p in store.versions(name, missing_ok=True, hidden=True) if p.counter == part_counter]
        if not match:
            raise PartGoneError(f"step {step} of {model!r} cannot be kept: the part of rank {rank} is gone (its "
                                "slot was reused since); keep a newer step", rank)
        found.append((name, match[0].step, part_counter))
    newly = []  # the parts this call kept: unkept again if a later one cannot be (no half-kept version)
    try:
        for name, part_step, part_counter in found:
            if store.keep(name, part_step, counter=part_counter):
                newly.append((name, part_step, part_counter))
    except BaseException:
        for name, part_step, part_counter in newly:
            store.unkeep(name, part_step, counter=part_counter)
        raise
    return newly


def named_by(store, model: str, saves: list[tuple[int, int]]) -> set[tuple[str, int]]:
    """(part model, counter) of the parts in ``store``'s region that the global versions
    ``saves`` ((step, counter) each) of ``model`` name; empty for a model without part models."""
    if not part_models(store, model):
        return set()  # a model of one process: its versions' indexes are not decoded for nothing
    out: set[tuple[str, int]] = set()
    for step, counter in saves:
        out |= {(part_model(model, rank), c) for rank, c in _parts_of(store, model, step, counter) or ()}
    return out


def give_back_parts(store, named: set[tuple[str, int]]) -> None:
    """Unkeep the parts ``named`` ((part model, counter) each, ``named_by``): once the global
    versions that named them are removed, no load can use them, and kept, no ring reuses them."""
    by_model: dict[str, set[int]] = {}
    for name, counter in named:
        by_model.setdefault(name, set()).add(counter)
    for name, counters in by_model.items():
        _unkeep(store, name, [v for v in store.versions(name, missing_ok=True, hidden=True) if v.counter in counters])


def named_parts(store, model: str, *, kept_only: bool = False) -> set[tuple[str, int]]:
    """(part model, counter) of the parts in ``store``'s region that the global versions of
    ``model`` there name (the kept ones only, with ``kept_only``)."""
    return named_by(store, model, [(v.step, v.counter) for v in store.versions(model, missing_ok=True)
                                   if not kept_only or v.kept])


# (region, model, its creation time, counter) -> _parts_of that version. The creation time:
# a model removed and made again counts its versions from 1 again
_parts: dict[tuple[str, str, int, int], frozenset] = {}


def _forget_parts_before(store, model: str, counter: int) -> None:
    """``_parts_of``'s records of the versions of ``model`` older than ``counter`` (the oldest
    listed), and of any earlier model of that name, go: those versions are gone for good (a
    counter is never reused), and a mount or a job that lists every step kept one record per
    step it ever saw."""
    here, born = store.region.superblock.uuid.hex(), _born(store, model)
    for key in list(_parts):  # a copy: other threads (the mount's) add records meanwhile
        if key[0] == here and key[1] == model and (key[2] != born or key[3] < counter):
            _parts.pop(key, None)


def _born(store, model: str) -> int | None:
    """When ``model`` was made (its table entry's creation time), None if there is no such model."""
    try:
        return store.region.get(model).created_ns
    except NotFoundError:
        return None


def _parts_of(store, model: str, step: int, counter: int) -> frozenset | None:
    """(rank, counter) of the parts in ``store``'s region that the version ``counter`` of
    ``step`` of ``model`` names (a save hidden by a later one of its step too; empty for a
    version that is not a global one; None if it is gone). Read once per process: a version
    never changes, and its counter is never reused (by that model: one made again under its
    name after a removal counts from 1 again, and is told apart by its creation time)."""
    key = (store.region.superblock.uuid.hex(), model, _born(store, model), counter)
    named = _parts.get(key)
    if named is None:
        try:
            with store.open_version(model, step, counter=counter, whole=False) as g:
                named = _named_in(store, g.manifest)
        except NotFoundError:
            return None  # reused meanwhile: it names nothing any more
        _parts[key] = named
    return named


def _named_in(store, manifest) -> frozenset:
    """(rank, counter) of the parts in ``store``'s region that the version whose index is
    ``manifest`` names (empty for a version that is not a global one)."""
    text = dict(manifest.files).get(METADATA_FILE)
    if text is None:
        return frozenset()
    from ckptfs.dist.codec import placed_parts  # imports torch.distributed.checkpoint

    here = store.region.superblock.uuid.hex()
    return frozenset((rank, counter) for region, rank, counter in placed_parts(text) if region == here)


def _unkeep(store, name: str, versions) -> list[tuple[str, int, int]]:
    """Unkeep those of ``versions`` (of part model ``name``) that are kept; (name, step,
    counter) of each unkept."""
    done = []
    for v in versions:
        if v.kept:
            try:
                if store.unkeep(name, v.step, counter=v.counter):
                    done.append((name, v.step, v.counter))
            except NotFoundError:
                pass  # reused meanwhile: nothing to give back
    return done


def keep_milestones_again(store, model: str, unkept: list[tuple[str, int, int]]) -> None:
    """Keep again those of the parts just ``unkept`` that a kept global version of ``model``
    names now: a keep (``ckptfs keep`` beside a running job) between the read of the milestones
    and the unkeep of their parts left the milestone kept and its parts given back to their
    rings, reused by the next saves (``Store.keep`` checks its parts again after setting its
    flag, for the other order)."""
    if not unkept:
        return
    milestones = named_parts(store, model, kept_only=True)
    for name, step, counter in unkept:
        if (name, counter) in milestones:
            try:
                store.keep(name, step, counter=counter)
            except CkptfsError as e:  # its slot reused in the instant between: the keep of it fails
                log.warning("a part of kept step %d of %r could not be kept again: %s", step, model, e)
