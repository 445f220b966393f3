"""Plan phase of a save: flatten the object, lay its tensors out and size its slot; every refusal
happens here, before anything is claimed or written.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ckptfs.chunks import IO_ALIGN_BYTES, BlockPiece, Chunk, Piece, block_pieces, copy_runs, plan_chunks
from ckptfs.errors import CkptfsError
from ckptfs.flatten import DTYPE_NAMES, Flattened, flatten
from ckptfs.manifest import (CRC_BLOCK_BYTES, TENSOR_ALIGN_BYTES, EncodedTensors, Manifest, TensorRecord,
                              block_count, dumps_compact)
from ckptfs.region.format import COUNTER_MAX
from ckptfs.region.claim import SlotLayout
from ckptfs.units import align_up
from ckptfs.writer.replan import Structure


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one object structure goes; shared by the saves of that structure."""

    records: tuple[TensorRecord, ...]
    data_bytes: int
    chunks: list[Chunk]
    tensors: EncodedTensors  # the index's tensor array: its length sizes the index, commit fills its CRCs
    crc_block_bytes: int = 0  # the manifest's (0: no tensor has block CRCs)
    block_pieces: tuple[BlockPiece, ...] = ()  # the pieces whose CRCs make the block CRCs
    copy_runs: tuple[tuple[Piece, ...], ...] = ()  # per chunk, its pieces as copies (chunks.copy_runs)

    def manifest(self, model: str, step: int, counter: int, time_ns: int, flat: Flattened,
                 files: tuple[tuple[str, str], ...]) -> Manifest:
        """The index of a save of this layout (its CRCs those of the records: see ``tensors``)."""
        return Manifest(model, step, counter, time_ns, self.records, flat.skeleton, self.data_bytes, files,
                        self.crc_block_bytes, skeleton_json=flat.skeleton_json)


@dataclass(frozen=True)
class SavePlan:
    """One save, checked and laid out; nothing has been claimed or written for it yet."""

    step: int
    flat: Flattened
    layout: Layout
    index_bytes: int  # an upper bound of the encoded index's length (it is encoded at commit)
    files: tuple[tuple[str, str], ...] = ()  # extra files saved with the version (manifest.encode_files)

    @property
    def cuda_devices(self) -> set[int]:
        return {d.index for d in self.flat.devices if d.type == "cuda"}

    @property
    def slot_layout(self) -> SlotLayout:
        return SlotLayout.of(self.index_bytes, self.layout.data_bytes)


class Planner:
    """Plans the saves of one writer: the layout is computed once per object structure (a
    training loop saves the same structure every time, and planning a large one costs
    milliseconds)."""

    def __init__(self, model: str, chunk_bytes: int):
        self.model = model
        self.chunk_bytes = chunk_bytes
        self._cache: tuple[tuple, Layout] | None = None
        self._structure: Structure | None = None  # of the last object flattened in full

    def plan(self, obj, step: int, files: tuple[tuple[str, str], ...] = ()) -> SavePlan:
        """Flatten and lay out ``obj`` (with its extra ``files``); raises every refusal of the
        object itself."""
        structure = self._structure
        flat = structure.match(obj) if structure is not None else None
        if flat is None:  # a first save, or a structure that changed: flatten in full
            flat = flatten(obj)
            for device in flat.devices:
                if device.type not in ("cpu", "cuda"):
                    raise CkptfsError(f"tensors on {device} are not supported yet; move them to cpu or cuda")
            flat.skeleton_json = dumps_compact(flat.skeleton)
            self._structure = Structure.of(flat)
        layout = self._layout(flat)
        probe = layout.manifest(self.model, step, COUNTER_MAX, time.time_ns(), flat, files)
        # The probe has the widest counter, so its index is at least as long as the real one:
        # its length fixes the slot layout, and the real index is encoded once, at commit.
        return SavePlan(step, flat, layout, probe.encoded_length(layout.tensors.text), files)

    def _layout(self, flat: Flattened) -> Layout:
        cached = self._cache
        if cached is not None and cached[0] == flat.signature:
            return cached[1]
        layout = lay_out(flat.names, flat.tensors, self.chunk_bytes_for)
        self._cache = (flat.signature, layout)
        return layout

    def chunk_bytes_for(self, data_bytes: int) -> int:
        """``chunk_bytes``, or less for a small state, so that a checkpoint of a few KiB does
        not pre-fault 64 MiB staging buffers. A state that grows gets larger chunks again: fixed
        by a tiny first save (an optimizer without its state yet), they made every later save of
        100 MiB take 20x as long."""
        return min(self.chunk_bytes, max(align_up(data_bytes, IO_ALIGN_BYTES), IO_ALIGN_BYTES))


def lay_out(names: list[str], tensors: list[torch.Tensor], chunk_bytes_for,
            crc_block_bytes: int = CRC_BLOCK_BYTES) -> Layout:
    """Tensor offsets (64-byte aligned, in object order), the chunks that cover them and the
    block CRCs each tensor will have; ``chunk_bytes_for(data_bytes)`` gives the chunk size."""
    records, offset, blocked = [], 0, False
    for name, t in zip(names, tensors, strict=True):
        offset = align_up(offset, TENSOR_ALIGN_BYTES)
        nbytes = t.numel() * t.element_size()
        blocks = block_count(nbytes, crc_block_bytes)
        blocked = blocked or blocks > 0
        records.append(TensorRecord(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes, 0, (0,) * blocks))
        offset += nbytes
    crc_block_bytes = crc_block_bytes if blocked else 0
    chunks = plan_chunks(records, offset, chunk_bytes_for(offset), crc_block_bytes)
    return Layout(tuple(records), offset, chunks, EncodedTensors.of(records), crc_block_bytes,
                  tuple(block_pieces(chunks, records, crc_block_bytes)),
                  tuple(copy_runs(chunk.pieces) for chunk in chunks))
