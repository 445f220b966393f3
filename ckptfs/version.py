"""A version as listed (VersionInfo) and as opened (Version: pinned, read through its checked data)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.errors import CkptfsError
from ckptfs.manifest import Manifest
from ckptfs.region.slots import SlotVersion

if TYPE_CHECKING:
    from ckptfs.store import Store


@dataclass(frozen=True, order=True)
class VersionInfo:
    """One committed version, as listed. Versions of a model order by (step, counter)."""

    model: str
    step: int
    counter: int
    slot: int
    time_ns: int
    data_bytes: int
    latest: bool
    kept: bool = False  # a milestone: never reused by the ring (Store.keep / unkeep)

    @property
    def save_id(self) -> tuple[int, int]:
        """What tells this save from every other of its model and step, (counter, time_ns): a
        model removed and made again counts its saves from 1 again, so the counter alone can
        name a save of the model that was removed (a cache keyed by it would serve that one)."""
        return (self.counter, self.time_ns)


def version_info(v: SlotVersion, is_latest: bool) -> VersionInfo:
    """What ``Store.versions`` and an opened ``Version`` say of the committed version ``v``."""
    h = v.header
    return VersionInfo(v.entry.name, h.step, h.counter, v.slot, h.time_ns, h.data_bytes, is_latest, h.kept)


class Version:
    """A pinned version: its slot cannot be reused until ``close``. Its bytes are read through
    ``data`` (ckptfs.reader.VersionData: checked, data-relative offsets)."""

    def __init__(self, store: "Store", slot_version: SlotVersion, manifest: Manifest, latest: bool,
                 checked: set | None = None):
        self._slot_version = slot_version
        self.manifest = manifest
        from ckptfs.reader import VersionData

        self._region = store.region
        self.data = VersionData(self._region, slot_version.data_base, manifest, checked)
        self.info = version_info(slot_version, latest)
        self._open = True

    def read(self, offset: int, length: int) -> memoryview:
        """Bytes of the data area (``record.offset`` is such an offset), zero-copy; every tensor
        touched is checked against its CRC first (CorruptionError names a damaged one)."""
        self._check_usable()
        return self.data.read(offset, length)

    def confirm(self) -> None:
        """RegionIOError if what ``read`` handed out may be zeros of a faulted mapping (see
        VersionData.confirm): call it after copying, before trusting the copy."""
        self.data.confirm()

    def load(self, map_location="cpu", verify: bool = True, into=None, keys=None):
        """The saved object (see Store.load)."""
        self._check_usable()
        return self.data.restore(map_location, verify, into, keys)

    def _check_usable(self) -> None:
        if not self._open:
            raise CkptfsError(f"{self.info.model} step {self.info.step} was closed: open it again (Store.open_version)")
        self._region.check_open(f"{self.info.model} step {self.info.step}")

    def close(self) -> None:
        """Let go of the version (its slot may be reused). Nothing to do twice, nor after the
        Store was closed (its pins went with it)."""
        if self._open:
            self._open = False
            self.data.close()  # its checks ahead end before the slot may be reused
            if not self._region.closed:
                self._region.unpin(self._slot_version)

    def __enter__(self) -> "Version":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_open", False):
            try:
                self.close()
            except Exception:
                pass
