"""torch.distributed.checkpoint's ``Metadata`` as JSON, and back: no pickle anywhere.

DCP's own filesystem layout pickles its ``.metadata``; a checkpoint store that others read must
not unpickle what it finds. The encoding covers what DCP's planners put there: per FQN the
tensor's properties, global size and chunks (``TensorStorageMetadata``) or a bytes entry
(``BytesStorageMetadata``); the planner data (the default planners' key paths: tuples of str and
int); the storage data (``MetadataIndex`` -> a JSON-able value of the storage layer); the
storage meta and the version. Anything else is refused with the FQN or key that holds it.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ckptfs.errors import MalformedInputError

CODEC_VERSION = 1
_LAYOUTS = {str(layout): layout for layout in (torch.strided, torch.sparse_coo)}
_FORMATS = {str(f): f for f in (torch.contiguous_format, torch.channels_last, torch.preserve_format,
                                torch.channels_last_3d)}


def encode_metadata(metadata: Metadata) -> str:
    """``metadata`` as a JSON document (canonical: sorted keys)."""
    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            entries[fqn] = {"tensor": {
                "dtype": str(p.dtype).removeprefix("torch."), "layout": str(p.layout),
                "requires_grad": bool(p.requires_grad), "memory_format": str(p.memory_format),
                "pin_memory": bool(p.pin_memory), "size": list(md.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}}
        elif isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"bytes": True}
        else:
            raise MalformedInputError(f"DCP metadata of {fqn!r} is a {type(md).__name__}, which ckptfs cannot store")
    storage = [[encode_index(i), v] for i, v in (metadata.storage_data or {}).items()]
    sm = metadata.storage_meta
    doc = {"codec": CODEC_VERSION, "version": metadata.version, "state_dict": entries,
           "planner_data": _plain(metadata.planner_data, "planner_data"), "storage_data": storage,
           "storage_meta": None if sm is None else {"checkpoint_id": None if sm.checkpoint_id is None
                                                    else str(sm.checkpoint_id), "save_id": sm.save_id,
                                                    "load_id": sm.load_id, "modules": list(sm.modules)}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def decode_metadata(text: str) -> Metadata:
    """The Metadata of ``encode_metadata``'s document; MalformedInputError if it is not one."""
    try:
        doc = json.loads(text)
        if doc.get("codec") != CODEC_VERSION:
            raise MalformedInputError(f"DCP metadata of codec {doc.get('codec')!r}, not {CODEC_VERSION}")
        entries = {}
        for fqn, e in doc["state_dict"].items():
            if "bytes" in e:
                entries[fqn] = BytesStorageMetadata()
                continue
            t = e["tensor"]
            props = TensorProperties(dtype=getattr(torch, t["dtype"]), layout=_LAYOUTS[t["layout"]],
                                     requires_grad=t["requires_grad"], memory_format=_FORMATS[t["memory_format"]],
                                     pin_memory=t["pin_memory"])
            if not isinstance(props.dtype, torch.dtype):
                raise MalformedInputError(f"DCP metadata of {fqn!r} names dtype {t['dtype']!r}")
            entries[fqn] = TensorStorageMetadata(props, torch.Size(t["size"]), [
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]])
        storage = {decode_index(i): v for i, v in doc["storage_data"]}
        sm = doc["storage_meta"]
        meta = None if sm is None else StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"],
                                                    load_id=sm["load_id"], modules=sm["modules"])
        return Metadata(state_dict_metadata=entries, planner_data=_unplain(doc["planner_data"]),
                        storage_data=storage, storage_meta=meta, version=doc["version"])
    except MalformedInputError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MalformedInputError(f"the DCP metadata of this checkpoint is damaged or not ckptfs's: {e}") from None


def with_storage_data(text: str, pairs) -> str:
    """``encode_metadata``'s document ``text`` with its storage data replaced by ``pairs``
    ((an ``encode_index`` index, a JSON-able value); of pairs with the same index the last wins),
    the rest taken as it is, undecoded (``PlacedMetadata`` makes each commit's text from it)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise MalformedInputError(f"the DCP metadata is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("codec") != CODEC_VERSION:
        raise MalformedInputError("the DCP metadata is not ckptfs's encoding")
    places = {}
    for index, value in pairs:
        fqn, offset, n = index
        places[(fqn, None if offset is None else tuple(offset), n)] = [index, value]
    doc["storage_data"] = list(places.values())
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def placed_parts(text: str) -> set[tuple[str, int, int]]:
    """(region, rank, counter) of every part that ``encode_metadata``'s document ``text`` (a
    global version's, with its places) names; read as plain JSON, without making DCP's objects."""
    try:
        return _parts_of_places(place for _, place in json.loads(text)["storage_data"])
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedInputError(f"the DCP metadata of this checkpoint is damaged or not ckptfs's: {e}") from None


def item_places(text: str) -> list[tuple[str, list | None, dict]]:
    """(FQN, offsets, place: ``{region, rank, counter, pos}``) of each item that
    ``encode_metadata``'s document ``text`` places; read as plain JSON, like ``placed_parts``."""
    try:
        return [(fqn, offset, place) for (fqn, offset, _), place in json.loads(text)["storage_data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedInputError(f"the DCP metadata of this checkpoint is damaged or not ckptfs's: {e}") from None


def part_places(metadata: Metadata) -> list[tuple[int, str, int]]:
    """(rank, region, counter) of every part that a decoded global version's metadata names,
    by rank."""
    return sorted((rank, region, counter) for region, rank, counter in _parts_of_places(metadata.storage_data.values()))


def _parts_of_places(places) -> set[tuple[str, int, int]]:
    """(region, rank, counter) of the parts that items' places (``{region, rank, counter,
    pos}``, as the global commit records them) name."""
    return {(place["region"], place["rank"], place["counter"]) for place in places}


class PlacedMetadata:
    """``with_storage_data``'s text for one plan, whose places differ from one commit to the next
    in their counters alone: the document is parsed once, and each commit's text is spliced from
    its pieces (a list of strings, which the garbage collector does not track; parsing 0.5 MB of
    JSON per commit made thousands of objects and brought on gen-2 collections)."""

    def __init__(self, text: str, places) -> None:
        """``places``: (an ``encode_index`` index, its place: a JSON-able dict with ``rank``;
        ``counter`` is filled in by ``render``)."""
        marker = f"ckptfs-counter-{uuid.uuid4().hex}-"  # no FQN holds it by chance
        doc = with_storage_data(text, [(index, {**place, "counter": f"{marker}{place['rank']}"})
                                       for index, place in places])
        parts = re.split(f'"{marker}(\\d+)"', doc)
        self._pieces = parts[0::2]
        self._ranks = [int(r) for r in parts[1::2]]

    def render(self, counters: dict[int, int]) -> str:
        """The document with each place's ``counter`` that of its rank in ``counters``."""
        out = [self._pieces[0]]
        for rank, piece in zip(self._ranks, self._pieces[1:]):
            out.append(str(int(counters[rank])))
            out.append(piece)
        return "".join(out)


def encode_index(i: MetadataIndex) -> list:
    """A MetadataIndex as JSON data."""
    return [i.fqn, None if i.offset is None else list(i.offset), i.index]


def decode_index(raw: list) -> MetadataIndex:
    """The MetadataIndex of ``encode_index``."""
    fqn, offset, index = raw
    return MetadataIndex(fqn, None if offset is None else torch.Size(offset), index)


def _plain(value: Any, where: str) -> Any:
    """JSON for plain values, tuples marked (the default planners' key paths are tuples)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_plain(v, where) for v in value]}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise MalformedInputError(f"DCP {where} has a dict with non-string keys, which ckptfs cannot store")
        return {"dict": {k: _plain(v, where) for k, v in value.items()}}
    raise MalformedInputError(f"DCP {where} holds a {type(value).__name__}, which ckptfs cannot store")


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(_unplain(v) for v in value["tuple"])
        return {k: _unplain(v) for k, v in value["dict"].items()}
    return value
