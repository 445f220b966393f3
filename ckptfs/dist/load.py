"""A DCP load's reads from the parts: every stored tensor the load plan needs is read once,
through the CRC-checked read path (``VersionData.scanner``: O_DIRECT reads of the pages that hold
it, its CRC taken on the way; the parts in one pipeline, ``scan_together``), and its pieces are
copied into their targets as the chunks come in, not through the page cache and a second pass.

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
from ckptfs.scan import ReadBuffers, scan_together
from ckptfs.restore import copy_out


@dataclass
class _Target:
    item: object  # DCP's ReadItem
    index: int  # the stored tensor's index in the part's manifest
    tensor: torch.Tensor | None  # the planner's target (None: bytes)
    direct: bool  # filled by the scan itself, else from the whole stored tensor afterwards


def wanted_tensors(records, items: list[tuple[object, int]]) -> dict[int, tuple[int, int] | None]:
    """What a part's scan reads for ``items`` ((ReadItem, stored tensor index)), known from the
    load plan alone: {stored tensor index: the byte range its items read (``_row_span``: whole
    rows of dim 0; several items of one tensor, the range that covers them), or None for the
    whole tensor}. PartRead reads the same where every piece goes straight into its target."""
    out: dict[int, tuple[int, int] | None] = {}
    for item, index in items:
        record = records[index]
        if not record.nbytes or (item.type != LoadItemType.BYTE_IO and not all(n > 0 for n in item.lengths)):
            continue
        span = _row_span(record, item) if item.type != LoadItemType.BYTE_IO else None
        if span == (0, record.nbytes):
            span = None  # all of it: one form, so that a scan made from the plan is found the same
        if span is None or (index in out and out[index] is None):
            out[index] = None
        else:
            lo, hi = out.get(index, span)
            out[index] = (min(lo, span[0]), max(hi, span[1]))
    return out


PIPELINED_WHOLE_BYTES = 64 << 20  # the whole copies the parts read in one pipeline may hold together


def read_parts(reads: list["PartRead"], buffers: ReadBuffers, ahead=None) -> None:
    """Do ``reads`` (of parts kept open meanwhile): in one pipeline (``scan_together``: no wait
    at each part's end, the many small reads of a part that holds a few wanted tensors beside
    the large ones of another) those whose pieces go straight into their targets, or whose
    whole copies of stored tensors are small (byte items: every optimizer's param_groups), up
    to PIPELINED_WHOLE_BYTES of copies in all; then each other part alone, so that only one
    part's copies are in memory at a time. ``ahead``: a ReadAhead of the parts' scans
    (``PartRead.scan``), used where every part is in the pipeline with that scan, else
    cancelled (its reads are made again)."""
    pipelined, alone = [], []
    room = PIPELINED_WHOLE_BYTES
    for r in reads:
        if r.whole_bytes <= room:
            pipelined.append(r)
            room -= r.whole_bytes
        else:
            alone.append(r)
    scans = [r.scanner() for r in pipelined]
    if ahead is not None and (alone or any(scan not in (None, r.scan) for r, scan in zip(pipelined, scans))):
        ahead.cancel()
        ahead = None
    scan_together([scan for scan in scans if scan is not None], buffers, ahead)
    for r, scan in zip(pipelined, scans):
        r.finish(scan)
    for r in alone:
        scan = r.scanner()
        if scan is not None:
            scan_together([scan], buffers)
        r.finish(scan)


class PartRead:
    """A DCP load's reads from one part: ``items`` ((ReadItem, stored tensor index)) of the
    part whose VersionData is ``data``, into ``planner``'s targets. ``scanner`` (None where no
    stored byte is needed), the scan, then ``finish``."""

    def __init__(self, data, items: list[tuple[object, int]], planner: LoadPlanner, scan=None):
        """``scan``: the part's Scan made from the plan alone (``wanted_tensors``), which a
        ReadAhead may have started; ``scanner`` then gives it its copies."""
        self.data = data
        self.planner = planner
        self.scan = scan
        records = data.manifest.tensors
        self.targets: list[_Target] = []
        self.sinks: dict[int, list] = {}
        self.whole_of: set[int] = set()  # stored tensors copied whole first
        for item, index in items:
            record = records[index]
            if item.type == LoadItemType.BYTE_IO:
                self.targets.append(_Target(item, index, None, False))
            else:
                tensor = planner.resolve_tensor(item).detach()
                span = _row_span(record, item)
                direct = tensor.numel() == 0 or (  # an empty piece: nothing to copy
                    span is not None and tensor.is_contiguous() and tensor.dtype == record.torch_dtype
                    and tensor.numel() * tensor.element_size() == span[1] - span[0])
                self.targets.append(_Target(item, index, tensor, direct))
                if direct and span[1] > span[0]:
                    self.sinks.setdefault(index, []).append((span[0], span[1], tensor))
            if not self.targets[-1].direct:
                self.whole_of.add(index)
        self.whole_bytes = sum(records[i].nbytes for i in self.whole_of)
        self.wholes: dict[int, torch.Tensor] = {}
        # what the targets read, by the rule the scan made from the plan followed (same items)
        self._wanted = wanted_tensors(records, items)

    def scanner(self):
        """The part's Scan (ckptfs.scan.Scan), with the whole copies made now; None if no
        stored byte is needed. The scan made from the plan (``scan``) where it reads exactly
        what is needed: it does unless a tensor copied whole was planned in rows."""
        records = self.data.manifest.tensors
        sinks = {i: list(dests) for i, dests in self.sinks.items()}
        for index in self.whole_of:
            self.wholes[index] = torch.empty(records[index].nbytes, dtype=torch.uint8)
            sinks.setdefault(index, []).append((0, records[index].nbytes, self.wholes[index]))
        wanted = {**self._wanted, **{i: None for i in self.whole_of if records[i].nbytes}}
        if not wanted:
            return None
        if self.scan is None or wanted != self._wanted:
            return self.data.scanner(copy_out(sinks, records), only=wanted)
        self.scan.on_chunk = copy_out(sinks, records)
        return self.scan

    def finish(self, scan) -> None:
        """After the scan: CorruptionError naming the first damaged tensor, else every target
        filled and committed."""
        bad = scan.bad() if scan is not None else []
        if bad:
            raise CorruptionError(self.data.damage_message(bad[0][0]))
        records = self.data.manifest.tensors
        for t in self.targets:
            if t.tensor is None:
                self.planner.load_bytes(t.item, io.BytesIO(self.wholes[t.index].numpy().tobytes()))
                continue
            if not t.direct:
                record = records[t.index]
                whole = self.wholes[t.index].view(record.torch_dtype).view(record.shape)
                for dim, (offset, length) in enumerate(zip(t.item.storage_offsets, t.item.lengths)):
                    whole = whole.narrow(dim, offset, length)
                with torch.no_grad():  # a parameter that requires grad, written in place
                    t.tensor.copy_(whole)
            self.planner.commit_tensor(t.item, t.tensor)
        self.wholes.clear()


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
