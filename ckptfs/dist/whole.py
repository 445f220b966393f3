"""A multi-rank DCP version seen as one checkpoint of whole, unsharded tensors.

The global version of a step holds DCP's metadata: each tensor's global size and chunks, and
where each chunk is (a rank's part version, the item's position in it). ``plan_whole`` lays the
whole tensors end to end in a *virtual* data area and describes it with an ordinary Manifest,
so that every view (checkpoint.pt, the safetensors files, hf/, metadata.json) is synthesized
exactly as for a single-process version; ``WholeVersion`` serves reads of that area from the
parts, through each part's checked read path (every chunk checked against its CRC before any of
its bytes leaves), with the parts pinned while it is open.

A whole tensor is a list of ``Piece``s: runs of its row-major bytes that lie contiguously in one
chunk. Chunks split along dim 0 (FSDP, a dim-0 Shard) are one piece each; a split along a later
dim interleaves: one piece per chunk per index of the dims before it. Each whole tensor's CRC32
(checkpoint.pt's zip entries, metadata.json) is combined from its chunks' CRCs where each piece
is a whole chunk, and read once from the parts otherwise.

DCP's byte items (non-tensor values such as ``epoch``, an optimizer's ``param_groups``) are
torch.save pickles, which ckptfs never unpickles: the whole checkpoint shows the ones whose part
also stored the value as plain data (ckptfs.dist.parts.part_state), and ``dcp-parts.json`` lists
the others. The nesting is DCP's own unflattening's (``dcp_to_torch_save``): DCP's key paths keep
a list's indices as ints and make every dict key a str. Where a part is in another node's region,
nothing of the state is shown and ``dcp-parts.json`` says which parts are where.

torch.distributed.checkpoint (its metadata types, and the codec that decodes them) is imported
where a global version is met, not with this module: the mount and the CLI import it for every
version, and that import takes half a second.
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ckptfs.checksum import crc32, crc32_combine
from ckptfs.dist.names import METADATA_FILE, PARTS_FILE, is_global_version
from ckptfs.dist.parts import item_records, item_values, open_part, shown_item_names
from ckptfs.errors import CorruptionError, MalformedInputError, NotFoundError
from ckptfs.gcpause import paused_gc
from ckptfs.manifest import ITEMSIZE, Manifest, TensorRecord, expected_nbytes
from ckptfs.skeleton import check_skeleton

PARTS_DIR = "parts"


class Piece(NamedTuple):
    """``nbytes`` of a whole tensor from byte ``at`` of it, stored at data ``offset`` of part ``part``."""

    at: int
    part: int
    offset: int
    nbytes: int


class _Chunk(NamedTuple):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    part: int  # index into WholeLayout.parts
    record: TensorRecord  # the chunk as stored in its part
    tensor: int = -1  # its index in that part's manifest


@dataclass
class WholeLayout:
    """What ``plan_whole`` made of a global version: the whole-tensor manifest, the parts it
    reads (rank, counter) in this region, each whole tensor's pieces, and each part's data area
    after them. Shared by every open of the version's files."""

    model: str
    parts: tuple[tuple[int, int], ...]
    manifest: Manifest | None = None
    whole_bytes: int = 0  # the whole tensors: [0, whole_bytes) of the virtual data area
    data_bytes: int = 0  # then each part's data area, from part_bases[i]
    part_bases: list[int] = field(default_factory=list)
    part_manifests: list[tuple[str, Manifest]] = field(default_factory=list)  # (directory/, its files' index)
    starts: list[int] = field(default_factory=list)  # virtual offset of each whole tensor
    pieces: list[tuple[list[int], list[Piece]]] = field(default_factory=list)  # per tensor: (each at, pieces)
    checked: dict[int, set[int]] = field(default_factory=dict)  # part -> its tensors found intact
    names: dict[tuple[int, int], dict[int, str]] = field(default_factory=dict)  # errors' names (parts.open_part)
    remote: tuple[int, ...] = ()  # the ranks whose parts are in another node's region (nothing whole is shown)
    not_shown: tuple[str, ...] = ()  # the FQNs of the byte items whose values the parts did not store


def plan_whole(store, version) -> WholeLayout | None:
    """The whole-tensor layout of ``version`` (pinned) if it is a DCP global version, else None.
    Opens (and closes) its parts in ``store``'s region; PartGoneError if one is gone,
    CorruptionError if one does not hold what the metadata says."""
    if not is_global_version(version.manifest):
        return None
    # the metadata's JSON and the layout are a few objects per tensor: at 40,000 tensors the
    # collections they started took 60 % of this (ckptfs.gcpause)
    with paused_gc():
        return _plan_whole(store, version)


def _plan_whole(store, version) -> WholeLayout:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckptfs.dist.codec import decode_metadata, part_places

    meta = decode_metadata(dict(version.manifest.files)[METADATA_FILE])
    here = store.region.superblock.uuid.hex()
    places = part_places(meta)
    remote = [rank for rank, region, _ in places if region != here]
    m = version.manifest
    layout = WholeLayout(m.model, tuple((rank, counter) for rank, region, counter in places if region == here),
                         remote=tuple(remote),
                         names=shown_item_names(((i.fqn, i.offset, w) for i, w in meta.storage_data.items()), here))
    summary = {"ranks": [{"rank": rank, "region": region, "counter": counter, "in_this_region": region == here,
                          "files": f"{PARTS_DIR}/{rank_dirname(rank)}/" if region == here else None}
                         for rank, region, counter in places]}
    opened = []
    try:
        for i, (rank, counter) in enumerate(layout.parts):  # the checks made here count for the reads
            opened.append(open_part(store, layout.model, rank, counter, checked=layout.checked.setdefault(i, set()),
                                    names=layout.names.get((rank, counter))))
        items = [item_records(p) for p in opened]
        records, skeleton, shown = (), {"dict": []}, set()
        if remote:  # some parts are out of reach: no whole tensor can be shown
            summary["whole_tensors"] = (f"absent: the parts of rank(s) {', '.join(map(str, remote))} are in "
                                        "another node's region")
        else:
            records, skeleton, shown = _plan_state(layout, meta, opened, items)
        # the values the parts here did not store as plain data; none where nothing is shown (a
        # plain "epoch" in another node's part was said to be one of DCP's pickles)
        layout.not_shown = () if remote else tuple(sorted(
            fqn for fqn, md in meta.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)
            and fqn not in shown))
        summary["not_shown"] = list(layout.not_shown)
        _plan_parts(layout, meta, opened, items)
    finally:
        for p in opened:
            p.close()
    files = tuple(m.files) + ((PARTS_FILE, json.dumps(summary, indent=2) + "\n"),)
    layout.manifest = Manifest(m.model, m.step, m.counter, m.time_ns, records, skeleton, layout.data_bytes, files)
    layout.manifest.validate()
    return layout


def rank_dirname(rank: int) -> str:
    """The directory of rank ``rank``'s own files in a multi-rank version: ``rank-00003``."""
    return f"rank-{rank:05d}"


def _plan_state(layout: WholeLayout, meta, opened, items) -> tuple[tuple[TensorRecord, ...], dict, set[str]]:
    """(the whole tensors' records, the skeleton of the state, the FQNs of the byte items shown
    in it); fills in the layout's starts, pieces and the end of the whole tensors in the virtual
    data area. ``items``: each part's item_records."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from ckptfs.flatten import DTYPE_NAMES

    part_of = {key: i for i, key in enumerate(layout.parts)}
    values = [item_values(p) for p in opened]
    records, paths, offset = [], [], 0
    stored_as: dict[tuple, int] = {}  # the chunks' stored tensors -> the record that holds them
    shown: set[str] = set()
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            node = _byte_value(meta, fqn, part_of, values)
            if node is not None:
                paths.append((_path(meta, fqn), node))
                shown.add(fqn)
            continue
        dtype = DTYPE_NAMES[md.properties.dtype]
        chunks = []
        for c in md.chunks:
            where = meta.storage_data[MetadataIndex(fqn, c.offsets)]
            i = part_of[(where["rank"], where["counter"])]
            tensor = items[i][where["pos"]]
            rec = opened[i].manifest.tensors[tensor]
            if rec.dtype != dtype or rec.shape != tuple(c.sizes):
                raise CorruptionError(f"{fqn}: the chunk at {list(c.offsets)} of rank {where['rank']} is "
                                      f"{rec.dtype} {list(rec.shape)}, the metadata says {dtype} {list(c.sizes)}")
            chunks.append(_Chunk(tuple(c.offsets), tuple(c.sizes), i, rec, tensor))
        shape = tuple(md.size)
        # tied weights (one parameter under two names): every rank's part stored their chunks
        # once (the part writer keeps ties), so both names' chunks are the same stored tensors;
        # the whole tensor is then one record under both paths, as ties of a single process are
        same = (dtype, shape, tuple((c.part, c.tensor, c.offsets) for c in chunks))
        if chunks and same in stored_as:
            paths.append((_path(meta, fqn), {"tensor": stored_as[same]}))
            continue
        stored_as[same] = len(records)
        nbytes = expected_nbytes(dtype, shape)
        pieces = _pieces(shape, ITEMSIZE[dtype], chunks)
        records.append(TensorRecord(fqn, dtype, shape, offset, nbytes, _whole_crc(pieces, chunks, opened)))
        layout.pieces.append(([p.at for p in pieces], pieces))
        layout.starts.append(offset)
        paths.append((_path(meta, fqn), {"tensor": len(records) - 1}))
        offset += nbytes
    layout.whole_bytes = offset
    return tuple(records), _skeleton(paths), shown


def _byte_value(meta, fqn: str, part_of: dict, values: list[dict]) -> dict | None:
    """The skeleton node of byte item ``fqn``'s value, where its part stored it, else None;
    CorruptionError if the stored node is not plain data (a part's values hold no tensors)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = meta.storage_data.get(MetadataIndex(fqn))
    i = part_of.get((where["rank"], where["counter"])) if isinstance(where, dict) else None
    node = values[i].get(where["pos"]) if i is not None else None
    if node is not None:
        try:
            check_skeleton(node, 0)  # no tensor reference is valid here
        except MalformedInputError as e:
            raise CorruptionError(f"{fqn}: the value stored by rank {where['rank']} is not plain data: {e}") from None
    return node


def _plan_parts(layout: WholeLayout, meta, opened, items) -> None:
    """Each part of this region as a manifest of its rank's own chunks, named by FQN, its data
    placed after the whole tensors in the virtual area (``parts/rank-NNNNN/``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index_at = {(w["rank"], w["counter"], w["pos"]): index for index, w in meta.storage_data.items()}
    base = layout.whole_bytes
    for (rank, counter), part, stored in zip(layout.parts, opened, items):
        records, paths, record_of = [], [], {}
        for pos, tensor in sorted(stored.items()):
            index = index_at.get((rank, counter, pos))
            md = meta.state_dict_metadata.get(index.fqn) if index is not None else None
            if not isinstance(md, TensorStorageMetadata):
                continue  # a byte item (a pickle): not shown
            rec = part.manifest.tensors[tensor]
            path = _path(meta, index.fqn)
            if tuple(index.offset or ()) != (0,) * len(md.size) or rec.shape != tuple(md.size):
                # a shard: its place in the whole tensor in its name
                path = path[:-1] + (f"{path[-1]}@{','.join(map(str, index.offset or ()))}",)
            if tensor not in record_of:  # else tied: the part stored it once
                record_of[tensor] = len(records)
                records.append(rec._replace(name=".".join(map(str, path)), offset=base + rec.offset))
            paths.append((path, {"tensor": record_of[tensor]}))
        layout.part_bases.append(base)
        layout.part_manifests.append((f"{PARTS_DIR}/{rank_dirname(rank)}/", Manifest(
            part.manifest.model, part.manifest.step, part.manifest.counter, part.manifest.time_ns,
            tuple(records), _skeleton(paths), base + part.manifest.data_bytes, (), part.manifest.crc_block_bytes)))
        base += part.manifest.data_bytes
    layout.data_bytes = base


def _path(meta, fqn: str) -> tuple:
    """The key path of ``fqn`` in the saved state dict (DCP's planner data), else ``(fqn,)``."""
    path = meta.planner_data.get(fqn) if isinstance(meta.planner_data, dict) else None
    return tuple(path) if path else (fqn,)


def _pieces(shape: tuple[int, ...], itemsize: int, chunks: list[_Chunk]) -> list[Piece]:
    """The runs of a whole tensor of ``shape`` in its chunks, in order; CorruptionError unless
    the chunks tile it exactly. Dims past the last one some chunk splits are whole in every
    chunk, so a row of them is contiguous in the chunk and in the whole tensor alike."""
    live = [c for c in chunks if math.prod(c.sizes)]
    ndim = len(shape)
    split = max((d for c in live for d in range(ndim) if c.sizes[d] != shape[d]), default=-1)
    if split < 0:
        live = live[:1]  # one chunk holds it all (a replicated tensor is written once)
        split = 0
    row = math.prod(shape[split + 1:]) * itemsize
    out: list[Piece] = []
    end = 0
    for outer in itertools.product(*(range(s) for s in shape[:split])):
        covering = sorted((c for c in live if all(o <= x < o + z for x, o, z in zip(outer, c.offsets, c.sizes))),
                          key=lambda c: c.offsets[split] if ndim else 0)
        base = _ravel(outer, shape[:split]) * (shape[split] if ndim else 1) * row
        for c in covering:
            local = _ravel([x - o for x, o in zip(outer, c.offsets)], c.sizes[:split])
            length = (c.sizes[split] if ndim else 1) * row
            at = base + (c.offsets[split] if ndim else 0) * row
            if at != end:
                raise CorruptionError(f"the chunks of a tensor of shape {list(shape)} leave a gap or overlap at byte {end}")
            piece = Piece(at, c.part, c.record.offset + local * length, length)
            last = out[-1] if out else None
            if last is not None and last.part == piece.part and last.offset + last.nbytes == piece.offset:
                out[-1] = last._replace(nbytes=last.nbytes + length)
            else:
                out.append(piece)
            end = at + length
    if end != math.prod(shape) * itemsize:
        raise CorruptionError(f"the chunks of a tensor of shape {list(shape)} cover {end} of its "
                              f"{math.prod(shape) * itemsize} bytes")
    return out


def _ravel(index, sizes) -> int:
    flat = 0
    for x, s in zip(index, sizes):
        flat = flat * s + x
    return flat


def _whole_crc(pieces: list[Piece], chunks: list[_Chunk], opened) -> int:
    """The CRC32 of the whole tensor: its chunks' stored CRCs combined where every piece is a
    whole chunk (a dim-0 split), else read from the parts once (checked reads)."""
    by_place = {(c.part, c.record.offset): c.record for c in chunks}
    crc = 0
    for p in pieces:
        rec = by_place.get((p.part, p.offset))
        if rec is not None and rec.nbytes == p.nbytes:
            crc = crc32_combine(crc, rec.crc32, p.nbytes)
            continue
        part = opened[p.part]
        crc = crc32(part.read(p.offset, p.nbytes), crc)
        part.confirm()
    return crc


class _Leaf(NamedTuple):
    node: dict  # a skeleton node: a tensor reference or a plain value


def _skeleton(paths: list[tuple[tuple, dict]]) -> dict:
    """The nested state of the entries ((key path, skeleton node) of each: DCP's planner data
    gives the key paths; a tensor under two paths is tied) as a skeleton, nested as DCP's own
    unflattening does it (``dcp_to_torch_save``): DCP's flattening keeps a list's indices as ints
    and makes every dict key a str, so a level keyed by ints is a list (an optimizer's
    ``param_groups``; None at an index with nothing under it, as DCP's ``set_element`` leaves
    it), any other level a dict (also one of indices far beyond their number: not DCP's). Flat
    by dotted name if the paths clash. An optimizer's ``state`` gets its int keys back
    (``_param_ids``); other int dict keys stay strs, as DCP's own unflattening leaves them."""
    root: dict = {}
    try:
        for path, leaf in paths:
            node = root
            for key in path[:-1]:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    raise ValueError
            if path[-1] in node:
                raise ValueError
            node[path[-1]] = _Leaf(leaf)
    except (ValueError, TypeError):
        root = {".".join(map(str, p)): _Leaf(leaf) for p, leaf in paths}

    def encode(value, int_keys: frozenset[str] = frozenset()):
        if isinstance(value, _Leaf):
            return value.node
        keys = list(value)
        if keys and all(type(k) is int and 0 <= k <= 2 * len(keys) + 16 for k in keys):
            # as DCP's set_element: an index with nothing under it (a list's empty dict) is None
            return {"list": [encode(value[k]) if k in value else {"none": None} for k in range(max(keys) + 1)]}
        ids = _param_ids(value)
        return {"dict": [[{"int": int(k)} if isinstance(k, int) or k in int_keys else {"str": k},
                          encode(v, ids if k == "state" else frozenset())] for k, v in value.items()]}
    return encode(root)


def _param_ids(level: dict) -> frozenset[str]:
    """The parameter ids (as the strs DCP's key paths hold) of ``level`` if it is a
    ``torch.optim`` state dict: ``{"state": {id: ...}, "param_groups": [{"params": [id, ...]}]}``
    with int ids. Its state's keys are ints again in the whole state: ``Optimizer.load_state_dict``
    keeps the state of a str key as a parameter's of none (the moments were silently dropped)."""
    groups, state = level.get("param_groups"), level.get("state")
    if not isinstance(groups, dict) or not isinstance(state, dict):
        return frozenset()
    ids = set()
    for group in groups.values():
        params = group.get("params") if isinstance(group, dict) else None
        items = params.node.get("list") if isinstance(params, _Leaf) else None
        if not isinstance(items, list) or not all(set(i) == {"int"} for i in items):
            return frozenset()
        ids.update(str(i["int"]) for i in items)
    return frozenset(k for k in state if isinstance(k, str) and k in ids)


def version_files(version, files_for) -> dict:
    """{path: View} of a pinned version as the mount shows it: ``files_for(version.manifest)``,
    and for a multi-rank version each rank's own files under ``parts/rank-NNNNN/``. Where some
    of its parts are in another node's region (``whole_absent``) no file of whole tensors is
    shown (checkpoint.pt was an empty dict), only metadata.json and the files saved with it."""
    files = dict(files_for(version.manifest))
    if whole_absent(version):
        from ckptfs.views.metadata import METADATA_FILE

        saved = {name for name, _ in version.manifest.files}
        files = {path: view for path, view in files.items() if path == METADATA_FILE or path in saved}
    for directory, manifest in getattr(version, "sub_manifests", ()):
        files.update((directory + path, view) for path, view in files_for(manifest).items())
    return files


def whole_absent(version) -> str | None:
    """Why the whole tensors of ``version`` (as ``as_whole`` gives it) cannot be read here, or
    None: the parts of some ranks are in another node's region."""
    remote = getattr(getattr(version, "layout", None), "remote", ())
    if not remote:
        return None
    return f"the parts of rank(s) {', '.join(map(str, remote))} are in another node's region"


def as_whole(store, version, layout: WholeLayout | bool | None = None):
    """(what to read ``version`` (pinned) through, its layout): ``version`` itself and False
    unless it is a multi-rank DCP version; then its ``WholeVersion``. ``layout``: one made
    earlier for the same version (False: known not to be multi-rank), else it is made here.
    ``version`` is closed if this fails."""
    try:
        if layout is None:
            layout = plan_whole(store, version) or False
        return (WholeVersion(store, version, layout) if layout else version), layout
    except BaseException:
        version.close()
        raise


def not_shown_words(fqns) -> str:
    """What the whole view of a multi-rank version leaves out (``WholeLayout.not_shown``), in the
    words every interface shows it with (a load's warning, ``ckptfs info`` and ``export``)."""
    return (f"{', '.join(fqns)} (values that are not plain data, kept as DCP's pickles, which ckptfs never "
            "unpickles: a load at the ranks with into= gives them back through DCP)")


class WholeVersion:
    """A pinned DCP global version read as its whole tensors: ``manifest`` (the layout's),
    ``read`` / ``confirm`` / ``close`` as a Version's, and ``data`` (itself: the reads are
    checked) for the consumers of a Version's data (export); ``sub_manifests``: (directory,
    index) of each rank's own files, read through ``read`` too. The parts stay pinned until
    ``close``."""

    def __init__(self, store, version, layout: WholeLayout):
        self.version = version  # the global version itself (its own index: version.manifest)
        self.info = version.info
        self.layout = layout
        self.manifest = layout.manifest
        self.sub_manifests = layout.part_manifests
        self._parts = []
        try:
            for i, (rank, counter) in enumerate(layout.parts):
                self._parts.append(open_part(store, layout.model, rank, counter,
                                              checked=layout.checked.setdefault(i, set()),
                                              names=layout.names.get((rank, counter))))
        except BaseException:
            self.close()
            raise

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the virtual data area (each whole tensor at its
        record's offset, then each part's data area), from the parts' checked reads."""
        out = []
        end = offset + length
        if offset < self.layout.whole_bytes:
            offset = self._read_whole(offset, min(end, self.layout.whole_bytes), out)
        bases = self.layout.part_bases
        while offset < end:
            i = bisect.bisect_right(bases, offset) - 1
            stop = bases[i + 1] if i + 1 < len(bases) else self.layout.data_bytes
            if i < 0 or offset >= stop:
                raise ValueError(f"read past the end of the data ({end} > {self.layout.data_bytes})")
            n = min(end, stop) - offset
            out.append(self._parts[i].read(offset - bases[i], n))
            offset += n
        return b"".join(out)

    def _read_whole(self, offset: int, end: int, out: list) -> int:
        starts, tensors = self.layout.starts, self.manifest.tensors
        i = max(bisect.bisect_right(starts, offset) - 1, 0)
        while offset < end and i < len(tensors):
            rec = tensors[i]
            lo, hi = offset - rec.offset, min(end, rec.offset + rec.nbytes) - rec.offset
            if hi > lo:
                ats, pieces = self.layout.pieces[i]
                j = bisect.bisect_right(ats, lo) - 1
                while lo < hi:
                    p = pieces[j]
                    n = min(hi, p.at + p.nbytes) - lo
                    out.append(self._parts[p.part].read(p.offset + lo - p.at, n))
                    lo += n
                    j += 1
                offset = rec.offset + hi
            i += 1
        return offset

    def confirm(self) -> None:
        for p in self._parts:
            p.confirm()

    def load(self, map_location="cpu", verify: bool = True, into=None, keys=None):
        """The whole state, as ``Version.load`` gives a single process's (``Store.load``): whole
        tensors and the plain values the parts stored. Every read is checked, ``verify`` or not
        (each part's checked read path). NotFoundError if some parts are in another node's region."""
        absent = whole_absent(self)
        if absent:
            m = self.manifest
            raise NotFoundError(
                f"{m.model} step {m.step}: {absent}; load it at the ranks (group=, peers=[their nodes' stores]) or "
                "through ckptfs.dcp.StorageReader(store, model, peers=...)")
        if self.layout.not_shown:
            import warnings

            m = self.manifest
            warnings.warn(f"{m.model} step {m.step}: left out {not_shown_words(self.layout.not_shown)}", stacklevel=4)
        from ckptfs.restore import restore

        return restore(self, map_location, verify, into, fill=self._read_tensors, keys=keys)

    def _read_tensors(self, tensors: list) -> None:
        """Fill ``tensors`` (one per whole tensor, contiguous, on any device; None: one not
        wanted) from the parts."""
        import torch
        from torch.autograd.graph import increment_version

        from ckptfs.memcopy import host_bytes

        # host tensors are written by address: tell autograd, as a copy_ would (ckptfs.restore.copy_out)
        increment_version([t for t in tensors if t is not None and t.is_cpu])
        for (_, pieces), record, t in zip(self.layout.pieces, self.manifest.tensors, tensors):
            if t is None or not record.nbytes:
                continue
            dest = t.detach() if t.is_cpu else torch.empty(record.nbytes, dtype=torch.uint8)
            out = host_bytes(dest.view(-1).view(torch.uint8))
            for p in pieces:
                out[p.at:p.at + p.nbytes] = self._parts[p.part].read(p.offset, p.nbytes)
            if not t.is_cpu:
                t.detach().view(-1).view(torch.uint8).copy_(dest)
        self.confirm()

    @property
    def data(self) -> "WholeVersion":
        return self

    def sequential_reader(self):
        """A read callable for a pass over the files in order (each part read is checked)."""
        return self.read

    def close(self) -> None:
        for p in self._parts:
            p.close()
        self._parts = []
        self.version.close()

    def __enter__(self) -> "WholeVersion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
