"""The things the mounted tree hands to the FUSE layer: a name's node (its kind, inode and the
version it belongs to), its attributes, and an open file (its version pinned until release).
ckptfs.fs.tree says which exist."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    ROOT = "root"
    MODEL = "model"
    LATEST = "latest"
    VERSION = "version"
    SUBDIR = "subdir"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class Node:
    """One name in the tree; ``ino`` is derived from the name and the save it shows (the same
    in every mount: ``Tree._free_ino``)."""

    ino: int
    kind: Kind
    model: str = ""
    step: int = -1
    save_id: tuple = ()  # VERSION, FILE and SUBDIR: the VersionInfo.save_id of the version they are or belong to
    name: str = ""  # FILE and SUBDIR: the path inside the version directory ("hf/config.json")

    @property
    def is_dir(self) -> bool:
        return self.kind in (Kind.ROOT, Kind.MODEL, Kind.VERSION, Kind.SUBDIR)

    @property
    def in_version(self) -> bool:
        """A file or subdirectory inside a version directory."""
        return self.kind in (Kind.FILE, Kind.SUBDIR)


@dataclass(frozen=True, slots=True)
class Attr:
    """What ``stat`` shows; the FUSE layer copies it into an EntryAttributes."""

    ino: int
    mode: int
    nlink: int
    size: int
    mtime_ns: int


class OpenFile:
    """An open file: its version stays pinned until :meth:`close`.

    Reads go through ``Version.read`` (ckptfs.reader.VersionData), which checks every tensor it
    hands out against its CRC: damaged bytes never leave the mount as if they were data
    (CorruptionError, EIO for the reader). The tree opens every version with the mount's one
    set of tensors found intact, so a version is checksummed once per mount, not once per open:
    its bytes cannot change while it is committed, and re-checking would checksum the page
    cache, not the device."""

    __slots__ = ("version", "view")

    def __init__(self, version, view):
        self.version = version
        self.view = view

    @property
    def size(self) -> int:
        return self.view.size

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only at the end of the file."""
        data = self.view.read(offset, size, self.version.read)
        self.version.confirm()  # a copy of the mapping, not zeros of a faulted page
        return data

    def close(self) -> None:
        self.version.close()
