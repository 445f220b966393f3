"""Reading versions back: restore tensors (to CPU or a device) and verify checksums."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ckptfs.checksum import crc32
from ckptfs.errors import CorruptionError
from ckptfs.manifest import Manifest, TensorRecord, unflatten
from ckptfs.region.region import Region

VERIFY_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class VerifyProblem:
    """One failed check: the version, the tensor (None for the index) and what is wrong."""

    model: str
    step: int
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.model} step {self.step}" + (f" tensor {self.tensor}" if self.tensor else "")
        return f"{where}: {self.message}"


def read_tensor(region: Region, data_base: int, record: TensorRecord, manifest: Manifest,
                verify: bool = True) -> torch.Tensor:
    """A new CPU tensor holding the record's bytes; CorruptionError if they fail their CRC."""
    t = torch.empty(record.shape, dtype=record.torch_dtype)
    if record.nbytes:
        dst = t.reshape(-1).view(torch.uint8).numpy()
        region.backend.read_into(data_base + record.offset, dst)
        if verify and crc32(dst) != record.crc32:
            raise CorruptionError(
                f"tensor {record.name!r} of {manifest.model} step {manifest.step} fails its checksum; "
                "the stored bytes are damaged: load another version (`ckptfs ls`) and run `ckptfs verify`")
    return t


def restore(region: Region, data_base: int, manifest: Manifest, map_location="cpu", verify: bool = True):
    """The saved object, with every tensor on ``map_location``."""
    tensors = [read_tensor(region, data_base, r, manifest, verify) for r in manifest.tensors]
    device = torch.device(map_location) if map_location is not None else torch.device("cpu")
    if device.type != "cpu":
        moved = [t.pin_memory().to(device, non_blocking=True) for t in tensors]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tensors = moved
    return unflatten(manifest.skeleton, tensors)


def verify_version(region: Region, data_base: int, manifest: Manifest,
                   progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
    """Recompute every tensor's CRC from the region; one problem per mismatching tensor."""
    problems = []
    for r in manifest.tensors:
        crc, done = 0, 0
        while done < r.nbytes:
            n = min(VERIFY_BLOCK_BYTES, r.nbytes - done)
            view = region.backend.view(data_base + r.offset + done, n)
            crc = crc32(view, crc)
            view.release()
            done += n
            if progress:
                progress(n)
        if crc != r.crc32:
            problems.append(VerifyProblem(manifest.model, manifest.step, r.name,
                                          f"checksum mismatch (stored {r.crc32:08x}, computed {crc:08x})"))
    return problems
