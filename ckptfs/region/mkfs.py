"""Formatting a region (mkfs): never destroying what is there, never showing a half-formatted one."""
from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

from ckptfs.errors import BusyError, RegionFormatError, in_words
from ckptfs.mounttable import mount_points
from ckptfs.region.backend import io_step, open_backend, what_to_do
from ckptfs.region.format import SUPERBLOCK_BYTES, SUPERBLOCK_MAGIC, Superblock, backup_superblock_offset
from ckptfs.region.locks import any_lock_held
from ckptfs.units import human_bytes


MIN_REGION_BYTES = 64 << 20  # the smallest region mkfs makes, on a file or a device


def check_region_size(size_bytes: int, device: str | None = None) -> None:
    """ValueError where a region of ``size_bytes`` (the whole ``device``, if given) is too small."""
    if size_bytes >= MIN_REGION_BYTES:
        return
    if device is not None:
        raise ValueError(f"{device} holds {human_bytes(size_bytes)}, too small for a region: it needs at least "
                         f"{human_bytes(MIN_REGION_BYTES)}; use a larger device or a region file")
    raise ValueError(f"a region of {human_bytes(size_bytes)} is too small: it needs at least "
                     f"{human_bytes(MIN_REGION_BYTES)}; " + in_words(python="pass a larger size_bytes",
                                                                      cli="give a larger --size"))


_BLANK_PROBE_BYTES = 1 << 20  # where filesystems, partition tables and LVM keep their labels


def _read_head(path: str, special: bool) -> bytes:
    """What tells a region or data: the magic of a file (any other content is data), the first
    MiB of a device (a devdax device has no read(): through its mapping)."""
    if not special:
        with open(path, "rb") as f:
            return f.read(len(SUPERBLOCK_MAGIC))
    backend = open_backend(path, writable=False)
    try:
        return bytes(backend.view(0, min(_BLANK_PROBE_BYTES, backend.size_bytes)))
    finally:
        backend.close()


def is_region_file(path: str) -> bool:
    """Whether ``path`` is a readable file that begins with a region's superblock."""
    try:
        return os.path.isfile(path) and Superblock.begins(_read_head(path, special=False))
    except OSError:
        return False


def refuse_to_overwrite(path: str, special: bool) -> None:
    """RegionFormatError unless ``path`` is an empty file or a blank device."""
    size = None if special else os.path.getsize(path)
    if size == 0:
        return
    head = _read_head(path, special)
    if Superblock.begins(head):
        raise RegionFormatError(f"{path} already holds a ckptfs region; " + in_words(
            python="open it with Store(path), or pass force=True to erase every checkpoint in it",
            cli="use it as it is (--exist-ok), or add --force to erase every checkpoint in it"))
    if special:
        if head.count(0) != len(head):
            raise RegionFormatError(
                f"{path} is not blank: its first MiB holds data (a filesystem or a partition table?). "
                "Formatting would destroy it; wipe the device first (`wipefs -a`), or "
                + in_words(python="pass force=True", cli="add --force"))
        return
    raise RegionFormatError(f"{path} exists and is not a ckptfs region ({human_bytes(size)}); formatting "
                            "would destroy it. Choose a new path, or "
                            + in_words(python="pass force=True", cli="add --force") + " to overwrite it")


def refuse_if_in_use(path: str) -> None:
    """BusyError if the region at ``path`` is in use: a lock byte held (a writer open, a reader's
    pin, a claim), or mounted. Formatting it under them would hand a reader holding a version
    open the new region's bytes as that version's, checked already, without an error."""
    points = mount_points(path)
    if points:
        raise BusyError(f"{path} is mounted at {', '.join(points)}: unmount it first (`ckptfs umount "
                        f"{points[0]}`), then format it")
    if any_lock_held(path):
        from ckptfs.region.holders import lock_holders

        pids = sorted({f"{command} (pid {pid})" for held in lock_holders(path).values() for pid, command, _ in held})
        raise BusyError(f"{path} is in use by {', '.join(pids) or 'another process'} (a training job's writer, a "
                        "reader holding a version): stop them, then format it")


def make_sparse_file(path: str, size_bytes: int, *, truncate: bool, exclusive: bool = False) -> None:
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o644)
    try:
        if truncate:
            os.ftruncate(fd, 0)  # drops the old blocks: the new region reads as zeros
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)


def format_new_file(path: str, size_bytes: int) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.formatting-{os.getpid()}-{threading.get_ident()}")
    try:
        try:
            make_sparse_file(tmp, size_bytes, truncate=False, exclusive=True)
        except OSError as e:
            if e.errno != errno.EFBIG:
                raise
            raise RegionFormatError(f"{path}: a file of {human_bytes(size_bytes)} cannot be made: {what_to_do(e.errno, size_bytes)}; "
                                    + in_words(python="or pass a smaller size_bytes", cli="or give a smaller --size")) from None
        format_in_place(tmp, None, shown=path)
        _publish_new_file(tmp, path)
    except OSError as e:
        if e.filename != tmp:
            raise
        raise OSError(e.errno, e.strerror, path) from None  # the user's path, not the temporary name
    finally:
        if os.path.lexists(tmp):  # (an unlink of what is not there failed again on a read-only filesystem)
            os.unlink(tmp)
    with contextlib.suppress(OSError):  # the new name is durable with its directory entry
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _publish_new_file(tmp: str, path: str) -> None:
    """Give the formatted ``tmp`` the name ``path``, unless something has taken that name."""
    taken = RegionFormatError(f"{path} appeared (another process created it) while this one formatted it; "
                              "open it with Store(path)")
    try:
        os.link(tmp, path)  # unlike rename, fails if the name is taken
    except FileExistsError:
        raise taken from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # No hard links on this filesystem: rename, which leaves a short race with another creator.
        if os.path.exists(path):
            raise taken from None
        os.rename(tmp, path)


def format_in_place(path: str, size_bytes: int | None, *, shown: str | None = None) -> None:
    """Superblock, empty model table and the backup superblock, on a file or device of its own
    size (``shown``: the path errors name, where ``path`` is a temporary name)."""
    backend = open_backend(path, writable=True)
    try:
        if size_bytes is not None and backend.kind != "file" and size_bytes != backend.size_bytes:
            raise ValueError(f"{path} is a {backend.kind} device of {backend.size_bytes} bytes and a region on a "
                             f"device takes all of it; leave size_bytes out (got {size_bytes})")
        if backend.kind != "file":
            check_region_size(backend.size_bytes, path)
        sb = Superblock.new(backend.size_bytes, backend.block_bytes, time.time_ns())
        table_bytes = sb.data_offset - sb.table_offset
        backup = backup_superblock_offset(backend.size_bytes)
        # written through the mapping: a full filesystem would answer with SIGBUS, reported
        # as a media error (a full disk said "the device reported a media error")
        for offset, length in ((0, sb.data_offset), (backup, SUPERBLOCK_BYTES)):
            with io_step("allocating the region's superblock and model table", shown or path):
                backend.allocate(offset, length)
        mapping = backend.mapping
        mapping[sb.table_offset:sb.table_offset + table_bytes] = bytes(table_bytes)
        backend.persist_mapped(sb.table_offset, table_bytes)
        # A backup in the last 4 KiB (never given to a ring): a damaged superblock does not
        # take every checkpoint of the region with it.
        mapping[backup:backup + SUPERBLOCK_BYTES] = sb.pack()
        backend.persist_mapped(backup, SUPERBLOCK_BYTES)
        # The superblock goes last: a half-formatted region is not recognized as one.
        mapping[0:SUPERBLOCK_BYTES] = sb.pack()
        backend.persist_mapped(0, SUPERBLOCK_BYTES)
    finally:
        backend.close()
