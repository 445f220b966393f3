"""A DCP load's reads from one rank's part: every stored tensor the load plan needs is read once,
front to back, through the CRC-checked read path (``VersionData.scan``: O_DIRECT chunks on reader
threads, each tensor's CRC taken on the way), and its pieces are copied into their targets as the
chunks come in, not through the page cache and a second pass.

A piece that is a run of whole rows of the stored tensor (a dim-0 shard of a dim-0 shard: what
FSDP's resharding asks for) goes straight into its target; any other piece (a split on a later
dim, a dtype to convert, a target that is not contiguous, bytes) is taken from a whole copy of the
stored tensor once the scan has checked it.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner

from ckptfs.errors import CorruptionError
from ckptfs.restore import copy_out


@dataclass
class _Target:
    item: object  # DCP's ReadItem
    index: int  # the stored tensor's index in the part's manifest
    tensor: torch.Tensor | None  # the planner's target (None: bytes)
    direct: bool  # filled by the scan itself, else from the whole stored tensor afterwards


def read_into_plan(data, items: list[tuple[object, int]], planner: LoadPlanner, buffers=None) -> None:
    """Read ``items`` ((ReadItem, stored tensor index) of one part, whose VersionData is ``data``)
    into ``planner``'s targets and commit each; CorruptionError naming the first damaged tensor
    (the targets may then hold some of its bytes: the load has failed). ``buffers``: the
    load's ckptfs.reader.ReadBuffers, shared by its parts."""
    records = data.manifest.tensors
    targets, sinks, wholes = [], {}, {}
    for item, index in items:
        record = records[index]
        if item.type == LoadItemType.BYTE_IO:
            targets.append(_Target(item, index, None, False))
        else:
            tensor = planner.resolve_tensor(item).detach()
            span = _row_span(record, item)
            direct = (span is not None and tensor.is_contiguous() and tensor.dtype == record.torch_dtype
                      and tensor.numel() * tensor.element_size() == span[1] - span[0])
            targets.append(_Target(item, index, tensor, direct))
            if direct and span[1] > span[0]:
                sinks.setdefault(index, []).append((span[0], span[1], tensor))
        if not targets[-1].direct and index not in wholes:
            wholes[index] = torch.empty(record.nbytes, dtype=torch.uint8)
            sinks.setdefault(index, []).append((0, record.nbytes, wholes[index]))

    wanted = {index for index in sinks if records[index].nbytes}
    bad = data.scan(copy_out(sinks, records), only=wanted, buffers=buffers) if wanted else []
    if bad:
        raise CorruptionError(data.damage_message(bad[0][0]))
    for t in targets:
        if t.tensor is None:
            planner.load_bytes(t.item, io.BytesIO(wholes[t.index].numpy().tobytes()))
            continue
        if not t.direct:
            record = records[t.index]
            whole = wholes[t.index].view(record.torch_dtype).view(record.shape)
            for dim, (offset, length) in enumerate(zip(t.item.storage_offsets, t.item.lengths)):
                whole = whole.narrow(dim, offset, length)
            t.tensor.copy_(whole)
        planner.commit_tensor(t.item, t.tensor)


def _row_span(record, item) -> tuple[int, int] | None:
    """The byte range of the stored tensor that ``item`` reads, where it is one run (whole rows
    of dim 0), else None."""
    shape = record.shape
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if not shape:
        return 0, record.nbytes
    if len(offsets) != len(shape) or any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:])):
        return None
    row_bytes = math.prod(shape[1:]) * record.torch_dtype.itemsize
    return offsets[0] * row_bytes, (offsets[0] + lengths[0]) * row_bytes
