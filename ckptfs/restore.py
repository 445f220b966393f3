"""Loading a version into tensors (``Store.load``; the DCP load's copies): the chunks that
``VersionData.scan`` reads are copied into fresh tensors or into the caller's, as they come in.
Apart from ckptfs.reader, which needs no torch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.graph import increment_version

from ckptfs.chunks import Chunk, copy_runs
from ckptfs.errors import CorruptionError, UnsupportedObjectError
from ckptfs.flatten import flatten, plain_node
from ckptfs.gcpause import paused_gc
from ckptfs.manifest import Manifest
from ckptfs.skeleton import map_tensor_refs, ref_names, tensor_refs, unflatten
from ckptfs.units import align_up
from ckptfs.memcopy import HostTargets, prefaulted
from ckptfs.reader import VersionData
from ckptfs.writer.staging import StagingBuffer


def restore(data: VersionData, map_location="cpu", verify: bool = True, into=None,
            fill: Callable[[list[torch.Tensor | None]], None] | None = None, keys=None):
    """The saved object, with every tensor on ``map_location``; CorruptionError naming the
    first damaged tensor (when ``verify``). ``keys``: top-level keys of the saved dict (a str
    for one); the result holds only those entries, and only their tensors are read and
    checked (``select_keys``). ``into``: an object of the result's structure (the state dicts
    of the model and optimizer being resumed) whose tensors are overwritten in place instead
    (on their own devices; no new tensor memory); the result is the saved object over those
    tensors. ``fill``: what reads the stored tensors into the tensors made here (one per
    record of ``data.manifest``, contiguous; None for a record not wanted), for data that is
    not one version's area (a multi-rank version's whole tensors: ckptfs.dist.whole); else
    ``read_into``."""
    # tens of thousands of tensors, pieces and CRCs are made here: see ckptfs.gcpause
    with paused_gc():
        return _restore(data, map_location, verify, into, fill, keys)


def select_keys(manifest: Manifest, keys) -> tuple[dict, set[int] | None]:
    """(the skeleton of the saved object restricted to top-level entries ``keys``, in the
    saved order; the indices of the stored tensors it refers to), or (the whole skeleton, None)
    where ``keys`` is None. ValueError, in the words of the argument, where the saved object is
    not a dict or lacks one of the keys."""
    if keys is None:
        return manifest.skeleton, None
    keys = key_list(keys)
    (kind, value), = manifest.skeleton.items()
    where = f"{manifest.model} step {manifest.step}"
    if kind not in ("dict", "odict"):
        raise ValueError(f"keys={keys!r}: {where} is not a dict (its saved object is a {kind}); load it whole "
                         "(keys=None)")
    # compared as skeleton nodes, as the keys are stored: the key 0 is not False, nor 1.0
    chosen = []
    for key in keys:
        try:
            chosen.append(plain_node(key))
        except UnsupportedObjectError:
            chosen.append(None)  # not a key any saved dict can have
    stored_keys = [k for k, _ in value]
    for key, node in zip(keys, chosen):
        if node not in stored_keys:
            have = [unflatten(k, []) for k, _ in value]
            raise ValueError(f"keys=: {where} has no top-level key {key!r}; it has "
                             f"{', '.join(map(repr, have[:8]))}{', ...' if len(have) > 8 else ''}")
    skeleton = {kind: [item for item in value if item[0] in chosen]}
    refs: list = []
    tensor_refs(skeleton, (), refs)
    return skeleton, {i for _, i in refs}


def key_list(keys) -> list:
    """``keys`` (Store.load's: an iterable of top-level keys, or one str) as a list; ValueError,
    in the words of the argument, for anything else."""
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, (bytes, bytearray, dict)) or not hasattr(keys, "__iter__"):
        raise ValueError(f"keys={keys!r:.60}: pass top-level keys of the saved dict, e.g. keys=['model']")
    chosen = list(keys)
    if not chosen:  # a load of nothing is a mistake in the caller's selection, not a request
        raise ValueError(f"keys={keys!r:.60} selects nothing: pass top-level keys of the saved dict (e.g. "
                         "keys=['model']), or keys=None for the whole object")
    return chosen


def load_device(map_location) -> torch.device:
    """The device of ``map_location`` (None: the CPU) once it is known to be usable here; a
    ValueError, in the words of the argument, before anything is read otherwise. torch.load's
    dict and function forms map the devices a file records; a version records none (its
    tensors load onto the CPU unless asked), so they are refused with what to pass instead."""
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, dict) or callable(map_location):
        raise ValueError(f"map_location={map_location!r:.60}: ckptfs loads onto one device (a str such as 'cuda:1' or "
                         "a torch.device; the CPU by default); a version does not record the devices it was saved "
                         "from, so torch.load's dict and function forms have nothing to map")
    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"map_location={map_location!r:.60} is not a device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"map_location={map_location!r}: torch.cuda.is_available() is False on this machine; load "
                         "onto the CPU (the default, map_location='cpu') and move the tensors where they are needed")
    if device.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, ImportError) as e:  # a backend this torch lacks, an index past the devices
            raise ValueError(f"map_location={map_location!r}: {str(e).splitlines()[0]}") from None
    return device


def _restore(data: VersionData, map_location, verify: bool, into, fill, keys):
    m = data.manifest
    device = load_device(map_location)
    skeleton, wanted = select_keys(m, keys)
    onto_device = into is None and device.type != "cpu"
    targets = None
    if into is not None:
        targets, untied, shown = matching_tensors(m, into, skeleton)
        # a target that is not contiguous (a channels_last weight, its optimizer's moments) is
        # read into a contiguous tensor of its own and copied over once the read is checked
        tensors = [t if t is None or t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                   for t in targets]
    elif onto_device:
        tensors = staging_views(m.tensors, pin=device.type == "cuda", wanted=wanted)
    else:
        tensors = [torch.empty(r.shape, dtype=r.torch_dtype) if wanted is None or i in wanted else None
                   for i, r in enumerate(m.tensors)]
    if fill is not None:
        fill(tensors)
    else:
        read_into(data, tensors, verify, prefault=into is None)
    if targets is not None:
        with torch.no_grad():  # a Parameter's in place, as its contiguous bytes were read into it
            for target, t in zip(targets, tensors):
                if t is not target:
                    target.copy_(t)
            for extra, i in untied:  # the saved tensor's other names, not tied in into=
                extra.copy_(targets[i])
        if shown is not None:  # into='s own tensors at those names, as it holds them apart
            return unflatten(*shown)
        tensors = targets
    if onto_device:
        # from pinned memory the copies are asynchronous: one wait for all of them
        tensors = [t if t is None else t.to(device, non_blocking=True) for t in tensors]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return unflatten(skeleton, tensors)


def _may_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: False where each of its strides, smallest
    first, passes the span of the dimensions before it (a transposed, sliced or strided view),
    True for an expand()ed view (a stride of 0) and for an as_strided view this cannot clear.
    (torch's own check answers "too hard to tell" for every view that is not dense: a column
    slice was refused.)"""
    span = 1
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False


def _sharing_memory(tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """Two of ``tensors`` (distinct views) with elements in common, or None. Only those whose
    byte spans meet in memory are compared, element by element, on a mask of the bytes they
    span (views of one fused weight, its rows or its columns, share no element)."""
    spans: dict = {}  # device -> [(start, end, index)]
    for j, t in enumerate(tensors):
        n = t.numel()
        if n:
            size = t.element_size()
            reach = n * size if t.is_contiguous() else \
                (sum((k - 1) * st for k, st in zip(t.shape, t.stride())) + 1) * size
            spans.setdefault(t.device, []).append((t.data_ptr(), t.data_ptr() + reach, j))
    for on_device in spans.values():
        on_device.sort()
        group, end = [], 0
        for lo, hi, j in on_device + [(float("inf"), 0, -1)]:  # (a sentinel closes the last group)
            if lo < end:
                group.append((lo, j))
                end = max(end, hi)
                continue
            if len(group) > 1:
                found = _common_elements(tensors, group, end)
                if found is not None:
                    return found
            group, end = [(lo, j)], hi
    return None


def _common_elements(tensors: list[torch.Tensor], group: list[tuple[int, int]], top: int) -> tuple[int, int] | None:
    """Of ``group`` ((start address, index) of tensors whose spans meet, ending at ``top``), two
    with a byte in common, or None (a mask of a byte per byte of their span)."""
    base = group[0][0]

    def marks(mask, lo, j):  # the bytes of tensors[j] in ``mask``
        t, size = tensors[j], tensors[j].element_size()
        return mask.as_strided((*t.shape, size), (*(st * size for st in t.stride()), 1), lo - base)

    mask = torch.zeros(top - base, dtype=torch.bool, device=tensors[group[0][1]].device)
    for n, (lo, j) in enumerate(group):
        mine = marks(mask, lo, j)
        if mine.any():  # which of the ones before: each alone (only on the way to the error)
            for lo_k, k in group[:n]:
                alone = torch.zeros_like(mask)
                marks(alone, lo_k, k).fill_(True)
                if marks(alone, lo, j).any():
                    return k, j
        mine.fill_(True)
    return None


def read_into(data: VersionData, tensors: list[torch.Tensor | None], verify: bool, prefault: bool) -> None:
    """Read every stored tensor of ``data`` into ``tensors`` (one per record, contiguous, of its
    size; None: a record not wanted, whose bytes are neither read nor checked); CorruptionError
    naming the first damaged one when ``verify``. ``prefault``: the tensors' memory is fresh
    (see ckptfs.memcopy.prefaulted)."""
    records = data.manifest.tensors
    sinks = {i: [(0, r.nbytes, t)] for i, (r, t) in enumerate(zip(records, tensors)) if t is not None}
    only = None if len(sinks) == len(records) else set(sinks)
    with prefaulted([t for t in tensors if t is not None] if prefault else []):
        bad = data.scan(copy_out(sinks, records, only), only=only)
    if verify and bad:
        raise CorruptionError(data.damage_message(bad[0][0]))


STAGING_ALIGN_BYTES = 64


def staging_views(records, pin: bool, wanted: set[int] | None = None) -> list[torch.Tensor | None]:
    """Host tensors for ``records`` (those in ``wanted``; None for the others), as views of one
    block of memory (pinned where ``pin``):
    the staging of a load onto another device, whose copies there are the result. One pinned
    allocation for the whole version instead of one per tensor (each a driver call), and no
    second host copy (``pin_memory()`` of each loaded tensor copied it once more). The views
    share one storage, so they are never handed to the caller."""
    offsets, total = [], 0
    for i, r in enumerate(records):
        offsets.append(total if wanted is None or i in wanted else None)
        if offsets[-1] is not None:
            total += align_up(r.nbytes, STAGING_ALIGN_BYTES)
    block = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
    return [None if o is None else block[o:o + r.nbytes].view(r.torch_dtype).view(r.shape)
            for o, r in zip(offsets, records)]


Sinks = dict[int, list[tuple[int, int, torch.Tensor]]]


def copy_out(sinks: Sinks, records, only: set[int] | None = None) -> Callable[[StagingBuffer, Chunk], list[int]]:
    """A scan's ``on_chunk`` that copies, as the chunks come in, the bytes [lo, hi) of stored
    tensor i (``records[i]``) into each ``(lo, hi, dest)`` of ``sinks[i]`` (``dest``: a
    contiguous tensor of hi - lo bytes, on any device).

    Host destinations are written by one native call per chunk with the GIL released, so the
    reader threads copy in parallel (a torch copy_ per piece held the GIL for most of a load of
    many small tensors); a chunk whose every piece goes whole into a host tensor is passed as it
    is. The same call takes the CRCs of the chunk's pieces in its pass over the buffer:
    ``on_chunk`` returns them, and is marked ``gives_crcs`` for Scan.check. Other devices'
    destinations take a copy_ per piece. ``only``: the stored tensors the scan reads (its own
    ``only``), where not all."""
    host: list[torch.Tensor | None] = [None] * len(records)  # [i]: all of stored tensor i
    partial: dict[int, list[tuple[int, int, int | torch.Tensor]]] = {}
    for index, dests in sinks.items():
        for lo, hi, dest in dests:
            if not dest.is_cpu:
                # a detached view: a parameter that requires grad is written like any tensor
                partial.setdefault(index, []).append((lo, hi, dest.detach().view(-1).view(torch.uint8)))
            elif host[index] is None and lo == 0 and hi == records[index].nbytes:
                host[index] = dest
            else:
                partial.setdefault(index, []).append((lo, hi, len(host)))
                host.append(dest)
    every_whole = not partial and all(host[i] is not None or records[i].nbytes == 0
                                      for i in (range(len(records)) if only is None else only))
    targets = HostTargets(host)
    # written by address, not by a torch op: tell autograd, as copy_ would, so that a graph that
    # saved one of these tensors refuses to run backward through the old values
    increment_version([t for t in host if t is not None])

    def on_chunk(buf: StagingBuffer, chunk: Chunk) -> list[int]:
        if every_whole:
            return targets.scatter_crc32(buf.mapping, chunk.pieces, chunk.pieces)
        runs = copy_runs(chunk.pieces)
        spans = [p for p in runs if host[p.tensor] is not None]
        for p in runs:
            for lo, hi, dest in partial.get(p.tensor, ()):
                a, b = max(lo, p.tensor_start), min(hi, p.tensor_start + p.length)
                if a < b:
                    start = p.buffer_start + a - p.tensor_start
                    if isinstance(dest, int):
                        spans.append((dest, a - lo, b - a, start))
                    else:
                        dest[a - lo:b - lo].copy_(buf.tensor[start:start + b - a])
        return targets.scatter_crc32(buf.mapping, spans, chunk.pieces)
    on_chunk.gives_crcs = True  # Scan.check takes the CRCs it returns
    return on_chunk


def matching_tensors(manifest: Manifest, into, skeleton: dict | None = None) -> tuple[
        list[torch.Tensor | None], list[tuple[torch.Tensor, int]], tuple[dict, list[torch.Tensor]] | None]:
    """Match ``into``'s tensors to the stored ones by key path (the order of keys may differ)
    of the saved object, or of its part ``skeleton`` (``select_keys``):
    (the tensor of ``into`` that each stored tensor is read into, in the manifest's order, None
    for one outside ``skeleton``;
    (tensor, stored index) of each other tensor of ``into`` that the same stored tensor fills;
    None, or where there are such, the skeleton and tensors to ``unflatten`` the loaded object
    from). ValueError naming the first difference, before anything is written into them: a key
    path one side lacks, a dtype or shape that differs, one tensor of ``into`` at the names of
    two stored tensors (which bytes should it hold?), elements that share memory, in one tensor
    or between two (any strides are taken otherwise). A stored tensor at several names (tied weights, e.g.
    ``lm_head.weight`` and ``transformer.wte.weight``) may be separate tensors in ``into`` (an
    untied model): each gets the saved bytes, as ``load_state_dict`` of a ``torch.load``
    would copy them. A name only ``into`` has is no difference where its tensor is one that
    a stored name fills (a tied alias the checkpoint holds once, as ``save_pretrained`` stores
    ``lm_head.weight``: a Hugging Face model's state dict, loaded from its import)."""
    try:
        flat = flatten(into)
    except UnsupportedObjectError as e:
        raise ValueError(f"into= holds something that is not a state: {e}") from None
    skeleton = manifest.skeleton if skeleton is None else skeleton
    saved: list = []
    have: list = []
    tensor_refs(skeleton, (), saved, exact=True)
    tensor_refs(flat.skeleton, (), have, exact=True)
    at = dict(have)  # key path -> index in flat.tensors
    stored_of: dict[int, int] = {}  # index in flat.tensors -> stored index
    first: dict[int, int] = {}  # stored index -> index in flat.tensors of its first name
    missing = False
    for path, i in saved:
        j = at.get(path)
        if j is None:
            missing = True
            break
        if stored_of.setdefault(j, i) != i:
            other = next(p for p, _ in saved if at.get(p) == j)
            raise ValueError(f"into= holds one tensor at {_saved_name(skeleton, saved, other)!r} and at "
                             f"{_saved_name(skeleton, saved, path)!r}, which {manifest.model} step {manifest.step} "
                             "stores apart: pass a tensor of its own for each (clone() one)")
        first.setdefault(i, j)
    if missing or any(j not in stored_of for j in at.values()):  # a key path one side lacks
        _key_paths_differ(manifest, skeleton, flat, saved, have, at, into)
    for j, t in enumerate(flat.tensors):
        record = manifest.tensors[stored_of[j]]
        name, dtype, shape = flat.signature[j]
        if (dtype, shape) != (record.dtype, record.shape):
            i = stored_of[j]
            tie = next(p for p, k in saved if k == i)  # the stored tensor's first place in the selection
            shares = "" if first[i] == j else \
                f" (a name that shares {_saved_name(skeleton, saved, tie)!r} in the checkpoint)"
            raise ValueError(f"into= differs from {manifest.model} step {manifest.step} at {name!r}{shares}: saved "
                             f"{record.dtype}{list(record.shape)}, into= has {dtype}{list(shape)}")
        if not t.is_contiguous() and _may_overlap(t):
            raise ValueError(f"into= tensor {name!r} has elements that may share memory (an expand()ed or "
                             "as_strided view): it cannot be loaded in place; pass a tensor of its own (clone() it)")
    shared = _sharing_memory(flat.tensors)
    if shared is not None:  # the later write won: one target held the other's values
        a, b = (flat.signature[j][0] for j in shared)
        raise ValueError(f"into= tensors {a!r} and {b!r} share memory (views of one tensor that overlap): they "
                         "cannot both be loaded in place; pass a tensor of its own for one (clone() it)")
    targets = [flat.tensors[first[i]] if i in first else None for i in range(len(manifest.tensors))]
    untied = [(flat.tensors[j], i) for j, i in stored_of.items() if first[i] != j]
    if not untied:
        return targets, [], None
    # the loaded object holds into='s own tensors at every name, as it holds them apart
    at_ref = iter([at[path] for path, _ in saved])  # map_tensor_refs visits them in tensor_refs' order
    return targets, untied, (map_tensor_refs(skeleton, lambda _: next(at_ref)), list(flat.tensors))


def _key_paths_differ(manifest: Manifest, skeleton: dict, flat, saved: list, have: list, at: dict, into) -> None:
    """The ValueError of an ``into`` (``flat``, whose tensor references are ``have``, by key path
    in ``at``) whose key paths differ from those of the saved ``skeleton`` (``saved``), naming
    a few of each side's own (in the words of dotted names)."""
    saved_paths = {path for path, _ in saved}
    only_into = [path for path, _ in have if path not in saved_paths]
    only_saved = [path for path, _ in saved if path not in at]
    into_names = dict(zip([p for p, _ in have], _names(flat.skeleton)))
    saved_names = _saved_names(skeleton, saved)
    alike = {into_names[p] for p in only_into} & {saved_names[p] for p in only_saved}
    said = "; ".join(part for part in (
        f"only into= has {', '.join(repr(into_names[p]) for p in only_into[:3])}" if only_into else "",
        f"only the checkpoint has {', '.join(repr(saved_names[p]) for p in only_saved[:3])}" if only_saved else "",
        f"{min(alike)!r} on both sides is a key or a list's item of another type" if alike else "") if part)
    stored = len({i for _, i in saved})
    if only_saved and not only_into and isinstance(into, dict) and \
            all(type(p[0]) is str and p[0] not in into for p in only_saved):
        # whole top-level entries that into= leaves out (the optimizer's): a load of the rest
        advice = f": to load only the entries into= holds, pass keys={list(into)!r:.80}"
    elif only_saved and not only_into and len(flat.tensors) < stored:
        advice = (": an optimizer has no state before its first step; load without into= and pass the parts to "
                  "load_state_dict (obj = store.load(...); opt.load_state_dict(obj['optim']))")
    else:
        advice = ": pass state dicts of the structure the checkpoint was saved from"
    raise ValueError(f"into= holds {_tensors(len(flat.tensors))} and {manifest.model} step {manifest.step} holds "
                     f"{_tensors(stored)} ({said}){advice}")


def _tensors(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _saved_name(skeleton: dict, saved: list, path: tuple) -> str:
    """The dotted name of exact key ``path`` of ``skeleton`` (whose references are ``saved``)."""
    return _saved_names(skeleton, saved)[path]


def _saved_names(skeleton: dict, saved: list) -> dict[tuple, str]:
    """{exact key path: dotted name} of the tensor references ``saved`` of ``skeleton``."""
    return dict(zip([p for p, _ in saved], _names(skeleton)))


def _names(skeleton: dict) -> list[str]:
    """The dotted name of each tensor reference of ``skeleton``, in tensor_refs' order."""
    refs: list = []
    tensor_refs(skeleton, (), refs)
    return ref_names(refs)
