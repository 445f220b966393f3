"""Where a region's bytes live: a file (sparse by default), a block device, or a devdax device.

A backend offers two write paths, chosen by what is written:
  * ``write(offset, buf)`` + ``barrier()`` for slot contents (headers, manifests, tensor bytes):
    O_DIRECT ``pwrite`` from page-aligned buffers then ``fdatasync`` on files and block devices
    (the fastest durable path measured by tools/bench_save.py), non-temporal copies with a fence
    (libpmem) on devdax;
  * in-place updates of the shared mapping + ``persist_mapped(offset, length)`` for the
    superblock and the model table, which hold the atomically updated latest pointers
    (``msync`` on files, flush + fence on devdax).
A byte range is only ever written through one of the two, so the page cache and O_DIRECT never
hold different versions of the same page.

Readers use ``view(offset, length)``: a zero-copy memoryview of the shared mapping.

The mapping is guarded (native/busguard.c): an access that would kill the process with SIGBUS
(the file truncated under it, a media error on pmem) reads zeros or writes nowhere instead, and
is counted. ``check_mapping`` turns a count into RegionIOError; it runs after every mapped write
is persisted and wherever a reader is about to trust what it read, so a truncation between a
check and an access is never fatal and never silent.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import resource
import re
import stat
import threading
import weakref

from ckptfs import _native
from ckptfs.checksum import crc32
from ckptfs.errors import CkptfsError, RegionFullError, RegionIOError, in_words, not_a_region
from ckptfs.units import human_bytes

PAGE_BYTES = mmap.PAGESIZE
DEVDAX_ALIGN_BYTES = 2 << 20


def _pread_full(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Read exactly len(view) bytes at ``offset``; a short read is an I/O error."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read from {path} at {offset + done}")
        done += n


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the blocks of ``[offset, offset + length)`` of a file, keeping its size."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot give back the blocks of a failed reservation: {os.strerror(err)}")


def free_bytes(fd_or_path: int | str) -> int:
    """What the filesystem of an open file or a path can still give an unprivileged writer."""
    st = os.fstatvfs(fd_or_path) if isinstance(fd_or_path, int) else os.statvfs(fd_or_path)
    return st.f_bavail * st.f_frsize


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer (O_DIRECT needs aligned memory)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class Backend:
    kind = "file"
    block_bytes = PAGE_BYTES

    def __init__(self, path: str, writable: bool):
        self.path = path
        self.writable = writable
        self._fd = -1
        self._map: mmap.mmap | None = None
        self.size_bytes = 0

    # ---- mapping --------------------------------------------------------------------------
    def _map_region(self, fd: int) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        try:
            self._map = mmap.mmap(fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as e:
            if e.errno != errno.ENOMEM:
                raise
            # the region is mapped whole: its size in address space (not in memory) at once
            raise RegionIOError(f"cannot map {self.path} ({human_bytes(self.size_bytes)}) into this process: its "
                                "address space is limited (`ulimit -v`); ckptfs maps a region whole, which takes "
                                "address space, not memory: raise the limit (`ulimit -v unlimited`)",
                                errno.ENOMEM, "mmap") from None
        self._view = memoryview(self._map)
        self._guard = _native.guard_mapping(self._map)
        # The guard goes with the mapping itself: where close() cannot unmap it (a reader still
        # holds a view), the mapping is unmapped when the last view goes, and a guard left on
        # its addresses would take the faults of the next mapping placed there (the new
        # region's guard would never see them: found by tests run in another order).
        self._unguard = weakref.finalize(self._map, _native.unguard_mapping, self._guard)

    def check_mapping(self, operation: str = "mapped access") -> None:
        """RegionIOError naming ``operation`` (the step that found it) if an access to this
        region's mapping has ever faulted (SIGBUS, caught by the bus guard): what that access
        read was zeros and what it wrote is lost, so nothing read or written through the mapping
        since is trusted. Cheap: one counter read."""
        if self._map is None:
            return
        faults, offset = _native.mapping_faults(self._guard)
        if not faults:
            return
        self._check_size()
        raise RegionIOError(f"{operation} of {self.path} failed: its mapping could not be read or written at "
                            f"{human_bytes(offset)} (a bus error: the device reported a media error there, or the "
                            "file was cut short); its versions there may be damaged: run `ckptfs verify`, and "
                            "restore it from a copy", errno.EIO, operation)

    def view(self, offset: int, length: int) -> memoryview:
        """Zero-copy view of region bytes; raises ValueError outside the region."""
        self._check_range(offset, length)
        return self._view[offset:offset + length]

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading ``[offset, offset + length)`` of the mapping in the background
        (MADV_WILLNEED), so that a reader walking the mapping in order finds it in memory: page
        faults alone read ahead little (a checked 2 GiB export took 2.7x as long without it).
        Advisory: clipped to the region, and a mapping that cannot take the advice ignores it."""
        start = max(offset, 0) // PAGE_BYTES * PAGE_BYTES
        end = min(offset + length, self.size_bytes)
        if end > start:
            try:
                self._map.madvise(mmap.MADV_WILLNEED, start, end - start)
            except (OSError, ValueError):
                pass

    def checksums(self, ranges: list[tuple[int, int]], block_bytes: int, ahead_bytes: int) -> list[int]:
        """CRC32 of each of ``ranges`` ((region offset, length), ascending, not overlapping, near
        each other: the tensors of one read), in one pass over their span, ``block_bytes`` at a
        time with ``ahead_bytes`` more asked for in the background, such that a reader of the
        mapping then finds the bytes in memory (a reader checks tensors, then serves them from
        the mapping). Here: through the mapping itself (device memory: nothing to read ahead)."""
        crcs = []
        for offset, length in ranges:
            crc, end = 0, offset + length
            for start in range(offset, end, block_bytes):
                n = min(block_bytes, end - start)
                self.prefetch(start, min(n + ahead_bytes, self.size_bytes - start))
                crc = crc32(self.view(start, n), crc)
            crcs.append(crc)
        self.check_mapping("mapped read")
        return crcs

    def read_bytes(self, offset: int, length: int) -> bytes:
        """A copy of a few region bytes (headers) that a concurrent writer thread may need
        without holding the GIL through a disk read; ValueError outside the region."""
        data = bytes(self.view(offset, length))
        self.check_mapping("mapped read")
        return data

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the region "
                             f"of {self.size_bytes} bytes")

    @property
    def mapping(self) -> mmap.mmap:
        return self._map

    def read_into(self, offset: int, buf) -> None:
        """Fill ``buf`` with region bytes from ``offset`` (through the page cache)."""
        view = memoryview(buf).cast("B")
        if offset < 0 or offset + len(view) > self.size_bytes:
            raise ValueError(f"read of {len(view)} bytes at {offset} is outside the region")
        try:
            with io_step("read", self.path, offset, len(view)):
                self._pread(self._fd, view, offset, self.path)
        except RegionIOError:
            self._check_size()  # a short read of a file cut short under this process: say so
            raise

    # the read system call, a method so that a fault-injecting backend (ckptfs.testing.anomaly)
    # can fail it
    _pread = staticmethod(_pread_full)

    def read_direct(self, offset: int, buf) -> None:
        """Fill page-aligned ``buf`` (length a multiple of 4 KiB) from ``offset`` bypassing the
        page cache where the device allows: large sequential restores go at device speed."""
        self.read_into(offset, buf)

    # ---- writes ---------------------------------------------------------------------------
    def write(self, offset: int, buf) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def persist_mapped(self, offset: int, length: int) -> None:
        raise NotImplementedError

    def reserve(self, offset: int, length: int) -> None:
        """Make sure writes to [offset, offset+length) cannot fail for lack of space."""

    def allocate(self, offset: int, length: int) -> None:
        """Allocate the blocks of [offset, offset+length) of a file (OSError as the system
        says), so that writes through the mapping there cannot meet a full filesystem (a
        SIGBUS, reported as a media error); nothing for a device."""

    def stat(self) -> os.stat_result:
        """The region file's (or device's) stat, through the descriptor it was opened by (a
        renamed or removed region is still the same file)."""
        return os.fstat(self._fd)

    def check_present(self, *, for_write: bool) -> None:
        """RegionIOError if the region file was truncated under this process (its mapping would
        kill the process with SIGBUS where it reaches past the end), or, ``for_write``, removed
        (a save to it would go when the process ends; reading it is still how to rescue what it
        holds), or if its mapping has faulted (``check_mapping``). Called before each save claims
        a slot and each version is opened (an fstat); what happens after the check is covered by
        the bus guard and ``check_mapping``."""
        self.check_mapping()
        if self.kind == "block" and self._fd >= 0:
            self._check_size()
        if self.kind != "file" or self._fd < 0:
            return
        st = os.fstat(self._fd)
        if st.st_nlink == 0 and for_write:
            raise RegionIOError(f"the region file {self.path} was removed while in use: nothing more can be saved "
                                "to it, and what it holds goes when its last user exits; copy out what you need "
                                "(`ckptfs export`) from this process, or restore the file", errno.ENOENT, "fstat")
        self._check_size(st)

    def _check_size(self, st: os.stat_result | None = None) -> None:
        """RegionIOError if the region file, or block device (an LV reduced, a loop device
        re-read after its file was cut), is now shorter than when it was opened."""
        if self.kind not in ("file", "block") or self._fd < 0:
            return
        if self.kind == "block":
            size = os.lseek(self._fd, 0, os.SEEK_END)
        else:
            size = (os.fstat(self._fd) if st is None else st).st_size
        if size < self.size_bytes:
            what = "region file" if self.kind == "file" else "region's device"
            verb = "was truncated to" if self.kind == "file" else "shrank to"
            raise RegionIOError(f"the {what} {self.path} {verb} {human_bytes(size)} while in use "
                                f"(it was {human_bytes(self.size_bytes)}); its versions are damaged: restore it from "
                                "a copy", errno.EIO, "fstat")

    def close(self) -> None:
        if self._map is not None:
            self._view.release()
            try:
                self._map.close()
                self._unguard()
            except BufferError:
                # A reader still holds a view (e.g. a tensor loaded with zero copy); the
                # mapping goes when the last view does, and stays guarded until then
                # (self._unguard runs then).
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_WHAT_TO_DO = {
    errno.ENOSPC: "the filesystem is full: free space on it",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
    errno.EROFS: "the filesystem is read-only: remount it read-write",
    errno.EIO: "the device reported an I/O error: check it (dmesg) and run `ckptfs verify`",
    # the process's or the system's limits, not the device's
    errno.EMFILE: "this process has as many files open as it may: raise its limit (`ulimit -n`) or close some",
    errno.ENFILE: "the system has as many files open as it may: close some (or raise fs.file-max)",
    errno.ENOMEM: "the system is out of memory",
}


def what_to_do(code: int, end_bytes: int | None = None) -> str:
    """The advice for an I/O step on the region that failed with ``code``; ``end_bytes``: the
    file's length the step would reach, where known."""
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and (end_bytes is None or end_bytes > limit):
            return f"this process may write files up to {human_bytes(limit)} (`ulimit -f`): raise that limit"
        return "the filesystem allows no file this large"
    return _WHAT_TO_DO.get(code, "check the device and the filesystem holding the region")


@contextlib.contextmanager
def io_step(operation: str, path: str, offset: int | None = None, length: int | None = None):
    """Run one I/O step on the region: an OSError from it becomes a RegionIOError that names the
    operation, where, the system's error and what to do (the one place that words them)."""
    try:
        yield
    except OSError as e:
        code = e.errno or errno.EIO
        where = "" if offset is None else f" at offset {offset}" + ("" if length is None else f" ({human_bytes(length)})")
        advice = what_to_do(code, None if offset is None else offset + (length or 0))
        raise RegionIOError(f"{operation} of {path}{where} failed: {os.strerror(code)}; {advice}",
                            code, operation) from e


class FileBackend(Backend):
    """A regular file or a block device: O_DIRECT writes, fdatasync barriers, msync for metadata."""

    def __init__(self, path: str, writable: bool):
        super().__init__(path, writable)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        self._fd = os.open(path, flags)
        st = os.fstat(self._fd)
        self.kind = "block" if stat.S_ISBLK(st.st_mode) else "file"
        self.size_bytes = os.lseek(self._fd, 0, os.SEEK_END)
        self._direct_fd = -1
        self._read_direct_fd: int | None = None
        if writable:
            self._direct_fd = self._open_direct(path)
        if self.size_bytes == 0:
            raise not_a_region(path, "it is empty")
        self._map_region(self._fd)

    @staticmethod
    def _open_direct(path: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return -1  # e.g. tmpfs: no O_DIRECT; buffered writes + fdatasync are still durable

    def write(self, offset: int, buf) -> None:
        fd = self._direct_fd if self._direct_fd >= 0 else self._fd
        view = memoryview(buf).cast("B")
        with io_step("write", self.path, offset, len(view)):
            done = 0
            while done < len(view):
                n = self._pwrite(fd, view[done:], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short write to {self.path} at {offset + done}")
                done += n

    def barrier(self) -> None:
        with io_step("fdatasync", self.path):
            self._fdatasync(self._fd)

    # the system calls of the write path, one method each, so that a fault-injecting backend
    # (ckptfs.testing.anomaly) can fail any one of them
    _pwrite = staticmethod(os.pwrite)
    _fdatasync = staticmethod(os.fdatasync)

    def checksums(self, ranges: list[tuple[int, int]], block_bytes: int, ahead_bytes: int) -> list[int]:
        # Read calls into the page cache: cold, 1.6-1.9x as fast on the VMs measured as walking
        # the mapping (page faults of 4 KiB, some fault-around), and the pages are then cached for
        # the mapping's readers. One pass over the span, however many ranges (40,000 small
        # tensors: a read call per block, not per tensor). No readahead advice (``ahead_bytes`` is
        # for the mapped backend): the kernel's own readahead of these sequential reads fills the
        # page cache with large folios, where POSIX_FADV_WILLNEED's (force_page_cache_ra) fills
        # it with 4 KiB pages, and every later use of them (this copy, the mount's faults and
        # copies from the mapping, the LRU) pays per page: the mount's cold `cp` of 2 GiB took
        # 1.44 s with the advice, 1.13 s without (median of 6 interleaved runs; torch.load of
        # checkpoint.pt, cold, 2.55 -> 1.62 s).
        crcs = [0] * len(ranges)
        if not ranges:
            return crcs
        buf = _bounce(block_bytes)
        span_end = ranges[-1][0] + ranges[-1][1]
        first = 0  # the first range not read to its end yet
        for start in range(ranges[0][0], span_end, block_bytes):
            n = min(block_bytes, span_end - start)
            view = memoryview(buf)[:n]
            self.read_into(start, view)
            i = first
            while i < len(ranges) and ranges[i][0] < start + n:
                lo, hi = max(ranges[i][0], start), min(ranges[i][0] + ranges[i][1], start + n)
                if hi > lo:
                    crcs[i] = crc32(view[lo - start:hi - start], crcs[i])
                i += 1
            while first < len(ranges) and ranges[first][0] + ranges[first][1] <= start + n:
                first += 1
        return crcs

    def read_direct(self, offset: int, buf) -> None:
        if self._read_direct_fd is None:
            # through our own descriptor, not the path: the same file even if it was renamed or
            # removed since (a removed region can still be read out); without /proc, the path
            try:
                self._read_direct_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                # no /proc, or no O_DIRECT on this filesystem (EINVAL): buffered reads
                self._read_direct_fd = -1
        if self._read_direct_fd < 0:
            return self.read_into(offset, buf)
        try:
            self._pread(self._read_direct_fd, memoryview(buf).cast("B"), offset, self.path)
        except OSError:
            # O_DIRECT refused where a buffered read may still work (ext4 gone read-only after an
            # error answers direct reads with EROFS): what is durable must stay loadable
            self.read_into(offset, buf)

    def persist_mapped(self, offset: int, length: int) -> None:
        # Not mmap.flush: it holds the GIL for the whole msync, a disk flush of several ms that
        # would stall the training loop's thread behind every commit.
        with io_step("msync", self.path, offset, length):
            self._msync(self._map, offset, length)
        self.check_mapping("msync")

    _msync = staticmethod(_native.msync_range)

    def read_bytes(self, offset: int, length: int) -> bytes:
        # pread, not the mapping: a page whose cache copy an O_DIRECT write just invalidated
        # would be faulted in from disk with the GIL held.
        self._check_range(offset, length)
        buf = bytearray(length)
        try:
            with io_step("read", self.path, offset, length):
                self._pread(self._fd, memoryview(buf), offset, self.path)
        except RegionIOError:
            self._check_size()  # a short read of a region cut short under this process: say so
            raise
        return bytes(buf)

    def allocate(self, offset: int, length: int) -> None:
        if self.kind == "file":
            self._fallocate(self._fd, offset, length)

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the blocks of a new ring, all or nothing: when the filesystem runs out part
        way, what was allocated is given back (a hole punched over the range, which holds no
        version yet) and RegionFullError says what was needed and what is free."""
        try:
            self.allocate(offset, length)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                _punch_hole(self._fd, offset, length)
                free = free_bytes(self._fd)
                raise RegionFullError(
                    f"the filesystem holding {self.path} has {human_bytes(free)} free, and the new ring needs "
                    f"{human_bytes(length)}; nothing was kept. Free space on that filesystem, " + in_words(
                        python="save this model with fewer or smaller slots (slots=, slot_bytes=), or remove models "
                               "(Store.remove_model)",
                        cli="or remove models (`ckptfs rm --all MODEL`)")) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                with io_step("fallocate", self.path, offset, length):
                    raise

    _fallocate = staticmethod(os.posix_fallocate)

    def close(self) -> None:
        for fd in (self._direct_fd, self._read_direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._direct_fd, self._read_direct_fd = -1, None
        super().close()


class DevdaxBackend(Backend):
    """A devdax persistent-memory device: all writes through the mapping, persisted by libpmem."""

    kind = "devdax"
    block_bytes = DEVDAX_ALIGN_BYTES

    def __init__(self, path: str, writable: bool):
        super().__init__(path, writable)
        if not _native.pmem_available():
            raise CkptfsError(f"{path} is a devdax device but libpmem is missing; install libpmem1")
        self._fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        # A regular file stands in for a device in tests: libpmem's flush+fence work on any mapping.
        self.size_bytes = _devdax_size(path) if stat.S_ISCHR(st.st_mode) else st.st_size
        self._map_region(self._fd)

    def write(self, offset: int, buf) -> None:
        self._memcpy_persist(self._map, offset, buf)
        self.check_mapping("pmem write")

    def barrier(self) -> None:
        # pmem_memcpy_persist already drained; nothing is pending.
        pass

    def persist_mapped(self, offset: int, length: int) -> None:
        self._persist(self._map, offset, length)
        self.check_mapping("pmem persist")

    # the mapped writes, methods so that a fault-injecting backend (ckptfs.testing.anomaly) can
    # poison the page they go to
    _memcpy_persist = staticmethod(_native.pmem_memcpy_persist)
    _persist = staticmethod(_native.pmem_persist)


_bounces = threading.local()


def _bounce(nbytes: int) -> bytearray:
    """This thread's buffer of at least ``nbytes`` for reads that only pass through."""
    buf = getattr(_bounces, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _bounces.buf = bytearray(nbytes)
    return buf


def _devdax_size(path: str) -> int:
    st = os.stat(path)
    sysfs = f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/size"
    try:
        with open(sysfs) as f:
            return int(f.read())
    except OSError as e:
        raise CkptfsError(f"cannot read the size of {path} from {sysfs}: {e}") from None


def is_devdax(path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISCHR(st.st_mode) and bool(re.match(r"dax\d+\.\d+$", os.path.basename(os.path.realpath(path))))


def open_backend(path: str, writable: bool = True) -> Backend:
    if is_devdax(path):
        return DevdaxBackend(path, writable)
    return FileBackend(path, writable)
