"""A version saved by one process (``store.writer`` without ``group=``) read through DCP, so that
``dcp.load`` with ``ckptfs.dcp.StorageReader`` and ``Store.load(group=, into=)`` reshard it into
any sharding: a job that saved from one process (or from rank 0 of a DDP job) resumes as FSDP2.

Its DCP metadata is made from its index, as DCP's own planner would have made it for the same
state dict saved by one rank: DCP's flattening (``flatten_state_dict``) gives the FQNs, each
stored tensor is one chunk covering it, each other value a byte item. The bytes of a value are
``torch.save`` of the value rebuilt from the index's JSON (ckptfs never unpickles; DCP's loader
unpickles what ckptfs wrote). A value that holds tensors (a tuple of tensors: DCP keeps a tuple
whole) would need their bytes pickled inline; such a version is refused, naming the FQN.
"""
from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

from ckptfs.errors import NotFoundError
from ckptfs.skeleton import unflatten

ONE_PROCESS = -1  # the "rank" of a storage entry that is a one-process version, not a rank's part


def one_process_metadata(version, region: str) -> Metadata:
    """DCP's Metadata of the (pinned) one-process ``version`` of the region whose uuid is
    ``region`` (hex); NotFoundError, saying how to load it instead, where DCP cannot express it."""
    m = version.manifest
    what = f"step {m.step} of {m.model!r}"
    # meta tensors stand for the stored ones: DCP's flattening walks into lists that hold tensors
    stand_ins = [torch.empty(r.shape, dtype=r.torch_dtype, device="meta") for r in m.tensors]
    index_of = {id(t): i for i, t in enumerate(stand_ins)}
    obj = unflatten(m.skeleton, stand_ins)
    if not isinstance(obj, dict):
        raise NotFoundError(f"{what} holds a {type(obj).__name__}, not a state dict (a dict), which DCP cannot load; "
                            "load it with Store.load")
    flat, mappings = flatten_state_dict(obj)
    entries, storage = {}, {}
    # a model's tensors share a few dtypes and shapes: their metadata objects are made once each
    # (DCP reads them, never changes them), at 40,000 tensors half of the time
    properties: dict = {}
    chunks: dict = {}
    for fqn, value in flat.items():
        index = index_of.get(id(value))
        if index is None:
            entries[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = {"bytes": _value_bytes(value, fqn, what)}
            continue
        record = m.tensors[index]
        props = properties.get(record.dtype)
        if props is None:
            props = properties[record.dtype] = TensorProperties(dtype=record.torch_dtype)
        chunk = chunks.get(record.shape)
        if chunk is None:
            size = torch.Size(record.shape)
            chunk = chunks[record.shape] = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
        entries[fqn] = TensorStorageMetadata(props, chunk.sizes, [chunk])
        storage[MetadataIndex(fqn, chunk.offsets, 0)] = {"region": region, "rank": ONE_PROCESS,
                                                         "counter": m.counter, "pos": index}
    return Metadata(state_dict_metadata=entries, planner_data=mappings, storage_data=storage)


def _value_bytes(value, fqn: str, what: str) -> bytes:
    if _holds_tensor(value):
        raise NotFoundError(f"{what} holds tensors inside {fqn!r} (a tuple of tensors), which DCP keeps as one "
                            "pickled object that ckptfs does not write; load it with Store.load")
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def open_one_process(store, model: str, counter: int):
    """The pinned one-process version of ``model`` with ``counter`` (NotFoundError if it went)."""
    try:
        return store.open_version(model, counter=counter, whole=False)
    except NotFoundError:
        raise NotFoundError(f"the version of {model!r} being loaded (counter {counter}) is gone: the ring reused "
                            "its slot; load again (a newer version)") from None
